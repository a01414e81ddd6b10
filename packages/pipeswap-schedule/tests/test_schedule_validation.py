"""Validation: per-rank rules and the cross-rank P2P simulation, with the errors users see."""

from __future__ import annotations

import pytest

from pipeswap.schedule import (
    ChunkOrderError,
    DeadlockError,
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
from pipeswap.schedule.formats import loads

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
