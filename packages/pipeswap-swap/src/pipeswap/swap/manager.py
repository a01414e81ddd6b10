"""The swap manager: groups of saved activations, offloaded to host and loaded back by storage.

A group collects what autograd saves while its :meth:`SwapManager.group_context` is active.
Activations are handled per *storage*: every view of one storage is copied once (the whole
storage, byte for byte) and restored together. The device storage is released only after its
copy is known complete, and only when nothing but autograd's saved tensors can reach it (see
:mod:`pipeswap.swap.references`), so no tensor a program still holds ever points to freed
memory. Backward refuses to read a storage that is not resident, and a saved tensor written in
place after it was saved fails backward exactly as it does without swap.
"""

from __future__ import annotations

import contextvars
import threading
import warnings
import weakref
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from pipeswap.platform import Event, Platform
from pipeswap.swap.pool import HostBuffer, HostBufferPool, default_pool_bytes
from pipeswap.swap.references import referenced_elsewhere, saved_alias

if TYPE_CHECKING:
    import torch



class GroupState(Enum):
    COLLECTING = "collecting"
    OFFLOADING = "offloading"
    OFFLOADED = "offloaded"
    LOADING = "loading"
    RESIDENT = "resident"
    DONE = "done"
    ABORTED = "aborted"


class SwapError(RuntimeError):
    """A swap call that is not legal now; the message names the group, its state and the call."""


class SwapResidencyError(SwapError):
    """Backward reached an activation whose storage is not on the device."""


class InPlaceModificationError(SwapError):
    """Backward met a saved activation written in place after autograd saved it (the error
    plain autograd raises there too)."""


@dataclass(frozen=True)
class SwapStats:
    """Byte-exact accounting of what the manager moved and holds."""

    bytes_offloaded: int
    bytes_reloaded: int
    # device bytes of resident storages in live groups that a saved activation still holds (a
    # storage whose saved views autograd has all freed, by a backward or by the input part of
    # a split backward, no longer counts)
    device_bytes_held: int
    peak_device_bytes_held: int
    host_bytes_in_use: int
    host_buffers_allocated: int
    host_bytes_allocated: int
    skipped: dict[str, int]  # reason -> saved tensors (or storages) left alone
    # device bytes an offload left in place because a tensor outside autograd's saved
    # activations still referenced their storage (freeing them would break that tensor)
    bytes_kept_referenced: int


@dataclass(frozen=True)
class GroupBytes:
    """A group's device bytes: all its saved activations hold (what it adds to
    ``device_bytes_held``), and the part not protected (what moves)."""

    held: int
    movable: int


@dataclass
class _Storage:
    """One device storage saved by a group: all its saved views travel together.

    The views are reached weakly, through the :class:`_Saved` objects autograd owns: autograd
    frees them during backward, and swap must not keep that memory alive any longer. A storage
    whose views are all gone has nothing left to move, and is no longer counted as held: each
    dying view posts its entry to ``graveyard``, which the manager reads (see
    :meth:`SwapManager._bury`) before it next counts.
    """

    nbytes: int
    graveyard: deque[_Storage]
    saved: weakref.WeakSet[_Saved] = field(default_factory=weakref.WeakSet)
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

    def holders(self) -> list[_Saved]:
        """The saved entries autograd still holds for this storage."""
        return list(self.saved)

    def storage(self) -> Any | None:
        """The storage (``torch.UntypedStorage``), or None once no saved view is alive."""
        for saved in self.saved:
            return saved.tensor.untyped_storage()
        return None

    def bytes_tensor(self, storage: Any) -> torch.Tensor:
        """A uint8 tensor over the whole storage (its current size)."""
        import torch

        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Group:
    name: str
    state: GroupState = GroupState.COLLECTING
    storages: dict[int, _Storage] = field(default_factory=dict)  # storage key -> storage
    event: Event | None = None  # the transfer in flight
    loading: list[_Storage] = field(default_factory=list)  # what the load in flight restores
    protected_keys: set[int] = field(default_factory=set)  # storages kept, saved now or later
    deferred: list[_Storage] = field(default_factory=list)  # copied, still referenced
    # the destinations of the load in flight: they keep its storages allocated until the
    # copy is waited for, even if autograd frees the saved tensors before (an unread layer)
    targets: list[Any] = field(default_factory=list)


