"""The swap manager's byte accounting: what moved, what live groups hold on the device, its peak.

The collection hooks and the transfers both change these counts, which must agree to the byte
with what the device holds (the simulator's peaks are checked against them), so they are kept
in one place. A storage counts as held from when a group saves it until it is released, its
saved views all die, or its group is dropped. Every call is made with the manager's lock held.
"""

from __future__ import annotations

from collections import Counter, deque

from pipeswap.swap.group_state import StorageEntry
from pipeswap.swap.pool import HostBufferPool
from pipeswap.swap.values import SwapStats


class Ledger:
    """Bytes offloaded and reloaded, device bytes held and their peak, bytes kept because
    something still referenced them, and the saved tensors left alone, by reason."""

    def __init__(self) -> None:
        self.offloaded = self.reloaded = self.held = self.peak = self.kept = 0
        self.graveyard: deque[StorageEntry] = deque()  # entries that lost a saved view
        self.skipped: Counter[str] = Counter()

    def count(self, entry: StorageEntry) -> None:
        """Count a storage brought back onto the device as held."""
        if not entry.counted:
            entry.counted = True
            self.held += entry.nbytes

    def uncount(self, entry: StorageEntry) -> None:
        """Stop counting a storage: released, replaced, dead, or its group dropped."""
        if entry.counted:
            entry.counted = False
            self.held -= entry.nbytes

    def note_peak(self) -> None:
        """Raise the peak to what is held now."""
        self.peak = max(self.peak, self.held)

    def bury(self) -> None:
        """Stop counting the storages whose saved views autograd has all freed since the last
        call: nothing saved holds them any more (a backward freed them, or a split backward's
        input part freed what its weight part does not need). Called before anything reads
        or raises the device bytes held."""
        graveyard = self.graveyard
        while graveyard:
            entry = graveyard.popleft()
            if entry.counted and not entry.alive():
                self.uncount(entry)

    def stats(self, pool: HostBufferPool) -> SwapStats:
        """The counts, with the host memory of ``pool`` (call :meth:`bury` first)."""
        return SwapStats(
            bytes_offloaded=self.offloaded,
            bytes_reloaded=self.reloaded,
            device_bytes_held=self.held,
            peak_device_bytes_held=self.peak,
            host_bytes_in_use=pool.in_use_bytes,
            host_buffers_allocated=pool.allocated_blocks,
            host_bytes_allocated=pool.allocated_bytes,
            host_bytes_reserved=pool.reserved_bytes,
            skipped=dict(self.skipped),
            bytes_kept_referenced=self.kept,
        )
