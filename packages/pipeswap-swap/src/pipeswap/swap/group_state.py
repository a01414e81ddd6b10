"""The records behind a swap group: the group and its state, each device storage it saved, and
what autograd keeps for each saved tensor.

The manager's hooks fill these records, the transfers move their storages, and the ledger
counts their bytes; they live here, apart from all three, so that each can read and change
them without importing the others. :func:`expect` is the group state machine's one check: a
call made in a state that does not allow it raises :class:`~pipeswap.swap.SwapError` naming
the group, its state and the call.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeswap.platform import Event
from pipeswap.swap.pool import HostBuffer
from pipeswap.swap.references import saved_alias
from pipeswap.swap.values import GroupState, SwapError

if TYPE_CHECKING:
    import torch


@dataclass
class StorageEntry:
    """One device storage saved by a group: all its saved views travel together.

    The views are reached weakly, through the :class:`SavedEntry` objects autograd owns:
    autograd frees them during backward, and swap must not keep that memory alive any longer.
    A storage whose views are all gone has nothing left to move, and is no longer counted as
    held: each dying view posts its entry to ``graveyard``, which the manager's ledger reads
    (see :meth:`~pipeswap.swap.ledger.Ledger.bury`) before it next counts.
    """

    nbytes: int
    graveyard: deque[StorageEntry]
    saved: weakref.WeakSet[SavedEntry] = field(default_factory=weakref.WeakSet)
    protected: bool = False
    resident: bool = True
    counted: bool = True  # its nbytes are in the manager's device bytes held
    host: HostBuffer | None = None
    # the end of an earlier owner's offload that copied it (taken over: see
    # SwapManager._hand_over); until then that queued copy may hold a reference to it
    copying: Event | None = None

    def alive(self) -> bool:
        """Whether a saved view is still alive (:meth:`storage` is not None), without
        iterating: a WeakSet drops a dead entry at once, and its length discounts the removals
        an iteration in progress holds back."""
        return len(self.saved) > 0

    def holders(self) -> list[SavedEntry]:
        """The saved entries autograd still holds for this storage."""
        return list(self.saved)

    def storage(self) -> torch.UntypedStorage | None:
        """The storage, or None once no saved view is alive."""
        for saved in self.saved:
            return saved.tensor.untyped_storage()
        return None

    def bytes_tensor(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """A uint8 tensor over the whole storage (its current size)."""
        import torch

        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class Group:
    name: str
    state: GroupState = GroupState.COLLECTING
    storages: dict[int, StorageEntry] = field(default_factory=dict)  # storage key -> storage
    event: Event | None = None  # the transfer in flight
    # what the load in flight restores
    loading: list[StorageEntry] = field(default_factory=list)
    protected_keys: set[int] = field(default_factory=set)  # storages kept, saved now or later
    deferred: list[StorageEntry] = field(default_factory=list)  # copied, still referenced
    # the destinations of the load in flight: they keep its storages allocated until the
    # copy is waited for, even if autograd frees the saved tensors before (an unread layer)
    targets: list[torch.Tensor] = field(default_factory=list)
    # the bytes each of its recomputed layers' last recompute made, by layer index (see
    # pipeswap.swap.layer_recompute)
    remade: dict[int, int] = field(default_factory=dict)

    def swappable(self) -> list[StorageEntry]:
        """The entries of the storages of the group that move: not protected, with a saved
        view alive. Entries, not storages: the release check must run while nothing of ours
        holds a storage object (see :mod:`pipeswap.swap.references`)."""
        return [entry for entry in self.storages.values()
                if not entry.protected and entry.alive()]


def expect(group: Group, call: str, *states: GroupState) -> None:
    """Raise unless ``group`` is in one of ``states``, the ones ``call`` is legal in."""
    if group.state not in states:
        allowed = " or ".join(s.value for s in states)
        raise SwapError(f"{call}({group.name!r}): group is {group.state.value}, "
                        f"{call} needs it {allowed}")


class SavedEntry:
    """What autograd keeps for a tensor saved inside a group: an alias of the tensor (its
    storage, geometry and version counter, without its autograd identity: see
    :func:`~pipeswap.swap.references.saved_alias`), its version when saved (autograd leaves
    that check to the hooks), and, when it may move, its group and storage entry, through
    which unpack checks residency.

    Never the tensor itself: for an op that saves its own output, the tensor's ``grad_fn`` is
    the node that holds this object, a cycle through C++ that Python's collector cannot break,
    so a graph dropped without a backward would leak with all its activations."""

    __slots__ = ("group", "entry", "tensor", "version", "__weakref__")

    def __init__(self, group: Group | None, entry: StorageEntry | None, tensor: torch.Tensor
                 ) -> None:
        self.group, self.entry = group, entry
        self.tensor = saved_alias(tensor)
        self.version = self.tensor._version  # the tensor's: the counter is shared

    def __del__(self) -> None:
        # Autograd freed this saved view (in whatever thread ran the backward): only post the
        # entry, without the manager's lock; the manager checks whether it has views left.
        entry = self.entry
        if entry is not None:
            entry.graveyard.append(entry)
