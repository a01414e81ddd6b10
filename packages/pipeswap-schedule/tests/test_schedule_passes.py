"""P2P batching, the dx/dw split, FSDP placement, and send/recv insertion."""

from __future__ import annotations

import itertools

import pytest

from pipeswap.schedule import (
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    StepType,
    add_fsdp_steps,
    build_schedule,
    coalesce_p2p,
    inject_swap,
    insert_send_recv,
    interleaved_1f1b_compute,
    one_f_one_b,
    parse_order,
    split_dxdw,
    validate,
)
from pipeswap.schedule.steps import COMM, FSDP, Step
from pipeswap.schedule.text import format_order


def _rank0(text: str) -> Schedule:
    """Rank 0's order of a two-stage pipeline whose rank 1 is left empty."""
    return Schedule((parse_order(text), ()), (0, 1))


def _flat_p2p(order: tuple[Step | None, ...]) -> list[Step]:
    return [leaf for s in order if s is not None for leaf in s.p2p_leaves]


def test_coalesce_batches_runs_of_two_or_more_alike_on_both_ends() -> None:
    after = coalesce_p2p(one_f_one_b(2, 4))
    assert [format_order(order) for order in after.orders] == [
        "0F0 0SEND_F0 0F1 (0RECV_B0;0SEND_F1)BATCH_P2P 0B0 0F2 (0RECV_B1;0SEND_F2)BATCH_P2P 0B1 "
        "0F3 (0RECV_B2;0SEND_F3)BATCH_P2P 0B2 0RECV_B3 0B3",
        "1RECV_F0 1F0 1B0 (1SEND_B0;1RECV_F1)BATCH_P2P 1F1 1B1 (1SEND_B1;1RECV_F2)BATCH_P2P 1F2 "
        "1B2 (1SEND_B2;1RECV_F3)BATCH_P2P 1F3 1B3 1SEND_B3"]
    validate(after, transport="nccl")


def test_coalesce_leaves_a_leaf_alone_when_its_counterpart_is_and_splits_its_run() -> None:
    # Rank 1 receives micro 2 alone, so rank 0 sends it alone too, which splits rank 0's run
    # of five sends into a batch, a lone send and a batch.
    before = Schedule.from_orders([
        parse_order("0F0 0F1 0F2 0F3 0F4 0SEND_F0 0SEND_F1 0SEND_F2 0SEND_F3 0SEND_F4 "
                    "0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2 0RECV_B3 0B3 0RECV_B4 0B4"),
        parse_order("1RECV_F0 1RECV_F1 1F0 1RECV_F2 1F1 1RECV_F3 1RECV_F4 1F2 1F3 1F4 "
                    "1B0 1SEND_B0 1B1 1SEND_B1 1B2 1SEND_B2 1B3 1SEND_B3 1B4 1SEND_B4")])
    after = coalesce_p2p(before)
    assert format_order(after.orders[0]).startswith(
        "0F0 0F1 0F2 0F3 0F4 (0SEND_F0;0SEND_F1)BATCH_P2P 0SEND_F2 "
        "(0SEND_F3;0SEND_F4)BATCH_P2P 0RECV_B0 0B0")
    assert format_order(after.orders[1]).startswith(
        "(1RECV_F0;1RECV_F1)BATCH_P2P 1F0 1RECV_F2 1F1 (1RECV_F3;1RECV_F4)BATCH_P2P 1F2")
    validate(after, transport="nccl")


def test_coalesce_never_changes_the_p2p_sequence() -> None:
    schedule = insert_send_recv(interleaved_1f1b_compute(4, 8, 2, overlap_b_f=True))
    batched = coalesce_p2p(schedule)
    assert any(s is not None and s.type is StepType.BATCH_SEND_RECV
               for order in batched.orders for s in order)
    for plain, packed in zip(schedule.orders, batched.orders):
        assert _flat_p2p(plain) == _flat_p2p(packed)
        assert [s for s in plain if s is None or s.type not in COMM] == [
            s for s in packed if s is None or s.type not in COMM]


def test_dxdw_split_follows_hyper_parallel() -> None:
    schedule = insert_send_recv(interleaved_1f1b_compute(4, 8, 2, overlap_b_f=True))
    split = split_dxdw(schedule)
    for rank, (plain, done) in enumerate(zip(schedule.orders, split.orders)):
        assert _flat_p2p(plain) == _flat_p2p(done)  # P2P order untouched
        inputs = [leaf for s in done if s is not None for leaf in s.compute_leaves
                  if leaf.type is StepType.BWD_INPUT]
        weights = [s for s in done if s is not None and s.type is StepType.BWD_WEIGHT]
        assert [s.key for s in inputs] == [s.key for s in weights]  # one W per I, same order
        for step in done:
            if step is not None and step.type is StepType.OVERLAP_B_F:
                bwd = step.sub_steps[0]
                # stage 0 keeps whole backwards: it has no input gradient to send
                assert (bwd.type is StepType.BWD) == (bwd.stage == 0)
        for w in weights:
            index = done.index(w)
            container = max(i for i in range(index) if done[i] is not None and any(
                leaf.type is StepType.BWD_INPUT and leaf.key == w.key
                for leaf in done[i].compute_leaves))  # type: ignore[union-attr]
            between = done[container + 1:index]
            # W follows the gradient P2P right after its overlap (its own SEND_B included)
            assert all(s is not None and s.type in (StepType.BWD_SEND, StepType.BWD_RECV)
                       for s in between)
            own_send = Step(StepType.BWD_SEND, *w.key)
            if own_send in done:
                assert done.index(own_send) < index


