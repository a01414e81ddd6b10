"""A checkpoint on disk: its manifest, each file's checksum, and which checkpoint to resume.

A checkpoint is a directory ``step-N`` holding DCP's files and ``pipeswap.json``, the
manifest. The manifest names every other file of the directory with its size and SHA-256
(computed while the file was written) and carries a checksum of its own content, so a byte
changed anywhere, a file truncated, emptied, removed or added, refuses that checkpoint, naming
the file, instead of loading weights that are not the ones saved. Nothing here needs a process
group: the launcher checks a checkpoint with these functions before it starts any rank, and
every rank of a loading job verifies its share of the files with them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeswap.runtime.errors import CheckpointError

MANIFEST = "pipeswap.json"
LATEST = "latest"
FORMAT = 2  # the manifest's format: 2 added the files' checksums and the job's description
_NAME = re.compile(r"step-(\d+)")
_BLOCK = 1 << 20  # bytes hashed at a time
_NFS_LEFTOVER = ".nfs"  # what NFS names a file deleted while open: not part of a checkpoint


@dataclass(frozen=True)
class FileSum:
    """A file's size and SHA-256, as written."""

    size: int
    sha256: str


@dataclass(frozen=True)
class Layout:
    """Which stages each global rank holds: a checkpoint fits only the layout it was saved
    with, as every key and shard belongs to one rank."""

    num_stages: int
    stages: tuple[tuple[int, ...], ...]  # per global rank, its stage indices

    def describe(self) -> str:
        ranks = [f"rank {rank}: stage{'s' * (len(s) > 1)} {', '.join(map(str, s))}"
                 for rank, s in enumerate(self.stages)]
        return f"{len(self.stages)} ranks and {self.num_stages} stages ({some(ranks, 8, '; ')})"


@dataclass(frozen=True)
class Manifest:
    """What ``pipeswap.json`` holds: the step, the data position, the layout, every other
    file's checksum, and the saving job's own description (``job``: what its caller gave)."""

    step: int
    data_position: int
    layout: Layout
    files: Mapping[str, FileSum] = field(default_factory=dict)
    job: Mapping[str, object] = field(default_factory=dict)

    def dumps(self) -> str:
        body = self._body()
        return json.dumps({**body, "checksum": _checksum(body)}, indent=1, sort_keys=True)

    def _body(self) -> dict[str, object]:
        return {"format": FORMAT, "step": self.step, "data_position": self.data_position,
                "num_stages": self.layout.num_stages,
                "stages": [list(s) for s in self.layout.stages],
                "files": {name: {"size": s.size, "sha256": s.sha256}
                          for name, s in sorted(self.files.items())},
                "job": dict(self.job)}


def _checksum(body: Mapping[str, object]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def read_manifest(path: Path) -> Manifest:
    """The manifest of checkpoint ``path``; :class:`CheckpointError` naming the file when it
    is unreadable, not a manifest, or changed since it was written."""
    where = path / MANIFEST
    try:
        data = json.loads(where.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where} cannot be read as JSON ({_reason(exc)})") from None
    if not isinstance(data, dict) or "checksum" not in data:
        raise CheckpointError(f"{where} is not a pipeswap manifest with checksums (one saved "
                              "by an earlier pipeswap has none): save the run again")
    body = {key: value for key, value in data.items() if key != "checksum"}
    if data["checksum"] != _checksum(body):
        raise CheckpointError(f"{where} was changed after it was written (its checksum "
                              "differs)")
    try:
        return _parse(body)
    except (KeyError, TypeError, ValueError) as exc:  # a manifest of another format
        raise CheckpointError(f"{where} does not hold a manifest of format {FORMAT} "
                              f"({_reason(exc)})") from None


def _parse(body: Mapping[str, object]) -> Manifest:
    if body["format"] != FORMAT:
        raise ValueError(f"format {body['format']!r}")
    stages = body["stages"]
    files = body["files"]
    job = body["job"]
    if not (isinstance(stages, list) and isinstance(files, dict) and isinstance(job, dict)):
        raise TypeError("stages, files or job of the wrong type")
    return Manifest(_count(body["step"]), _count(body["data_position"]),
                    Layout(_count(body["num_stages"]),
                           tuple(tuple(_count(i) for i in s) for s in stages)),
                    {str(name): FileSum(_count(s["size"]), str(s["sha256"]))
                     for name, s in files.items()},
                    job)


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} where a count belongs")
    return value


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# -- checksums ------------------------------------------------------------------------------


