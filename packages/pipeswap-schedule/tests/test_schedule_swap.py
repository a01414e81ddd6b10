"""Swap injection: MindSpore hyper-parallel's exact placements, its asserted behaviours, and
the bugs of its pass that this one fixes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

import pytest

from pipeswap.schedule import (
    MinGapPolicy,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    Step,
    StepType,
    SwapCandidate,
    SwapPlacement,
    add_fsdp_steps,
    build_schedule,
    coalesce_p2p,
    gpipe,
    inject_swap,
    insert_send_recv,
    interleaved_1f1b_compute,
    one_f_one_b,
    parse_order,
    split_dxdw,
    swap_candidates,
    swapped_chunks,
    validate,
    validate_rank,
)
from pipeswap.schedule.build import rank_plan
from pipeswap.schedule.policies import Selection, SwapPolicy
from pipeswap.schedule.policies.defaults import default_policy
from pipeswap.schedule.steps import ACTIVATION_CONSUMERS, Order
from pipeswap.schedule.swap_order import inject_swap_order
from pipeswap.schedule.text import format_order, parse_step

GAP = MinGapPolicy()  # MindSpore hyper-parallel's rule: its worked examples
Load = Callable[[str], Schedule]


def _injected(order: Order, policy: SwapPolicy) -> list[Step | None]:
    """``order`` (rank 0's) with the swap steps ``policy`` chooses for it."""
    return inject_swap_order(order, rank_plan(0, policy.select(0, swap_candidates(order, 0),
                                                                order)))


def _strip_swap(schedule: Schedule) -> Schedule:
    swap = {StepType.SWAP_LAUNCH_OFFLOAD, StepType.SWAP_WAIT_OFFLOAD,
            StepType.SWAP_LAUNCH_LOAD, StepType.SWAP_WAIT_LOAD}
    return schedule.map_orders(lambda _r, o: [s for s in o if s is None or s.type not in swap])


@pytest.mark.parametrize(
    ("name", "build"),
    [
        ("1f1b_p4_m8_plain", lambda: one_f_one_b(4, 8)),
        ("1f1b_p4_m8_swap", lambda: inject_swap(one_f_one_b(4, 8), GAP)),
        ("gpipe_p2_m4_swap", lambda: inject_swap(gpipe(2, 4), GAP)),
        ("interleaved_p4_v2_m8_swap",
         lambda: inject_swap(insert_send_recv(interleaved_1f1b_compute(4, 8, 2)), GAP)),
        ("interleaved_p2_v2_m4_overlap_dxdw_swap",
         lambda: inject_swap(split_dxdw(insert_send_recv(
             interleaved_1f1b_compute(2, 4, 2, overlap_b_f=True))), GAP)),
        ("1f1b_p4_m8_fsdp_swap", lambda: inject_swap(add_fsdp_steps(one_f_one_b(4, 8)), GAP)),
    ],
)
def test_worked_examples_reproduce_exactly(
    worked: Load, name: str, build: Callable[[], Schedule]
) -> None:
    expected = worked(name)
    got = build()
    for rank, (want, have) in enumerate(zip(expected.orders, got.orders)):
        assert format_order(have) == format_order(want), f"rank {rank}"
    assert got == expected
    validate(got)


def test_build_schedule_runs_the_passes_in_hyper_parallels_order(worked: Load) -> None:
    spec = ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 2, 4, 2, overlap_b_f=True,
                        dxdw_split=True, swap=True)
    assert build_schedule(spec, GAP) == worked("interleaved_p2_v2_m4_overlap_dxdw_swap")
    fsdp = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 4, 8, fsdp=True, swap=True)
    assert build_schedule(fsdp, GAP) == worked("1f1b_p4_m8_fsdp_swap")


def test_injection_only_adds_swap_steps(worked: Load) -> None:
    for name in ("1f1b_p4_m8_swap", "interleaved_p4_v2_m8_swap", "1f1b_p4_m8_fsdp_swap"):
        swapped = worked(name)
        assert inject_swap(_strip_swap(swapped), GAP) == swapped


