"""Fitting a streamed plan to its budget chunk by chunk.

A plan alike on every chunk (:func:`~pipeswap.schedule.policies._mixed.alike`) with long
lags and loads two layers ahead hides most of a slow link's copies, but it may go over the
rank's budget at a few points only: where the warm-up's last forward meets the first loads,
say. Giving up the whole plan there throws away what it saves everywhere else. So the plan
is fitted instead: at the first point over the budget, each streamed chunk whose copies are
in flight or whose layers wait on the device then is tried with its load depth, or its
lag, one lower; the change that leaves the least excess over the whole order (then the
shortest step) is kept, and the fitting goes on from the next point over, until the plan
meets the budget or no change lowers the excess. A plan over in many stretches would need
as many changes; the search has plans with lower lags or depths everywhere for that, so a
fit gives up on it at once, and after a few changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.simulate import RankResult, SwappedChunk, simulate_alone
from pipeswap.schedule.steps import ChunkKey, Order, StepType
from pipeswap.schedule.swap_plan import SwapPlacement

#: The most changes a fit makes, per chunk the plan swaps (and at least
#: :data:`FEWEST_CHANGES`): each costs a few runs of the rank's order. A change mends two or
#: three stretches over the budget where those recur in the steady state, so a plan over in
#: more than :data:`STRETCHES_PER_CHANGE` times as many stretches is given up at once: it
#: would need a lower lag or depth on most chunks, and the search has such plans of its own.
CHANGES_PER_CHUNK = 1 / 8
FEWEST_CHANGES = 8
STRETCHES_PER_CHANGE = 3


def excess(run: RankResult, budget: int) -> int:
    """How far, summed over every change of its memory, ``run`` goes over ``budget``."""
    return sum(held - budget for _, held in run.memory if held > budget)


def stretches(run: RankResult, budget: int) -> int:
    """How many separate stretches of ``run``'s memory go over ``budget``."""
    held = [amount > budget for _, amount in run.memory]
    return sum(1 for k, over in enumerate(held) if over and (k == 0 or not held[k - 1]))


class Fitted(NamedTuple):
    """A fit's placements, and the rank's order with them run alone (its memory too)."""

    placements: dict[ChunkKey, SwapPlacement]
    run: RankResult


def fit(placements: Mapping[ChunkKey, SwapPlacement], order_of: Callable[
        [Mapping[ChunkKey, SwapPlacement]], Order], rank: int, costs: CostModel,
        budget: int) -> Fitted | None:
    """``placements`` with lags and load depths lowered chunk by chunk until the rank's
    order (``order_of(placements)``) meets ``budget``; None if no such change gets there
    within :data:`CHANGES_PER_CHUNK` of them."""
    current = dict(placements)
    run = simulate_alone(order_of(current), rank, costs, timeline=True)
    changes = max(FEWEST_CHANGES, int(len(placements) * CHANGES_PER_CHUNK))
    if stretches(run, budget) > changes * STRETCHES_PER_CHANGE:
        return None
    for _ in range(changes):
        over = next((time for time, held in run.memory if held > budget), None)
        if over is None:
            return Fitted(current, run)
        best: tuple[tuple[int, float], dict[ChunkKey, SwapPlacement], RankResult] | None = None
        for key, lower in _changes(current, run.swapped, over, costs, rank):
            trial = {**current, key: lower}
            tried = simulate_alone(order_of(trial), rank, costs, timeline=True)
            merit = (excess(tried, budget), tried.step_time)
            if best is None or merit < best[0]:
                best = (merit, trial, tried)
        if best is None or best[0][0] >= excess(run, budget):
            return None
        _, current, run = best
    return None


def _changes(placements: Mapping[ChunkKey, SwapPlacement], swapped: tuple[SwappedChunk, ...],
             at: float, costs: CostModel, rank: int) -> Iterator[tuple[ChunkKey,
                                                                       SwapPlacement]]:
    """The one-step-lower choices of the streamed chunks live at time ``at``: a load depth
    from its SL until its backward ends, a lag from its forward until its WO."""
    for chunk in swapped:
        key = (chunk.stage, chunk.micro)
        placement = placements.get(key)
        if placement is None or not placement.layer_lag:
            continue
        loaded_at = chunk.wait_offload + chunk.off_device  # its SL
        if placement.load_depth > 1 and loaded_at <= at <= chunk.load[1] + costs.compute_time(
                StepType.BWD, chunk.stage, rank):
            yield key, placement._replace(load_depth=placement.load_depth - 1)
        if placement.layer_lag > 1 and chunk.offload[0] - costs.compute_time(
                StepType.FWD, chunk.stage, rank) <= at <= chunk.wait_offload:
            yield key, placement._replace(layer_lag=placement.layer_lag - 1)
