"""Whether anything but autograd's saved tensors can still reach a storage.

Releasing a storage (resizing it to zero bytes) is safe only when no tensor a program can still
use points into it: a read through such a tensor would be a use-after-free, a crash or silently
wrong numbers. The saved tensors themselves are safe to cut off, since autograd reaches them
only through the swap manager's unpack hook, which checks residency first. Everything else
shows up in three reference counts, exact in CPython and torch:

- the storage's use count: one per tensor viewing it, plus one for its Python object; one
  more is a tensor the saved views do not account for (another view, a ``.data`` alias);
- each such tensor's use count: one for its Python object, plus one per saved view whose base
  it is; one more is a C++ holder (an autograd node that saved it outside the hooks);
- each such tensor's Python reference count: one per saved entry holding it (and one that
  torch itself keeps while views hold the tensor); one more is a variable or container.

Each count is compared with that of a fresh tensor taken the same way, so the check does not
depend on interpreter details; anything unexpected (or a torch without these counters) keeps
the storage on the device: the cost of a doubt is memory, never a crash.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class HoldsTensor(Protocol):
    """One of autograd's saved entries: it holds one reference to its tensor."""

    tensor: torch.Tensor


def referenced_elsewhere(holders: Sequence[HoldsTensor]) -> bool:
    """True unless the tensors of ``holders`` (the live saved entries of one storage, each
    holding one reference) and their view bases are all that reference their storage."""
    if not holders:
        return False
    if not _counters_available():
        return True
    known, expected_python = _known_tensors(holders)
    fresh = _fresh_counts()
    storage = next(iter(known.values())).untyped_storage()
    if _storage_uses(storage) - fresh.storage != len(known):
        return True
    bases = Counter(id(t._base) for t in known.values() if t._base is not None)
    if any(_use_count(t) - fresh.impl != bases[key] for key, t in known.items()):
        return True  # a C++ holder besides the Python object and the known views
    # A tensor that views hold keeps one more Python reference of its own: torch lets the
    # tensor own its Python object while C++ still uses it.
    python = _python_refs(known)
    return any(python[key] - fresh.python != expected_python[key] + (bases[key] > 0)
               for key in known)


def _counters_available() -> bool:
    import torch

    return hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")


def _known_tensors(holders: Sequence[HoldsTensor]
                   ) -> tuple[dict[int, torch.Tensor], Counter[int]]:
    """The saved tensors and their view bases by id, and how many holders each saved one has
    (the Python references to it that are expected)."""
    known: dict[int, torch.Tensor] = {}
    expected: Counter[int] = Counter()
    for holder in holders:
        known.setdefault(id(holder.tensor), holder.tensor)
        expected[id(holder.tensor)] += 1
    for tensor in list(known.values()):
        base = tensor._base
        if base is not None:
            known.setdefault(id(base), base)
    return known, expected


def _use_count(tensor: torch.Tensor) -> int:
    uses: int = tensor._use_count()  # type: ignore[attr-defined]
    return uses


class _Counts:
    """A fresh tensor's counts, taken exactly as :func:`referenced_elsewhere` takes them."""

    def __init__(self, storage: int, impl: int, python: int) -> None:
        self.storage, self.impl, self.python = storage, impl, python


def _fresh_counts() -> _Counts:
    import torch

    known = {0: torch.empty(1)}
    storage = _storage_uses(known[0].untyped_storage()) - 1
    impl = _use_count(known[0])
    return _Counts(storage, impl, _python_refs(known)[0])


def _storage_uses(storage: Any) -> int:
    import torch

    uses: int = torch._C._storage_Use_Count(storage._cdata)
    return uses


def _python_refs(known: dict[int, torch.Tensor]) -> dict[int, int]:
    """Python references to each tensor; ``known`` holds one of them."""
    return {key: sys.getrefcount(tensor) for key, tensor in known.items()}
