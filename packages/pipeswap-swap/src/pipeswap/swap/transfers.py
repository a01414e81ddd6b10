"""The copies between device and host, one group at a time, and the releases they allow.

Apart from the manager (which owns the groups and autograd's hooks) so that the ordering rules
of every copy read in one place: a copy starts after an event from compute; a device storage
is freed only once its copy is waited for, and only when nothing but autograd's saved tensors
references it (:mod:`pipeswap.swap.references`, which needs the checks made on entries while
no storage object of ours is held); a host buffer goes back to the pool with the event of its
last copy, or with none once compute has waited for that copy: every copy into a pooled buffer
is queued after an event that its offload's launch records on compute, so the device orders
the reuse, and the next offload takes the buffer even while the host has yet to see the copy
end, instead of pinning another. Each method is called with the manager's lock held, after the
manager checked that the group's state allows the call (:func:`~pipeswap.swap.group_state.expect`),
and moves the group to its next state.
"""

from __future__ import annotations

import warnings
from contextlib import suppress
from typing import TYPE_CHECKING

from pipeswap.platform import Event, Platform, Stream
from pipeswap.swap.group_state import Group, StorageEntry
from pipeswap.swap.ledger import Ledger
from pipeswap.swap.pool import HostBufferPool, default_pool_bytes
from pipeswap.swap.references import referenced_elsewhere
from pipeswap.swap.values import GroupState

if TYPE_CHECKING:
    import torch


