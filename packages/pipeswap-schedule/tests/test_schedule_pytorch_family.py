"""The PyTorch schedule family in pipeswap: placement, P2P, swap, validation, errors.
(Equality with PyTorch's own orders is checked where torch is installed:
tests/test_pytorch_schedules.py at the repository root.)"""

from __future__ import annotations

import pytest

from pipeswap.schedule import (
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    StepType,
    build_schedule,
    swapped_chunks,
    validate,
)
from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.simulate import simulate
from pipeswap.schedule.steps import COMPOSITES, SWAP

FAMILY = [ScheduleKind.LOOPED_BFS, ScheduleKind.INTERLEAVED_ZB, ScheduleKind.ZBV,
          ScheduleKind.DUALPIPEV]


@pytest.mark.parametrize("kind", FAMILY, ids=lambda k: k.value)
@pytest.mark.parametrize(("ranks", "micro"), [(2, 4), (3, 6), (4, 8)])
def test_each_builds_with_swap_and_runs_with_in_order_transfers(
        kind: ScheduleKind, ranks: int, micro: int) -> None:
    for batch_p2p, fsdp in ((False, False), (True, False), (False, True)):
        spec = ScheduleSpec(kind, ranks=ranks, microbatches=micro, stages_per_rank=2,
                            swap=True, batch_p2p=batch_p2p, fsdp=fsdp)
        schedule = build_schedule(spec)
        validate(schedule)  # F < LO < WO < LL < WL < backward, P2P paired in order (NCCL)...
        assert any(swapped_chunks(schedule))
        for order in schedule.orders:
            for step in order:
                if step is not None and step.type in COMPOSITES:
                    assert not any(s.type in SWAP for s in step.sub_steps)
        result = simulate(schedule, CostModel(activation_bytes=10))
        assert all(r.peak_activation_bytes <= r.peak_activation_bytes_no_swap
                   for r in result.ranks)


def test_v_placement_hands_over_locally_at_the_turn() -> None:
    schedule = build_schedule(ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=4))
    assert schedule.stage_ranks == (0, 1, 1, 0)
    rank1 = [s for s in schedule.orders[1] if s is not None]
    # stage 1 -> 2 and its gradient 2 -> 1 stay on rank 1: no P2P between them
    assert not any(s.type in (StepType.FWD_SEND, StepType.BWD_RECV) and s.stage == 1
                   for s in rank1)
    assert not any(s.type in (StepType.FWD_RECV, StepType.BWD_SEND) and s.stage == 2
                   for s in rank1)


def test_dualpipev_overlaps_a_forward_with_a_full_backward() -> None:
    schedule = build_schedule(ScheduleSpec(ScheduleKind.DUALPIPEV, ranks=2, microbatches=8,
                                           swap=True))
    overlaps = [s for s in schedule.orders[0] if s is not None
                and s.type is StepType.OVERLAP_F_B]
    assert overlaps
    assert all([sub.type for sub in s.sub_steps] == [StepType.FWD, StepType.BWD]
               for s in overlaps)


@pytest.mark.parametrize(("spec", "message"), [
    (dict(kind=ScheduleKind.DUALPIPEV, ranks=2, microbatches=3),
     "dualpipev needs at least as many microbatches as stages (4 for 2 ranks), got 3"),
    (dict(kind=ScheduleKind.INTERLEAVED_ZB, ranks=3, microbatches=10, stages_per_rank=2),
     "multiple of the number of rounds (3 = microbatches // ranks), got 10"),
    (dict(kind=ScheduleKind.ZBV, ranks=2, microbatches=4, stages_per_rank=3),
     "zbv runs exactly two stages per rank"),
    (dict(kind=ScheduleKind.INTERLEAVED_ZB, ranks=2, microbatches=4, stages_per_rank=2,
          dxdw_split=True), "interleaved-zb splits its backwards into I and W itself"),
])
def test_invalid_arguments_say_what_to_fix(spec: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_schedule(ScheduleSpec(**spec))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", FAMILY, ids=lambda k: k.value)
def test_the_command_line_builds_and_shows_them(kind: ScheduleKind,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from pipeswap.schedule.cli import main
    from pipeswap.schedule.formats import loads

    argv = ["--schedule", kind.value, "--ranks", "2", "--microbatches", "4",
            "--stages-per-rank", "2", "--swap"]
    assert main(["orders", *argv, "--format", "json"]) == 0
    printed = loads(capsys.readouterr().out)
    assert printed == build_schedule(ScheduleSpec(kind, ranks=2, microbatches=4,
                                                  stages_per_rank=2, swap=True))
    assert main(["show", *argv]) == 0
    shown = capsys.readouterr().out
    assert "rank 0" in shown and "swapped" in shown
