"""The default swap policy: swap only what lowers a rank's peak of saved activations.

It plans on the rank's own timeline, at slot resolution for whole chunks
(:mod:`pipeswap.schedule.policies._chunk_plan`) or, where chunks have layers to stream, layer
by layer (:mod:`pipeswap.schedule.policies._layer_plan`): a streamed chunk leaves the device
while its forward still runs and comes back while its backward runs, so it saves memory even
with a short gap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.policies._chunk_plan import ChunkPlan
from pipeswap.schedule.policies._layer_plan import LayerPlan, Way
from pipeswap.schedule.policies._points import Points
from pipeswap.schedule.policies._slots import Timeline
from pipeswap.schedule.policies.base import SwapCandidate, SwapPlacement
from pipeswap.schedule.steps import ChunkKey, Order


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
    compute (each copy may take 1 to 3 compute slots, queued on its stream behind the
    copies already taken), giving it the tightest placement that hides. With a ``budget``
    (bytes, or per rank) still exceeded, chunks whose copies stall compute are taken next,
    least added stall first (a copy may then take zero slots: compute waits for it), until
    the budget is met. Last, every chunk whose removal would not raise the peak is dropped:
    nothing is swapped for nothing.
    :attr:`outcomes` reports per rank the peak reached and the stall accepted.

    ``granularity`` says how a chunk may be swapped: ``"chunk"`` whole, as above;
    ``"layer"`` streamed, layer by layer (each chunk gets the smallest layer lag its copies
    hide with); ``"auto"`` (the default) either, chunk by chunk, whichever lowers the peak
    more. Streaming frees a chunk's first layers while its forward still runs and loads its
    layers one ahead of its backward, which whole-chunk swap cannot; a chunk of one layer
    gains nothing from it, and where every chunk of the rank has one layer ``"auto"`` plans
    exactly as ``"chunk"``. Layers come from the cost model (``CostModel.layers``,
    ``StageCosts.layers``, ``ChunkBytes.layers``); with streaming the plan follows each
    rank's memory layer by layer (:mod:`pipeswap.schedule.policies._layer_plan`).
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
        plan = ChunkPlan(self.costs, rank, Timeline.of(order, self.costs, rank), candidates)
        peak_no_swap = plan.peak
        plan.lower(budget, allow_stall=False)
        if budget is not None and plan.peak > budget:
            plan.lower(budget, allow_stall=True)
        plan.prune()
        self.outcomes[rank] = PeakOutcome(rank, plan.peak, peak_no_swap,
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
        starts: list[tuple[bool, Callable[[], LayerPlan]]] = []  # (everything taken, make)
        for streamed_only in (True,) if only else (False, True):
            for full in (False, True):
                starts.append((full, partial(self._start, candidates, points, rank,
                                             streamed_only, full)))
        if not only:
            starts.append((False, partial(self._seeded, candidates, order, rank, budget,
                                          points)))
        # Without a budget, a plan at the lowest peak hidden copies can reach, no stall,
        # is as good as any: the cheap starts (everything taken) go first, and where one
        # gets there the others are not run, nor the drops after.
        floor = None if budget is not None else LayerPlan(
            self.costs, rank, points, candidates, only).floor()
        plans: dict[int, LayerPlan] = {}
        for index in sorted(range(len(starts)), key=lambda k: not starts[k][0]):
            plans[index] = _descend(starts[index][1](), budget)
            if _at_floor(plans[index], floor):
                break
        plan = min((plans[k] for k in sorted(plans)), key=lambda p: _merit(p, budget))
        plan.streamed_only = only  # auto may go on with whole chunks from any start
        if not _at_floor(plan, floor):
            plan = _perturb(plan, budget)
        if not only:
            plan.unstream()  # auto streams only where streaming lowers the peak
        self.outcomes[rank] = PeakOutcome(rank, plan.peak, plan.initial_peak, plan.stall,
                                          budget)
        return plan.placements()

    def _start(self, candidates: Sequence[SwapCandidate], points: Points, rank: int,
               streamed_only: bool, full: bool) -> LayerPlan:
        """A plan with nothing taken, or (``full``) every chunk taken that hides."""
        plan = LayerPlan(self.costs, rank, points, candidates, streamed_only)
        if full:
            plan.fill()
        return plan

    def _seeded(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
                budget: int | None, points: Points) -> LayerPlan:
        """A layer-resolution plan holding the chunks the chunk-level plan swaps."""
        chunk_level = ChunkPlan(self.costs, rank, Timeline.of(order, self.costs, rank),
                                candidates)
        chunk_level.lower(budget, allow_stall=False)
        stalls = budget is not None and chunk_level.peak > budget
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


def _at_floor(plan: LayerPlan, floor: int | None) -> bool:
    """Whether ``plan`` reached ``floor`` (the lowest peak hidden copies can) without a
    stall."""
    return floor is not None and plan.stall == 0 and plan.peak <= floor


def _merit(plan: LayerPlan, budget: int | None) -> tuple[int, float, int, int]:
    """Smaller is better: the budget's shortfall, the stall, the peak, the chunks swapped."""
    short = 0 if budget is None else max(0, plan.peak - budget)
    return short, plan.stall, plan.peak, len(plan.chosen)


def _perturb(plan: LayerPlan, budget: int | None) -> LayerPlan:
    """Try dropping one taken chunk (those before the peak, the latest first) and
    descending again; keep the first that does better, and go on from it."""
    for _ in range(_ROUNDS):
        first = plan.profile.first(plan.peak) if plan.profile.raw else 0
        before = sorted((k for k in plan.chosen if plan.chunks[k].forward_points <= first),
                        key=lambda k: -plan.chunks[k].forward_points)
        better = next((trial for trial in (_descend(plan.without(key), budget)
                                           for key in before[:_DROPS_PER_ROUND])
                       if _merit(trial, budget) < _merit(plan, budget)), None)
        if better is None:
            return plan
        plan = better
    return plan