def test_1f1b_swaps_hyper_parallels_chunks() -> None:
    chunks = swapped_chunks(inject_swap(one_f_one_b(4, 8), GAP))
    assert [[m for _, m in c] for c in chunks] == [list(range(8)), list(range(1, 7)), [], []]


def test_interleaved_swaps_hyper_parallels_chunks() -> None:
    chunks = swapped_chunks(inject_swap(insert_send_recv(interleaved_1f1b_compute(4, 8, 2)), GAP))

    def keys(*groups: tuple[int, Sequence[int]]) -> list[tuple[int, int]]:
        return [(stage, m) for stage, micros in groups for m in micros]

    assert chunks[0] == tuple(keys((0, range(4)), (4, range(4)), (0, range(4, 8)), (4, range(4, 8))))
    assert chunks[1] == tuple(keys((1, range(4)), (5, range(4)), (1, range(4, 8)), (5, range(4, 8))))
    assert chunks[2] == tuple(keys((2, range(4)), (6, range(1, 4)), (2, range(4, 8)), (6, range(4, 7))))
    assert chunks[3] == tuple(keys((3, range(8))))


def _pos(order: Sequence[Step | None], text: str) -> int:
    return order.index(parse_step(text))


def test_gpipe_lifecycle_per_micro() -> None:
    order = inject_swap(gpipe(2, 4), GAP).orders[0]
    for m in range(4):
        f, lo, wo, ll, wl, b = (_pos(order, f"0{c}{m}") for c in ("F", "LO", "WO", "LL", "WL", "B"))
        assert f < lo < _pos(order, f"0SEND_F{m}")
        assert lo < wo < ll < wl
        assert _pos(order, f"0RECV_B{m}") < wl < b


def test_load_is_launched_one_compute_ahead_of_the_backward() -> None:
    order = inject_swap(one_f_one_b(4, 8), GAP).orders[0]
    assert _pos(order, "0WO0") < _pos(order, "0LL0") < _pos(order, "0F3")
    assert _pos(order, "0LL0") < _pos(order, "0SEND_F3")


def test_coalesced_batches_are_never_split() -> None:
    order = parse_order("0F0 0SEND_F0 0F1 0RECV_B0 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 0B0")
    # rank 1 posts the counterparts of 0RECV_B0 and 0SEND_F1 together: both ends are batched
    peer = parse_order("1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1RECV_F2 1F2 1RECV_F3 1F3")
    batched = coalesce_p2p(Schedule((order, peer), (0, 1)))
    done = inject_swap(batched, GAP).orders[0]
    assert format_order(done) == ("0F0 0LO0 0SEND_F0 0F1 (0RECV_B0;0SEND_F1)BATCH_P2P 0WO0 "
                                  "0F2 0SEND_F2 0LL0 0F3 0SEND_F3 0WL0 0B0")


def test_overlap_containers_are_one_slot_and_get_waits_around_them() -> None:
    schedule = inject_swap(split_dxdw(insert_send_recv(
        interleaved_1f1b_compute(4, 8, 2, overlap_b_f=True))), GAP)
    validate(schedule)
    order = schedule.orders[0]
    for step in order:
        if step is not None and step.type in (StepType.SWAP_LAUNCH_OFFLOAD,
                                              StepType.SWAP_WAIT_LOAD):
            assert step.stage is not None and step.micro is not None
    overlap = next(i for i, s in enumerate(order) if s is not None and any(
        leaf.key == (4, 0) and leaf.type in ACTIVATION_CONSUMERS for leaf in s.compute_leaves))
    assert Step(StepType.FWD, 0, 7) in order[overlap].sub_steps  # type: ignore[union-attr]
    assert _pos(order, "4LL0") < _pos(order, "4WL0") < overlap
    assert _pos(order, "4RECV_B0") < _pos(order, "4WL0")
    assert overlap < _pos(order, "0LO7") < _pos(order, "0WO7")


