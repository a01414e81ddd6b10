"""Recompute alone, the baseline users know from activation checkpointing: on each rank, the
same first layers of every chunk recomputed, as few as bring the rank's peak under the
budget (Megatron's ``--recompute-num-layers``, chosen per rank instead of configured).
Nothing is swapped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.policies.cost_model import BudgetOutcome
from pipeswap.schedule.recompute import inject_recompute
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.simulate import peak_without_swap
from pipeswap.schedule.steps import ChunkKey, Order, StepType


@dataclass(frozen=True)
class RecomputeOutcome(BudgetOutcome):
    """What recompute alone reached on one rank: its first ``layers`` layers of every chunk
    recomputed (``peak_no_swap``: with none; ``exposed_copy`` is 0, nothing is copied)."""

    layers: int


@dataclass
class RecomputePolicy:
    """Per rank, the fewest first layers of every chunk to recompute for the rank's peak
    (counted as the simulator counts it) to fit ``budget`` bytes; every layer where even
    that does not fit (``outcomes`` says by how much). :meth:`apply` adds the RC steps."""

    costs: CostModel
    budget: int
    outcomes: dict[int, RecomputeOutcome] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ScheduleError(f"the recompute policy's budget is a whole number of bytes "
                                f">= 1, got {self.budget!r}")

    def apply(self, schedule: Schedule) -> Schedule:
        """``schedule`` (without swap or RC steps) with this policy's RC steps."""
        self.outcomes = {}
        chosen: dict[ChunkKey, tuple[int, ...]] = {}
        for rank, order in enumerate(schedule.orders):
            found = fewest_first_layers(order, self.costs, self.budget)
            chosen.update(found.layers)
            self.outcomes[rank] = RecomputeOutcome(rank, self.budget, found.peak, found.plain,
                                                   0.0, layers=found.first)
        return inject_recompute(schedule, chosen)


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
