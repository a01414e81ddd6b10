"""The cost-model policies that swap whole chunks with one compute slot for each copy:
every chunk whose copies hide, or the chunks that bring a rank under a memory budget.

Both plan on the rank's own timeline (:mod:`pipeswap.schedule.policies._slots`), so only
chunks whose backward is at least :data:`SAVING_GAP` slots after their forward save anything.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.policies._slots import SAVING_GAP, Timeline, copy_times
from pipeswap.schedule.policies.base import refuse_recompute
from pipeswap.schedule.steps import ChunkKey, Order
from pipeswap.schedule.swap_plan import DEFAULT_PLACEMENT, PlanOutcome, RankPlan, SwapCandidate


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

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> Collection[ChunkKey]:
        refuse_recompute(order, "cost")
        if not candidates:
            return set()
        line = Timeline.of(order, self.costs, rank)
        duplex = self.costs.rank_link(rank).duplex
        usable = [c for c in candidates if c.gap >= SAVING_GAP]
        usable.sort(key=lambda c: (-(line.starts[c.backward_slot] - line.ends[c.forward_slot]),
                                   c.forward_slot))
        taken: list[SwapCandidate] = []
        for candidate in usable:
            if self._hidden([*taken, candidate], line, rank, duplex):
                taken.append(candidate)
        return {c.key for c in taken}

    def _hidden(self, chosen: list[SwapCandidate], line: Timeline, rank: int,
                duplex: bool) -> bool:
        """Whether every copy of ``chosen`` ends before the compute that waits for it."""
        copies = []  # (earliest start, duration, deadline, stream)
        for c in chosen:
            d2h, h2d = copy_times(self.costs, rank, c.key)
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
class MemoryBudgetPolicy:
    """Swap the chunks that bring each rank's activation peak under ``budget`` bytes, with
    the least exposed copy time.

    Greedy: while the peak is over the budget, take the chunk that is off the device at the
    peak and would stall compute least (its copies' excess over the slots that hide them),
    and repeat. When no chunk can lower the peak further, the budget cannot be met: the
    outcome in each rank's plan says by how much. ``budget`` may differ per rank.
    """

    costs: CostModel
    budget: int | Mapping[int, int]

    def budget_for(self, rank: int) -> int:
        if isinstance(self.budget, int):
            return self.budget
        if rank not in self.budget:
            raise ScheduleError(f"the memory budget gives no figure for rank {rank}")
        return self.budget[rank]

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> RankPlan:
        refuse_recompute(order, "budget")
        budget = self.budget_for(rank)
        line = Timeline.of(order, self.costs, rank)
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
        return RankPlan(rank, dict.fromkeys(chosen, DEFAULT_PLACEMENT), outcome=PlanOutcome(
            rank, max(held, default=0), peak_no_swap, exposed, budget), gather_reloads=True)

    def _stall(self, c: SwapCandidate, line: Timeline, rank: int) -> float:
        d2h, h2d = copy_times(self.costs, rank, c.key)
        after = line.ends[c.forward_slot + 1] - line.starts[c.forward_slot + 1]
        before = line.ends[c.backward_slot - 1] - line.starts[c.backward_slot - 1]
        return max(0.0, d2h - after) + max(0.0, h2d - before)
