"""The peak policy at slot resolution: which whole chunks to swap, and with how many compute
slots for each copy.

A plan holds the chunks taken on one rank and what the rank holds in each compute slot with
them; it takes, one at a time, the chunk that best lowers the highest slot with copies that
hide (or, for a budget, that stall least), then drops what lowers nothing. The layer
resolution plan (:mod:`pipeswap.schedule.policies._layer_plan`) refines the same loop.

Every step costs what it touches, not the rank's length, so that a rank of thousands of slots
plans in milliseconds: the slots are kept in blocks that know their highest value
(:class:`~pipeswap.schedule.policies._profile.Profile`), the chunks that may cover a slot are found by bisection (candidates come
in forward order), and a copy's effect on its stream is replayed only as far as it reaches
(:class:`~pipeswap.schedule.policies._streams.CopyStream`).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from itertools import accumulate, compress
from collections.abc import Iterator, Sequence

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.policies._profile import Profile
from pipeswap.schedule.policies._slots import MAX_COPY_SLOTS, Timeline
from pipeswap.schedule.policies._streams import AFTER, BEFORE, Copy, CopyStream
from pipeswap.schedule.steps import ChunkKey
from pipeswap.schedule.swap_plan import SwapCandidate, SwapPlacement

#: Placements to try, tightest first; zero slots (compute waits for the whole copy) only
#: where a budget allows exposed copies.
_PLACEMENTS = tuple(SwapPlacement(off, load) for off, load in sorted(
    ((off, load) for off in range(MAX_COPY_SLOTS + 1) for load in range(MAX_COPY_SLOTS + 1)),
    key=lambda p: (sum(p), p)))
_HIDING = tuple(p for p in _PLACEMENTS if min(p.offload_slots, p.load_slots) > 0)
#: How far a copy's lower bound may exceed what :meth:`ChunkPlan._added` works out for it (the
#: same sums, added in another order).
_ROUNDING = 1e-9


class ChunkPlan:
    """The chunks a :class:`PeakPolicy` has taken on one rank, and what the rank holds in
    each compute slot with them."""

    def __init__(self, costs: CostModel, rank: int, line: Timeline,
                 candidates: Sequence[SwapCandidate]) -> None:
        self.costs, self.rank, self.line = costs, rank, line
        link = costs.rank_link(rank)
        self.candidates = [c for c in candidates if c.gap >= 2]  # off the device a slot
        self.position = {c.key: i for i, c in enumerate(self.candidates)}
        self.forwards = [c.forward_slot for c in self.candidates]  # ascending
        # each candidate's backward slot while it is not taken, -1 once it is
        self.open = [c.backward_slot for c in self.candidates]
        self.longest = max((c.gap for c in self.candidates), default=0)
        by_stage: dict[int, int] = {}
        self.movable = [self._movable(c.key, by_stage) for c in self.candidates]
        self.d2h = [m / link.d2h_bandwidth for m in self.movable]
        self.h2d = [m / link.h2d_bandwidth for m in self.movable]
        self.offloads = CopyStream()
        self.loads = CopyStream() if link.duplex else self.offloads
        # over a link of no limit every copy ends as it starts: none is ever late
        self.instant = math.inf == link.d2h_bandwidth == link.h2d_bandwidth
        self.chosen: dict[ChunkKey, SwapPlacement] = {}
        self.profile = Profile(line.held(candidates, costs))
        self._made: dict[tuple[int, SwapPlacement], tuple[Copy, Copy]] = {}

    def _movable(self, key: ChunkKey, by_stage: dict[int, int]) -> int:
        if key in self.costs.chunks or key[0] not in by_stage:
            movable = self.costs.chunk_bytes(key).movable
            if key in self.costs.chunks:
                return movable
            by_stage[key[0]] = movable
        return by_stage[key[0]]

    @property
    def peak(self) -> int:
        return self.profile.peak

    def off_slots(self, c: SwapCandidate, placement: SwapPlacement) -> range:
        """The slots during which ``c`` is off the device when placed so."""
        return range(c.forward_slot + placement.offload_slots + 1,
                     c.backward_slot - placement.load_slots)

    def _copies(self, index: int, placement: SwapPlacement) -> tuple[Copy, Copy]:
        """The offload and the load of candidate ``index`` placed so, each with the time
        compute waits for it (made once per placement)."""
        found = self._made.get((index, placement))
        if found is not None:
            return found
        c, line = self.candidates[index], self.line
        f, b, key = c.forward_slot, c.backward_slot, c.key
        done, at = line.ends[f], line.starts[b - placement.load_slots]
        found = self._made[index, placement] = (
            Copy((f, AFTER, done, f), done, self.d2h[index], key, 0, True,
                 line.ends[f + placement.offload_slots]),
            Copy((b - placement.load_slots, BEFORE, at, f), at, self.h2d[index], key, 0,
                 False, line.starts[b]))
        return found

    def _added(self, index: int, placement: SwapPlacement, strict: bool) -> float | None:
        """How much later, in all, the copies end past their deadlines once candidate
        ``index`` is placed so (None, with ``strict``, as soon as a copy would)."""
        if self.instant:
            return 0.0
        key = self.candidates[index].key
        offload, load = self._copies(index, placement)
        streams = ((self.offloads, [offload, load]),) if self.loads is self.offloads else (
            (self.offloads, [offload]), (self.loads, [load]))
        added = 0.0
        for stream, new in streams:
            changed, ends = stream.replay(key, new)
            for copy, end in zip(new, ends):
                added += max(0.0, end - copy.deadline)
            for at, end in changed.items():
                copy = stream.copies[at]
                added += max(0.0, end - copy.deadline) - max(0.0, stream.ends[at]
                                                             - copy.deadline)
            for at in stream.positions(key):
                copy = stream.copies[at]
                added -= max(0.0, stream.ends[at] - copy.deadline)
            if strict and added > 0:
                return None
        return added

    def _least_added(self, index: int, placement: SwapPlacement) -> float:
        """A lower bound of :meth:`_added` for a candidate not taken, at a bisection per
        copy (:meth:`CopyStream.least_lateness`: its copies, and those they delay, only
        add)."""
        offload, load = self._copies(index, placement)
        return self.offloads.least_lateness(offload) + self.loads.least_lateness(load)

    def _place(self, index: int, placement: SwapPlacement) -> None:
        c = self.candidates[index]
        now = self.chosen.get(c.key)
        if now is not None:
            span = self.off_slots(c, now)
            self.profile.add(span.start, span.stop, self.movable[index])
        if not self.instant:
            offload, load = self._copies(index, placement)
            if self.loads is self.offloads:
                self.offloads.replace(c.key, [offload, load])
            else:
                self.offloads.replace(c.key, [offload])
                self.loads.replace(c.key, [load])
        span = self.off_slots(c, placement)
        self.profile.add(span.start, span.stop, -self.movable[index])
        self.chosen[c.key] = placement
        self.open[index] = -1

    def copies(self) -> list[tuple[float, float, float, str]]:
        """(earliest start, duration, deadline, stream) of every chosen copy."""
        names = ("copy", "copy") if self.loads is self.offloads else ("d2h", "h2d")
        out = []
        for key, placement in self.chosen.items():
            for copy, name in zip(self._copies(self.position[key], placement), names):
                out.append((copy.release, copy.duration, copy.deadline, name))
        return out

    @staticmethod
    def stall(copies: list[tuple[float, float, float, str]]) -> float:
        """Compute time the copies hold up: each stream runs its copies in order of start,
        and a copy ending after its deadline stalls compute by the difference."""
        free: dict[str, float] = {}
        total = 0.0
        for start, duration, deadline, stream in sorted(copies):
            end = max(start, free.get(stream, 0.0)) + duration
            total += max(0.0, end - deadline)
            free[stream] = end
        return total

    def lower(self, budget: int | None, *, allow_stall: bool) -> None:
        """Take chunks (or, with ``allow_stall``, widen a taken chunk's time off the device)
        while the peak can be lowered: without stalls as far as it goes, with them until it
        is within ``budget``."""
        if self.instant and not allow_stall:
            self._take_all()
            return
        while self.profile.raw:
            peak = self.peak
            if allow_stall and budget is not None and peak <= budget:
                return
            first = self.profile.first(peak)
            best = (self._stalling(first, peak) if allow_stall
                    else self._hiding(first, peak))
            if best is None:
                return
            self._place(*best)

    def _take_all(self) -> None:
        """Over a link of no limit every copy hides, and the tightest placement keeps a
        chunk on the device least at every slot, so every chunk placed so gives the lowest
        peak hidden copies can reach, which is where the loop above ends too; the prune
        step then drops what it does not need."""
        tight = _HIDING[0]
        spans = [0] * (len(self.profile.raw) + 1)  # a difference array over slots
        for index, c in enumerate(self.candidates):
            span = self.off_slots(c, tight)
            if span and self.open[index] >= 0:
                spans[span.start] -= self.movable[index]
                spans[span.stop] += self.movable[index]
                self.chosen[c.key] = tight
                self.open[index] = -1
        values = self.profile.values
        self.profile = Profile([value + change for value, change in zip(
            values, accumulate(spans))])

    def _hiding(self, first: int, peak: int) -> tuple[int, SwapPlacement] | None:
        """The chunk not yet taken that, with the tightest placement whose copies hide, off
        the device at slot ``first``, leaves the fewest slots at ``peak``; among equals the
        larger, then the tighter, then the earlier.

        No slot before ``first`` is at the peak, so a chunk covers at most the peak slots
        from ``first`` to its backward; those whose backward comes after the last of them
        can cover them all, and are tried first, in order, until one does with the
        tightest placement. The rest are tried only when none does."""
        lo = bisect_left(self.forwards, first - self.longest)
        hi = bisect_right(self.forwards, first - 2)  # a forward a slot before, at least
        window = self.open[lo:hi]
        top = max(window, default=-1)
        if top < first + 2:
            return None  # no chunk left can be off the device at ``first``
        last = self.profile.last(peak, first, top - 1)
        most, threshold = self.profile.count(peak, first, last + 1), last + 2
        ideal = (-most, -max(self.movable[lo:hi]), 2)
        best: tuple[tuple[int, int, int, int], int, SwapPlacement] | None = None
        for index in compress(range(lo, hi), map(threshold.__le__, window)):
            best = self._better(index, first, peak, best)
            if best is not None and best[0][:3] == ideal:
                return best[1], best[2]
        for at, back in enumerate(window):
            if first + 2 <= back < threshold and (best is None or self.profile.count(
                    peak, first, back - 1) >= -best[0][0]):
                best = self._better(lo + at, first, peak, best)
        return None if best is None else (best[1], best[2])

    def _better(self, index: int, first: int, peak: int,
                best: tuple[tuple[int, int, int, int], int, SwapPlacement] | None
                ) -> tuple[tuple[int, int, int, int], int, SwapPlacement] | None:
        """``best``, or candidate ``index`` with its tightest placement that hides and
        covers slot ``first``, whichever is better."""
        f, back = self.forwards[index], self.open[index]
        for placement in _HIDING:
            span = range(f + placement.offload_slots + 1, back - placement.load_slots)
            if first not in span:
                continue
            if not self.instant and self._least_added(index, placement) > 0:
                continue  # a copy is late, surely
            if self._added(index, placement, strict=True) is None:
                continue
            covered = self.profile.count(peak, span.start, span.stop)
            order = (-covered, -self.movable[index], sum(placement), index)
            return (order, index, placement) if best is None or order < best[0] else best
        return best

    def _stalling(self, first: int, peak: int) -> tuple[int, SwapPlacement] | None:
        """Any chunk off the device at slot ``first`` (or taken, and then widened to be),
        placed as stalls compute least, then as leaves the fewest slots at ``peak`` (the
        first of equals, in forward and placement order). Each choice's stall is worked
        out (a replay of its streams) in the order of a lower bound of it
        (:meth:`_least_added`), and only until no bound left can do better."""
        options = sorted(self._stalling_options(first, peak))
        best: tuple[tuple[float, int, int, int, int], int, SwapPlacement] | None = None
        for least, covered, movable, slots, seen, index, placement in options:
            if best is not None and (least, covered, movable, slots, seen) >= best[0]:
                break  # none left can do better
            added = self._added(index, placement, strict=False)
            assert added is not None
            order = (added, covered, movable, slots, seen)
            if best is None or order < best[0]:
                best = (order, index, placement)
        return None if best is None else best[1:]

    def _stalling_options(self, first: int, peak: int
                          ) -> Iterator[tuple[float, int, int, int, int, int, SwapPlacement]]:
        """For :meth:`_stalling`: each chunk and placement that puts it off the device at
        ``first``, as (a lower bound of its stall, minus the slots at ``peak`` it covers,
        minus its bytes, its copy slots, its place in order, candidate, placement)."""
        lo = bisect_left(self.forwards, first - self.longest)
        hi = bisect_right(self.forwards, first - 1)
        seen = 0
        for index in range(lo, hi):
            c = self.candidates[index]
            if not c.forward_slot < first < c.backward_slot:
                continue
            now = self.chosen.get(c.key)
            if now is not None and first in self.off_slots(c, now):
                continue
            for placement in _PLACEMENTS:
                span = self.off_slots(c, placement)
                if first not in span or (now is not None and not (
                        span.start <= c.forward_slot + now.offload_slots + 1
                        and c.backward_slot - now.load_slots <= span.stop)):
                    continue
                # a taken chunk's stall may fall: no bound
                least = -math.inf if now is not None or self.instant else (
                    self._least_added(index, placement) * (1 - _ROUNDING))
                seen += 1
                yield (least, -self.profile.count(peak, span.start, span.stop),
                       -self.movable[index], sum(placement), seen, index, placement)

    def prune(self) -> None:
        """Drop, latest taken first, each chunk whose removal leaves the peak as it is."""
        peak = self.peak
        for key in reversed(list(self.chosen)):
            index = self.position[key]
            span = self.off_slots(self.candidates[index], self.chosen[key])
            room = peak - self.movable[index]
            if span and (self.profile.bound(span.start, span.stop) <= room
                         or self.profile.highest_in(span.start, span.stop) <= room):
                self.profile.add(span.start, span.stop, self.movable[index])
                del self.chosen[key]
