"""Adding sends and receives to compute orders: PyTorch's early placement, the deferred one,
and what each transport accepts.

The fixture holds PyTorch's own lowered orders (``_PipelineScheduleRuntime``'s orders with
comms, FSDP actions removed), recorded from torch; tests/test_pytorch_schedules.py checks it
against the installed torch, so this comparison needs no torch and survives a move of
PyTorch's private module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeswap.schedule import (
    DeadlockError,
    Lowering,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    StepType,
    build_schedule,
    insert_send_recv_by_dependency,
    insert_send_recv_early,
    parse_order,
    validate,
)
from pipeswap.schedule.formats import dumps_csv, loads_csv
from pipeswap.schedule.p2p import pytorch_turns
from pipeswap.schedule.pytorch_family import dualpipev, zbv

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "pytorch_lowered_orders.json")
                     .read_text())
CASE = re.compile(r"(?P<kind>\S+) P=(?P<P>\d+) M=(?P<M>\d+) V=(?P<V>\d+)")


def spec_of(case: str, **options: object) -> ScheduleSpec:
    found = CASE.fullmatch(case)
    assert found is not None
    return ScheduleSpec(ScheduleKind(found["kind"]), int(found["P"]), int(found["M"]),
                        int(found["V"]), **options)  # type: ignore[arg-type]


def test_the_fixture_covers_the_four_families_over_the_grid() -> None:
    kinds = {CASE.fullmatch(case)["kind"] for case in FIXTURE["orders"]}  # type: ignore[index]
    assert kinds == {"looped-bfs", "interleaved-zb", "zbv", "dualpipev"}
    assert len(FIXTURE["orders"]) >= 60


@pytest.mark.parametrize("case", sorted(FIXTURE["orders"]))
def test_default_lowering_equals_pytorchs_and_runs_in_order(case: str) -> None:
    schedule = build_schedule(spec_of(case))
    assert [" ".join(map(str, order)) for order in schedule.orders] == FIXTURE["orders"][case]
    micros = int(CASE.fullmatch(case)["M"])  # type: ignore[index]
    validate(schedule, microbatches=micros)  # the ordered (NCCL) transport
    validate(build_schedule(spec_of(case, swap=True)), microbatches=micros)
    validate(build_schedule(spec_of(case, swap=True, fsdp=True, batch_p2p=True)),
             microbatches=micros)


def test_early_lowering_of_an_imported_csv_equals_the_built_schedule() -> None:
    """`convert --lower` on PyTorch's compute-only CSV gives what `orders` builds."""
    text = dumps_csv(dualpipev(4, 8), compute_only=True)
    assert insert_send_recv_early(loads_csv(text)) == build_schedule(
        ScheduleSpec(ScheduleKind.DUALPIPEV, 4, 8))


def test_deferred_lowering_needs_a_tagged_transport() -> None:
    """Receives right before their consumers hang an in-order transport on ZBV; the
    validator says so and names the transport that runs it."""
    deferred = build_schedule(ScheduleSpec(ScheduleKind.ZBV, 4, 8, lowering=Lowering.DEFERRED))
    with pytest.raises(DeadlockError, match="on NCCL it would hang"):
        validate(deferred)
    validate(deferred, transport="tagged")
    early = build_schedule(ScheduleSpec(ScheduleKind.ZBV, 4, 8))
    validate(early)
    # Both place the same computes in the same order; only the P2P differs.
    def computes(s: Schedule) -> list[list[str]]:
        return [[str(step) for step in order if step is not None and step.compute_leaves]
                for order in s.orders]
    assert computes(early) == computes(deferred)


def test_pytorch_turns_count_the_fsdp_actions_pytorch_inserts() -> None:
    """Rank 0 of ZBV P=2 M=2: PyTorch gathers stages 0 and 3 before the first compute and
    reduces each stage's gradients after its second W; idle slots take no turn."""
    order = zbv(2, 2).orders[0]
    turns = pytorch_turns(order, 2)
    computes = [step for step in order if step is not None]
    assert [t for t in turns if t is not None] == computes
    assert turns[:3] == [None, None, computes[0]]  # UNSHARD 0, UNSHARD 3, then 0F0
    weights = [i for i, t in enumerate(turns) if t is not None and t.type is StepType.BWD_WEIGHT]
    # After the second W of each stage comes REDUCE_GRAD; RESHARDs are not turns before W.
    reduced = [i for i in weights if turns[i + 1:i + 2] == [None]]
    assert len(reduced) == 2


def test_interleaved_less_memory_with_overlaps_is_lowered_early() -> None:
    spec = ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 4, 8, 2, overlap_b_f=True,
                        less_memory=True)
    assert spec.effective_lowering is Lowering.EARLY
    schedule = build_schedule(spec)
    validate(schedule, microbatches=8)
    validate(build_schedule(ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 4, 8, 2,
                                         overlap_b_f=True, less_memory=True, dxdw_split=True,
                                         swap=True, batch_p2p=True)), microbatches=8)
    # Without the options it keeps MindSpore hyper-parallel's column scan.
    assert ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 4, 8, 2).effective_lowering is (
        Lowering.COLUMNS)


@pytest.mark.parametrize("lower", [insert_send_recv_early, insert_send_recv_by_dependency])
def test_compute_orders_that_cannot_run_are_refused_naming_the_ranks(lower: object) -> None:
    """Rank 0 runs stage 0's backward before anything reaches it from rank 1, which waits
    for rank 0's forward of micro 1: no lowering can order that."""
    orders = [parse_order("0F0 0B0 0F1 0B1"), parse_order("1F1 1B1 1F0 1B0")]
    stuck = Schedule((orders[0], orders[1]), (0, 1))
    with pytest.raises(ScheduleError, match=r"cannot run together: rank 0 at 0B0 \(waits for "
                                            r"the gradient of stage 1 micro 0\), rank 1 at 1F1"):
        lower(stuck)  # type: ignore[operator]


@pytest.mark.parametrize("lower", [insert_send_recv_early, insert_send_recv_by_dependency])
def test_lowerings_take_compute_only_orders(lower: object) -> None:
    lowered = build_schedule(ScheduleSpec(ScheduleKind.ZBV, 2, 4))
    with pytest.raises(ScheduleError, match="takes compute-only orders"):
        lower(lowered)  # type: ignore[operator]
