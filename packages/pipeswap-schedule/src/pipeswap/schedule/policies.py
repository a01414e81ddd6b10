"""Swap policies that weigh costs: copies that hide, or a memory budget to meet.

Both look at one rank's order with a :class:`CostModel`, on that rank's own timeline (compute
slots back to back, no waits for other ranks: waits only add room for copies, so what hides
here hides in the full simulation too). The swap pass places a chosen chunk's steps as always:
the offload runs during the compute slot after its forward (WO ends that slot), the reload
during the compute slot before its backward; so a chunk is off the device from the second
slot after its forward to the second slot before its backward, and only chunks with a gap of
at least 4 slots save anything.

The peak policy may also stream a chunk layer by layer (``PeakPolicy.granularity``): the
chunk then leaves the device while its forward still runs and comes back while its backward
runs, so it saves memory even with a short gap. Its memory changes within a compute slot,
so that plan follows the rank layer by layer (:mod:`pipeswap.schedule._layer_plan`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from pipeswap.schedule._layer_plan import MAX_COPY_SLOTS, LayerPlan, Points, Way
from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.steps import COMPUTE, OVERLAPS, ChunkKey, Order, StepType
from pipeswap.schedule.swap import SwapCandidate, SwapPlacement

#: Fewest compute slots from forward to backward for a swapped chunk to leave the device.
SAVING_GAP = 4


@dataclass(frozen=True)
class _Timeline:
    """One rank's compute slots back to back: slot i runs from ``starts[i]`` to ``ends[i]``."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]
    last_slot: dict[ChunkKey, int]  # the slot whose end frees the chunk (its B or W)

    @staticmethod
    def of(order: Order, costs: CostModel, rank: int) -> _Timeline:
        starts: list[float] = []
        ends: list[float] = []
        last: dict[ChunkKey, int] = {}
        now = 0.0
        for step in order:
            if step is None or not (step.type in COMPUTE or step.type in OVERLAPS):
                continue
            leaves = step.sub_steps if step.type in OVERLAPS else (step,)
            starts.append(now)
            now += sum(costs.compute_time(l.type, l.key[0], rank) for l in leaves)
            ends.append(now)
            for leaf in leaves:
                if leaf.type is not StepType.FWD:
                    last[leaf.key] = max(last.get(leaf.key, -1), len(ends) - 1)
        return _Timeline(tuple(starts), tuple(ends), last)

    def held(self, candidates: Sequence[SwapCandidate], costs: CostModel) -> list[int]:
        """Bytes of saved activations the rank holds in each slot without swap: a chunk from
        its forward's slot through the slot that frees it."""
        held = [0] * (len(self.ends) + 1)  # a difference array over slots, then prefix sums
        for c in candidates:
            total = costs.chunk_bytes(c.key).total
            held[c.forward_slot] += total
            held[self.last_slot.get(c.key, c.backward_slot) + 1] -= total
        for slot in range(1, len(held)):
            held[slot] += held[slot - 1]
        held.pop()
        return held


def _copy_times(costs: CostModel, rank: int, key: ChunkKey) -> tuple[float, float]:
    link = costs.rank_link(rank)
    movable = costs.chunk_bytes(key).movable
    return movable / link.d2h_bandwidth, movable / link.h2d_bandwidth


