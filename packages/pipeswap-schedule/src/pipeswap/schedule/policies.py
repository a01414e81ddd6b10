"""Swap policies that weigh costs: copies that hide, or a memory budget to meet.

Both look at one rank's order with a :class:`CostModel`, on that rank's own timeline (compute
slots back to back, no waits for other ranks: waits only add room for copies, so what hides
here hides in the full simulation too). The swap pass places a chosen chunk's steps as always:
the offload runs during the compute slot after its forward (WO ends that slot), the reload
during the compute slot before its backward; so a chunk is off the device from the second
slot after its forward to the second slot before its backward, and only chunks with a gap of
at least 4 slots save anything.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.steps import COMPUTE, OVERLAPS, ChunkKey, Order, StepType
from pipeswap.schedule.swap import SwapCandidate

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
        held = [0] * (len(line.ends) + 1)  # a difference array over slots, then prefix sums
        for c in candidates:
            total = self.costs.chunk_bytes(c.key).total
            held[c.forward_slot] += total
            held[line.last_slot.get(c.key, c.backward_slot) + 1] -= total
        for slot in range(1, len(held)):
            held[slot] += held[slot - 1]
        held.pop()
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
