"""DCP's file-system writer, taking each file's size and SHA-256 as it writes the file, so a
checkpoint's checksums describe the bytes saved, with no second read of them."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from pipeswap.runtime.checkpoint.manifest import FileSum


class _Digesting(io.IOBase):
    """A file opened for writing that hashes every byte written through it. DCP writes each
    file front to back (its offsets are ``tell()`` before each item), never seeking back."""

    def __init__(self, file: Any,  # Any: the binary file DCP's stream wraps
                 path: str, failures: list[str]) -> None:
        super().__init__()
        self._file = file
        self._path, self._failures = path, failures
        self._digest = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        self._digest.update(view)
        self.size += view.nbytes
        try:
            written: int = self._file.write(view)
            if written < view.nbytes:  # the rest refused: the next write would say why
                self._file.write(view[written:])
        except OSError as exc:  # torch's zip writer would say only "unexpected pos"
            self._failures.append(f"{exc.strerror or exc} (writing {self._path})")
            raise
        return view.nbytes

    def tell(self) -> int:
        position: int = self._file.tell()
        return position

    def flush(self) -> None:
        if not self._file.closed:
            try:
                self._file.flush()
            except OSError as exc:
                self._failures.append(f"{exc.strerror or exc} (writing {self._path})")
                raise

    def fileno(self) -> int:
        number: int = self._file.fileno()
        return number

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()

    def sum(self) -> FileSum:
        return FileSum(self.size, self._digest.hexdigest())


class _DigestingFileSystem(FileSystem):
    """DCP's local file system, recording what each file written holds under its final name
    (DCP writes ``.metadata`` as ``.metadata.tmp`` and renames it)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, FileSum] = {}
        self.failures: list[str] = []  # the writes the disk refused, with their files
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            digesting = _Digesting(stream, str(path), self.failures)
            yield digesting
        with self._lock:
            self.sums[Path(path).name.removesuffix(".tmp")] = digesting.sum()


def digesting_writer(path: Path
                     ) -> tuple[FileSystemWriter, dict[str, FileSum], list[str]]:
    """A writer of a DCP checkpoint into ``path``, the sums of the files it writes (filled
    as it writes them), and the writes the disk refused (each with its file)."""
    writer = FileSystemWriter(path)
    fs = _DigestingFileSystem()
    writer.fs = fs
    return writer, fs.sums, fs.failures