@dataclass(frozen=True)
class CostModelPolicy:
    """Swap a chunk only if its copies hide behind compute with ``costs``' bandwidths.

    Chunks are considered longest-lived first; one is taken when its offload, queued on the
    D2H stream behind those already taken, ends within the slot after its forward, and its
    reload, queued likewise on the H2D stream, ends within the slot before its backward
    (one shared stream for both where the link is not duplex). Cost: quadratic in the
    number of swappable chunks of a rank.
    """

    costs: CostModel

    def select(self, candidates: Sequence[SwapCandidate], order: Order) -> Collection[ChunkKey]:
        if not candidates:
            return set()
        rank = candidates[0].rank
        line = _Timeline.of(order, self.costs, rank)
        duplex = self.costs.rank_link(rank).duplex
        usable = [c for c in candidates if c.gap >= SAVING_GAP]
        usable.sort(key=lambda c: (-(line.starts[c.backward_slot] - line.ends[c.forward_slot]),
                                   c.forward_slot))
        taken: list[SwapCandidate] = []
        for candidate in usable:
            if self._hidden([*taken, candidate], line, rank, duplex):
                taken.append(candidate)
        return {c.key for c in taken}

    def _hidden(self, chosen: list[SwapCandidate], line: _Timeline, rank: int,
                duplex: bool) -> bool:
        """Whether every copy of ``chosen`` ends before the compute that waits for it."""
        copies = []  # (earliest start, duration, deadline, stream)
        for c in chosen:
            d2h, h2d = _copy_times(self.costs, rank, c.key)
            copies.append((line.ends[c.forward_slot], d2h, line.ends[c.forward_slot + 1],
                           "d2h" if duplex else "copy"))
            copies.append((line.starts[c.backward_slot - 1], h2d, line.starts[c.backward_slot],
                           "h2d" if duplex else "copy"))
        free: dict[str, float] = {}
        for start, duration, deadline, stream in sorted(copies):
            end = max(start, free.get(stream, 0.0)) + duration
            if end > deadline:
                return False
            free[stream] = end
        return True


@dataclass(frozen=True)
class BudgetOutcome:
    """What a memory-budget policy achieved on one rank (simulated on that rank alone)."""

    rank: int
    budget: int
    peak: int  # with the chunks chosen
    peak_no_swap: int
    exposed_copy: float  # estimated compute stall of the chosen chunks' copies

    @property
    def met(self) -> bool:
        return self.peak <= self.budget

    @property
    def shortfall(self) -> int:
        """Bytes by which the peak stays over the budget (0 when met)."""
        return max(0, self.peak - self.budget)


@dataclass
class MemoryBudgetPolicy:
    """Swap the chunks that bring each rank's activation peak under ``budget`` bytes, with
    the least exposed copy time.

    Greedy: while the peak is over the budget, take the chunk that is off the device at the
    peak and would stall compute least (its copies' excess over the slots that hide them),
    and repeat. When no chunk can lower the peak further, the budget cannot be met: the
    outcome per rank (:attr:`outcomes`) says by how much. ``budget`` may differ per rank.
    """

    costs: CostModel
    budget: int | Mapping[int, int]
    outcomes: dict[int, BudgetOutcome] = field(default_factory=dict)

    def budget_for(self, rank: int) -> int:
        if isinstance(self.budget, int):
            return self.budget
        if rank not in self.budget:
            raise ScheduleError(f"the memory budget gives no figure for rank {rank}")
        return self.budget[rank]

    def select(self, candidates: Sequence[SwapCandidate], order: Order) -> Collection[ChunkKey]:
        rank = candidates[0].rank if candidates else 0
        budget = self.budget_for(rank)
        line = _Timeline.of(order, self.costs, rank)
        held = line.held(candidates, self.costs)
        peak_no_swap = max(held, default=0)
        chosen: set[ChunkKey] = set()
        exposed = 0.0
        usable = [c for c in candidates if c.gap >= SAVING_GAP]
        while held and max(held) > budget:
            at = held.index(max(held))
            options = [c for c in usable if c.key not in chosen
                       and c.forward_slot + 2 <= at <= c.backward_slot - 2]
            if not options:
                break
            best = min(options, key=lambda c: (self._stall(c, line, rank),
                                               -self.costs.chunk_bytes(c.key).movable,
                                               -c.gap))
            chosen.add(best.key)
            exposed += self._stall(best, line, rank)
            movable = self.costs.chunk_bytes(best.key).movable
            for slot in range(best.forward_slot + 2, best.backward_slot - 1):
                held[slot] -= movable
        self.outcomes[rank] = BudgetOutcome(rank, budget, max(held, default=0), peak_no_swap,
                                            exposed)
        return chosen

    def _stall(self, c: SwapCandidate, line: _Timeline, rank: int) -> float:
        d2h, h2d = _copy_times(self.costs, rank, c.key)
        after = line.ends[c.forward_slot + 1] - line.starts[c.forward_slot + 1]
        before = line.ends[c.backward_slot - 1] - line.starts[c.backward_slot - 1]
        return max(0.0, d2h - after) + max(0.0, h2d - before)


