"""The copy streams of the layer-resolution plan: each a queue, first in first out, that
says when every copy on it ends.

Which chunks are taken (and where their loads start) fixes when every copy ends, and so the
smallest layer lag each streamed chunk can have; the plan asks a stream what would change if
one chunk's copies were replaced, without changing it (:meth:`Stream.replay`).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import NamedTuple

from pipeswap.schedule.steps import ChunkKey

# Copies go on their stream in program order: by compute slot, and in a slot the launches
# before its compute, the copies the compute starts itself, the launches after it.
BEFORE, INSIDE, AFTER = 0, 1, 2


class Copy(NamedTuple):
    """One copy on a stream: issued in ``order`` (slot, phase, time, then the order of the
    forwards or of the layers), from ``release`` on. A load's ``deadline`` is when compute
    needs it; an offload's follows from the lag and slots chosen for it."""

    order: tuple[int, int, float, int]
    release: float
    duration: float
    owner: ChunkKey
    layer: int
    offload: bool
    deadline: float = math.inf



class Stream:
    """One copy stream's queue on the rank's own timeline, first in first out, with the end
    of every copy."""

    def __init__(self) -> None:
        self.copies: list[Copy] = []
        self.ends: list[float] = []
        self.index: dict[ChunkKey, list[int]] = {}  # owner -> its copies' indices

    def replay(self, owner: ChunkKey, new: Sequence[Copy]
               ) -> tuple[dict[int, float], list[float]]:
        """The ends that change when ``owner``'s copies are replaced by ``new`` (sorted):
        existing copies' by index, and the new copies'. Stops once the queue is back where
        it was."""
        copies, ends = self.copies, self.ends
        old = self.index.get(owner, [])
        starts = [*old, *(bisect_left(copies, c) for c in new[:1])]
        if not starts:
            return {}, []
        index, last_old = min(starts), max(old, default=-1)
        free = ends[index - 1] if index > 0 else 0.0
        changed: dict[int, float] = {}
        new_ends: list[float] = []
        while index < len(copies) or len(new_ends) < len(new):
            pending = new[len(new_ends)] if len(new_ends) < len(new) else None
            if pending is not None and (index >= len(copies) or pending < copies[index]):
                free = max(pending.release, free) + pending.duration
                new_ends.append(free)
                continue
            queued = copies[index]
            if queued.owner != owner:
                end = max(queued.release, free) + queued.duration
                if end != ends[index]:
                    changed[index] = end
                elif pending is None and index > last_old:
                    break  # from here on the queue runs as it did
                free = end
            index += 1
        return changed, new_ends

    def replace(self, owner: ChunkKey, new: Sequence[Copy]) -> None:
        self.copies = sorted([*(c for c in self.copies if c.owner != owner), *new])
        self.ends, self.index, free = [], {}, 0.0
        for index, queued in enumerate(self.copies):
            free = max(queued.release, free) + queued.duration
            self.ends.append(free)
            self.index.setdefault(queued.owner, []).append(index)

    def offload_ends(self, owner: ChunkKey) -> dict[int, float]:
        """When each of ``owner``'s offloads ends, by layer."""
        return {self.copies[i].layer: self.ends[i] for i in self.index.get(owner, ())
                if self.copies[i].offload}

    def with_replaced(self, owner: ChunkKey, new: Sequence[Copy]
                      ) -> list[tuple[Copy, float]]:
        """Every copy and its end once ``owner``'s copies are ``new``."""
        out, free = [], 0.0
        for queued in sorted([*(c for c in self.copies if c.owner != owner), *new]):
            free = max(queued.release, free) + queued.duration
            out.append((queued, free))
        return out
