"""The swap manager: groups of saved activations, offloaded to host and loaded back by storage.

A group collects what autograd saves while its :meth:`SwapManager.group_context` is active.
Activations are handled per *storage*: every view of one storage is copied once (the whole
storage, byte for byte) and restored together. The device storage is released only after its
copy is known complete, and only when nothing but autograd's saved tensors can reach it (see
:mod:`pipeswap.swap.references`), so no tensor or storage object a program still holds ever
points to freed memory. Backward refuses to read a storage that is not resident, and a saved
tensor written in place after it was saved fails backward exactly as it does without swap.

This module holds the facade: the groups by name, autograd's pack and unpack hooks,
protection, chains of per-layer groups and the backward's loads ahead. The records it keeps
are in :mod:`pipeswap.swap.groups`, the copies in :mod:`pipeswap.swap.transfers`, the byte
counts in :mod:`pipeswap.swap.ledger`.
"""

from __future__ import annotations

import contextvars
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pipeswap.platform import Platform
from pipeswap.swap.groups import Group, SavedEntry, StorageEntry, expect
from pipeswap.swap.ledger import Ledger
from pipeswap.swap.recompute import Call, Frame, Placeholder, frames_of, track
from pipeswap.swap.transfers import Transfers, drain
from pipeswap.swap.values import (GroupBytes, GroupState, InPlaceModificationError, SwapError,
                                  SwapResidencyError, SwapStats, check_load_depth)

if TYPE_CHECKING:
    import torch