#: Placements to try, tightest first; zero slots (compute waits for the whole copy) only
#: where a budget allows exposed copies.
_PLACEMENTS = sorted(((off, load, 0) for off in range(MAX_COPY_SLOTS + 1)
                      for load in range(MAX_COPY_SLOTS + 1)), key=lambda p: (sum(p), p))


@dataclass(frozen=True)
class PeakOutcome:
    """What the peak policy achieved on one rank (on that rank's own timeline)."""

    rank: int
    peak: int
    peak_no_swap: int
    exposed_copy: float  # compute time the chosen copies stall (0 unless a budget needed it)
    budget: int | None = None

    @property
    def met(self) -> bool:
        return self.budget is None or self.peak <= self.budget

    @property
    def shortfall(self) -> int:
        """Bytes by which the peak stays over the budget (0 when met or without one)."""
        return 0 if self.budget is None else max(0, self.peak - self.budget)


#: How the peak policy may swap a chunk. chunk: whole (LO/LL); layer: streamed layer by
#: layer (SO/SL); auto: whichever lowers the peak more, chunk by chunk.
GRANULARITIES = ("auto", "chunk", "layer")


@dataclass
class PeakPolicy:
    """Swap only what lowers the rank's peak of saved activations, with copies hidden.

    Greedy on the rank's own timeline: while some chunk can lower the highest point, take the
    one that covers most of the slots at that height with copies that still hide behind
    compute (each copy may take 1 to :data:`MAX_COPY_SLOTS` compute slots, queued on its
    stream behind the copies already taken), giving it the tightest placement that hides.
    With a ``budget`` (bytes, or per rank) still exceeded, chunks whose copies stall compute
    are taken next, least added stall first (a copy may then take zero slots: compute waits
    for it), until the budget is met. Last, every chunk whose
    removal would not raise the peak is dropped: nothing is swapped for nothing.
    :attr:`outcomes` reports per rank the peak reached and the stall accepted.

    ``granularity`` says how a chunk may be swapped: ``"chunk"`` whole, as above;
    ``"layer"`` streamed, layer by layer (each chunk gets the smallest layer lag its copies
    hide with); ``"auto"`` (the default) either, chunk by chunk, whichever lowers the peak
    more. Streaming frees a chunk's first layers while its forward still runs and loads its
    layers one ahead of its backward, which whole-chunk swap cannot; a chunk of one layer
    gains nothing from it, and where every chunk of the rank has one layer ``"auto"`` plans
    exactly as ``"chunk"``. Layers come from the cost model (``CostModel.layers``,
    ``StageCosts.layers``, ``ChunkBytes.layers``); with streaming the plan follows each
    rank's memory layer by layer (:mod:`pipeswap.schedule._layer_plan`).
    """

    costs: CostModel
    budget: int | Mapping[int, int] | None = None
    outcomes: dict[int, PeakOutcome] = field(default_factory=dict)
    granularity: str = "auto"

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ScheduleError(
                f"unknown swap granularity {self.granularity!r}; use one of "
                f"{', '.join(GRANULARITIES)} (chunk: whole chunks, layer: streamed layer by "
                "layer, auto: whichever lowers the peak more)")

    def budget_for(self, rank: int) -> int | None:
        if self.budget is None or isinstance(self.budget, int):
            return self.budget
        if rank not in self.budget:
            raise ScheduleError(f"the memory budget gives no figure for rank {rank}")
        return self.budget[rank]

    def select(self, candidates: Sequence[SwapCandidate], order: Order
               ) -> dict[ChunkKey, SwapPlacement]:
        rank = candidates[0].rank if candidates else 0
        budget = self.budget_for(rank)
        if self._by_layer(candidates):
            return self._select_layers(candidates, order, rank, budget)
        plan = _PeakPlan(self.costs, rank, _Timeline.of(order, self.costs, rank), candidates)
        peak_no_swap = max(plan.held, default=0)
        plan.lower(budget, allow_stall=False)
        if budget is not None and max(plan.held, default=0) > budget:
            plan.lower(budget, allow_stall=True)
        plan.prune()
        self.outcomes[rank] = PeakOutcome(rank, max(plan.held, default=0), peak_no_swap,
                                          plan.stall(plan.copies()), budget)
        return dict(plan.chosen)

    def _by_layer(self, candidates: Sequence[SwapCandidate]) -> bool:
        """Whether to plan at layer resolution: streaming asked for, or allowed and some
        chunk has layers to stream."""
        if self.granularity != "auto":
            return self.granularity == "layer"
        chunks = self.costs.chunks
        return any(self.costs.stage_layers(stage) > 1
                   for stage in {c.stage for c in candidates}) or any(
            len(chunks[c.key].layers) > 1 for c in candidates if c.key in chunks)

    def _select_layers(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
                       budget: int | None) -> dict[ChunkKey, SwapPlacement]:
        """The plan at layer resolution: the best of descents from nothing taken and from
        everything taken (for auto: also from everything streamed, and from the chunk-level
        plan, so that it never does worse than either), then improved by dropping a chunk
        and descending again (a stream runs its copies in order, so a chunk left out can
        let the chunks after it stream with shorter lags)."""
        points = Points(order, self.costs, rank)
        only = self.granularity == "layer"
        starts: list[LayerPlan] = []
        for streamed_only in (True,) if only else (False, True):
            for full in (False, True):
                plan = LayerPlan(self.costs, rank, points, candidates, streamed_only)
                if full:
                    plan.fill()
                starts.append(plan)
        if not only:
            starts.append(self._seeded(candidates, order, rank, budget, points))
        plans = [_descend(plan, budget) for plan in starts]
        plan = min(plans, key=lambda p: _merit(p, budget))
        plan.streamed_only = only  # auto may go on with whole chunks from any start
        plan = _perturb(plan, budget)
        if not only:
            plan.unstream()  # auto streams only where streaming lowers the peak
        self.outcomes[rank] = PeakOutcome(rank, plan.peak, plan.initial_peak, plan.stall,
                                          budget)
        return plan.placements()

    def _seeded(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
                budget: int | None, points: Points) -> LayerPlan:
        """A layer-resolution plan holding the chunks the chunk-level plan swaps."""
        chunk_level = _PeakPlan(self.costs, rank, _Timeline.of(order, self.costs, rank),
                                candidates)
        chunk_level.lower(budget, allow_stall=False)
        stalls = budget is not None and max(chunk_level.held, default=0) > budget
        if stalls:
            chunk_level.lower(budget, allow_stall=True)
        chunk_level.prune()
        plan = LayerPlan(self.costs, rank, points, candidates, streamed_only=False)
        plan.take({key: Way(False, p.load_slots, None, p.offload_slots if stalls else None)
                   for key, p in chunk_level.chosen.items()}, allow_stall=stalls)
        return plan


