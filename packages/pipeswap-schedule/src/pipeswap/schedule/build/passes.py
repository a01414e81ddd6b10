"""Build a finished schedule: generate, then run the passes in MindSpore hyper-parallel's
order.

generate (+ send/recv, + dx/dw split) → FSDP → P2P batching → swap injection. Swap comes last
so it sees the final FSDP steps and P2P batches and never splits one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.build.spec import Lowering, ScheduleKind, ScheduleSpec
from pipeswap.schedule.build.swap_pass import apply_swap, inject_swap, plan_swap
from pipeswap.schedule.dxdw import split_dxdw
from pipeswap.schedule.fsdp import add_fsdp_steps
from pipeswap.schedule.generators import gpipe, interleaved_1f1b_compute, one_f_one_b
from pipeswap.schedule.p2p import (
    coalesce_p2p,
    insert_send_recv,
    insert_send_recv_by_dependency,
    insert_send_recv_early,
)
from pipeswap.schedule.policies.base import SwapPolicy
from pipeswap.schedule.pytorch_family import (
    dualpipev,
    interleaved_zero_bubble,
    looped_bfs,
    zbv,
)
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.swap_plan import SwapPlan

LOWERINGS: dict[Lowering, Callable[[Schedule], Schedule]] = {
    Lowering.EARLY: insert_send_recv_early,
    Lowering.DEFERRED: insert_send_recv_by_dependency,
    Lowering.COLUMNS: insert_send_recv,
}


Pass = Callable[[Schedule], Schedule]


def generate(spec: ScheduleSpec) -> Schedule:
    """The generator's output for ``spec``: with P2P for GPipe and 1F1B, compute orders for
    the multi-stage schedules (their P2P comes from the first pass of :func:`passes`)."""
    if spec.kind is ScheduleKind.GPIPE:
        return gpipe(spec.ranks, spec.microbatches)
    if spec.kind is ScheduleKind.ONE_F_ONE_B:
        return one_f_one_b(spec.ranks, spec.microbatches)
    if spec.kind is ScheduleKind.LOOPED_BFS:
        return looped_bfs(spec.ranks, spec.microbatches, spec.stages_per_rank)
    if spec.kind is ScheduleKind.INTERLEAVED_ZB:
        return interleaved_zero_bubble(spec.ranks, spec.microbatches, spec.stages_per_rank)
    if spec.kind is ScheduleKind.ZBV:
        return zbv(spec.ranks, spec.microbatches)
    if spec.kind is ScheduleKind.DUALPIPEV:
        return dualpipev(spec.ranks, spec.microbatches)
    return interleaved_1f1b_compute(
        spec.ranks,
        spec.microbatches,
        spec.stages_per_rank,
        overlap_b_f=spec.overlap_b_f,
        less_memory=spec.less_memory,
    )


def passes(spec: ScheduleSpec, swap_policy: SwapPolicy | None = None, *,
           swap_ranks: Collection[int] | None = None) -> list[tuple[str, Pass]]:
    """The passes ``spec`` asks for, named, in the order they run after :func:`generate`;
    the swap pass plans only ``swap_ranks`` when given (see :func:`inject_swap`)."""
    chosen: list[tuple[str, Pass]] = []
    lowering = spec.effective_lowering
    if lowering is not None:  # multi-stage generators emit computes only
        chosen.append((f"send/recv ({lowering.value})", LOWERINGS[lowering]))
    if spec.dxdw_split:
        chosen.append(("dx/dw split", split_dxdw))
    if spec.fsdp:
        chosen.append(("fsdp", add_fsdp_steps))
    if spec.batch_p2p:
        chosen.append(("batch p2p", coalesce_p2p))
    if spec.swap:
        chosen.append(("swap", lambda schedule: inject_swap(schedule, swap_policy,
                                                            ranks=swap_ranks)))
    return chosen


@gc_paused
def build_schedule(spec: ScheduleSpec, swap_policy: SwapPolicy | None = None, *,
                   swap_ranks: Collection[int] | None = None) -> Schedule:
    """Generate ``spec.kind`` and apply the passes ``spec`` asks for (the swap pass on
    ``swap_ranks`` only, when given: a rank that runs alone plans only itself)."""
    return build_planned(spec, swap_policy, swap_ranks=swap_ranks)[0]


@gc_paused
def build_planned(spec: ScheduleSpec, swap_policy: SwapPolicy | None = None, *,
                  swap_ranks: Collection[int] | None = None
                  ) -> tuple[Schedule, SwapPlan | None]:
    """:func:`build_schedule`, and the swap plan its swap pass made (None where ``spec``
    asks for no swap)."""
    schedule = generate(spec)
    for _, apply in passes(replace(spec, swap=False)):
        schedule = apply(schedule)
    if not spec.swap:
        return schedule, None
    plan = plan_swap(schedule, swap_policy, ranks=swap_ranks)
    return apply_swap(schedule, plan), plan