class Transfers:
    """Offloads on a D2H stream and loads on an H2D stream of ``platform``, into and out of
    a host buffer pool of ``pool_bytes`` (default
    :func:`~pipeswap.swap.pool.default_pool_bytes`), counted in ``ledger``."""

    def __init__(self, platform: Platform, pool_bytes: int | None, ledger: Ledger) -> None:
        self.platform = platform
        self.pool = HostBufferPool(
            platform, default_pool_bytes() if pool_bytes is None else pool_bytes)
        self.d2h = platform.new_stream()
        self.h2d = platform.new_stream()
        self.ledger = ledger

    @property
    def streams(self) -> tuple[Stream, ...]:
        """The copy streams, for :func:`drain`."""
        return (self.d2h, self.h2d)

    def releasable(self, candidates: list[StorageEntry], *, launch: bool = False
                   ) -> list[StorageEntry]:
        """The candidates nothing outside the saved activations references; the rest stay on
        the device, counted in the stats (with a warning: that memory is not saved). At a
        ``launch``, one whose earlier copy is still queued passes unchecked: that copy may
        hold it (the CPU platform's does), so :meth:`wait_offload` checks it after."""
        moving, kept = [], []
        for entry in candidates:
            queued = launch and entry.copying is not None and not entry.copying.query()
            if not queued and referenced_elsewhere(entry.holders()):
                kept.append(entry)
            else:
                moving.append(entry)
        if kept:
            self.ledger.skipped["referenced outside saved activations"] += len(kept)
            self.ledger.kept += sum(entry.nbytes for entry in kept)
            warnings.warn(  # stacklevel: the caller of the manager's method
                "swap keeps an activation storage on the device: a tensor (or the storage "
                "object) outside autograd's saved activations still references it, and "
                "freeing it would leave that reference pointing at freed memory; drop such "
                "references before launch_offload (or protect them with "
                "protect_alias_tensors) to save that memory",
                stacklevel=4)
        return moving

    def launch_offload(self, group: Group, *, copy_referenced: bool) -> None:
        """Copy the group's movable storages to host buffers on the D2H stream (see
        :meth:`SwapManager.launch_offload <pipeswap.swap.SwapManager.launch_offload>`)."""
        ready = self.platform.new_event()
        ready.record()
        done = self.platform.new_event()
        taken: list[StorageEntry] = []
        try:
            ready.wait(self.d2h)
            candidates = group.swappable()
            if not copy_referenced:
                candidates = self.releasable(candidates, launch=True)
            with self.platform.stream(self.d2h):
                for entry in candidates:
                    storage = entry.storage()
                    if storage is None:  # its saved views died since: nothing to copy
                        continue
                    entry.host = self.pool.acquire(entry.nbytes)
                    taken.append(entry)
                    self.platform.copy_(entry.host.view, entry.bytes_tensor(storage))
            done.record(self.d2h)
        except BaseException:
            with suppress(Exception):  # the first error is the one to report
                self.d2h.synchronize()  # nothing may still write into returned buffers
            for entry in taken:
                self.return_host(entry, None)
            raise
        group.event, group.state = done, GroupState.OFFLOADING

    def wait_offload(self, group: Group, *, defer_referenced: bool) -> None:
        """Make compute wait for the offload and release what may go (see
        :meth:`SwapManager.wait_offload <pipeswap.swap.SwapManager.wait_offload>`)."""
        assert group.event is not None
        group.event.wait()
        self.pool.waited(group.event)  # buffers of storages the next layer took over
        copied = [entry for entry in group.swappable() if entry.host is not None]
        if defer_referenced:
            group.deferred = [e for e in copied if referenced_elsewhere(e.holders())]
            moving = [e for e in copied if all(e is not d for d in group.deferred)]
        else:
            moving = self.releasable(copied)
        kept = [*moving, *group.deferred]
        for entry in group.storages.values():  # protected, referenced, gone, not copied
            if all(entry is not other for other in kept):
                self.return_host(entry, None)  # compute waited for its copy
        self.release(moving)
        group.event, group.state = None, GroupState.OFFLOADED

    def release_deferred(self, group: Group) -> None:
        """Release what :meth:`wait_offload` deferred, if nothing else references it now."""
        waiting, group.deferred = group.deferred, []
        alive = [entry for entry in waiting if not entry.protected and entry.alive()]
        moving = self.releasable(alive)
        for entry in waiting:
            if all(entry is not other for other in moving):
                self.return_host(entry, None)  # its copy was waited for
        self.release(moving)

    def release(self, moving: list[StorageEntry]) -> None:
        """Free copied storages' device memory: their host copies are complete."""
        for entry in moving:
            storage = entry.storage()
            if storage is not None:  # else its saved views died since, and freed it
                storage.resize_(0)
            entry.resident = False
            self.ledger.uncount(entry)
            self.ledger.offloaded += entry.nbytes

    def launch_load(self, group: Group) -> None:
        """Re-allocate the group's released storages and copy them back on the H2D stream."""
        for entry in group.deferred:  # never released: they stayed on the device
            self.return_host(entry, None)
        group.deferred = []
        moving = [(e, s) for e in group.swappable()
                  if not e.resident and (s := e.storage()) is not None]
        for entry, storage in moving:
            storage.resize_(entry.nbytes)
        ready = self.platform.new_event()
        ready.record()
        ready.wait(self.h2d)
        group.targets = [entry.bytes_tensor(storage) for entry, storage in moving]
        with self.platform.stream(self.h2d):
            for (entry, _), target in zip(moving, group.targets):
                assert entry.host is not None
                self.platform.copy_(target, entry.host.view)
        done = self.platform.new_event()
        done.record(self.h2d)
        group.loading = [entry for entry, _ in moving]
        self.ledger.bury()
        for entry in group.loading:
            self.ledger.count(entry)
        self.ledger.note_peak()
        group.event, group.state = done, GroupState.LOADING

    def wait_load(self, group: Group) -> None:
        """Make compute wait for the load; the group is resident again."""
        assert group.event is not None
        group.event.wait()
        for entry in group.loading:
            entry.resident = True
            self.ledger.reloaded += entry.nbytes
        for entry in group.storages.values():
            self.return_host(entry, None)  # compute waited for the load
        group.loading, group.targets = [], []
        group.event, group.state = None, GroupState.RESIDENT

    def stop_offload(self, group: Group) -> None:
        """End an offload that released nothing yet by keeping every storage: backward reads
        the group now, so a release would only be loaded back (and the tensor being unpacked
        would count as a reference). Compute waits for the copies, which read the storages,
        before autograd may free them."""
        assert group.event is not None
        group.event.wait()
        self.pool.waited(group.event)
        for entry in group.storages.values():
            self.return_host(entry, None)  # compute waited for the copies
        group.event, group.state = None, GroupState.RESIDENT

    def load_now(self, group: Group, entry: StorageEntry) -> None:
        """Make ``entry`` of ``group`` resident before this returns: wait for the load in
        flight that restores it (not loading it twice), else copy it back synchronously."""
        if any(e is entry for e in group.loading):  # load in flight: wait, not again
            assert group.event is not None
            group.event.synchronize()
            for loaded in group.loading:
                loaded.resident = True
                self.ledger.reloaded += loaded.nbytes
            group.loading = []  # wait_load still returns the buffers
        else:
            self.restore_now(entry)

    def abort(self, group: Group) -> None:
        """Wait for the group's transfer in flight, put every released storage back on the
        device and return every host buffer (also when a copy failed: that error raises)."""
        try:
            if group.event is not None:
                group.event.synchronize()
            for entry in group.loading:  # a load in flight is complete now
                entry.resident = True
                self.ledger.reloaded += entry.nbytes
            for entry in group.storages.values():
                if not entry.resident:
                    self.restore_now(entry)
                self.return_host(entry, None)
        finally:  # a failed copy raised above: still return the group's buffers
            for entry in group.storages.values():
                self.return_host(entry, None)
            group.targets = []

    def restore_now(self, entry: StorageEntry) -> None:
        """Bring one released storage back synchronously (its host copy is complete); a
        storage whose saved views are all gone is simply forgotten."""
        storage = entry.storage()
        if storage is None:
            self.return_host(entry, None)
            return
        assert entry.host is not None
        storage.resize_(entry.nbytes)
        self.platform.copy_(entry.bytes_tensor(storage), entry.host.view)
        done = self.platform.new_event()
        done.record()
        done.synchronize()
        entry.resident = True
        self.ledger.bury()
        self.ledger.count(entry)
        self.ledger.reloaded += entry.nbytes
        self.ledger.note_peak()
        self.return_host(entry, None)

    def return_host(self, entry: StorageEntry, after: Event | None) -> None:
        """Give the entry's host buffer back, reusable once ``after`` (its last copy) ends;
        None: at once (no copy, or one compute has waited for: see the module's docstring)."""
        if entry.host is not None:
            self.pool.release(entry.host, after)
            entry.host = None


def drain(streams: tuple[Stream, ...]) -> None:
    """Wait for everything queued on ``streams``; a copy that failed raises nothing here."""
    for stream in streams:
        with suppress(Exception):  # a failed copy was reported where it was waited for
            stream.synchronize()
