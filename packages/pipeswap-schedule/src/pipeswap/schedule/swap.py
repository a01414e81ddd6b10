"""The swap-injection pass over a whole schedule: every rank's order through
:func:`~pipeswap.schedule.swap_order.inject_swap_order` (where the steps go) with the policy
given, by default the peak policy."""

from __future__ import annotations

from collections.abc import Collection

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.policies.base import PreparingPolicy, SwapPolicy
from pipeswap.schedule.policies.defaults import default_policy
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import ChunkKey, StepType
from pipeswap.schedule.swap_order import inject_swap_order, swap_candidates

__all__ = ["inject_swap", "inject_swap_order", "swap_candidates", "swapped_chunks"]


@gc_paused
def inject_swap(schedule: Schedule, policy: SwapPolicy | None = None, *,
                ranks: Collection[int] | None = None) -> Schedule:
    """Insert swap steps into every rank's order (or only ``ranks``') for the chunks
    ``policy`` selects (by default
    :func:`~pipeswap.schedule.policies.defaults.default_policy`: the peak policy).

    Swap steps are a rank's own (no other rank waits on them), so a rank that runs its
    order alone may plan only itself: ``ranks={rank}`` leaves the other orders as they
    are, and costs one rank's planning instead of all of them."""
    chosen = default_policy() if policy is None else policy
    if isinstance(chosen, PreparingPolicy):  # told the ranks only where it plans some
        if ranks is None:
            chosen.prepare(schedule)
        else:
            chosen.prepare(schedule, ranks=ranks)
    return schedule.map_orders(
        lambda rank, order: order if ranks is not None and rank not in ranks
        else inject_swap_order(order, chosen, rank=rank))


_OFFLOAD_LAUNCHES = frozenset({StepType.SWAP_LAUNCH_OFFLOAD, StepType.SWAP_STREAM_OFFLOAD})


def swapped_chunks(schedule: Schedule) -> tuple[tuple[ChunkKey, ...], ...]:
    """Per rank, the chunks that have a launch-offload step (whole or streaming), in
    execution order."""
    return tuple(
        tuple(s.key for s in order if s is not None and s.type in _OFFLOAD_LAUNCHES)
        for order in schedule.orders
    )


