"""One run at a time in a checkpoint directory: a run claims the directory it saves into
for as long as it lives, and a second run given the same directory is refused in one line
naming the first, instead of the two deleting each other's saves in progress.

The claim is a file (``pipeswap.owner``) made with ``O_EXCL``, holding who made it, and kept
fresh by a thread that touches it every few seconds. A claim is stale, and taken over, when
its process is gone (on this host: no such process, or another one under that pid) or when
it has not been touched for a minute (a run on another host sharing the file system, gone
without its clean-up).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from pipeswap.runtime.errors import CheckpointError

__all__ = ["OWNER", "claimed"]

OWNER = "pipeswap.owner"
_TOUCH_S = 5.0  # how often a live claim is touched
_STALE_S = 60.0  # a claim untouched this long belongs to no live run


@contextmanager
def claimed(directory: str | os.PathLike[str], what: str) -> Iterator[Path]:
    """``directory`` claimed for this process while the block runs (created if need be);
    :class:`~pipeswap.runtime.errors.CheckpointError` naming the owner where a live run
    holds it. ``what``: how the caller names the directory in that error
    (``"--checkpoint-dir runs/a"``)."""
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{what}: cannot create {root}: {exc.strerror or exc}") from None
    claim = root / OWNER
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid()),
            "run": uuid.uuid4().hex, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    _take(claim, mine, what)
    stop = threading.Event()
    toucher = threading.Thread(target=_keep_fresh, args=(claim, stop), daemon=True,
                               name="pipeswap-claim")
    toucher.start()
    try:
        yield claim
    finally:
        stop.set()
        toucher.join()
        if _holder(claim).get("run") == mine["run"]:
            with suppress(OSError):
                claim.unlink()


def _take(claim: Path, mine: dict[str, object], what: str) -> None:
    """Make the claim file, taking over a stale one; refuse a live one."""
    for _ in range(3):  # a stale claim moved aside may meet another run doing the same
        try:
            descriptor = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _holder(claim)
            if not _stale(claim, holder):
                raise CheckpointError(
                    f"{what} is in use by another run (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, since {holder.get('since')}): two runs saving "
                    "into one directory delete each other's saves; give this run a "
                    "directory of its own, or stop that run first") from None
            with suppress(OSError):
                claim.rename(claim.with_name(f"{OWNER}.stale-{uuid.uuid4().hex}"))
                for old in claim.parent.glob(f"{OWNER}.stale-*"):
                    old.unlink()
            continue
        except OSError as exc:
            raise CheckpointError(f"{what}: cannot write {claim}: "
                                  f"{exc.strerror or exc}") from None
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(mine, file)
        return
    raise CheckpointError(f"{what}: could not claim {claim}: other runs keep taking it")


def _holder(claim: Path) -> dict[str, object]:
    try:
        found = json.loads(claim.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _stale(claim: Path, holder: dict[str, object]) -> bool:
    """Whether no live run holds ``claim``: its process gone (on this host), or the claim
    untouched for a minute (a file being written now is not stale)."""
    try:
        untouched = time.time() - claim.stat().st_mtime
    except OSError:
        return True  # gone meanwhile
    if not holder:
        return untouched > _STALE_S
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        return _started(pid) != holder.get("started")
    return untouched > _STALE_S


def _started(pid: int) -> str | None:
    """When process ``pid`` started, as the kernel counts (so a pid reused by another
    process reads otherwise); None where there is no such process. Without /proc, whether
    it exists at all."""
    if Path("/proc").is_dir():
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: it exists
    return "alive"


def _keep_fresh(claim: Path, stop: threading.Event) -> None:
    while not stop.wait(_TOUCH_S):
        with suppress(OSError):
            os.utime(claim)
