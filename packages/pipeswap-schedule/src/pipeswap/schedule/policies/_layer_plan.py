"""The peak policy at layer resolution: which chunks to swap, whole or streamed, and how.

The plan follows one rank point by point (:mod:`pipeswap.schedule.policies._points`). The
copies decide the lags: the D2H and H2D streams run their copies first in, first out
(:mod:`pipeswap.schedule.policies._streams`), so which chunks are taken (and where their
loads start) fixes when every copy ends; each taken chunk then gets the smallest lag and the
fewest offload slots that its copies' ends allow. Taking a chunk whose copies queue ahead of
others can so raise their lags: the plan redoes them and counts what that costs in memory.
The greedy loop and the prune step are the slot-resolution plan's
(:mod:`pipeswap.schedule.policies._chunk_plan`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.policies._points import Choice, LayerChunk, Points, Runs, lowest, runs
from pipeswap.schedule.policies._points import changes as runs_changed
from pipeswap.schedule.policies._profile import Profile
from pipeswap.schedule.policies._slots import MAX_COPY_SLOTS
from pipeswap.schedule.policies._streams import AFTER, BEFORE, INSIDE, Copy, CopyStream
from pipeswap.schedule.steps import ChunkKey
from pipeswap.schedule.swap_plan import SwapCandidate, SwapPlacement


class Way(NamedTuple):
    """How a taken chunk is swapped: streamed or whole, its load slots and, where a budget
    forces them at the cost of a stall, its lag and offload slots (None: the smallest that
    hide)."""

    streamed: bool
    load: int
    lag: int | None = None
    offload: int | None = None


Changes = dict[ChunkKey, "Choice | None"]


class LayerPlan:
    """The chunks a peak policy has taken on one rank at layer resolution, and what the rank
    holds at each point with them (see the module docstring)."""

    def __init__(self, costs: CostModel, rank: int, points: Points,
                 candidates: Sequence[SwapCandidate], streamed_only: bool) -> None:
        self.points = points
        link = costs.rank_link(rank)
        self.d2h, self.h2d, self.duplex = link.d2h_bandwidth, link.h2d_bandwidth, link.duplex
        self.streamed_only = streamed_only
        self.whole_only = False  # the chunk granularity, planned at layer resolution
        self.chunks = {c.key: points.chunk(c) for c in candidates if c.gap >= 1}
        self.taken: dict[ChunkKey, Way] = {}
        self.chosen: dict[ChunkKey, Choice] = {}
        self.streams = ({"d2h": CopyStream(), "h2d": CopyStream()} if self.duplex
                        else {"copy": CopyStream()})
        self.keys = list(self.chunks)  # in forward order
        self.place = {key: at for at, key in enumerate(self.keys)}
        self.forwards = [c.forward_points for c in self.chunks.values()]
        self.longest = max((c.end - c.forward_points for c in self.chunks.values()), default=0)
        # over a link of no limit no copy delays another
        self.instant = math.inf == self.d2h == self.h2d
        # what a chunk holds swapped one way, its copies, and where what it holds differs
        # from another way: the same for every copy of the plan (its points do not change)
        self._held_by: dict[tuple[ChunkKey, Choice | None], Runs] = {}
        self._copies_by: dict[tuple[ChunkKey, Way | None], tuple[list[Copy], ...]] = {}
        self._moved_by: dict[tuple[ChunkKey, Choice | None, Choice | None],
                             list[tuple[int, int, int]]] = {}
        held = [0] * (len(points.times) + 1)  # a difference array over points
        for c in candidates:
            chunk = self.chunks.get(c.key) or points.chunk(c)
            values = runs(points, chunk, None)
            base = chunk.forward_points
            for (offset, value), (after, _) in zip(values, [*values[1:], (chunk.end - base, 0)]):
                held[base + offset] += value
                held[base + after] -= value
        self.profile = Profile(list(accumulate(held[:-1])))
        self.stall = 0.0
        self.initial_peak = self.peak

    @property
    def peak(self) -> int:
        return self.profile.peak

    def copy(self) -> LayerPlan:
        """An independent copy."""
        other = copy.copy(self)
        other.profile, other.taken, other.chosen = self.profile.clone(), dict(self.taken), dict(
            self.chosen)
        other.streams = {name: stream.clone() for name, stream in self.streams.items()}
        return other

    def placements(self) -> dict[ChunkKey, SwapPlacement]:
        return {key: choice.placement for key, choice in self.chosen.items()}

    # -- copies ----------------------------------------------------------------------------

    def _copies(self, c: LayerChunk, way: Way | None) -> tuple[list[Copy], list[Copy]]:
        """The offloads and loads of ``c`` swapped as ``way`` says."""
        if way is None:
            return [], []
        streamed, load = way.streamed, way.load
        points, layers, key = self.points, c.layers, c.key
        f, b = c.forward_slot, c.backward_slot
        at = points.starts[b - load]
        launch = (b - load, BEFORE, at, f)  # launches at one place go in forward order
        if not streamed:
            movable = sum(layer.movable for layer in layers)
            done = points.ends[f]
            return ([Copy((f, AFTER, done, f), done, movable / self.d2h, key, 0, True)],
                    [Copy(launch, at, movable / self.h2d, key, 0, False, points.starts[b])])
        last = len(layers) - 1
        offloads = []
        for k, layer in enumerate(layers):
            done = points.times[c.forward_points + k]
            offloads.append(Copy((f, INSIDE, done, k), done, layer.movable / self.d2h, key,
                                  k, True))
        loads = [Copy(launch, at, layers[last].movable / self.h2d, key, last, False,
                       points.starts[b])]
        for k in reversed(range(1, len(layers))):  # started with the part of layer k
            point = c.backward_points + last - k
            start = points.times[point]
            loads.append(Copy((b, INSIDE, start, last - k), start,
                               layers[k - 1].movable / self.h2d, key, k - 1, False,
                               points.times[point + 1]))
        return offloads, loads

    def _queued(self, key: ChunkKey, way: Way | None) -> tuple[list[Copy], ...]:
        """The copies of ``key`` swapped as ``way`` says, per stream (in the order of
        :attr:`streams`), sorted; made once per way, for every copy of the plan."""
        found = self._copies_by.get((key, way))
        if found is None:
            offloads, loads = self._copies(self.chunks[key], way)
            found = self._copies_by[key, way] = (
                (sorted([*offloads, *loads]),) if not self.duplex else
                (sorted(offloads), sorted(loads)))
        return found

    def _choice(self, c: LayerChunk, way: Way, ends: Sequence[float], allow_stall: bool
                ) -> Choice | None:
        """The smallest lag and fewest offload slots that ``ends`` (of the chunk's offloads,
        in layer order) allow, unless ``way`` forces them; with ``allow_stall``, the most
        slots where none hide (None: none hide and no stall is allowed)."""
        points = self.points
        room = min(MAX_COPY_SLOTS, c.gap - way.load - 1)
        off = way.offload
        if off is None:
            off = next((o for o in range(1, room + 1)
                        if ends[-1] <= points.ends[c.forward_slot + o]), None)
            if off is None:
                if not allow_stall:
                    return None
                off = room
        if not way.streamed:
            return Choice(0, off, way.load)
        count = len(c.layers)
        lag = way.lag or next(d for d in range(1, count + 1)
                              if all(ends[k] <= points.times[c.forward_points + k + d]
                                     for k in range(count - d)))
        return Choice(lag, off, way.load)

    # -- options ---------------------------------------------------------------------------

    def option(self, key: ChunkKey, way: Way | None, allow_stall: bool
               ) -> tuple[Changes, float] | None:
        """Every chunk whose choice changes when ``key`` is swapped as ``way`` says (None:
        not swapped), and the stall all copies then leave (None: some copy would not hide
        and no stall is allowed)."""
        if self.instant:  # each copy ends as it starts: only this chunk's choice changes
            c = self.chunks[key]
            if way is None:
                return {key: None}, 0.0
            ends = ([self.points.times[c.forward_points + k] for k in range(len(c.layers))]
                    if way.streamed else [self.points.ends[c.forward_slot]])
            return {key: self._choice(c, way, ends, True)}, 0.0
        strict = not allow_stall and not self.stall  # every copy hides, and must
        moved: dict[ChunkKey, dict[int, float]] = {}  # offload ends that change, by owner
        replays: list[tuple[CopyStream, dict[int, float], list[Copy], list[float]]] = []
        for stream, new in zip(self.streams.values(), self._queued(key, way)):
            changed, ends = stream.replay(key, new)
            replays.append((stream, changed, new, ends))
            for queued, end in [*((stream.copies[i], e) for i, e in changed.items()),
                                *zip(new, ends)]:
                if queued.offload:
                    moved.setdefault(queued.owner, {})[queued.layer] = end
                elif end > queued.deadline and strict:
                    return None
        changes: Changes = {}
        if way is None:
            changes[key] = None
            moved.pop(key, None)
        offload_stream = self.streams["d2h" if self.duplex else "copy"]
        for owner, moved_ends in moved.items():
            own = owner == key and way is not None
            known = {} if own else offload_stream.offload_ends(owner)
            known.update(moved_ends)
            owner_way = way if own and way is not None else self.taken[owner]
            choice = self._choice(self.chunks[owner], owner_way,
                                  [known[k] for k in sorted(known)], not strict)
            if choice is None:
                return None
            if own or choice != self.chosen.get(owner):
                changes[owner] = choice
        stall = 0.0 if strict else self.stall + self._stall_change(key, replays, changes)
        return changes, stall

    def _stall_change(self, key: ChunkKey,
                      replays: list[tuple[CopyStream, dict[int, float], list[Copy], list[float]]],
                      changes: Changes) -> float:
        """How much the compute time all copies hold up (each copy's lateness past the
        compute that waits for it: a load's, an offload's a lag of layers later, or its WO)
        changes once ``key``'s copies are replaced as ``replays`` found (per stream: the
        ends of other copies that move, the new copies and their ends) and ``changes``
        made. Only what moves is counted, so an option costs what it disturbs."""
        chosen = self.chosen
        delta = 0.0
        for stream, changed, new, ends in replays:
            copies, before = stream.copies, stream.ends
            for index in stream.positions(key):
                delta -= self._late(copies[index], before[index], chosen.get(key))
            for index, end in changed.items():
                queued = copies[index]
                owner = queued.owner
                delta += (self._late(queued, end, changes.get(owner, chosen.get(owner)))
                          - self._late(queued, before[index], chosen.get(owner)))
            after = changes.get(key) if key in changes else chosen.get(key)
            for queued, end in zip(new, ends):
                delta += self._late(queued, end, after)
            for owner, choice in changes.items():  # an offload's deadline moved with its lag
                if owner == key or choice == chosen.get(owner):
                    continue
                for index in stream.positions(owner):
                    queued = copies[index]
                    if queued.offload and index not in changed:
                        delta += (self._late(queued, before[index], choice)
                                  - self._late(queued, before[index], chosen.get(owner)))
        return delta

    def _late(self, queued: Copy, end: float, choice: Choice | None) -> float:
        """How long compute waits for ``queued`` ending at ``end``, its owner swapped as
        ``choice`` says (an offload's deadline follows from its lag and slots)."""
        if not queued.offload:
            return max(0.0, end - queued.deadline)
        if choice is None:
            return 0.0
        c, points = self.chunks[queued.owner], self.points
        if choice.lag and queued.layer + choice.lag < len(c.layers):
            return max(0.0, end - points.times[c.forward_points + queued.layer + choice.lag])
        return max(0.0, end - points.ends[c.forward_slot + choice.offload_slots])

    def deltas(self, changes: Changes) -> list[tuple[int, int, int]]:
        """How the bytes held change with ``changes``: (start, stop, change) point spans,
        apart and in order."""
        if len(changes) == 1:  # one chunk's spans are apart, in order, merged already
            (key, choice), = changes.items()
            return self._moved(key, choice)
        steps: dict[int, int] = {}
        for key, choice in changes.items():
            for start, stop, change in self._moved(key, choice):
                steps[start] = steps.get(start, 0) + change
                steps[stop] = steps.get(stop, 0) - change
        out: list[tuple[int, int, int]] = []
        level, bounds = 0, sorted(steps)
        for point, after in zip(bounds, bounds[1:]):
            level += steps[point]
            if level:
                out.append((point, after, level))
        return out

    def _held(self, key: ChunkKey, choice: Choice | None) -> Runs:
        """What ``key`` holds swapped as ``choice`` says."""
        found = self._held_by.get((key, choice))
        if found is None:
            found = self._held_by[key, choice] = runs(self.points, self.chunks[key], choice)
        return found

    def _moved(self, key: ChunkKey, choice: Choice | None) -> list[tuple[int, int, int]]:
        """Where ``key`` swapped as ``choice`` says holds other than as it is now: (start,
        stop, change) point spans, apart and in order."""
        now = self.chosen.get(key)
        found = self._moved_by.get((key, now, choice))
        if found is None:
            c = self.chunks[key]
            base = c.forward_points
            found = self._moved_by[key, now, choice] = [
                (base + start, base + stop, change) for start, stop, change in runs_changed(
                    self._held(key, now), self._held(key, choice), c.end - base)]
        return found

    def within(self, spans: list[tuple[int, int, int]], peak: int) -> bool:
        """Whether no point goes above ``peak`` with these changes."""
        return all(change <= 0 or self.profile.highest_in(start, stop) + change <= peak
                   for start, stop, change in spans)

    def apply(self, key: ChunkKey, way: Way | None, changes: Changes, stall: float) -> None:
        for start, stop, change in self.deltas(changes):
            self.profile.add(start, stop, change)
        if not self.instant:
            for stream, new in zip(self.streams.values(), self._queued(key, way)):
                stream.replace(key, new)
        if way is None:
            self.taken.pop(key, None)
        else:
            self.taken[key] = way
        for owner, choice in changes.items():
            if choice is None:
                self.chosen.pop(owner, None)
            else:
                self.chosen[owner] = choice
        self.stall = stall

    def floor(self) -> int:
        """The lowest peak a plan whose copies all hide can reach: every chunk holding at
        each point as little as any way of swapping it would (whole, or streamed with a lag
        of one layer, one slot for each copy), copies' timing aside."""
        steps = [0] * (len(self.points.times) + 1)
        for key, c in self.chunks.items():
            if c.gap < 3:
                continue  # no room for a hidden copy each way: held as it is
            kinds = [1] if self.streamed_only else [0, 1] if self.may_stream(c) else [0]
            options = [runs(self.points, c, Choice(lag, 1, 1)) for lag in kinds]
            base = c.forward_points
            now = self._held(key, self.chosen.get(key))
            for start, stop, change in runs_changed(now, lowest(options), c.end - base):
                steps[base + start] += change
                steps[base + stop] -= change
        return max((value + change for value, change in zip(
            self.profile.values, accumulate(steps[:-1]))), default=0)

    def may_stream(self, c: LayerChunk) -> bool:
        """Whether ``c`` may be streamed as well as swapped whole."""
        return len(c.layers) > 1 and not self.whole_only
