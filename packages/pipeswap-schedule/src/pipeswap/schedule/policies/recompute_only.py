"""Recompute alone, the baseline users know from activation checkpointing: on each rank, the
same first layers of every chunk recomputed, as few as bring the rank's peak under the
budget (Megatron's ``--recompute-num-layers``, chosen per rank instead of configured).
Nothing is swapped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.recompute_pass import recomputed_in
from pipeswap.schedule.simulate import peak_without_swap
from pipeswap.schedule.steps import ChunkKey, Order, StepType
from pipeswap.schedule.swap_plan import PlanOutcome, RankPlan, SwapCandidate


@dataclass(frozen=True)
class RecomputePolicy:
    """Per rank, the fewest first layers of every chunk to recompute for the rank's peak
    (counted as the simulator counts it) to fit ``budget`` bytes; every layer where even
    that does not fit (the plan's outcome says by how much). Swaps nothing."""

    costs: CostModel
    budget: int

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ScheduleError(f"the recompute policy's budget is a whole number of bytes "
                                f">= 1, got {self.budget!r}")

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> RankPlan:
        if recomputed_in(order):
            raise ScheduleError(f"rank {rank}'s order already recomputes layers; plan "
                                "recompute on a schedule without RC steps")
        found = fewest_first_layers(order, self.costs, self.budget)
        counts = {key: len(layers) for key, layers in found.layers.items()}
        return RankPlan(rank, {}, found.layers, PlanOutcome(
            rank, found.peak, found.plain, 0.0, self.budget, sum(counts.values()),
            recompute_seconds(self.costs, rank, counts)))


class FirstLayers(NamedTuple):
    """Recompute alone on one rank: the first ``first`` layers of every chunk (``layers``
    per chunk), the peak with them and the peak with none."""

    first: int
    layers: dict[ChunkKey, tuple[int, ...]]
    peak: int
    plain: int


def fewest_first_layers(order: Order, costs: CostModel, budget: int) -> FirstLayers:
    """The fewest first layers of every chunk of ``order`` to recompute for its peak (as
    the simulator counts it) to fit ``budget``; all of them where none do."""
    keys = [leaf.key for step in order if step is not None
            for leaf in step.compute_leaves if leaf.type is StepType.FWD]
    peaks: dict[int, int] = {}

    def recomputing(count: int) -> dict[ChunkKey, tuple[int, ...]]:
        if not count:
            return {}
        firsts: dict[int, tuple[int, ...]] = {}  # one tuple per stage, shared
        chosen: dict[ChunkKey, tuple[int, ...]] = {}
        for key in keys:
            layers = firsts.get(key[0])
            if layers is None:
                layers = firsts[key[0]] = tuple(range(min(count, costs.stage_layers(key[0]))))
            chosen[key] = layers
        return chosen

    def peak(count: int) -> int:
        if count not in peaks:
            peaks[count] = peak_without_swap(order, costs, recomputing(count) or None)
        return peaks[count]

    # the peak falls as more layers are recomputed: bisect
    low, high = 0, max((costs.stage_layers(stage) for stage, _ in keys), default=0)
    while low < high:
        middle = (low + high) // 2
        if peak(middle) <= budget:
            high = middle
        else:
            low = middle + 1
    return FirstLayers(low, recomputing(low), peak(low), peak(0))


def recompute_seconds(costs: CostModel, rank: int, layers: Mapping[ChunkKey, int]) -> float:
    """The compute seconds ``rank`` takes to recompute ``layers[key]`` layers of each chunk
    (a forward's share per layer)."""
    forward = {stage: costs.compute_time(StepType.FWD, stage, rank) / costs.stage_layers(stage)
               for stage in {key[0] for key in layers}}
    return sum(forward[key[0]] * count for key, count in layers.items())