class SwapManager:
    """Offload and reload groups of saved activations on one platform.

    ``min_bytes``: saved tensors whose storage is smaller stay on the device (0, MindSpore
    hyper-parallel's behaviour, swaps everything eligible). ``pool_bytes``: the most host
    memory (pinned on accelerators) the manager's buffers take; default
    :func:`~pipeswap.swap.pool.default_pool_bytes`, half the host's memory shared among the
    local ranks. ``load_on_demand``: when backward reaches an activation that is not
    resident, load it synchronously with a warning instead of raising.
    """

    def __init__(
        self,
        platform: Platform,
        *,
        min_bytes: int = 0,
        pool_bytes: int | None = None,
        load_on_demand: bool = False,
    ) -> None:
        self.platform = platform
        self._device = platform.device  # read for every saved tensor
        self.min_bytes = min_bytes
        self.load_on_demand = load_on_demand
        self._ledger = Ledger()
        self._transfers = Transfers(platform, pool_bytes, self._ledger)
        self._lock = threading.RLock()
        self._groups: dict[str, Group] = {}
        self._owner: dict[int, str] = {}  # storage key -> group that saved it
        self._protected: set[int] = set()  # storage keys protected manager-wide
        self._current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            f"pipeswap_swap_group_{id(self):x}", default=None)
        # the recomputed layer whose forward runs (see record_layer)
        self._recording: contextvars.ContextVar[Frame | None] = contextvars.ContextVar(
            f"pipeswap_swap_recording_{id(self):x}", default=None)
        self._releases = 0  # backwards that only free what they saved (see releasing)
        # group -> the group its first read in backward loads ahead (None: none); see
        # load_ahead
        self._ahead: dict[str, str | None] = {}
        self._chains: dict[str, int] = {}  # group -> its chain (see link_groups)
        self._next_chain = 0
        # A copy still running when the interpreter exits aborts the process: drain first.
        self._drain = weakref.finalize(self, drain, self._transfers.streams)

    def close(self) -> None:
        """Wait for every transfer in flight (also done at interpreter exit). Each call
        drains: the manager stays usable, and the exit's drain stays armed."""
        drain(self._transfers.streams)

    # -- groups ----------------------------------------------------------------------------

    def ensure_group(self, name: str) -> None:
        with self._lock:
            if name not in self._groups:
                self._groups[name] = Group(name)

    def active_group_count(self) -> int:
        with self._lock:
            return len(self._groups)

    def group_state(self, name: str) -> GroupState:
        return self._group(name, "group_state").state

    def _group(self, name: str, call: str) -> Group:
        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise SwapError(f"{call}({name!r}): no such group; create it with ensure_group() or "
                            "group_context()")
        return group

    # -- collection ------------------------------------------------------------------------

    @contextmanager
    def group_context(self, name: str) -> Iterator[None]:
        """Saved activations of the ops run inside join group ``name``."""
        import torch

        self.ensure_group(name)
        expect(self._group(name, "group_context"), "group_context", GroupState.COLLECTING)
        token = self._current.set(name)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._current.reset(token)
            self._recording.set(None)  # a recomputed layer that raised ends here

    def switch_group(self, name: str) -> None:
        """Inside :meth:`group_context`, send what autograd saves from now on to group
        ``name`` (created if new) instead: how a forward is cut into per-layer groups."""
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

    def _pack(self, tensor: torch.Tensor) -> SavedEntry | Placeholder:
        # Every tensor autograd saves in a group comes through here: kept lean (one storage
        # object per call, no WeakSet iteration where its length answers).
        name = self._current.get()
        if name is None:
            return SavedEntry(None, None, tensor)
        frame = self._recording.get()
        if frame is not None:  # a recomputed layer's: made again in backward
            return frame.placeholder(tensor, self._groups.get(name))
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

    def _unpack(self, saved: SavedEntry | Placeholder) -> torch.Tensor:
        if type(saved) is Placeholder:
            return self._remade(saved)
        assert isinstance(saved, SavedEntry)
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
                          stacklevel=2)
            with self._lock:
                self._transfers.load_now(group, entry)
        return tensor

    # -- recomputed layers (see pipeswap.swap.recompute) -------------------------------------

    def record_layer(self, layer: torch.nn.Module, index: int, args: tuple[object, ...],
                     kwargs: dict[str, object]) -> None:
        """Layer ``index`` of a forward starts, recomputed: its call's tensors are saved in
        the collecting group (what it keeps), and what its ops save becomes placeholders
        until :meth:`end_recording`, made again by the backward's first read of one."""
        name = self._current.get()
        if name is None:
            raise SwapError(f"record_layer: layer {index} is recomputed but no group is "
                            "collecting here; run its forward inside group_context()")
        if self._recording.get() is not None:
            raise SwapError(f"record_layer: layer {index} starts inside a recomputed layer; "
                            "recompute the outer layer or the inner ones, not both")
        call = Call(args, kwargs)
        kept = []
        for tensor in call.tensors:
            saved = self._pack(tensor)
            assert isinstance(saved, SavedEntry)
            kept.append(saved)
        frame = Frame(layer, index, self._group(name, "record_layer"), call, kept)
        with self._lock:
            track(frame.group, frame)
        self._recording.set(frame)

    def end_recording(self, layer: torch.nn.Module) -> None:
        """``layer``'s forward ended: if it was being recorded, its ops save normally again."""
        if (frame := self._recording.get()) is not None and frame.layer is layer:
            self._recording.set(None)

    @contextmanager
    def releasing(self) -> Iterator[None]:
        """Around a backward that runs nodes with no gradient only to free what they saved
        (after a split backward's I): a placeholder read again there gets a stand-in of its
        shape (nothing computes with it) instead of a recompute."""
        with self._lock:
            self._releases += 1
        try:
            yield
        finally:
            with self._lock:
                self._releases -= 1

    def release_remade(self, name: str) -> None:
        """The group's recomputed layers are done with (a split backward's input part computed
        their weight gradients too): drop what they keep and what their recomputes left."""
        group = self._group(name, "release_remade")
        with self._lock:
            for frame in frames_of(group):
                frame.finish()

    def remade_bytes(self, name: str) -> dict[int, int]:
        """Per recomputed layer of the group (by index), the device bytes its last recompute
        made and counted."""
        return dict(self._group(name, "remade_bytes").remade)

    def _remade(self, holder: Placeholder) -> torch.Tensor:
        """A placeholder's tensor, made again by the layer's recompute if not yet made."""
        import torch

        frame, group = holder.frame, holder.group
        if frame.finished:
            raise SwapError(
                f"backward read a tensor that {frame.describe()} saved after that layer's "
                "backward was done: a split backward's I computes a recomputed layer's "
                "weight gradients, and this W reaches the layer through a parameter it does "
                "not own (a tensor made from another layer's parameters, passed in); "
                "recompute other layers, or run the schedule without the I/W split")
        if group is not None and group.name in self._ahead:
            self._first_read(group)
        slot = frame.slots[holder.index] if frame.made else None  # made: slots filled
        if slot is None:
            if self._releases and frame.made:  # taken already: read only to be freed
                shape, dtype = frame.metas[holder.index]
                return torch.zeros((), dtype=dtype, device=self._device).expand(shape)
            frame.remake([self._unpack(saved) for saved in frame.kept],  # fills the slots
                         lambda tensor: self._store(frame, tensor))
            with self._lock:
                frame.group.remade[frame.index] = frame.remade
            slot = frame.slots[holder.index]
            assert slot is not None
        frame.slots[holder.index] = None
        return slot.tensor

    def _store(self, frame: Frame, tensor: torch.Tensor) -> torch.Tensor:
        with self._lock:  # the recompute's save hook
            return frame.store(tensor, self._ledger, self._counted)

    def _counted(self, tensor: torch.Tensor, key: int, nbytes: int) -> bool:
        """Whether a storage a recompute saves is counted already, or never is: a parameter
        or buffer, one a live group holds (the kept input), one left out of swap."""
        return (self._skip_reason(tensor, nbytes) is not None or key in self._protected
                or self._live_entry(self._owner.get(key), key) is not None)

    def link_groups(self, names: Sequence[str]) -> None:
        """Make ``names`` (one forward's per-layer groups, in order) one chain: a storage a
        group saved that a later group of the chain saves again (a layer's output, saved by
        the op that made it and by the next layer's first op) moves to the later group, which
        leaves the device later and comes back earlier, instead of staying on the device."""
        with self._lock:
            self._next_chain += 1
            for name in names:
                self._group(name, "link_groups")
                self._chains[name] = self._next_chain

    def _chained(self, owner: Group, group: Group) -> bool:
        """Whether ``group`` may take a storage ``owner`` saved: same chain, and the owner
        has not released anything yet."""
        chain = self._chains.get(owner.name)
        return (chain is not None and chain == self._chains.get(group.name)
                and owner.state in (GroupState.COLLECTING, GroupState.OFFLOADING))

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

    def load_ahead(self, names: Sequence[str], depth: int = 1) -> None:
        """Stream a backward's loads: when backward first reads a saved activation of
        ``names[k]``, that group is made resident (its load waited for, or done then if none
        was launched) and the load of ``names[k - depth]`` is launched, so each copy overlaps
        the backward of the ``depth`` groups after it (one more resident per ``depth`` over
        1). ``names``: a forward's groups in the order it saved them (one per layer); launch
        the last ``depth`` loads yourself. With a name missing or ``depth`` not 1 to
        ``len(names)``, it raises and arms none."""
        check_load_depth(depth, len(names), "load_ahead: depth")
        with self._lock:
            for name in names:
                self._group(name, "load_ahead")
            for index, name in enumerate(names):
                self._ahead[name] = names[index - depth] if index >= depth else None

    def _first_read(self, group: Group) -> None:
        """Backward reached ``group`` for the first time (see :meth:`load_ahead`)."""
        with self._lock:
            if group.name not in self._ahead:  # another thread got here first
                return
            ahead = self._ahead[group.name]
            self._make_resident(group)
            del self._ahead[group.name]
            following = self._groups.get(ahead) if ahead is not None else None
            if following is not None:
                if following.state is GroupState.OFFLOADING:
                    self.wait_offload(following.name)
                if following.state is GroupState.OFFLOADED:
                    self.launch_load(following.name)

    def _make_resident(self, group: Group) -> None:
        if group.state is GroupState.OFFLOADING:
            self._transfers.stop_offload(group)
        if group.state is GroupState.OFFLOADED:
            self.launch_load(group.name)
        if group.state is GroupState.LOADING:
            self.wait_load(group.name)

    # -- transfers -------------------------------------------------------------------------

    def launch_offload(self, name: str, *, copy_referenced: bool = False) -> None:
        """Start copying the group's storages to host memory on the D2H stream; a storage that
        something outside the saved activations references is not copied (it cannot be
        freed), unless ``copy_referenced``: for a group launched while the forward still
        holds its last tensors (a layer's input, in a per-layer group), which
        :meth:`wait_offload` checks again before freeing."""
        group = self._group(name, "launch_offload")
        with self._lock:
            expect(group, "launch_offload", GroupState.COLLECTING)
            self._transfers.launch_offload(group, copy_referenced=copy_referenced)

    def wait_offload(self, name: str, *, defer_referenced: bool = False) -> None:
        """Make compute wait for the offload, then release the group's device storage (what
        is still unreferenced outside the saved activations: the check is made again here).
        With ``defer_referenced``, a storage still referenced keeps its host copy and waits,
        without a warning, for :meth:`release_deferred` (a per-layer group freed while the
        forward runs, whose tensors its caller may still hold: autocast's cast weights)."""
        group = self._group(name, "wait_offload")
        with self._lock:
            expect(group, "wait_offload", GroupState.OFFLOADING)
            self._transfers.wait_offload(group, defer_referenced=defer_referenced)

    def release_deferred(self, name: str) -> None:
        """Release what :meth:`wait_offload` deferred in an offloaded group, now that nothing
        else references it; what is still referenced stays on the device (with a warning)."""
        group = self._group(name, "release_deferred")
        with self._lock:
            expect(group, "release_deferred", GroupState.OFFLOADED)
            self._transfers.release_deferred(group)

    def launch_load(self, name: str) -> None:
        """Re-allocate the group's storages and start copying them back on the H2D stream."""
        group = self._group(name, "launch_load")
        with self._lock:
            if group.state is GroupState.OFFLOADING:
                raise SwapError(f"launch_load({name!r}): group is offloading; call "
                                "wait_offload first (load before the offload finished)")
            expect(group, "launch_load", GroupState.OFFLOADED)
            self._transfers.launch_load(group)

    def wait_load(self, name: str) -> None:
        """Make compute wait for the load; the activations are usable again."""
        group = self._group(name, "wait_load")
        with self._lock:
            expect(group, "wait_load", GroupState.LOADING)
            self._transfers.wait_load(group)

    def finish_group(self, name: str) -> None:
        """Forget a group whose activations are resident (after its backward)."""
        group = self._group(name, "finish_group")
        with self._lock:
            expect(group, "finish_group", GroupState.RESIDENT, GroupState.COLLECTING)
            self._drop(group, GroupState.DONE)

    def abort_group(self, name: str) -> None:
        """Stop whatever the group is doing: wait for its transfers, put every freed storage
        back on the device, return every host buffer, forget the group. Missing: no-op."""
        with self._lock:
            group = self._groups.get(name)
            if group is None:
                return
            try:
                self._transfers.abort(group)
            finally:  # a failed copy raised: still forget the group
                self._drop(group, GroupState.ABORTED)

    def end_group(self, name: str) -> None:
        """Forget a group after its backward, whatever its state: a per-layer group whose
        tensors backward never read may still be offloaded; what of it is still alive comes
        back first (another backward may yet read it)."""
        group = self._group(name, "end_group")
        if group.state is GroupState.LOADING:
            self.wait_load(name)
        if group.state in (GroupState.RESIDENT, GroupState.COLLECTING):
            self.finish_group(name)
        else:
            self.abort_group(name)

    def _drop(self, group: Group, state: GroupState) -> None:
        self._ahead.pop(group.name, None)
        self._chains.pop(group.name, None)
        for key, entry in group.storages.items():
            self._ledger.uncount(entry)
            if self._owner.get(key) == group.name:
                del self._owner[key]
        group.state = state
        group.storages.clear()
        del self._groups[group.name]

    # -- accounting ------------------------------------------------------------------------

    def group_bytes(self, name: str) -> GroupBytes:
        """Device bytes the group holds now, and how many of them an offload would move."""
        group = self._group(name, "group_bytes")
        held = movable = 0
        with self._lock:  # one pass; movable as Group.swappable counts it
            self._ledger.bury()
            for entry in group.storages.values():
                if entry.counted:
                    held += entry.nbytes
                    if not entry.protected and entry.alive():
                        movable += entry.nbytes
        return GroupBytes(held, movable)

    def movable_sizes(self, name: str) -> tuple[int, ...]:
        """The byte size of each storage of the group an offload would copy now (not
        protected, a saved view alive), in the order the group saved them: one host buffer
        each, what :meth:`launch_offload` with ``copy_referenced`` takes from the pool."""
        group = self._group(name, "movable_sizes")
        with self._lock:
            return tuple(entry.nbytes for entry in group.swappable())

    def reserve_host(self, sizes: Sequence[int]) -> int:
        """Pin now the host buffers for storages of ``sizes`` bytes held off the device at
        once (an executor works them out from its schedule), so that the first step's
        offloads take them instead of pinning; see
        :meth:`~pipeswap.swap.pool.HostBufferPool.reserve`. Returns the bytes pinned now."""
        return self._transfers.pool.reserve(sizes)

    def reset_peak(self) -> None:
        """Start the peak of device bytes held over from what is held now (e.g. per step)."""
        with self._lock:
            self._ledger.bury()
            self._ledger.peak = self._ledger.held

    def stats(self) -> SwapStats:
        with self._lock:
            self._ledger.bury()
            return self._ledger.stats(self._transfers.pool)


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
