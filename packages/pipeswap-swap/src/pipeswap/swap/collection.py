"""What autograd saves, into a swap manager's groups: per device storage, once, with what
stays out of swap (parameters, other devices, small storages, protected ones) and what a
later group of the same chain takes over; and what backward reads back, checked unchanged and
resident.

The records are :mod:`pipeswap.swap.group_state`'s, the byte counts
:mod:`pipeswap.swap.ledger`'s; :class:`~pipeswap.swap.SwapManager` installs the hooks.
"""

from __future__ import annotations

import contextvars
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pipeswap.platform import Platform
from pipeswap.swap.group_state import Group, SavedEntry, StorageEntry, expect
from pipeswap.swap.lifecycle import GroupLifecycle
from pipeswap.swap.values import (GroupState, InPlaceModificationError, SwapError,
                                  SwapResidencyError)

if TYPE_CHECKING:
    import torch


class Collector(GroupLifecycle):
    """The saving and reading half of the manager's hooks, and protection (see
    :class:`~pipeswap.swap.SwapManager` for the arguments)."""

    def __init__(self, platform: Platform, *, min_bytes: int, pool_bytes: int | None,
                 load_on_demand: bool) -> None:
        super().__init__(platform, pool_bytes)
        self._device = platform.device  # read for every saved tensor
        self.min_bytes = min_bytes
        self.load_on_demand = load_on_demand
        self._protected: set[int] = set()  # storage keys protected manager-wide
        self._current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            f"pipeswap_swap_group_{id(self):x}", default=None)

    def switch_group(self, name: str) -> None:
        """Inside :meth:`~pipeswap.swap.SwapManager.group_context`, send what autograd saves
        from now on to group ``name`` (created if new) instead: how a forward is cut into
        per-layer groups."""
        if self._current.get() is None:
            raise SwapError(f"switch_group({name!r}): no group is collecting here; call it "
                            "inside group_context()")
        self.ensure_group(name)
        expect(self._group(name, "switch_group"), "switch_group", GroupState.COLLECTING)
        self._current.set(name)

    def protect_module(self, module: torch.nn.Module) -> None:
        """Never free storage shared with the module's parameters or buffers (``.data`` and
        ``.detach()`` aliases included)."""
        tensors = [*self.platform.parameters_dict(module).values(),
                   *self.platform.buffers_dict(module).values()]
        keys = {_storage_key(t) for t in tensors}
        with self._lock:
            self._protect(list(self._groups.values()), keys, "protect_module")
            self._protected |= keys

    def protect_alias_tensors(self, name: str, tensors: object) -> None:
        """Never free the storages in group ``name`` shared with any tensor in ``tensors`` (a
        tensor, or a nest of lists, tuples, dicts and sets holding some), whether the group
        saved them already or saves them later."""
        group = self._group(name, "protect_alias_tensors")
        keys = {_storage_key(t) for t in _tensors(tensors)}
        with self._lock:
            self._protect([group], keys, "protect_alias_tensors")
            group.protected_keys |= keys

    def _protect(self, groups: list[Group], keys: set[int], call: str) -> None:
        """Mark the groups' storages among ``keys`` protected; all or nothing.

        Protection during an offload still counts (wait_offload keeps the storage), but a
        storage already released cannot be kept: the caller protected it too late.
        """
        hits = [(g, g.storages[key]) for g in groups for key in keys & g.storages.keys()]
        for group, entry in hits:
            if not entry.resident:
                raise SwapError(f"{call}({group.name!r}): group is {group.state.value} and a "
                                "storage to protect is already off the device; protect before "
                                "launch_offload, or before wait_offload at the latest")
        for _, entry in hits:
            entry.protected = True

    def _save(self, name: str, tensor: torch.Tensor) -> SavedEntry:
        """What autograd keeps for ``tensor``, saved in group ``name``."""
        # Every tensor autograd saves in a group comes through here: kept lean (one storage
        # object per call, no WeakSet iteration where its length answers).
        storage = tensor.untyped_storage()
        key: int = storage._cdata
        ledger = self._ledger
        with self._lock:
            if ledger.graveyard:
                ledger.bury()
            group = self._groups[name]
            if group.state is not GroupState.COLLECTING:
                raise SwapError(f"group_context({name!r}): group is {group.state.value}; "
                                "collecting needs it collecting")
            owner_name = self._owner.get(key)
            owner = None if owner_name is None else self._live_entry(owner_name, key)
            if owner is not None and not owner[1].resident:
                other = owner[0]
                raise SwapResidencyError(
                    f"group_context({name!r}): an op saved a tensor {tuple(tensor.shape)} "
                    f"whose storage group {other.name!r} ({other.state.value}) has moved off "
                    "the device, so the op read freed memory; protect tensors that later "
                    f"forwards use (protect_alias_tensors({other.name!r}, ...)) before "
                    "launch_offload")
            nbytes = storage.nbytes()
            reason = self._skip_reason(tensor, nbytes)
            if reason is not None:
                ledger.skipped[reason] += 1
                return SavedEntry(None, None, tensor)
            if owner is not None and owner[0] is not group and self._chained(owner[0], group):
                self._hand_over(owner[0], owner[1], key, group)
            elif owner is not None and owner[0] is not group:
                owner[1].protected = True  # saved by two groups: it stays on the device
                ledger.skipped["shared across groups"] += 1
                return SavedEntry(None, None, tensor)
            entry = group.storages.get(key)
            if entry is None or not entry.alive():  # new, or a dead storage's key
                if entry is not None:
                    ledger.uncount(entry)
                entry = StorageEntry(nbytes, ledger.graveyard, protected=(
                    key in self._protected or key in group.protected_keys))
                group.storages[key] = entry
                self._owner[key] = name
                ledger.held += entry.nbytes
                ledger.note_peak()
            saved = SavedEntry(group, entry, tensor)
            entry.saved.add(saved)
        return saved


    def _skip_reason(self, tensor: torch.Tensor, nbytes: int) -> str | None:
        """Why a saved tensor (its storage ``nbytes`` long) stays out of swap, if it does."""
        import torch

        base = tensor._base
        if isinstance(tensor, torch.nn.Parameter) or (
                base is not None and isinstance(base, torch.nn.Parameter)):
            return "parameter"
        if tensor.device != self._device:
            return "other device"
        if nbytes == 0:
            return "empty storage"
        if nbytes < self.min_bytes:
            return "below min_bytes"
        return None

    def _live_entry(self, name: str | None, key: int) -> tuple[Group, StorageEntry] | None:
        """The group and entry that hold storage ``key`` with a saved view still alive."""
        group = self._groups.get(name) if name is not None else None
        entry = group.storages.get(key) if group is not None else None
        if group is None or entry is None or not entry.alive():
            return None
        return group, entry

    def _read(self, saved: SavedEntry) -> torch.Tensor:
        """The tensor autograd saved as ``saved``, once it is resident and unchanged."""
        tensor = saved.tensor
        if tensor._version != saved.version:
            where = f" in swap group {saved.group.name!r}" if saved.group is not None else ""
            raise InPlaceModificationError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a {tensor.dtype} tensor of shape {tuple(tensor.shape)} "
                f"saved{where} is at version {tensor._version}; expected version "
                f"{saved.version} instead. Hint: as without swap, write to a copy (clone()) "
                "or make the write before the op that saved it; "
                "torch.autograd.set_detect_anomaly(True) shows that op")
        entry, group = saved.entry, saved.group
        if entry is None or group is None:
            return tensor
        if group.name in self._ahead:
            self._first_read(group)
        if not entry.resident:
            if not self.load_on_demand:
                raise SwapResidencyError(
                    f"backward needs an activation of group {group.name!r}, which is "
                    f"{group.state.value}: call launch_load and wait_load before backward (or "
                    "create the manager with load_on_demand=True)")
            warnings.warn(f"loading an activation of group {group.name!r} on demand; schedule "
                          "launch_load/wait_load before backward to overlap the copy",
                          stacklevel=3)
            with self._lock:
                self._transfers.load_now(group, entry)
        return tensor


    def _hand_over(self, owner: Group, entry: StorageEntry, key: int, group: Group) -> None:
        """Move a storage from ``owner`` to ``group`` (see :meth:`link_groups`); a copy of it
        in flight in the owner's offload is dropped (its buffer returns once the copy ends)."""
        del owner.storages[key]
        if entry.host is not None:
            entry.copying = owner.event
        self._transfers.return_host(entry, owner.event)
        for saved in entry.holders():
            saved.group = group
        entry.protected = entry.protected or key in group.protected_keys
        group.storages[key] = entry
        self._owner[key] = group.name


def _storage_key(tensor: torch.Tensor) -> int:
    """Identity of the tensor's storage, shared by all its views and ``.data``/``.detach()``
    aliases, and stable while the storage is resized to zero (its data pointer is not)."""
    key: int = tensor.untyped_storage()._cdata
    return key


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of lists, tuples, dicts and sets."""
    import torch

    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