#: How many chunks the layer-resolution plan tries to drop in a round, and how many rounds
#: it goes on while one does better (a bound on its time).
_DROPS_PER_ROUND, _ROUNDS = 12, 8


def _descend(plan: LayerPlan, budget: int | None) -> LayerPlan:
    """Lower the peak with copies hidden, then with stalls where a budget needs them, and
    drop what lowers nothing."""
    plan.lower(budget, allow_stall=False)
    if budget is not None and plan.peak > budget:
        plan.lower(budget, allow_stall=True)
    plan.prune()
    return plan


def _merit(plan: LayerPlan, budget: int | None) -> tuple[int, float, int, int]:
    """Smaller is better: the budget's shortfall, the stall, the peak, the chunks swapped."""
    short = 0 if budget is None else max(0, plan.peak - budget)
    return short, plan.stall, plan.peak, len(plan.chosen)


def _perturb(plan: LayerPlan, budget: int | None) -> LayerPlan:
    """Try dropping one taken chunk (those before the peak, the latest first) and
    descending again; keep the first that does better, and go on from it."""
    for _ in range(_ROUNDS):
        first = plan.held.index(plan.peak) if plan.held else 0
        before = sorted((k for k in plan.chosen if plan.chunks[k].forward_points <= first),
                        key=lambda k: -plan.chunks[k].forward_points)
        better = next((trial for trial in (_descend(plan.without(key), budget)
                                           for key in before[:_DROPS_PER_ROUND])
                       if _merit(trial, budget) < _merit(plan, budget)), None)
        if better is None:
            return plan
        plan = better
    return plan


