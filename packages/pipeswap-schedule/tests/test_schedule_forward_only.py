"""A rank's forward-only order (what an evaluation runs): every forward of the rank once, in
the training order's order, with its activations' sends and receives and nothing of the
backward; all ranks' forward-only orders still pair every message under the ordered
(NCCL) model and both ends of each alike."""

from __future__ import annotations

import dataclasses

import pytest

from pipeswap.schedule import (
    ScheduleKind,
    ScheduleSpec,
    Step,
    StepType,
    build_schedule,
    check_batches_alike,
    forward_order,
    simulate_p2p,
)

KEPT = {StepType.FWD, StepType.FWD_SEND, StepType.FWD_RECV, StepType.BATCH_SEND_RECV,
        StepType.FSDP_UNSHARD, StepType.FSDP_RESHARD}

SPECS = [
    ScheduleSpec(ScheduleKind.GPIPE, ranks=4, microbatches=8, swap=True),
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True,
                 batch_p2p=True),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=4, stages_per_rank=2,
                 overlap_b_f=True, dxdw_split=True),
    ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=4, fsdp=True),
    ScheduleSpec(ScheduleKind.DUALPIPEV, ranks=2, microbatches=4),
]


def _forwards(order: tuple[Step | None, ...]) -> list[Step]:
    return [leaf for step in order if step is not None for leaf in
            (step.sub_steps if step.sub_steps else (step,)) if leaf.type is StepType.FWD]


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.kind.value)
def test_forward_only_orders_keep_every_forward_and_pair_every_message(
        spec: ScheduleSpec) -> None:
    schedule = build_schedule(spec)
    orders = tuple(forward_order(order) for order in schedule.orders)
    for full, mine in zip(schedule.orders, orders):
        assert None not in mine and {step.type for step in mine} <= KEPT
        assert _forwards(mine) == _forwards(full)  # each forward, in the same order
        assert all(leaf.type in (StepType.FWD_SEND, StepType.FWD_RECV) for step in mine
                   if step is not None and step.type is StepType.BATCH_SEND_RECV
                   for leaf in step.sub_steps)
    evaluation = dataclasses.replace(schedule, orders=orders)
    simulate_p2p(evaluation)  # raises on a mismatch, a dangling message or a deadlock
    check_batches_alike(evaluation)


def test_an_order_without_forwards_keeps_nothing() -> None:
    assert forward_order((None, Step(StepType.BWD, 0, 0), None)) == ()
