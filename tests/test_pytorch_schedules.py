"""pipeswap's PyTorch-family generators give PyTorch's own compute orders, and its default
lowering PyTorch's own orders with sends and receives.

Compared against torch.distributed.pipelining (each schedule class built on mocked stages, as
its schedule visualizer does); skipped where that module is missing. The lowered orders are
also committed as a fixture that pipeswap-schedule's own tests compare against without torch;
the last test here keeps that fixture equal to what the installed PyTorch builds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest

from pipeswap.schedule import Schedule, ScheduleError
from pipeswap.schedule.pytorch_family import (
    dualpipev,
    interleaved_zero_bubble,
    looped_bfs,
    zbv,
)

visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

GRID = [(ranks, micro) for ranks in (2, 3, 4) for micro in (1, 2, 3, 4, 6, 8, 12, 16)]
MULTI: list[tuple[str, Callable[[int, int, int], Schedule]]] = [
    ("ScheduleLoopedBFS", looped_bfs), ("ScheduleInterleavedZeroBubble", interleaved_zero_bubble)]
V_SHAPED: list[tuple[str, Callable[[int, int], Schedule]]] = [
    ("ScheduleZBVZeroBubble", zbv), ("ScheduleDualPipeV", dualpipev)]


def _theirs(name: str, ranks: int, micro: int, local: int) -> list[list[str | None]] | None:
    """PyTorch's orders, or None where PyTorch refuses the arguments."""
    try:
        orders = visualizer.get_schedule_ops(getattr(schedules, name), ranks, micro, local)
    except (ValueError, AssertionError):
        return None
    return [[None if a is None else str(a) for a in order] for order in orders]


def _ours(build: Callable[[], Schedule]) -> list[list[str | None]] | None:
    try:
        schedule = build()
    except ScheduleError:
        return None
    return [[None if s is None else str(s) for s in order] for order in schedule.orders]


@pytest.mark.parametrize(("name", "generate"), MULTI, ids=[n for n, _ in MULTI])
@pytest.mark.parametrize("local", [2, 3, 4])
def test_multi_stage_schedules_match_pytorch(
        name: str, generate: Callable[[int, int, int], Schedule], local: int) -> None:
    compared = 0
    for ranks, micro in GRID:
        theirs = _theirs(name, ranks, micro, local)
        assert _ours(lambda: generate(ranks, micro, local)) == theirs, (ranks, micro)
        compared += theirs is not None
    assert compared >= len(GRID) // 2


@pytest.mark.parametrize(("name", "generate"), V_SHAPED, ids=[n for n, _ in V_SHAPED])
def test_v_schedules_match_pytorch(name: str, generate: Callable[[int, int], Schedule]) -> None:
    compared = 0
    for ranks, micro in GRID:
        theirs = _theirs(name, ranks, micro, 2)
        assert _ours(lambda: generate(ranks, micro)) == theirs, (ranks, micro)
        compared += theirs is not None
    assert compared >= len(GRID) // 2


@pytest.mark.parametrize("name", ["ScheduleZBVZeroBubble", "ScheduleDualPipeV",
                                  "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS"])
def test_pytorch_csv_in_and_out(name: str) -> None:
    import csv
    import io

    from pipeswap.schedule import validate
    from pipeswap.schedule.formats import dumps_csv, loads_csv
    from pipeswap.schedule.p2p import insert_send_recv_by_dependency, insert_send_recv_early
    from pipeswap.schedule import inject_swap

    actions = visualizer.get_schedule_ops(getattr(schedules, name), 2, 8, 2)
    theirs = io.StringIO()
    csv.writer(theirs).writerows(actions)  # what PyTorch's _dump_csv writes, compute only
    imported = loads_csv(theirs.getvalue())
    assert dumps_csv(imported, compute_only=True) == theirs.getvalue()
    lowered = inject_swap(insert_send_recv_early(imported))
    validate(lowered)  # in-order transport (NCCL)
    validate(inject_swap(insert_send_recv_by_dependency(imported)), transport="tagged")
    # PyTorch reads back what pipeswap writes, P2P included (no pipeswap-only steps here).
    plain = insert_send_recv_early(imported)
    for row in csv.reader(io.StringIO(dumps_csv(plain))):
        parsed = [schedules._Action.from_str(cell) for cell in row]
        assert [("" if a is None else str(a)) for a in parsed] == row


FIXTURE = (Path(__file__).parents[1] / "packages" / "pipeswap-schedule" / "tests" / "fixtures"
           / "pytorch_lowered_orders.json")
LOWERED = {"looped-bfs": ("ScheduleLoopedBFS", (2, 3)),
           "interleaved-zb": ("ScheduleInterleavedZeroBubble", (2, 3)),
           "zbv": ("ScheduleZBVZeroBubble", (2,)), "dualpipev": ("ScheduleDualPipeV", (2,))}


def _pytorch_lowered(name: str, ranks: int, micro: int, local: int) -> list[str] | None:
    """The orders PyTorch's runtime runs (``pipeline_order_with_comms``), one line per rank,
    without the FSDP actions it always adds; None where PyTorch refuses the arguments."""
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, ranks, None
    stage.num_stages = ranks * local
    try:
        built = getattr(schedules, name)([stage] * local, micro)
    except (ValueError, AssertionError):
        return None
    fsdp = {schedules.UNSHARD, schedules.RESHARD, schedules.REDUCE_GRAD}
    return [" ".join(str(a) for a in built.pipeline_order_with_comms[rank]
                     if a.computation_type not in fsdp) for rank in range(ranks)]


def test_default_lowering_equals_pytorchs_runtime_orders_and_the_fixture() -> None:
    """P in {2,4,8}, M in {2,4,8,16}, V in {2,3}: wherever PyTorch builds the schedule, its
    lowered orders equal pipeswap's default build token for token, and the committed fixture
    holds exactly these cases."""
    from pipeswap.schedule import ScheduleKind, ScheduleSpec, build_schedule

    fixture = json.loads(FIXTURE.read_text())["orders"]
    seen = {}
    for kind, (name, locals_) in LOWERED.items():
        for ranks in (2, 4, 8):
            for micro in (2, 4, 8, 16):
                for local in locals_:
                    theirs = _pytorch_lowered(name, ranks, micro, local)
                    if theirs is None:
                        continue
                    case = f"{kind} P={ranks} M={micro} V={local}"
                    ours = build_schedule(ScheduleSpec(ScheduleKind(kind), ranks, micro, local))
                    assert [" ".join(map(str, order)) for order in ours.orders] == theirs, case
                    seen[case] = theirs
    assert seen == fixture
