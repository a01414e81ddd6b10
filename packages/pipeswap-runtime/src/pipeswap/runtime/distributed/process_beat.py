"""A rank's second beat, from a process of its own, for the neighbours on other hosts.

The peer watch beats from a Python thread, which cannot run while the rank's main thread
holds the interpreter lock through one long call; a neighbour on the same host then looks
the silent process up in /proc and waits for a busy one, but a neighbour on another host
cannot. So where a rank exchanges data with another host, its watch starts this small
process: it adds to the rank's process beat (``pipeswap/process-beat/<rank>``) while the
rank's process runs or waits, stops while it is stopped (SIGSTOP, a debugger), and ends with
it. A neighbour counts a rank silent only when both beats have stopped.

Run as ``python -m pipeswap.runtime.distributed.process_beat PID INTERVAL HOST PORT KEY``:
the beat is key ``KEY`` of the TCPStore at ``HOST:PORT``, under no prefix.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter as /proc gives it (R running, S or D waiting, T
    stopped, Z dead); None where there is no such process, or no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def unprefixed(store: Store) -> Store:
    """The store under ``store``'s prefixes: its keys are the same for every process of the
    job, whatever prefixes each wraps it in."""
    import torch.distributed as dist

    while isinstance(store, dist.distributed_c10d.PrefixStore):
        store = store.underlying_store
    return store


def start_process_beat(store: Store, key: str, interval_s: float
                       ) -> subprocess.Popen[bytes] | None:
    """This process's beat at ``key`` of ``store`` (a store under no prefix), from a process
    of its own; None where no other process can reach the store (not a TCPStore)."""
    import torch.distributed as dist

    tcp = getattr(dist, "TCPStore", None)
    if tcp is None or not isinstance(store, tcp):
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "pipeswap.runtime.distributed.process_beat", str(os.getpid()),
         str(interval_s), str(store.host), str(store.port), key],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)


def _beat(pid: int, interval_s: float, store: Store, key: str) -> None:
    """Add to ``key`` every ``interval_s`` while process ``pid`` runs or waits; return when
    it has ended (or this process was handed to another parent)."""
    while os.getppid() == pid:
        state = process_state(pid)
        if state is None or state in ("Z", "X"):
            return
        if state not in ("T", "t"):
            store.add(key, 1)
        time.sleep(interval_s)


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    pid, interval_s, host, port, key = argv
    store: Store = dist.TCPStore(  # type: ignore[attr-defined]  # public, unstubbed
        host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    try:
        _beat(int(pid), float(interval_s), store, key)
    except Exception:  # noqa: BLE001 - the store gone with its host: nothing left to beat
        return


if __name__ == "__main__":
    main(sys.argv[1:])
