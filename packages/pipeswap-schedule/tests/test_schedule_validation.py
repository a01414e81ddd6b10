"""Validation: per-rank rules and the cross-rank P2P simulation, with the errors users see."""

from __future__ import annotations

import re

import pytest

from pipeswap.schedule import (
    ChunkOrderError,
    DeadlockError,
    FSDPOrderError,
    P2PError,
    Schedule,
    SwapLifecycleError,
    ValidationError,
    one_f_one_b,
    parse_order,
    validate_rank,
    simulate_p2p,
    validate,
)
from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.formats import loads
from pipeswap.schedule.simulate import simulate

TWO_RANKS = "rank 0: 0F0 0SEND_F0 0RECV_B0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0"


def test_a_minimal_pipeline_is_valid() -> None:
    validate(loads(TWO_RANKS))


@pytest.mark.parametrize(
    ("rank0", "error", "message"),
    [
        ("0F0 0SEND_F0 0RECV_B0", ChunkOrderError, "never backwarded: add 0B0"),
        ("0RECV_B0 0B0 0F0 0SEND_F0", ChunkOrderError, "must come after forward"),
        ("0F0 0SEND_F0 0F0 0RECV_B0 0B0", ChunkOrderError, "0F0 appears twice"),
        ("0F0 0SEND_F0 0RECV_B0 0I0", ChunkOrderError, "never dw: add 0W0"),
        ("0F0 0SEND_F0 0RECV_B0 0W0 0I0", ChunkOrderError, "dw 0W0 (position 3) must come after dx"),
        ("0F0 0SEND_F0 0RECV_B0 0B0 0W0", ChunkOrderError, "full backward B and a split one"),
        ("0F0 0SEND_F0 0RECV_B0 0B0 1F1", ChunkOrderError, "names stage 1, which runs on rank 1"),
        ("0F0 0SEND_F0 0RECV_B0 0B0 0SEND_B0", P2PError, "talks to stage -1, which does not exist"),
        ("0SEND_F0 0F0 0RECV_B0 0B0", P2PError,
         "0SEND_F0 (position 0) must come after the forward 0F0 (position 1)"),
        ("0F0 0B0 0SEND_F0 0RECV_B0", P2PError, "0RECV_B0 (position 3) must come before the backward"),
        ("0F0 0RECV_B0 0B0", P2PError, "needs 0SEND_F0 after it"),
        ("0F0 0SEND_F0 0LO0 0WO0 0LL0 0RECV_B0 0B0", SwapLifecycleError, "lacks 0WL0"),
        ("0F0 0SEND_F0 0LO0 0LL0 0WO0 0WL0 0RECV_B0 0B0", SwapLifecycleError,
         "0LL0 (position 3) comes before 0WO0 (position 4)"),
        ("0LO0 0F0 0SEND_F0 0WO0 0LL0 0WL0 0RECV_B0 0B0", SwapLifecycleError,
         "0F0 < 0LO0 < 0WO0 < 0LL0 < 0WL0 < its backward"),
        ("0F0 0SEND_F0 0LO0 0WO0 0LL0 0RECV_B0 0B0 0WL0", SwapLifecycleError,
         "0B0 (position 6) comes before 0WL0"),
    ],
)
def test_per_rank_problems_are_named(rank0: str, error: type[ValidationError], message: str) -> None:
    schedule = Schedule((parse_order(rank0), parse_order("1RECV_F0 1F0 1B0 1SEND_B0")), (0, 1))
    with pytest.raises(error) as info:
        validate(schedule)
    assert message in str(info.value)
    assert info.value.rank == 0
    assert "rank 0" in str(info.value)


def test_empty_schedules_and_unknown_ranks_are_refused() -> None:
    with pytest.raises(ValidationError, match="no steps"):
        validate(loads("rank 0: _ _\nrank 1:"))
    with pytest.raises(ValidationError, match="rank 5 is not in this 2-rank schedule"):
        validate_rank(loads(TWO_RANKS), 5)


def test_sends_and_receives_must_pair_in_order() -> None:
    schedule = loads(
        "rank 0: 0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1\n"
        "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1")
    with pytest.raises(P2PError) as info:
        validate(schedule)
    assert str(info.value).startswith(
        "rank 0's 1st send to rank 1 is 0SEND_F1 (the activation of stage 0 micro 1) but rank 1's "
        "1st receive from rank 0 is 1RECV_F0 (expecting the activation of stage 0 micro 0)")