def file_sum(path: Path) -> FileSum:
    """``path``'s size and SHA-256, read from disk."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as file:
        while block := file.read(_BLOCK):
            digest.update(block)
            size += len(block)
    return FileSum(size, digest.hexdigest())


def file_problems(path: Path, manifest: Manifest, share: Callable[[int], bool] | None = None
                  ) -> list[str]:
    """What is wrong with checkpoint ``path``'s files against its manifest, one line each:
    a file missing or not listed, or whose size or checksum differs. ``share`` picks the
    listed files (by their index in name order) this caller verifies; the presence of every
    file is always checked."""
    present = {entry.name for entry in path.iterdir()
               if entry.name != MANIFEST and not entry.name.startswith(_NFS_LEFTOVER)}
    listed = set(manifest.files)
    problems = [f"{name}: missing" for name in sorted(listed - present)]
    problems += [f"{name}: not one of the files saved" for name in sorted(present - listed)]
    for index, (name, saved) in enumerate(sorted(manifest.files.items())):
        if name not in present or (share is not None and not share(index)):
            continue
        try:
            found = file_sum(path / name)
        except OSError as exc:
            problems.append(f"{name}: unreadable ({_reason(exc)})")
            continue
        if found.size != saved.size:
            problems.append(f"{name}: {found.size} bytes, {saved.size} saved")
        elif found.sha256 != saved.sha256:
            problems.append(f"{name}: its checksum differs from the one saved")
    return problems


# -- finding checkpoints --------------------------------------------------------------------


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where :func:`~pipeswap.runtime.checkpoint.save_checkpoint` puts the checkpoint of
    ``step`` in ``directory``."""
    return Path(directory) / f"step-{step:08d}"


def complete(path: Path) -> bool:
    """Whether ``path`` is a whole checkpoint: the manifest is written last, before the
    rename that gives it its name."""
    return _NAME.fullmatch(path.name) is not None and (path / MANIFEST).is_file()


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``root``, by step; :class:`CheckpointError` if ``root``
    cannot be listed."""
    try:
        if not root.is_dir():
            return []
        return sorted((int(match.group(1)), path) for path in root.iterdir()
                      if (match := _NAME.fullmatch(path.name)) and complete(path))
    except OSError as exc:
        raise CheckpointError(f"{root} cannot be read ({_reason(exc)})") from None


def candidates(directory: str | os.PathLike[str]) -> list[Path]:
    """The checkpoints to try resuming from, best first: ``directory`` itself if it is one;
    else the one its ``latest`` file names (the last saved), then the others, newest step
    first."""
    root = Path(directory)
    try:
        if complete(root):
            return [root]
    except OSError as exc:
        raise CheckpointError(f"{root} cannot be read ({_reason(exc)})") from None
    found = [path for _, path in reversed(checkpoints(root))]
    pointer = root / LATEST
    if pointer.is_file():
        try:
            named = root / pointer.read_text("utf-8").strip()
        except (OSError, UnicodeDecodeError):
            named = None
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The first of :func:`candidates` (not verified); None if there is none."""
    found = candidates(directory)
    return found[0] if found else None


@dataclass(frozen=True)
class Verified:
    """The checkpoint to resume from and its manifest, and the better ones skipped (each with
    why)."""

    path: Path
    manifest: Manifest
    skipped: tuple[tuple[Path, str], ...]


def examine(path: Path, share: Callable[[int], bool] | None = None, files: bool = True
            ) -> tuple[Manifest | None, list[str]]:
    """Checkpoint ``path``'s manifest (None when it does not read) and what is wrong with it,
    one line each: the manifest, and with ``files`` its files (``share``: as for
    :func:`file_problems`)."""
    try:
        manifest = read_manifest(path)
        return manifest, file_problems(path, manifest, share) if files else []
    except CheckpointError as exc:
        return None, [str(exc)]
    except OSError as exc:
        return None, [f"unreadable ({_reason(exc)})"]


def newest_verified(directory: str | os.PathLike[str], files: bool = True) -> Verified:
    """The first of :func:`candidates` whose manifest (and with ``files`` its files) verify,
    in this process; :class:`CheckpointError` saying why each failed when none does."""
    skipped: list[tuple[Path, str]] = []
    for path in candidates(directory):
        manifest, problems = examine(path, files=files)
        if manifest is not None and not problems:
            return Verified(path, manifest, tuple(skipped))
        skipped.append((path, some(problems, separator="; ")))
    raise no_checkpoint(Path(directory), skipped)


def no_checkpoint(root: Path, skipped: Sequence[tuple[Path, str]]) -> CheckpointError:
    """The error of a directory with nothing to resume from."""
    if skipped:
        return CheckpointError(
            f"no checkpoint in {root} verifies: " + describe_skipped(skipped) + "; resume from "
            "another copy, or start afresh")
    where = "does not exist" if not root.exists() else "holds no complete checkpoint"
    return CheckpointError(
        f"no checkpoint to resume from: {root} {where} (a save cut short leaves only a "
        "step-N.tmp directory, which never loads); give the directory an earlier run saved "
        "its checkpoints into, or one of its step-N directories, or start afresh")


def describe_skipped(skipped: Sequence[tuple[Path, str]]) -> str:
    """``skipped`` in a line: each checkpoint's name and why."""
    return some([f"{path.name} ({why})" for path, why in skipped], separator="; ")


def some(items: Sequence[str], shown: int = 3, separator: str = ", ") -> str:
    """The first ``shown`` of ``items``, and how many more there are."""
    more = len(items) - shown
    return separator.join(items[:shown]) + (f" and {more} more" if more > 0 else "")
