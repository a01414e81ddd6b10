"""A host buffer pool: size classes, a byte cap, and reuse only after the copy that used a
buffer is complete or ordered before any later copy into it (each release carries the event of
that copy, or none once compute has waited for it: see :mod:`pipeswap.swap.transfers`)."""

from __future__ import annotations

import os
import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeswap.platform import Event, Platform

if TYPE_CHECKING:
    import torch

MIN_CLASS = 4096


class PoolExhaustedError(RuntimeError):
    """The pool cannot hand out a buffer without going over its byte cap."""


@dataclass
class HostBuffer:
    """One pooled host block; ``view`` is the caller's ``nbytes`` prefix of ``block``."""

    block: torch.Tensor
    view: torch.Tensor


def default_pool_bytes() -> int:
    """The host pool's default cap: half this host's physical memory, shared evenly among the
    processes a launcher started on it (``LOCAL_WORLD_SIZE``, as torchrun sets it; else one),
    and at least 1 GiB. Pinned memory cannot be paged out, so no process may take it all; a
    rank of a large model offloads tens of GB in a step, so a fixed cap would be too small."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no such figures here
        physical = 32 << 30
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1 << 30, physical // 2 // local)


def size_class(nbytes: int) -> int:
    """Blocks come in powers of two from 4 KiB, so a steady workload reuses them."""
    size = MIN_CLASS
    while size < nbytes:
        size *= 2
    return size


class HostBufferPool:
    """Pinned (where the platform pins) host blocks, reused across steps; :meth:`reserve`
    pins them ahead of the steps that take them."""

    def __init__(self, platform: Platform, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        self._platform = platform
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: deque[tuple[torch.Tensor, Event]] = deque()
        self.allocated_bytes = 0
        self.allocated_blocks = 0
        self.in_use_bytes = 0
        self.reserved_bytes = 0  # of allocated_bytes: the blocks reserve() allocated
        self._owned: Counter[int] = Counter()  # size class -> blocks allocated (never freed)

    def reserve(self, sizes: Sequence[int]) -> int:
        """Allocate now the blocks that buffers of ``sizes`` (bytes), all held at once, need,
        so that the steps that take them pin nothing: pinning is slow, a page-locking call
        per block. Per size class only the blocks the pool lacks are allocated (those it
        has count, free or not), so reserving again for the same sizes allocates nothing.
        All or nothing: a reservation over the cap raises and allocates no block. Returns
        the bytes allocated."""
        if any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in sizes):
            raise ValueError(f"sizes are positive byte counts, got {list(sizes)!r}")
        needed = Counter(size_class(n) for n in sizes)
        with self._lock:
            missing = {size: count - self._owned[size] for size, count in needed.items()
                       if count > self._owned[size]}
            extra = sum(size * count for size, count in missing.items())
            if self.allocated_bytes + extra > self.max_bytes:
                over = self.allocated_bytes + extra - self.max_bytes
                raise PoolExhaustedError(
                    f"reserving host buffers for {len(sizes)} storages needs {extra} bytes "
                    f"more than the pool holds ({self.allocated_bytes} allocated), {over} "
                    f"over its cap of {self.max_bytes}: raise the cap (SwapManager's "
                    "pool_bytes, pipeswap-train's --host-pool-bytes) to at least "
                    f"{self.allocated_bytes + extra}, or swap fewer activations at a time")
            for size, count in sorted(missing.items()):
                for _ in range(count):
                    self._free.setdefault(size, []).append(self._allocate(size))
            self.reserved_bytes += extra
        return extra

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes``; waits for a pending block only when at the cap."""
        size = size_class(nbytes)
        with self._lock:
            self._reclaim()
            block = self._take_free(size)
            if block is None and self.allocated_bytes + size <= self.max_bytes:
                block = self._allocate(size)
            if block is None:  # at the cap: a larger free block, else wait for a pending one
                block = self._take_larger_free(size) or self._wait_for_pending(size)
            self.in_use_bytes += block.numel()
        return HostBuffer(block, block[:nbytes])

    def release(self, buffer: HostBuffer, after: Event | None = None) -> None:
        """Give ``buffer`` back; it is reused only once ``after`` (its last copy) completed."""
        with self._lock:
            self.in_use_bytes -= buffer.block.numel()
            if after is None or after.query():
                self._free.setdefault(buffer.block.numel(), []).append(buffer.block)
            else:
                self._pending.append((buffer.block, after))

    def waited(self, event: Event) -> None:
        """Compute has waited for ``event``: the blocks released pending on it are free for
        the next offload, whose copy the device orders after that wait (see
        :mod:`pipeswap.swap.transfers`), whether or not the host has seen the event yet."""
        with self._lock:
            still: deque[tuple[torch.Tensor, Event]] = deque()
            for block, after in self._pending:
                if after is event:
                    self._free.setdefault(block.numel(), []).append(block)
                else:
                    still.append((block, after))
            self._pending = still

    def _allocate(self, size: int) -> torch.Tensor:
        block = self._platform.host_buffer(size)
        self.allocated_bytes += size
        self.allocated_blocks += 1
        self._owned[size] += 1
        return block

    def _reclaim(self) -> None:
        still: deque[tuple[torch.Tensor, Event]] = deque()
        while self._pending:
            block, event = self._pending.popleft()
            if event.query():
                self._free.setdefault(block.numel(), []).append(block)
            else:
                still.append((block, event))
        self._pending = still

    def _take_free(self, size: int) -> torch.Tensor | None:
        blocks = self._free.get(size)
        return blocks.pop() if blocks else None

    def _take_larger_free(self, size: int) -> torch.Tensor | None:
        sizes = sorted(s for s, blocks in self._free.items() if s > size and blocks)
        return self._free[sizes[0]].pop() if sizes else None

    def _wait_for_pending(self, size: int) -> torch.Tensor:
        for index, (block, event) in enumerate(self._pending):
            if block.numel() >= size:
                del self._pending[index]
                event.synchronize()
                return block
        raise PoolExhaustedError(
            f"host buffer pool exhausted: need {size} bytes, {self.allocated_bytes} of "
            f"{self.max_bytes} allocated and {self.in_use_bytes} in use; raise the cap "
            "(SwapManager's pool_bytes, pipeswap-train's --host-pool-bytes) or swap fewer "
            "activations at a time")
