"""Whether anything but autograd's saved tensors can still reach a storage.

Releasing a storage (resizing it to zero bytes) is safe only when no tensor a program can still
use points into it: a read through such a tensor would be a use-after-free, a crash or silently
wrong numbers. The saved tensors themselves are safe to cut off, since autograd reaches them
only through the swap manager's unpack hook, which checks residency first.

A saved entry holds :func:`saved_alias` of the tensor autograd saved, never the tensor itself:
an alias sharing its storage and version counter, with no autograd identity (no ``grad_fn``,
no view base). Holding the tensor would close a reference cycle through C++ for every op that
saves its own output (node -> saved variable -> entry -> tensor -> ``grad_fn`` == node), which
Python's collector cannot see: a graph dropped without a backward would never be freed. The
alias also means the saved entries reach nothing but the storage, so everything else that can
still use it shows up in four reference counts, exact in CPython and torch:

- the storage's use count: one per tensor viewing it, plus one for its Python object; one
  more than the entries' aliases is any other tensor (the tensor autograd saved, still held by
  the program or by an autograd node that saved it outside the hooks, a view, a ``.data`` or
  ``.detach()`` alias, an unpacked saved tensor);
- the storage's Python object's reference count: torch keeps one such object per storage,
  alive while a tensor uses the storage whether or not anything holds it, and counts it once
  in the use count either way, so a handle the program keeps (``untyped_storage()``, a typed
  ``storage()`` wrapping it, kept in a forward or from an earlier step) shows only here; one
  more than a fresh storage's is such a handle;
- each alias's use count: one for its Python object; one more is a C++ holder (a view of it);
- each alias's Python reference count: one per saved entry holding it; one more is a variable
  or container.

Each count is compared with that of a fresh alias taken the same way, so the check does not
depend on interpreter details; anything unexpected (or a torch without these counters) keeps
the storage on the device: the cost of a doubt is memory, never wrong numbers. The caller
must hold no storage object while it checks (only saved entries): its own reference would
read as the program's, and keep every storage.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class HoldsTensor(Protocol):
    """One of autograd's saved entries: it holds one reference to its tensor, a
    :func:`saved_alias`."""

    tensor: torch.Tensor


def saved_alias(tensor: torch.Tensor) -> torch.Tensor:
    """What a saved entry holds for ``tensor``: the same storage, view geometry and version
    counter (an in-place write to ``tensor`` shows in its ``_version``), and no autograd
    identity (no ``grad_fn``, no ``_base``), so it keeps neither the graph nor a view base
    alive. Unpacked, autograd attaches the saved tensor's ``grad_fn`` or gradient accumulator
    to it again."""
    return tensor.detach()


def referenced_elsewhere(holders: Sequence[HoldsTensor]) -> bool:
    """True unless the tensors of ``holders`` (the live saved entries of one storage, each
    holding one reference to its :func:`saved_alias`) are all that reference their storage."""
    if not holders:
        return False
    if not _counters_available():
        return True
    known, expected_python = _known_tensors(holders)
    fresh = _fresh_counts()
    storage = next(iter(known.values())).untyped_storage()
    if _storage_uses(storage) - fresh.storage != len(known):
        return True  # another tensor views the storage (a view base counts here too)
    if _storage_refs(storage) != fresh.storage_python:
        return True  # the program holds the storage object itself, or a typed storage over it
    if any(_use_count(t) - fresh.impl != 0 for t in known.values()):
        return True  # a C++ holder besides the Python object: a view of the alias
    python = _python_refs(known)
    return any(python[key] - fresh.python != expected_python[key] for key in known)


def _counters_available() -> bool:
    import torch

    return (hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")
            and hasattr(sys, "getrefcount"))


def _known_tensors(holders: Sequence[HoldsTensor]
                   ) -> tuple[dict[int, torch.Tensor], Counter[int]]:
    """The saved aliases by id, and how many holders each has (the Python references to it
    that are expected)."""
    known: dict[int, torch.Tensor] = {}
    expected: Counter[int] = Counter()
    for holder in holders:
        known.setdefault(id(holder.tensor), holder.tensor)
        expected[id(holder.tensor)] += 1
    return known, expected


def _use_count(tensor: torch.Tensor) -> int:
    uses: int = tensor._use_count()  # type: ignore[attr-defined]
    return uses


class _Counts:
    """A fresh alias's counts, taken exactly as :func:`referenced_elsewhere` takes them."""

    def __init__(self, storage: int, storage_python: int, impl: int, python: int) -> None:
        self.storage, self.storage_python = storage, storage_python
        self.impl, self.python = impl, python


def _fresh_counts() -> _Counts:
    import torch

    # An alias as the pack hook makes it, of a tensor nothing holds any more: what one saved
    # entry's alias counts when it alone reaches its storage, less the entry's own reference.
    known = {0: saved_alias(torch.empty(1, device="cpu"))}
    storage = known[0].untyped_storage()
    uses = _storage_uses(storage) - 1
    storage_python = _storage_refs(storage)
    impl = _use_count(known[0])
    return _Counts(uses, storage_python, impl, _python_refs(known)[0])


def _storage_uses(storage: torch.UntypedStorage) -> int:
    import torch

    uses: int = torch._C._storage_Use_Count(storage._cdata)
    return uses


def _storage_refs(storage: torch.UntypedStorage) -> int:
    """Python references to the storage object; the caller holds one, in a variable."""
    return sys.getrefcount(storage)


def _python_refs(known: dict[int, torch.Tensor]) -> dict[int, int]:
    """Python references to each tensor; ``known`` holds one of them."""
    return {key: sys.getrefcount(tensor) for key, tensor in known.items()}