def test_hyper_parallel_single_stage_fsdp_case_verbatim() -> None:
    # MindSpore hyper-parallel's case of one FSDP stage whose parameters stay gathered
    # throughout, so every reload waits until right before its backward (plain orders launch
    # it one compute earlier).
    order = parse_order("0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 0RECV_B0 "
                        "0B0 0RECV_B1 0B1 0RECV_B2 0B2 0RECV_B3 0B3 0REDUCE_GRAD 0RESHARD")
    assert format_order(_injected(order, MinGapPolicy())) == (
        "0UNSHARD 0F0 0LO0 0SEND_F0 0F1 0LO1 0SEND_F1 0WO0 0F2 0LO2 0SEND_F2 0WO1 0F3 0LO3 "
        "0SEND_F3 0WO2 0RECV_B0 0LL0 0WL0 0B0 0RECV_B1 0WO3 0LL1 0WL1 0B1 0RECV_B2 0LL2 0WL2 0B2 "
        "0RECV_B3 0LL3 0WL3 0B3 0REDUCE_GRAD 0RESHARD")
    plain = parse_order(" ".join(str(s) for s in order[1:-2]))
    done = _injected(plain, MinGapPolicy())
    assert _pos(done, "0LL0") < _pos(done, "0F3")


def test_hyper_parallel_gathered_stage_reloads_adjacent_to_the_backward() -> None:
    done = _injected(parse_order("0UNSHARD 0F0 0F1 0F2 0F3 0B0 0RESHARD"), MinGapPolicy())
    assert format_order(done[_pos(done, "0LL0"):_pos(done, "0B0") + 1]) == "0LL0 0WL0 0B0"


def test_hyper_parallel_overlap_fragment_verbatim() -> None:
    # MindSpore hyper-parallel's rank-0 fragment for Interleaved P=4 V=2 M=8 with overlap_b_f:
    # the reload wait precedes the whole overlap, the overlap's forward offloads after it.
    order = format_order(inject_swap(insert_send_recv(
        interleaved_1f1b_compute(4, 8, 2, overlap_b_f=True)), GAP).orders[0])
    assert ("_ _ _ 4RECV_B0 4LL0 0F6 0LO6 0SEND_F6 0WO5 4LL1 4WL0 (4B0;0F7)OVERLAP_B_F 0LO7 "
            "4SEND_B0 4RECV_B1 0SEND_F7 4RECV_F4 0WO6 4LL2 4WL1 (4B1;4F4)OVERLAP_B_F 4LO4") in order


def test_fsdp_orders_reload_right_before_the_backward(worked: Load) -> None:
    order = worked("1f1b_p4_m8_fsdp_swap").orders[0]
    assert _pos(order, "0LO0") < order.index(Step(StepType.FSDP_RESHARD, 0))
    assert order.index(Step(StepType.FSDP_UNSHARD, 0)) < _pos(order, "0F0")
    assert _pos(order, "0WO0") < _pos(order, "0LL0")
    assert _pos(order, "0LL0") + 1 == _pos(order, "0WL0") == _pos(order, "0B0") - 1


def test_fsdp_reload_overlaps_the_backward_stages_gather() -> None:
    # Another stage's gather (1UNSHARD) before stage 0's backward leaves stage 0's reload
    # right before that backward. (A fragment, stage 1 never computes: placement only.)
    order = parse_order("0UNSHARD 0F0 0F1 0F2 0F3 1UNSHARD 0B0 0B1 0B2 0B3 0RESHARD")
    done = _injected(order, MinGapPolicy())
    assert format_order(done).startswith("0UNSHARD 0F0 0LO0 0F1 0LO1 0WO0")
    assert format_order(done[_pos(done, "0LL0"):_pos(done, "0B0") + 1]) == "0LL0 0WL0 0B0"

    gather_before = parse_order(
        "0UNSHARD 0F0 0F1 0F2 0F3 0RESHARD 0UNSHARD 0B0 0B1 0B2 0B3 0REDUCE_GRAD 0RESHARD")
    done = _injected(gather_before, MinGapPolicy())
    # every reload whose offload wait came before the re-gather launches ahead of it
    assert format_order(done[_pos(done, "0LL0"):_pos(done, "0B0") + 1]) == (
        "0LL0 0LL1 0LL2 0UNSHARD 0WL0 0B0")
    validate_rank(Schedule.from_orders([done]), 0)


