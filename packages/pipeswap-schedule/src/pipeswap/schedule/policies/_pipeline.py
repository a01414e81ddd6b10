"""Choosing each rank's plan in the whole pipeline, where the cost model times every stage.

A rank's own timeline cannot tell a copy's stall that another rank's slack absorbs (it costs
nothing) from one on the critical path, nor a recompute off that path from one on it. So
where a rank has more than one plan that meets its budget, it keeps the one that gives the
whole schedule the shortest step, every other rank as its plan stands. The ranks choose in
turn, so each choice depends on where the others start: ranks left as given (no swap, no
recompute) make a rank's stalls look cheaper than they will be once the ranks after it
swap too, while ranks that already meet their budgets make them look as they will be. Both
starts are tried, and the pipeline keeps the one whose last step is shorter.

A rank's turn simulates the whole schedule for only a few of its plans, not for each: every
plan adds swap or recompute steps to the rank's given order, so none makes any compute
earlier, and one run with the rank as given bounds every plan's step from below (see
:mod:`pipeswap.schedule._messages`): the plan run alone against that run's messages, each
message it sends plus the least time the schedule needs after it. The plans are simulated
in the order of their bounds until the next bound exceeds the shortest step found; the
choice is the one simulating every plan would make, in a turn's few whole simulations
rather than one per plan (planning every rank of 32 stages took minutes before). Where the
next rank is still as given, the run a turn chooses is that rank's run, logged as it ran.
The start planned alike (:func:`first_fastest`) is bounded alike: by its recompute alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple, TypeVar

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.policies._mixed import Outcome, Trial
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.simulate import (
    Logged,
    SimulationResult,
    simulate,
    simulate_against,
    simulate_logged,
)
from pipeswap.schedule.steps import ChunkKey, Order
from pipeswap.schedule.swap_order import inject_swap_order
from pipeswap.schedule.swap_plan import RankPlan, SwapPlacement

_Outcome = TypeVar("_Outcome", bound=Outcome)


def placed(order: Order, rank: int, recomputed: Mapping[ChunkKey, tuple[int, ...]],
           placements: Mapping[ChunkKey, SwapPlacement]) -> Order:
    """``order`` with ``placements``' swap steps and ``recomputed``'s RC steps."""
    return tuple(inject_swap_order(order, RankPlan(rank, placements, recomputed)))


def order_of(order: Order, rank: int, trial: Trial[_Outcome]) -> Order:
    """``order`` with ``trial``'s swap and recompute steps."""
    return placed(order, rank, trial.recomputed, trial.placements)


def with_orders(given: Schedule, orders: Mapping[int, Order]) -> Schedule:
    """``given`` with ``orders`` in place of its own."""
    return replace(given, orders=tuple(
        orders.get(rank, order) for rank, order in enumerate(given.orders)))


def run_with(given: Schedule, costs: CostModel, orders: Mapping[int, Order]
             ) -> SimulationResult:
    """The whole schedule simulated with ``orders`` in place of the given ones (made by the
    swap pass from valid orders: not validated again)."""
    return simulate(with_orders(given, orders), costs, timeline=False, check=False)


def step_time(given: Schedule, costs: CostModel, orders: Mapping[int, Order]) -> float:
    """The whole schedule's step with ``orders`` in place of the given ones."""
    return run_with(given, costs, orders).step_time


class Turn(NamedTuple):
    """What a rank's turn chose: its plan (an index), the step the whole schedule then
    makes, and (where asked) that run's log for the next rank's turn."""

    choice: int
    step: float
    logged: Logged | None


def choose(given: Schedule, costs: CostModel,
           options: Mapping[int, Sequence[Trial[_Outcome]]],
           starts: Sequence[Mapping[int, Order]],
           recompute_s: Callable[[Trial[_Outcome]], float],
           progress: Callable[[int, int], None] | None = None
           ) -> tuple[dict[int, Trial[_Outcome]], float]:
    """Each rank of ``options`` (its plans that meet its budget, or its one best) in turn
    takes the plan that gives the shortest step with the other ranks as they stand (then
    the least recompute), from each of ``starts`` (orders of some ranks; the rest as
    given; a start given twice runs once); the choices of the start whose last step is
    shortest (the first of equals), and that step. ``progress`` is told (choices made,
    choices to make) after each."""
    made: dict[tuple[int, int], Order] = {}

    def made_order(rank: int, index: int) -> Order:
        if (rank, index) not in made:
            made[rank, index] = order_of(given.orders[rank], rank, options[rank][index])
        return made[rank, index]

    best: tuple[float, dict[int, Trial[_Outcome]]] = (math.inf, {})
    distinct = [start for k, start in enumerate(starts) if start not in starts[:k]]
    made_so_far, to_make = 0, len(distinct) * len(options)
    ranks = sorted(options)
    for start in distinct:  # the same start would choose the same
        current = dict(start)
        chosen: dict[int, Trial[_Outcome]] = {}
        turn: Turn | None = None  # the last turn, while the schedule is as it ran
        for k, rank in enumerate(ranks):
            plans = options[rank]
            if len(plans) == 1:
                index, turn = 0, None
            else:
                # the run chosen is the next turn's run where that rank is still as given
                then = ranks[k + 1] if (k + 1 < len(ranks) and ranks[k + 1] not in current
                                        and len(options[ranks[k + 1]]) > 1) else None
                turn = fastest(given, costs, current, rank,
                               [made_order(rank, j) for j in range(len(plans))],
                               [recompute_s(plan) for plan in plans],
                               None if turn is None else turn.logged, then)
                index = turn.choice
            chosen[rank] = plans[index]
            current[rank] = made_order(rank, index)
            made_so_far += 1
            if progress is not None:
                progress(made_so_far, to_make)
        finished = step_time(given, costs, current) if turn is None else turn.step
        if finished < best[0]:
            best = (finished, chosen)
    return best[1], best[0]


