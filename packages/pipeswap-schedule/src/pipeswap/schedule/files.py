"""The command line's files: each way reading or writing one can fail becomes one line that
says which file, what went wrong and what to do, instead of a traceback."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class FileAccessError(Exception):
    """A file the command line cannot read or write (not a problem of the schedule in it)."""


def read_text(path: str) -> str:
    """The UTF-8 text of ``path``, or of standard input for ``-``."""
    name = "standard input" if path == "-" else path
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileAccessError(f"cannot read {name}: no such file; check the path, or give - "
                              "to read standard input") from None
    except IsADirectoryError:
        raise FileAccessError(f"cannot read {name}: it is a directory; give a schedule "
                              "file") from None
    except OSError as exc:
        raise FileAccessError(f"cannot read {name}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise FileAccessError(f"{name} is not a text file: expected a schedule in UTF-8 "
                              "(JSON, 'rank N:' lines or PyTorch's CSV)") from None


@contextmanager
def writing(path: str) -> Iterator[None]:
    """Turn an ``OSError`` from writing ``path`` in the block into a :class:`FileAccessError`."""
    try:
        yield
    except IsADirectoryError:
        raise FileAccessError(f"cannot write {path}: it is a directory; give a file "
                              "name") from None
    except OSError as exc:
        folder = Path(path).parent
        why = (f"the directory {folder} does not exist; create it first"
               if not folder.is_dir() else f"{exc.strerror or exc}; write somewhere else")
        raise FileAccessError(f"cannot write {path}: {why}") from None


def write_text(path: str, text: str) -> None:
    with writing(path):
        Path(path).write_text(text, encoding="utf-8")