def test_fsdp_single_stage_matches_hyper_parallel() -> None:
    order = ("0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 "
             "0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2 0RECV_B3 0B3")
    done = add_fsdp_steps(_rank0(order), managed_stages=[0])
    assert format_order(done.orders[0]) == f"0UNSHARD {order} 0REDUCE_GRAD 0RESHARD"


def test_fsdp_window_keeps_at_most_three_stages_gathered_and_each_compute_gathered() -> None:
    schedule = insert_send_recv(interleaved_1f1b_compute(2, 8, 4))  # 4 stages per rank
    done = add_fsdp_steps(schedule)
    for order in done.orders:
        gathered: list[int] = []
        reduced: set[int] = set()
        for step in order:
            if step is None:
                continue
            if step.type is StepType.FSDP_UNSHARD:
                assert step.stage not in gathered
                gathered.append(step.stage)  # type: ignore[arg-type]
                assert len(gathered) <= 3
            elif step.type is StepType.FSDP_RESHARD:
                gathered.remove(step.stage)  # type: ignore[arg-type]
            elif step.type is StepType.FSDP_REDUCE_GRAD:
                reduced.add(step.stage)  # type: ignore[arg-type]
            for leaf in step.compute_leaves:
                assert leaf.stage in gathered and leaf.stage not in reduced
        assert gathered == []
        assert len(reduced) == 4


def test_fsdp_leaves_unmanaged_stages_alone() -> None:
    schedule = insert_send_recv(interleaved_1f1b_compute(2, 4, 2))  # stages 0, 2 | 1, 3
    done = add_fsdp_steps(schedule, managed_stages=[0, 3])
    fsdp = [[s for s in order if s is not None and s.type in FSDP] for order in done.orders]
    assert {s.stage for s in fsdp[0]} == {0} and {s.stage for s in fsdp[1]} == {3}
    for order, steps in zip(done.orders, fsdp):
        assert [s.type for s in steps].count(StepType.FSDP_REDUCE_GRAD) == 1
        rest = [s for s in order if s is None or s.type not in FSDP]
        assert rest == list(schedule.orders[done.orders.index(order)])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: add_fsdp_steps(s, window=0), "window must be an integer >= 1"),
        (lambda s: add_fsdp_steps(s, managed_stages=[7]), r"stage\(s\) \[7\]"),
        (lambda s: add_fsdp_steps(add_fsdp_steps(s)), "already has FSDP steps"),
        (lambda s: insert_send_recv(s), "compute-only orders"),
    ],
)
def test_pass_misuse_is_refused(call: object, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        call(one_f_one_b(2, 4))  # type: ignore[operator]


def test_send_recv_insertion_pairs_even_and_odd_ranks() -> None:
    schedule = insert_send_recv(interleaved_1f1b_compute(2, 2, 1))
    # Rank 0 sends right after its forward; rank 1's receive lands before its own forward.
    assert format_order(schedule.orders[0][:4]) == "0F0 0SEND_F0 0F1 0SEND_F1"
    assert format_order(schedule.orders[1][:3]) == "_ 1RECV_F0 1F0"


def test_dxdw_split_refuses_batched_p2p() -> None:
    schedule = coalesce_p2p(insert_send_recv(interleaved_1f1b_compute(2, 4, 2, overlap_b_f=True)))
    with pytest.raises(ScheduleError, match="split_dxdw runs before P2P batching"):
        split_dxdw(schedule)


def test_fsdp_with_a_window_of_one_gathers_both_stages_of_an_overlap() -> None:
    # (1B0;0F1)OVERLAP_B_F computes two stages at once: both must be gathered, window or not.
    schedule = add_fsdp_steps(insert_send_recv(interleaved_1f1b_compute(1, 2, 2,
                                                                        overlap_b_f=True)),
                              window=1)
    gathered: set[int] = set()
    for step in schedule.orders[0]:
        if step is None:
            continue
        if step.type is StepType.FSDP_UNSHARD:
            gathered.add(step.stage)  # type: ignore[arg-type]
        elif step.type is StepType.FSDP_RESHARD:
            gathered.discard(step.stage)
        if step.compute_leaves:
            assert {leaf.stage for leaf in step.compute_leaves} <= gathered, step
            assert len(gathered) <= 2  # the window, widened only as far as an overlap needs
    validate(schedule)


@pytest.mark.parametrize("kind", list(ScheduleKind), ids=lambda k: k.value)
def test_fsdp_on_every_generator_window_and_managed_set_validates(kind: ScheduleKind) -> None:
    for ranks, micros, window in itertools.product((1, 2, 3), (2, 4, 6), (1, 2, 3)):
        try:
            base = build_schedule(ScheduleSpec(kind, ranks, micros, 2))
        except ScheduleError:  # e.g. dualpipev with fewer microbatches than stages
            continue
        for managed in (None, [0], range(0, base.num_stages, 2)):
            fsdp = add_fsdp_steps(base, managed, window=window)
            for schedule in (fsdp, inject_swap(coalesce_p2p(fsdp))):
                validate(schedule, microbatches=micros)
