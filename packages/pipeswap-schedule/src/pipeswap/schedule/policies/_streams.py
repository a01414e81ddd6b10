"""The copy streams the cost-aware plans keep: each a queue, first in first out, that says
when every copy on it ends.

Which chunks are taken (and where their copies are issued) fixes when every copy ends; a plan
asks a stream what would change if one chunk's copies were replaced, without changing it
(:meth:`Stream.replay`), then makes the change (:meth:`Stream.replace`). Both walk only from
the first copy that moves until the queue runs as it did, so a change costs what it disturbs,
not the length of the queue: what keeps planning linear in a long timeline.
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
    forwards or of the layers), from ``release`` on. ``deadline`` is when compute needs it
    done (a plan may instead derive an offload's from the lag and slots it chooses)."""

    order: tuple[int, int, float, int]
    release: float
    duration: float
    owner: ChunkKey
    layer: int
    offload: bool
    deadline: float = math.inf


class Stream:
    """One copy stream's queue on a rank's own timeline, first in first out, with the end
    of every copy."""

    def __init__(self) -> None:
        self.copies: list[Copy] = []
        self.ends: list[float] = []
        self.owned: dict[ChunkKey, list[Copy]] = {}  # owner -> its copies, in queue order

    def clone(self) -> Stream:
        other = Stream()
        other.copies, other.ends = list(self.copies), list(self.ends)
        other.owned = dict(self.owned)  # the lists are replaced, never changed in place
        return other

    def positions(self, owner: ChunkKey) -> list[int]:
        """Where ``owner``'s copies sit in the queue."""
        return [bisect_left(self.copies, c) for c in self.owned.get(owner, ())]

    def replay(self, owner: ChunkKey, new: Sequence[Copy]
               ) -> tuple[dict[int, float], list[float]]:
        """The ends that change when ``owner``'s copies are replaced by ``new`` (sorted):
        other copies' by index, and the new copies'. Stops once the queue is back where
        it was."""
        copies, ends = self.copies, self.ends
        old = self.positions(owner)
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
        """Put ``new`` (sorted) in the queue in place of ``owner``'s copies."""
        copies, ends = self.copies, self.ends
        for copy in self.owned.pop(owner, ()):
            index = bisect_left(copies, copy)
            del copies[index], ends[index]
            if index < len(copies):
                self._settle(index)
        for copy in new:
            index = bisect_left(copies, copy)
            copies.insert(index, copy)
            ends.insert(index, math.nan)
            self._settle(index)
        if new:
            self.owned[owner] = list(new)

    def _settle(self, index: int) -> None:
        """Recompute the ends from ``index`` (always that one) until one is as it was."""
        copies, ends = self.copies, self.ends
        free = ends[index - 1] if index > 0 else 0.0
        end = max(copies[index].release, free) + copies[index].duration
        ends[index] = end
        for index in range(index + 1, len(copies)):
            queued = copies[index]
            end = max(queued.release, end) + queued.duration
            if end == ends[index]:
                return
            ends[index] = end

    def busy_from(self, index: int) -> int:
        """Where the busy spell that copy ``index`` is in began: from there on each copy
        waited for the one before it."""
        while index > 0 and self.ends[index - 1] > self.copies[index].release:
            index -= 1
        return index

    def offload_ends(self, owner: ChunkKey) -> dict[int, float]:
        """When each of ``owner``'s offloads ends, by layer."""
        return {copy.layer: self.ends[bisect_left(self.copies, copy)]
                for copy in self.owned.get(owner, ()) if copy.offload}

    def with_replaced(self, owner: ChunkKey, new: Sequence[Copy]
                      ) -> list[tuple[Copy, float]]:
        """Every copy and its end once ``owner``'s copies are ``new``."""
        out, free = [], 0.0
        for queued in sorted([*(c for c in self.copies if c.owner != owner), *new]):
            free = max(queued.release, free) + queued.duration
            out.append((queued, free))
        return out

    def lateness(self) -> float:
        """How long, in all, the copies end past their deadlines."""
        return sum(max(0.0, end - copy.deadline) for copy, end in zip(self.copies, self.ends))