class _PeakPlan:
    """The chunks a :class:`PeakPolicy` has taken on one rank, and what the rank holds in
    each compute slot with them."""

    def __init__(self, costs: CostModel, rank: int, line: _Timeline,
                 candidates: Sequence[SwapCandidate]) -> None:
        self.costs, self.rank, self.line = costs, rank, line
        self.duplex = costs.rank_link(rank).duplex
        self.candidates = [c for c in candidates if c.gap >= 2]  # off the device a slot
        self.chosen: dict[ChunkKey, SwapPlacement] = {}
        self.by_key = {c.key: c for c in self.candidates}
        self.held = line.held(candidates, costs)

    def off_slots(self, c: SwapCandidate, placement: SwapPlacement) -> range:
        """The slots during which ``c`` is off the device when placed so."""
        return range(c.forward_slot + placement.offload_slots + 1,
                     c.backward_slot - placement.load_slots)

    def _shift(self, key: ChunkKey, placement: SwapPlacement, sign: int) -> None:
        movable = self.costs.chunk_bytes(key).movable
        for slot in self.off_slots(self.by_key[key], placement):
            self.held[slot] -= sign * movable

    def copies(self, extra: tuple[ChunkKey, SwapPlacement] | None = None
               ) -> list[tuple[float, float, float, str]]:
        """(earliest start, duration, deadline, stream) of every chosen copy."""
        chosen = dict(self.chosen)
        if extra is not None:
            chosen[extra[0]] = extra[1]
        line, out = self.line, []
        for key, (off, load, _) in chosen.items():
            c = self.by_key[key]
            d2h, h2d = _copy_times(self.costs, self.rank, key)
            out.append((line.ends[c.forward_slot], d2h, line.ends[c.forward_slot + off],
                        "d2h" if self.duplex else "copy"))
            out.append((line.starts[c.backward_slot - load], h2d,
                        line.starts[c.backward_slot], "h2d" if self.duplex else "copy"))
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
        while self.held:
            peak = max(self.held)
            if allow_stall and budget is not None and peak <= budget:
                return
            top = [slot for slot, value in enumerate(self.held) if value == peak]
            best: tuple[tuple[float, int, int, int], ChunkKey, SwapPlacement] | None = None
            base = self.stall(self.copies())
            for c in self.candidates:
                if not c.forward_slot < top[0] < c.backward_slot:
                    continue
                now = self.chosen.get(c.key)
                if now is not None and (not allow_stall or top[0] in self.off_slots(c, now)):
                    continue
                for placement in map(SwapPlacement._make, _PLACEMENTS):
                    if not allow_stall and min(placement.offload_slots, placement.load_slots) == 0:
                        continue
                    span = self.off_slots(c, placement)
                    if top[0] not in span or (now is not None and not (
                            set(self.off_slots(c, now)) <= set(span))):
                        continue
                    added = self.stall(self.copies((c.key, placement))) - base
                    if added > 0 and not allow_stall:
                        continue
                    covered = sum(slot in span for slot in top)
                    order = (added, -covered, -self.costs.chunk_bytes(c.key).movable,
                             sum(placement))
                    if best is None or order < best[0]:
                        best = (order, c.key, placement)
                    if not allow_stall:
                        break  # the tightest placement of this chunk that hides
            if best is None:
                return
            _, key, placement = best
            if key in self.chosen:
                self._shift(key, self.chosen[key], -1)
            self.chosen[key] = placement
            self._shift(key, placement, +1)

    def prune(self) -> None:
        """Drop, latest taken first, each chunk whose removal leaves the peak as it is."""
        for key in reversed(list(self.chosen)):
            peak = max(self.held)
            placement = self.chosen.pop(key)
            self._shift(key, placement, -1)
            if max(self.held) > peak:  # it was lowering the peak: keep it
                self.chosen[key] = placement
                self._shift(key, placement, +1)
