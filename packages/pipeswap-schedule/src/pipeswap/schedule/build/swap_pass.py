"""The swap-injection pass over a whole schedule: the policy given (by default the peak
policy) plans every rank, and :func:`~pipeswap.schedule.swap_order.inject_swap_order` puts
each plan's steps in its rank's order. Planning and placing are apart, so the plan is a value
the caller keeps (:func:`plan_swap`, :func:`apply_swap`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.policies.base import PreparingPolicy, Selection, SwapPolicy
from pipeswap.schedule.policies.defaults import default_policy
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.swap_order import inject_swap_order, swap_candidates
from pipeswap.schedule.swap_plan import DEFAULT_PLACEMENT, RankPlan, SwapPlan


@gc_paused
def plan_swap(schedule: Schedule, policy: SwapPolicy | None = None, *,
              ranks: Collection[int] | None = None) -> SwapPlan:
    """What ``policy`` (by default
    :func:`~pipeswap.schedule.policies.defaults.default_policy`: the peak policy) decides
    for every rank of ``schedule`` (or only ``ranks``).

    Swap steps are a rank's own (no other rank waits on them), so a rank that runs its
    order alone may plan only itself: ``ranks={rank}`` costs one rank's planning instead of
    all of them."""
    chosen = default_policy() if policy is None else policy
    planner = chosen.prepare(schedule, ranks) if isinstance(chosen, PreparingPolicy) else chosen
    planned = range(len(schedule.orders)) if ranks is None else sorted(ranks)
    plans: dict[int, RankPlan] = {}
    for rank in planned:
        order = schedule.orders[rank]
        plans[rank] = rank_plan(rank, planner.select(rank, swap_candidates(order, rank), order))
    return SwapPlan(plans)


def rank_plan(rank: int, selection: Selection) -> RankPlan:
    """``selection`` as ``rank``'s plan: chunks chosen without a placement get
    :data:`~pipeswap.schedule.swap_plan.DEFAULT_PLACEMENT`, and their reloads follow an
    FSDP stage's parameter gathers."""
    if isinstance(selection, RankPlan):
        return selection
    if isinstance(selection, Mapping):
        return RankPlan(rank, selection)
    return RankPlan(rank, dict.fromkeys(selection, DEFAULT_PLACEMENT), gather_reloads=True)


@gc_paused
def apply_swap(schedule: Schedule, plan: SwapPlan) -> Schedule:
    """``schedule`` with the swap and RC steps of ``plan``'s ranks (the other orders as they
    are)."""
    return schedule.map_orders(
        lambda rank, order: order if rank not in plan.ranks
        else inject_swap_order(order, plan.ranks[rank]))


def inject_swap(schedule: Schedule, policy: SwapPolicy | None = None, *,
                ranks: Collection[int] | None = None) -> Schedule:
    """``schedule`` with the swap (and RC) steps ``policy`` plans for every rank (or only
    ``ranks``): :func:`apply_swap` of :func:`plan_swap`, for a caller that keeps no plan."""
    return apply_swap(schedule, plan_swap(schedule, policy, ranks=ranks))
