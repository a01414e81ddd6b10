"""The copy streams the cost-aware plans keep: each a queue, first in first out, that says
when every copy on it ends.

Which chunks are taken (and where their copies are issued) fixes when every copy ends; a plan
asks a stream what would change if one chunk's copies were replaced, without changing it
(:meth:`CopyStream.replay`), then makes the change (:meth:`CopyStream.replace`). Both walk
only from the first copy that moves until the queue runs as it did, so a change costs what it
disturbs, not the length of the queue: what keeps planning linear in a long timeline.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
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


class CopyStream:
    """One copy stream's queue on a rank's own timeline, first in first out, with the end
    of every copy."""

    def __init__(self) -> None:
        self.copies: list[Copy] = []
        self.ends: list[float] = []
        self.owned: dict[ChunkKey, list[Copy]] = {}  # owner -> its copies, in queue order
        # per copy, how many past their deadlines from it to the end of the run of copies
        # that waited for the one before (made when asked, dropped when the queue changes)
        self._late: list[int] | None = None
        self._at: dict[ChunkKey, list[int]] = {}  # positions asked for since the last change

    def clone(self) -> CopyStream:
        other = CopyStream()
        other.copies, other.ends = list(self.copies), list(self.ends)
        other.owned = dict(self.owned)  # the lists are replaced, never changed in place
        return other

    def positions(self, owner: ChunkKey) -> list[int]:
        """Where ``owner``'s copies sit in the queue (not to be changed)."""
        found = self._at.get(owner)
        if found is None:
            found = self._at[owner] = [bisect_left(self.copies, c)
                                       for c in self.owned.get(owner, ())]
        return found

    def replay(self, owner: ChunkKey, new: Sequence[Copy]
               ) -> tuple[dict[int, float], list[float]]:
        """The ends that change when ``owner``'s copies are replaced by ``new`` (sorted):
        other copies' by index, and the new copies'. Walks from each place the queue
        changes (an old copy leaves, a new one comes) only until it runs as it did again."""
        copies, ends = self.copies, self.ends
        old = self.positions(owner)
        events = sorted({*old, *(bisect_left(copies, c) for c in new)})
        if not events:
            return {}, []
        gone = set(old)
        changed: dict[int, float] = {}
        new_ends: list[float] = []
        index, pending = events[0], 0
        free = ends[index - 1] if index > 0 else 0.0
        while index < len(copies) or pending < len(new):
            if pending < len(new) and (index >= len(copies) or new[pending] < copies[index]):
                free = max(new[pending].release, free) + new[pending].duration
                new_ends.append(free)
                pending += 1
                continue
            if index in gone:
                index += 1
                continue
            queued = copies[index]
            free = max(queued.release, free) + queued.duration
            if free != ends[index]:
                changed[index] = free
                index += 1
                continue
            # the queue runs as it did from here to the next place it changes
            after = bisect_right(events, index)
            if after == len(events):
                break
            index = events[after]
            free = ends[index - 1]
        return changed, new_ends

    def least_lateness(self, copy: Copy) -> float:
        """A lower bound of how much later than now, in all, the copies end past their
        deadlines once ``copy`` joins the queue (its own lateness included): the copy
        after it starts later by some shift, and so does each copy after that one that
        waited for the one before, one past its deadline being that much later."""
        copies, ends = self.copies, self.ends
        at = bisect_left(copies, copy)
        end = max(copy.release, ends[at - 1] if at else 0.0) + copy.duration
        least = max(0.0, end - copy.deadline)
        if at < len(copies):
            before = ends[at - 1] if at else 0.0
            shift = max(copies[at].release, end) - max(copies[at].release, before)
            least += shift * self._late_runs()[at]
        return least

    def _late_runs(self) -> list[int]:
        if self._late is None:
            copies, ends = self.copies, self.ends
            late = [0] * (len(copies) + 1)
            for index in reversed(range(len(copies))):
                waits = index + 1 < len(copies) and copies[index + 1].release <= ends[index]
                late[index] = (ends[index] > copies[index].deadline) + (
                    late[index + 1] if waits else 0)
            self._late = late
        return self._late

    def replace(self, owner: ChunkKey, new: Sequence[Copy]) -> None:
        """Put ``new`` (sorted) in the queue in place of ``owner``'s copies."""
        self._late = None
        self._at = {}
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

    def waiting(self, owner: ChunkKey) -> set[ChunkKey]:
        """The owners of the copies that waited, one after the other, for one of
        ``owner``'s: the copies a change to ``owner``'s may end sooner or later."""
        copies, ends, found = self.copies, self.ends, set()
        for index in self.positions(owner):
            while index + 1 < len(copies) and copies[index + 1].release < ends[index]:
                index += 1
                found.add(copies[index].owner)
        return found

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