class _Saved:
    """What autograd keeps for a tensor saved inside a group: an alias of the tensor (its
    storage, geometry and version counter, without its autograd identity: see
    :func:`~pipeswap.swap.references.saved_alias`), its version when saved (autograd leaves
    that check to the hooks), and, when it may move, its group and storage entry, through
    which unpack checks residency.

    Never the tensor itself: for an op that saves its own output, the tensor's ``grad_fn`` is
    the node that holds this object, a cycle through C++ that Python's collector cannot break,
    so a graph dropped without a backward would leak with all its activations."""

    __slots__ = ("group", "entry", "tensor", "version", "__weakref__")

    def __init__(self, group: _Group | None, entry: _Storage | None, tensor: torch.Tensor
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


class SwapManager:
    """Offload and reload groups of saved activations on one platform.

    ``min_bytes``: saved tensors whose storage is smaller stay on the device (0, MindSpore hyper-parallel's
    behaviour, swaps everything eligible). ``pool_bytes``: the most host memory (pinned on
    accelerators) the manager's buffers take; default :func:`~pipeswap.swap.pool.default_pool_bytes`,
    half the host's memory shared among the local ranks. ``load_on_demand``: when backward
    reaches an activation that is not resident, load it synchronously with a warning instead
    of raising.
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
        self._pool = HostBufferPool(
            platform, default_pool_bytes() if pool_bytes is None else pool_bytes)
        self._d2h = platform.new_stream()
        self._h2d = platform.new_stream()
        self._lock = threading.RLock()
        self._groups: dict[str, _Group] = {}
        self._owner: dict[int, str] = {}  # storage key -> group that saved it
        self._protected: set[int] = set()  # storage keys protected manager-wide
        self._current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            f"pipeswap_swap_group_{id(self):x}", default=None)
        # group -> the group its first read in backward loads ahead (None: none); see
        # load_ahead
        self._ahead: dict[str, str | None] = {}
        self._chains: dict[str, int] = {}  # group -> its chain (see link_groups)
        self._next_chain = 0
        self._offloaded = self._reloaded = self._held = self._peak = self._kept = 0
        self._graveyard: deque[_Storage] = deque()  # entries that lost a saved view
        self._skipped: Counter[str] = Counter()
        # A copy still running when the interpreter exits aborts the process: drain first.
        self._drain = weakref.finalize(self, _drain, (self._d2h, self._h2d))

    def close(self) -> None:
        """Wait for every transfer in flight (also done at interpreter exit). Each call
        drains: the manager stays usable, and the exit's drain stays armed."""
        _drain((self._d2h, self._h2d))

    # -- groups ----------------------------------------------------------------------------

    def ensure_group(self, name: str) -> None:
        with self._lock:
            if name not in self._groups:
                self._groups[name] = _Group(name)

    def active_group_count(self) -> int:
        with self._lock:
            return len(self._groups)

    def group_state(self, name: str) -> GroupState:
        return self._group(name, "group_state").state

    def _group(self, name: str, call: str) -> _Group:
        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise SwapError(f"{call}({name!r}): no such group; create it with ensure_group() or "
                            "group_context()")
        return group

    def _expect(self, group: _Group, call: str, *states: GroupState) -> None:
        if group.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise SwapError(f"{call}({group.name!r}): group is {group.state.value}, "
                            f"{call} needs it {allowed}")

    # -- collection ------------------------------------------------------------------------

    @contextmanager
    def group_context(self, name: str) -> Iterator[None]:
        """Saved activations of the ops run inside join group ``name``."""
        import torch

        self.ensure_group(name)
        self._expect(self._group(name, "group_context"), "group_context", GroupState.COLLECTING)
        token = self._current.set(name)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._current.reset(token)

    def switch_group(self, name: str) -> None:
        """Inside :meth:`group_context`, send what autograd saves from now on to group
        ``name`` (created if new) instead: how a forward is cut into per-layer groups."""
        if self._current.get() is None:
            raise SwapError(f"switch_group({name!r}): no group is collecting here; call it "
                            "inside group_context()")
        self.ensure_group(name)
        self._expect(self._group(name, "switch_group"), "switch_group", GroupState.COLLECTING)
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

    def protect_alias_tensors(self, name: str, tensors: Any) -> None:
        """Never free the storages in group ``name`` shared with any tensor in ``tensors``,
        whether the group saved them already or saves them later."""
        group = self._group(name, "protect_alias_tensors")
        keys = {_storage_key(t) for t in _tensors(tensors)}
        with self._lock:
            self._protect([group], keys, "protect_alias_tensors")
            group.protected_keys |= keys

    def _protect(self, groups: list[_Group], keys: set[int], call: str) -> None:
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

    def _pack(self, tensor: torch.Tensor) -> Any:
        # Every tensor autograd saves in a group comes through here: kept lean (one storage
        # object per call, no WeakSet iteration where its length answers).
        name = self._current.get()
        if name is None:
            return _Saved(None, None, tensor)
        storage = tensor.untyped_storage()
        key: int = storage._cdata
        with self._lock:
            if self._graveyard:
                self._bury()
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
                self._skipped[reason] += 1
                return _Saved(None, None, tensor)
            if owner is not None and owner[0] is not group and self._chained(owner[0], group):
                self._hand_over(owner[0], owner[1], key, group)
            elif owner is not None and owner[0] is not group:
                owner[1].protected = True  # saved by two groups: it stays on the device
                self._skipped["shared across groups"] += 1
                return _Saved(None, None, tensor)
            entry = group.storages.get(key)
            if entry is None or not entry.alive():  # new, or a dead storage's key
                if entry is not None:
                    self._uncount(entry)
                entry = _Storage(nbytes, self._graveyard, protected=(
                    key in self._protected or key in group.protected_keys))
                group.storages[key] = entry
                self._owner[key] = name
                self._held += entry.nbytes
                self._peak = max(self._peak, self._held)
            saved = _Saved(group, entry, tensor)
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

    def _live_entry(self, name: str | None, key: int) -> tuple[_Group, _Storage] | None:
        """The group and entry that hold storage ``key`` with a saved view still alive."""
        group = self._groups.get(name) if name is not None else None
        entry = group.storages.get(key) if group is not None else None
        if group is None or entry is None or not entry.alive():
            return None
        return group, entry

    def _unpack(self, saved: _Saved) -> torch.Tensor:
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
                if any(e is entry for e in group.loading):  # load in flight: wait, not again
                    assert group.event is not None
                    group.event.synchronize()
                    for loaded in group.loading:
                        loaded.resident = True
                        self._reloaded += loaded.nbytes
                    group.loading = []  # wait_load still returns the buffers
                else:
                    self._restore_now(group, entry)
        return tensor

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

    def _chained(self, owner: _Group, group: _Group) -> bool:
        """Whether ``group`` may take a storage ``owner`` saved: same chain, and the owner
        has not released anything yet."""
        chain = self._chains.get(owner.name)
        return (chain is not None and chain == self._chains.get(group.name)
                and owner.state in (GroupState.COLLECTING, GroupState.OFFLOADING))

    def _hand_over(self, owner: _Group, entry: _Storage, key: int, group: _Group) -> None:
        """Move a storage from ``owner`` to ``group`` (see :meth:`link_groups`); a copy of it
        in flight in the owner's offload is dropped (its buffer returns once the copy ends)."""
        del owner.storages[key]
        if entry.host is not None:
            entry.copying = owner.event
        self._return_host(entry, owner.event)
        for saved in entry.holders():
            saved.group = group
        entry.protected = entry.protected or key in group.protected_keys
        group.storages[key] = entry
        self._owner[key] = group.name

    def load_ahead(self, names: Sequence[str]) -> None:
        """Stream a backward's loads: when backward first reads a saved activation of
        ``names[k]``, that group is made resident (its load waited for, or done then if none
        was launched) and the load of ``names[k - 1]`` is launched, so each group's copy
        overlaps the backward of the group after it. ``names`` are a forward's groups in the
        order it saved them (one per layer); launch the last one's load yourself. All or
        nothing: with one of ``names`` missing, it raises and arms none."""
        with self._lock:
            for name in names:
                self._group(name, "load_ahead")
            for index, name in enumerate(names):
                self._ahead[name] = names[index - 1] if index > 0 else None

    def _first_read(self, group: _Group) -> None:
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

    def _make_resident(self, group: _Group) -> None:
        if group.state is GroupState.OFFLOADING:
            self._stop_offload(group)
        if group.state is GroupState.OFFLOADED:
            self.launch_load(group.name)
        if group.state is GroupState.LOADING:
            self.wait_load(group.name)

    def _stop_offload(self, group: _Group) -> None:
        """End an offload that released nothing yet by keeping every storage: backward reads
        the group now, so a release would only be loaded back (and the tensor being unpacked
        would count as a reference). Compute waits for the copies, which read the storages,
        before autograd may free them."""
        assert group.event is not None
        group.event.wait()
        for entry in group.storages.values():
            self._return_host(entry, group.event)
        group.event, group.state = None, GroupState.RESIDENT

    # -- transfers -------------------------------------------------------------------------

    def _swappable(self, group: _Group) -> list[tuple[_Storage, Any]]:
        """(entry, storage) for every storage of the group that moves: not protected, with a
        saved view alive."""
        moving = []
        for entry in group.storages.values():
            storage = None if entry.protected else entry.storage()
            if storage is not None:
                moving.append((entry, storage))
        return moving

    def _releasable(self, candidates: list[tuple[_Storage, Any]], *, launch: bool = False
                    ) -> list[tuple[_Storage, Any]]:
        """The candidates nothing outside the saved activations references; the rest stay on
        the device, counted in the stats (with a warning: that memory is not saved). At a
        ``launch``, one whose earlier copy is still queued passes unchecked: that copy may
        hold it (the CPU platform's does), so :meth:`wait_offload` checks it after."""
        moving, kept = [], []
        for entry, storage in candidates:
            queued = launch and entry.copying is not None and not entry.copying.query()
            if not queued and referenced_elsewhere(entry.holders()):
                kept.append(entry)
            else:
                moving.append((entry, storage))
        if kept:
            self._skipped["referenced outside saved activations"] += len(kept)
            self._kept += sum(entry.nbytes for entry in kept)
            warnings.warn(
                "swap keeps an activation storage on the device: a tensor outside autograd's "
                "saved activations still references it, and freeing it would leave that "
                "tensor pointing at freed memory; drop such references before launch_offload "
                "(or protect them with protect_alias_tensors) to save that memory",
                stacklevel=3)
        return moving

    def launch_offload(self, name: str, *, copy_referenced: bool = False) -> None:
        """Start copying the group's storages to host memory on the D2H stream; a storage that
        something outside the saved activations references is not copied (it cannot be
        freed), unless ``copy_referenced``: for a group launched while the forward still
        holds its last tensors (a layer's input, in a per-layer group), which
        :meth:`wait_offload` checks again before freeing."""
        group = self._group(name, "launch_offload")
        with self._lock:
            self._expect(group, "launch_offload", GroupState.COLLECTING)
            ready = self.platform.new_event()
            ready.record()
            done = self.platform.new_event()
            taken: list[_Storage] = []
            try:
                ready.wait(self._d2h)
                candidates = self._swappable(group)
                with self.platform.stream(self._d2h):
                    for entry, storage in (candidates if copy_referenced
                                           else self._releasable(candidates, launch=True)):
                        entry.host = self._pool.acquire(entry.nbytes)
                        taken.append(entry)
                        self.platform.copy_(entry.host.view, entry.bytes_tensor(storage))
                done.record(self._d2h)
            except BaseException:
                with suppress(Exception):  # the first error is the one to report
                    self._d2h.synchronize()  # nothing may still write into returned buffers
                for entry in taken:
                    self._return_host(entry, None)
                raise
            group.event, group.state = done, GroupState.OFFLOADING

    def wait_offload(self, name: str, *, defer_referenced: bool = False) -> None:
        """Make compute wait for the offload, then release the group's device storage (what
        is still unreferenced outside the saved activations: the check is made again here).
        With ``defer_referenced``, a storage still referenced keeps its host copy and waits,
        without a warning, for :meth:`release_deferred` (a per-layer group freed while the
        forward runs, whose tensors its caller may still hold: autocast's cast weights)."""
        group = self._group(name, "wait_offload")
        with self._lock:
            self._expect(group, "wait_offload", GroupState.OFFLOADING)
            assert group.event is not None
            group.event.wait()
            copied = [(e, s) for e, s in self._swappable(group) if e.host is not None]
            if defer_referenced:
                group.deferred = [e for e, _ in copied if referenced_elsewhere(e.holders())]
                moving = [(e, s) for e, s in copied if all(e is not d for d in group.deferred)]
            else:
                moving = self._releasable(copied)
            kept = [*(entry for entry, _ in moving), *group.deferred]
            for entry in group.storages.values():  # protected, referenced, gone, not copied
                if all(entry is not other for other in kept):
                    self._return_host(entry, group.event)
            self._release(moving)
            group.event, group.state = None, GroupState.OFFLOADED

    def release_deferred(self, name: str) -> None:
        """Release what :meth:`wait_offload` deferred in an offloaded group, now that nothing
        else references it; what is still referenced stays on the device (with a warning)."""
        group = self._group(name, "release_deferred")
        with self._lock:
            self._expect(group, "release_deferred", GroupState.OFFLOADED)
            waiting, group.deferred = group.deferred, []
            alive = [(e, s) for e in waiting
                     if not e.protected and (s := e.storage()) is not None]
            moving = self._releasable(alive)
            for entry in waiting:
                if all(entry is not other for other, _ in moving):
                    self._return_host(entry, None)  # its copy was waited for
            self._release(moving)

    def _release(self, moving: list[tuple[_Storage, Any]]) -> None:
        """Free copied storages' device memory: their host copies are complete."""
        for entry, storage in moving:
            storage.resize_(0)
            entry.resident = False
            self._uncount(entry)
            self._offloaded += entry.nbytes

    def launch_load(self, name: str) -> None:
        """Re-allocate the group's storages and start copying them back on the H2D stream."""
        group = self._group(name, "launch_load")
        with self._lock:
            if group.state is GroupState.OFFLOADING:
                raise SwapError(f"launch_load({name!r}): group is offloading; call "
                                "wait_offload first (load before the offload finished)")
            self._expect(group, "launch_load", GroupState.OFFLOADED)
            for entry in group.deferred:  # never released: they stayed on the device
                self._return_host(entry, None)
            group.deferred = []
            moving = [(e, s) for e, s in self._swappable(group) if not e.resident]
            for entry, storage in moving:
                storage.resize_(entry.nbytes)
            ready = self.platform.new_event()
            ready.record()
            ready.wait(self._h2d)
            group.targets = [entry.bytes_tensor(storage) for entry, storage in moving]
            with self.platform.stream(self._h2d):
                for (entry, _), target in zip(moving, group.targets):
                    assert entry.host is not None
                    self.platform.copy_(target, entry.host.view)
            done = self.platform.new_event()
            done.record(self._h2d)
            group.loading = [entry for entry, _ in moving]
            self._bury()
            for entry in group.loading:
                self._count(entry)
            self._peak = max(self._peak, self._held)
            group.event, group.state = done, GroupState.LOADING

    def wait_load(self, name: str) -> None:
        """Make compute wait for the load; the activations are usable again."""
        group = self._group(name, "wait_load")
        with self._lock:
            self._expect(group, "wait_load", GroupState.LOADING)
            assert group.event is not None
            group.event.wait()
            for entry in group.loading:
                entry.resident = True
                self._reloaded += entry.nbytes
            for entry in group.storages.values():
                self._return_host(entry, group.event)
            group.loading, group.targets = [], []
            group.event, group.state = None, GroupState.RESIDENT

    def finish_group(self, name: str) -> None:
        """Forget a group whose activations are resident (after its backward)."""
        group = self._group(name, "finish_group")
        with self._lock:
            self._expect(group, "finish_group", GroupState.RESIDENT, GroupState.COLLECTING)
            self._drop(group, GroupState.DONE)

    def abort_group(self, name: str) -> None:
        """Stop whatever the group is doing: wait for its transfers, put every freed storage
        back on the device, return every host buffer, forget the group. Missing: no-op."""
        with self._lock:
            group = self._groups.get(name)
            if group is None:
                return
            try:
                if group.event is not None:
                    group.event.synchronize()
                for entry in group.loading:  # a load in flight is complete now
                    entry.resident = True
                    self._reloaded += entry.nbytes
                for entry in group.storages.values():
                    if not entry.resident:
                        self._restore_now(group, entry)
                    self._return_host(entry, None)
            finally:  # a failed copy raised above: still forget the group and its buffers
                for entry in group.storages.values():
                    self._return_host(entry, None)
                group.targets = []
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

    def _restore_now(self, group: _Group, entry: _Storage) -> None:
        """Bring one freed storage back synchronously (its host copy is complete); a storage
        whose saved views are all gone is simply forgotten."""
        storage = entry.storage()
        if storage is None:
            self._return_host(entry, None)
            return
        assert entry.host is not None
        storage.resize_(entry.nbytes)
        self.platform.copy_(entry.bytes_tensor(storage), entry.host.view)
        done = self.platform.new_event()
        done.record()
        done.synchronize()
        entry.resident = True
        self._bury()
        self._count(entry)
        self._reloaded += entry.nbytes
        self._peak = max(self._peak, self._held)
        self._return_host(entry, None)

    def _return_host(self, entry: _Storage, after: Event | None) -> None:
        if entry.host is not None:
            self._pool.release(entry.host, after)
            entry.host = None

    def _count(self, entry: _Storage) -> None:
        """Count a storage brought back onto the device as held."""
        if not entry.counted:
            entry.counted = True
            self._held += entry.nbytes

    def _uncount(self, entry: _Storage) -> None:
        """Stop counting a storage: released, replaced, dead, or its group dropped."""
        if entry.counted:
            entry.counted = False
            self._held -= entry.nbytes

    def _bury(self) -> None:
        """Stop counting the storages whose saved views autograd has all freed since the last
        call: nothing saved holds them any more (a backward freed them, or a split backward's
        input part freed what its weight part does not need). Called with the lock held,
        before anything reads or raises the device bytes held."""
        graveyard = self._graveyard
        while graveyard:
            entry = graveyard.popleft()
            if entry.counted and not entry.alive():
                self._uncount(entry)

    def _drop(self, group: _Group, state: GroupState) -> None:
        self._ahead.pop(group.name, None)
        self._chains.pop(group.name, None)
        for key, entry in group.storages.items():
            self._uncount(entry)
            if self._owner.get(key) == group.name:
                del self._owner[key]
        group.state = state
        group.storages.clear()
        del self._groups[group.name]

    def group_bytes(self, name: str) -> GroupBytes:
        """Device bytes the group holds now, and how many of them an offload would move."""
        group = self._group(name, "group_bytes")
        held = movable = 0
        with self._lock:  # one pass; movable as _swappable counts it, without storage objects
            self._bury()
            for entry in group.storages.values():
                if entry.counted:
                    held += entry.nbytes
                    if not entry.protected and entry.alive():
                        movable += entry.nbytes
        return GroupBytes(held, movable)

    def reset_peak(self) -> None:
        """Start the peak of device bytes held over from what is held now (e.g. per step)."""
        with self._lock:
            self._bury()
            self._peak = self._held

    def stats(self) -> SwapStats:
        with self._lock:
            self._bury()
            return SwapStats(
                bytes_offloaded=self._offloaded,
                bytes_reloaded=self._reloaded,
                device_bytes_held=self._held,
                peak_device_bytes_held=self._peak,
                host_bytes_in_use=self._pool.in_use_bytes,
                host_buffers_allocated=self._pool.allocated_blocks,
                host_bytes_allocated=self._pool.allocated_bytes,
                skipped=dict(self._skipped),
                bytes_kept_referenced=self._kept,
            )


def _drain(streams: tuple[Any, ...]) -> None:
    for stream in streams:
        with suppress(Exception):  # a failed copy was reported where it was waited for
            stream.synchronize()


def _storage_key(tensor: torch.Tensor) -> int:
    """Identity of the tensor's storage, shared by all its views and ``.data``/``.detach()``
    aliases, and stable while the storage is resized to zero (its data pointer is not)."""
    key: int = tensor.untyped_storage()._cdata
    return key


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
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