def test_fsdp_with_dxdw_reloads_before_the_input_gradient() -> None:
    order = parse_order(
        "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 0RECV_B0 0I0 0W0 "
        "0RECV_B1 0I1 0W1 0RECV_B2 0I2 0W2 0RECV_B3 0I3 0W3 0REDUCE_GRAD 0RESHARD")
    done = _injected(order, MinGapPolicy())
    lifecycle = [str(s) for s in done if s is not None and s.micro == 0 and s.stage == 0
                 and s.type not in (StepType.FWD_SEND, StepType.BWD_RECV)]
    assert lifecycle == ["0F0", "0LO0", "0WO0", "0LL0", "0WL0", "0I0", "0W0"]
    for i, step in enumerate(done):
        if step is not None and step.type is StepType.SWAP_LAUNCH_LOAD:
            nxt = next(s for s in done[i:] if s is not None and s.compute_leaves)
            assert nxt.type is StepType.BWD_INPUT


def test_zero_width_steps_are_transparent_to_the_offload_wait() -> None:
    # A bug of MindSpore hyper-parallel's pass (its DATA_* tokens): a local control step
    # between F1 and F1's send made the offload wait of micro 0 run before that send was
    # issued.
    order = parse_order("0F0 0SEND_F0 0F1 0REDUCE_GRAD 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 "
                        "0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2 0RECV_B3 0B3")
    done = _injected(order, MinGapPolicy())
    assert _pos(done, "0SEND_F1") + 1 == _pos(done, "0WO0")


def test_reload_never_precedes_the_offload_wait() -> None:
    # A bug of MindSpore hyper-parallel's pass: the search for the backward stage's UNSHARD
    # was bounded by the forward, so an UNSHARD before the first compute in between put LL
    # before WO.
    order = parse_order(
        "0UNSHARD 0F0 0RESHARD 0UNSHARD 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0REDUCE_GRAD 0RESHARD")
    done = _injected(order, MinGapPolicy())
    assert _pos(done, "0WO0") < _pos(done, "0LL0") < _pos(done, "0WL0")
    validate_rank(Schedule.from_orders([done]), 0)


def test_policy_decides_which_chunks_swap() -> None:
    base = one_f_one_b(4, 8)
    default = swapped_chunks(inject_swap(base, GAP))
    looser = swapped_chunks(inject_swap(base, MinGapPolicy(3)))
    assert [len(c) for c in default] == [8, 6, 0, 0]
    assert [len(c) for c in looser] == [8, 8, 6, 0]  # rank 2's steady gap is 3
    validate(inject_swap(base, MinGapPolicy(3)))

    class Nothing:
        def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
                   ) -> Collection[tuple[int, int]]:
            return ()

    assert inject_swap(base, Nothing()) == base