#: How far past a step a plan's bound may be and the plan still be able to match it: the
#: simulator counts a copy ending a rounding error late as hidden, so its times are monotone
#: only to within that.
_ROUNDING = 1e-9


def beyond(bound: float, step: float) -> bool:
    """Whether a plan whose :func:`least_step` is ``bound`` surely makes a longer step than
    ``step``."""
    return bound > step * (1 + _ROUNDING)


def fastest(given: Schedule, costs: CostModel, current: Mapping[int, Order], rank: int,
            orders: Sequence[Order], recompute_s: Sequence[float],
            logged: Logged | None = None, then: int | None = None) -> Turn:
    """Which of ``orders`` (each ``rank``'s given order with swap or recompute steps added)
    gives the shortest step with the other ranks as ``current`` has them (the rest as
    given), then the least recompute, then the first: the same as simulating each, but
    most are ruled out by a bound (see the module docstring). ``logged``: that schedule's
    run with ``rank`` as given, where one is at hand; with ``then``, the runs made here
    are logged for rank ``then``'s turn, and the chosen one's log is returned."""
    if logged is None:
        logged = simulate_logged(with_orders(given, {**current, rank: given.orders[rank]}),
                                 costs, rank)
    bounds = [least_step(logged, given, rank, order, costs) for order in orders]
    runs: dict[int, tuple[float, Logged | None]] = {}
    for index in sorted(range(len(orders)), key=bounds.__getitem__):
        if runs and beyond(bounds[index], min(step for step, _ in runs.values())):
            break
        if then is None:
            runs[index] = step_time(given, costs, {**current, rank: orders[index]}), None
        else:
            run = simulate_logged(with_orders(given, {**current, rank: orders[index]}),
                                  costs, then)
            runs[index] = max(run.finishes, default=0.0), run
    index = min(runs, key=lambda k: (runs[k][0], recompute_s[k], k))
    return Turn(index, *runs[index])


#: A rank's plan as the pipeline runs it: its recomputed layers per chunk, its placements.
Plan = tuple[Mapping[ChunkKey, tuple[int, ...]], Mapping[ChunkKey, SwapPlacement]]


def first_fastest(given: Schedule, costs: CostModel, choices: Sequence[Mapping[int, Plan]],
                  plain_step: float, accepted: Callable[[SimulationResult], bool]
                  ) -> dict[int, Order]:
    """The orders of the choice (plans of some ranks; the rest as given) that gives the
    shortest step among those whose run ``accepted`` takes, the first of equals ({} where
    none is taken): the same as running each, but a choice whose recompute alone (its
    orders without their swap steps) already makes a longer step than one found is not
    run, since swap steps make no compute earlier. The choices share few ways of
    recomputing (``plain_step``: the step of none), so few runs bound them all."""
    alone: dict[tuple[tuple[int, frozenset[tuple[ChunkKey, tuple[int, ...]]]], ...],
                float] = {}
    bounds: list[float] = []
    for choice in choices:
        key = tuple((rank, frozenset(plan[0].items())) for rank, plan in sorted(choice.items())
                    if plan[0])
        if key not in alone:
            alone[key] = step_time(given, costs, {
                rank: placed(given.orders[rank], rank, recomputed, {})
                for rank, (recomputed, _) in choice.items() if recomputed}) if key else plain_step
        bounds.append(alone[key])
    best: tuple[float, int, dict[int, Order]] = (math.inf, 0, {})
    for index in sorted(range(len(choices)), key=lambda k: (bounds[k], k)):
        if beyond(bounds[index], best[0]):
            break
        orders = {rank: placed(given.orders[rank], rank, recomputed, placements)
                  for rank, (recomputed, placements) in choices[index].items()}
        run = run_with(given, costs, orders)
        if accepted(run) and (run.step_time, index) < best[:2]:
            best = (run.step_time, index, orders)
    return best[2]


def least_step(logged: Logged, given: Schedule, rank: int, order: Order, costs: CostModel
               ) -> float:
    """The least step ``order`` can give ``rank`` with the other ranks as ``logged`` ran
    them; minus infinity where it sends a message earlier than ``logged`` (a plan that adds
    steps never should, but then nothing bounds it)."""
    finish, sent = simulate_against(logged, given, rank, order, costs)
    least = max([finish] + [end for other, end in enumerate(logged.finishes) if other != rank])
    stage_ranks = given.stage_ranks
    for message, at in sent.items():
        direction, stage, _ = message
        if stage_ranks[stage + 1 if direction == "F" else stage - 1] == rank:
            continue  # a hand-off between two stages of the rank
        if at < logged.arrivals[message] * (1 - _ROUNDING):
            return -math.inf
        least = max(least, at + logged.tails.get(message, 0.0))
    return least
