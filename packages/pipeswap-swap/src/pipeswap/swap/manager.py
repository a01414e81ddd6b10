"""The swap manager: groups of saved activations, offloaded to host and loaded back by storage.

A group collects what autograd saves while its :meth:`SwapManager.group_context` is active.
Activations are handled per *storage*: every view of one storage is copied once (the whole
storage, byte for byte) and restored together. The device storage is released only after its
copy is known complete, and only when nothing but autograd's saved tensors can reach it (see
:mod:`pipeswap.swap.references`), so no tensor or storage object a program still holds ever
points to freed memory. Backward refuses to read a storage that is not resident, and a saved
tensor written in place after it was saved fails backward exactly as it does without swap.

This module holds the whole: autograd's pack and unpack hooks, recomputed layers and the
byte counts. It builds on :mod:`pipeswap.swap.collection` (what the hooks save and read back,
protection, chains of per-layer groups), which builds on :mod:`pipeswap.swap.lifecycle` (the
groups by name, their offloads and loads, the backward's loads ahead). The records they keep
are in :mod:`pipeswap.swap.group_state`, the copies in :mod:`pipeswap.swap.transfers`, the
byte counts in :mod:`pipeswap.swap.ledger`.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pipeswap.platform import Platform
from pipeswap.swap.collection import Collector
from pipeswap.swap.group_state import Group, SavedEntry, expect
from pipeswap.swap.layer_recompute import Call, Frame, Placeholder
from pipeswap.swap.values import GroupBytes, GroupState, SwapError, SwapStats

if TYPE_CHECKING:
    import torch


class SwapManager(Collector):
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
        super().__init__(platform, min_bytes=min_bytes, pool_bytes=pool_bytes,
                         load_on_demand=load_on_demand)
        # the recomputed layer whose forward runs (see record_layer)
        self._recording: contextvars.ContextVar[Frame | None] = contextvars.ContextVar(
            f"pipeswap_swap_recording_{id(self):x}", default=None)
        self._releases = 0  # backwards that only free what they saved (see releasing)
        # group -> its recomputed layers, weakly (autograd's nodes keep them)
        self._frames: dict[str, list[weakref.ref[Frame]]] = {}

    # -- autograd's hooks ------------------------------------------------------------------

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

    def _pack(self, tensor: torch.Tensor) -> SavedEntry | Placeholder:
        name = self._current.get()
        if name is None:
            return SavedEntry(None, None, tensor)
        frame = self._recording.get()
        if frame is not None:  # a recomputed layer's: made again in backward
            return frame.placeholder(tensor, self._groups.get(name))
        return self._save(name, tensor)

    def _unpack(self, saved: SavedEntry | Placeholder) -> torch.Tensor:
        if type(saved) is Placeholder:
            return self._remade(saved)
        assert isinstance(saved, SavedEntry)
        return self._read(saved)

    # -- recomputed layers (see pipeswap.swap.layer_recompute) -----------------------------

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
        kept = [self._save(name, tensor) for tensor in call.tensors]
        frame = Frame(layer, index, self._group(name, "record_layer"), call, kept)
        with self._lock:  # weakly: the frame lives as long as autograd's nodes that hold it
            frames = [ref for ref in self._frames.get(name, ()) if ref() is not None]
            self._frames[name] = [*frames, weakref.ref(frame)]
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
            for ref in self._frames.get(group.name, ()):
                if (frame := ref()) is not None:
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
            frame.remake([self._read(saved) for saved in frame.kept],  # fills the slots
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


    def _drop(self, group: Group, state: GroupState) -> None:
        """Forget the group and its recomputed layers."""
        super()._drop(group, state)
        self._frames.pop(group.name, None)