@pytest.mark.parametrize("spec", [
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=4, stages_per_rank=2,
                 overlap_b_f=True, dxdw_split=True, fsdp=True, batch_p2p=True),
    ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=4),
])
def test_a_rank_may_plan_only_its_own_swap(spec: ScheduleSpec) -> None:
    """What a rank that runs alone builds: its own order as planning every rank gives it,
    every other order as built without swap, and valid as it stands."""
    everyone = build_schedule(dataclasses.replace(spec, swap=True))
    plain = build_schedule(spec)
    asked: list[int] = []

    class Recording:
        def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
                   ) -> Selection:
            asked.append(rank)
            return default_policy().select(rank, candidates, order)

    for rank in range(spec.ranks):
        asked.clear()
        alone = build_schedule(dataclasses.replace(spec, swap=True), Recording(),
                               swap_ranks={rank})
        assert asked == [rank]  # the other ranks were not planned
        assert alone.orders[rank] == everyone.orders[rank]
        assert all(alone.orders[r] == plain.orders[r] for r in range(spec.ranks) if r != rank)
        validate(alone, transport="nccl" if spec.batch_p2p else "ordered")
    assert any(swapped_chunks(everyone))  # so the orders compared hold swap steps
    assert inject_swap(plain, ranks=()) == plain


def test_candidates_report_slots_and_gaps() -> None:
    candidates = swap_candidates(one_f_one_b(4, 8).orders[1], rank=1)
    assert [(c.micro, c.forward_slot, c.backward_slot, c.gap) for c in candidates][:3] == [
        (0, 0, 3, 3), (1, 1, 5, 4), (2, 2, 7, 5)]
    assert all(c.rank == 1 and c.stage == 1 for c in candidates)


def test_policies_that_ask_for_the_impossible_are_refused() -> None:
    with pytest.raises(ScheduleError, match="min_gap must be an integer >= 3"):
        MinGapPolicy(2)

    class Greedy:
        def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
                   ) -> Collection[tuple[int, int]]:
            return {c.key for c in candidates}

    with pytest.raises(ScheduleError, match=r"chunk \(2, 0\) on rank 2 with 1 slot\(s\) to "
                                            r"offload and 1 to reload, but its backward is 2 "):
        inject_swap(one_f_one_b(4, 8), Greedy())

    class Wide:
        def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
                   ) -> Mapping[tuple[int, int], SwapPlacement]:
            return {c.key: SwapPlacement(2, 2) for c in candidates if c.gap >= 4}

    with pytest.raises(ScheduleError, match=r"with 2 slot\(s\) to offload and 2 to reload, "
                                            r"but its backward is 4 compute slot"):
        inject_swap(one_f_one_b(4, 8), Wide())

    class Stranger:
        def __init__(self, chunk: tuple[int, int]) -> None:
            self.chunk = chunk

        def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
                   ) -> Collection[tuple[int, int]]:
            return {self.chunk}

    with pytest.raises(ScheduleError, match=r"\(9, 9\).*not candidates"):
        inject_swap(one_f_one_b(2, 4), Stranger((9, 9)))
    forward_only = parse_order("0F0 0F1 0F2 0F3 0F4")  # forwarded, never backwarded here
    with pytest.raises(ScheduleError, match=r"\(0, 0\).*not candidates"):
        _injected(forward_only, Stranger((0, 0)))


def test_injecting_twice_is_refused() -> None:
    with pytest.raises(ScheduleError, match="already has swap steps"):
        inject_swap(inject_swap(one_f_one_b(4, 8)), GAP)


def test_a_placement_moves_the_offload_wait_and_the_load_launch() -> None:
    """Two slots to offload put WO after the second compute that follows the forward; two
    to reload put LL before the second compute ahead of the backward."""
    order = parse_order("0F0 0F1 0F2 0F3 0B0 0F4 0B1 0B2 0B3 0B4")

    class Placed:
        def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
                   ) -> Mapping[tuple[int, int], SwapPlacement]:
            return {(0, 0): SwapPlacement(offload_slots=2, load_slots=1),
                    (0, 1): SwapPlacement(offload_slots=1, load_slots=2)}

    placed = format_order(_injected(order, Placed()))
    assert placed == ("0F0 0LO0 0F1 0LO1 0F2 0WO0 0WO1 0LL0 0F3 0LL1 0WL0 0B0 0F4 0WL1 0B1 "
                      "0B2 0B3 0B4")
    validate_rank(Schedule((tuple(parse_order(placed)),), (0,)), 0)