def test_a_two_rank_deadlock_reports_its_cycle() -> None:
    # Both ranks receive before they send.
    schedule = loads(
        "rank 0: 0F0 0RECV_B0 0SEND_F0 0B0\n"
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    simulate_p2p(loads(TWO_RANKS))
    with pytest.raises(DeadlockError) as info:
        simulate_p2p(schedule)
    assert info.value.cycle == ((0, "0RECV_B0", 1), (1, "1RECV_F0", 0))
    assert "deadlock: rank 0 waits at 0RECV_B0 for rank 1; rank 1 waits at 1RECV_F0 for rank 0" \
        in str(info.value)


def test_a_three_rank_deadlock_reports_every_rank_in_it() -> None:
    # Stages 0..3 on ranks 0, 1, 2, 0: every rank receives before it sends, around the ring.
    orders = ("3RECV_F0 0F0 0SEND_F0 3F0", "1RECV_F0 1F0 1SEND_F0", "2RECV_F0 2F0 2SEND_F0")
    schedule = Schedule(tuple(parse_order(o) for o in orders), (0, 1, 2, 0))
    with pytest.raises(DeadlockError) as info:
        simulate_p2p(schedule)
    assert info.value.cycle == ((0, "3RECV_F0", 2), (2, "2RECV_F0", 1), (1, "1RECV_F0", 0))
    rotated = ("0F0 0SEND_F0 3RECV_F0 3F0", "1RECV_F0 1F0 1SEND_F0", "2RECV_F0 2F0 2SEND_F0")
    simulate_p2p(Schedule(tuple(parse_order(o) for o in rotated), (0, 1, 2, 0)))


def test_a_send_nobody_receives_is_reported_as_such() -> None:
    schedule = loads(
        "rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1\n"
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    with pytest.raises(P2PError, match="rank 0 waits at 0SEND_F1 for rank 1, whose order ends "
                                        "without the matching receive of 0SEND_F1"):
        simulate_p2p(schedule)


def test_batched_p2p_with_both_directions_pairs_up() -> None:
    schedule = loads(
        "rank 0: 0F0 0F1 0SEND_F0 (0SEND_F1;0RECV_B0)BATCH_P2P 0B0 0RECV_B1 0B1\n"
        "rank 1: 1RECV_F0 1F0 (1RECV_F1;1SEND_B0)BATCH_P2P 1B0 1F1 1B1 1SEND_B1")
    with pytest.raises(P2PError, match=r"\(1RECV_F1;1SEND_B0\)BATCH_P2P \(position 2\) must "
                                        r"come after the backward 1B0"):
        validate(schedule)
    fixed = loads(
        "rank 0: 0F0 0SEND_F0 0F1 (0SEND_F1;0RECV_B0)BATCH_P2P 0B0 0RECV_B1 0B1\n"
        "rank 1: 1RECV_F0 1F0 1B0 (1RECV_F1;1SEND_B0)BATCH_P2P 1F1 1B1 1SEND_B1")
    validate(fixed)


def test_simulation_alone_refuses_p2p_that_has_no_peer() -> None:
    schedule = Schedule((parse_order("0F0 0SEND_B0 0B0"), parse_order("1F0 1B0")), (0, 1))
    with pytest.raises(P2PError, match="0SEND_B0 talks to stage -1, which does not exist"):
        simulate_p2p(schedule)


def _one_rank(text: str) -> Schedule:
    return Schedule.from_orders([parse_order(text)])


def test_a_skipped_microbatch_is_named_with_what_to_add() -> None:
    with pytest.raises(ChunkOrderError) as info:
        validate(_one_rank("0F0 0B0 0F1 0B1 0F3 0B3"))
    assert str(info.value) == (
        "the schedule runs micro 0..3 but never computes chunk(s) (stage 0, micro 2); every "
        "stage forwards and backwards each microbatch once: add 0F2 and 0B2 (or 0I2 then 0W2) "
        "to rank 0's order")
    assert info.value.rank == 0


def test_a_stage_missing_a_microbatch_on_another_rank_is_named() -> None:
    schedule = loads(
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    with pytest.raises(ChunkOrderError, match=r"never computes chunk\(s\) \(stage 1, micro 1\);"
                                              r".* to rank 1's order") as info:
        validate(schedule)
    assert info.value.rank == 1


def test_many_missing_chunks_are_counted_not_listed() -> None:
    with pytest.raises(ChunkOrderError, match=r"\(stage 0, micro 1\), \(stage 0, micro 2\), "
                                              r"\(stage 0, micro 3\), \(stage 0, micro 4\), "
                                              r"\(stage 0, micro 5\) and 999993 more;"):
        validate(_one_rank("0F0 0B0 0F999999 0B999999"))


def test_a_stated_microbatch_count_must_match() -> None:
    schedule = one_f_one_b(2, 4)
    validate(schedule, microbatches=4)
    assert schedule.num_microbatches == 4
    with pytest.raises(ChunkOrderError, match=re.escape(
            "the schedule runs 4 microbatches (micro 0..3), not the 8 expected: add the steps "
            "of micro 4..7 to every stage, or give 4 as the microbatch count")):
        validate(schedule, microbatches=8)
    with pytest.raises(ChunkOrderError, match=re.escape(
            "not the 3 expected: drop the steps of micro 3 and above, or give 4")):
        validate(schedule, microbatches=3)
    for bad in (0, True, 2.0):
        with pytest.raises(ValidationError, match="microbatches must be an integer >= 1"):
            validate(schedule, microbatches=bad)  # type: ignore[arg-type]


def test_the_microbatch_count_reads_inside_composites() -> None:
    assert _one_rank("0F0 (0B0;0F1)OVERLAP_B_F 0B1").num_microbatches == 2
    assert _one_rank("0UNSHARD 0REDUCE_GRAD 0RESHARD").num_microbatches == 0
    with pytest.raises(ChunkOrderError, match="the schedule computes nothing"):
        validate(_one_rank("0UNSHARD 0REDUCE_GRAD 0RESHARD"))


@pytest.mark.parametrize(("order", "message"), [
    ("1F0 0F0 0B0 1B0", "rank 0: 1F0 (position 0) takes stage 0's output, which this rank "
                        "makes only later, at 0F0 (position 1); run 0F0 before it"),
    ("0F0 1F0 0B0 1B0", "rank 0: 0B0 (position 2) takes stage 1's input gradient, which this "
                        "rank makes only later, at 1B0 (position 3); run 1B0 (or 1I0) before it"),
    ("0F0 0F1 1F1 1B1 0B1 0B0 1F0 1B0", "0B0 (position 5) takes stage 1's input gradient, which "
                                        "this rank makes only later, at 1B0 (position 7)"),
])
def test_neighbouring_stages_on_one_rank_hand_over_in_order(order: str, message: str) -> None:
    # Nothing is sent between stages on the same rank, so the order itself must carry the data.
    with pytest.raises(ChunkOrderError) as info:
        validate(_one_rank(order))
    assert message in str(info.value)


def test_in_order_hand_overs_validate_and_simulate() -> None:
    schedule = _one_rank("0F0 1F0 0F1 1F1 1B0 0B0 1I1 0B1 1W1")
    validate(schedule)
    assert simulate(schedule, CostModel()).step_time == 4 * 1.0 + 4 * 2.0


@pytest.mark.parametrize(("order", "message"), [
    ("0F0 0UNSHARD 0B0 0REDUCE_GRAD 0RESHARD",
     "rank 0: 0F0 (position 0) computes stage 0 while its parameters are not gathered; stage 0 "
     "has FSDP steps, so put 0UNSHARD before this compute (and 0RESHARD after it)"),
    ("0F0 0UNSHARD 0B0", "0F0 (position 0) computes stage 0 while its parameters are not"),
    ("0UNSHARD 0F0 0RESHARD 0B0 0UNSHARD 0REDUCE_GRAD 0RESHARD",
     "0B0 (position 3) computes stage 0 while its parameters are not gathered"),
    ("0UNSHARD 0F0 0RESHARD (0B0;0F1)OVERLAP_B_F 0UNSHARD 0B1 0REDUCE_GRAD 0RESHARD",
     "(0B0;0F1)OVERLAP_B_F (position 3) computes stage 0 while its parameters are not"),
    ("0UNSHARD 0UNSHARD 0F0 0B0 0REDUCE_GRAD 0RESHARD 0RESHARD",
     "rank 0: 0UNSHARD (position 1) gathers stage 0, which 0UNSHARD (position 0) gathered "
     "already; free it with 0RESHARD in between, or drop one of them"),
    ("0RESHARD 0UNSHARD 0F0 0B0 0REDUCE_GRAD 0RESHARD",
     "rank 0: 0RESHARD (position 0) frees stage 0, which is not gathered there; put 0UNSHARD "
     "before it"),
    ("0UNSHARD 0F0 0B0 0REDUCE_GRAD",
     "rank 0: stage 0 stays gathered: 0UNSHARD (position 0) has no 0RESHARD after it; add one "
     "after the stage's last compute"),
    ("0UNSHARD 0F0 0B0 0RESHARD",
     "rank 0: stage 0 has FSDP steps but no 0REDUCE_GRAD; add one after its last gradient "
     "computation 0B0 (position 2)"),
    ("0UNSHARD 0F0 0B0 0REDUCE_GRAD 0REDUCE_GRAD 0RESHARD",
     "rank 0: 0REDUCE_GRAD appears twice (positions 3 and 4); reduce a stage's gradients once, "
     "after its last B or W"),
    ("0UNSHARD 0F0 0F1 0B0 0REDUCE_GRAD 0B1 0RESHARD",
     "rank 0: 0REDUCE_GRAD (position 4) reduces stage 0's gradients too early: move it after "
     "its last gradient computation 0B1 (position 5)"),
    ("0UNSHARD 0F0 0I0 0REDUCE_GRAD 0W0 0RESHARD", "0REDUCE_GRAD (position 3) reduces stage 0's "
                                                 "gradients too early"),
])
def test_fsdp_steps_out_of_order_are_named(order: str, message: str) -> None:
    with pytest.raises(FSDPOrderError) as info:
        validate(_one_rank(order))
    assert message in str(info.value)
    assert info.value.rank == 0


def test_fsdp_may_gather_a_stage_again_and_leave_others_alone() -> None:
    # Stage 1 has no FSDP steps: it is not managed, so its computes need no gather.
    validate(_one_rank("0UNSHARD 0F0 0RESHARD 1F0 1B0 0UNSHARD 0B0 0REDUCE_GRAD 0RESHARD"))
