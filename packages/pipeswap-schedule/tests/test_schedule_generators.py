"""Generators: MindSpore hyper-parallel's exact orders, closed forms, argument errors, and
validity everywhere."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import pytest

from pipeswap.schedule import (
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    StageMapping,
    Lowering,
    StepType,
    TransportModel,
    build_schedule,
    gpipe,
    interleaved_1f1b_compute,
    one_f_one_b,
    stage_to_rank,
    validate,
)

# MindSpore hyper-parallel's Interleaved 1F1B compute orders for P=4, V=2, M=8 (its tests
# assert them exactly).
# "F0.0-3" abbreviates F0.0 F0.1 F0.2 F0.3; idle slots and P2P are not part of this listing.
HYPER_PARALLEL_INTERLEAVED_P4_V2_M8 = [
    "F0.0-3 F4.0-3 F0.4 F0.5 F0.6 B4.0 F0.7 B4.1 F4.4 B4.2 F4.5 B4.3 F4.6 B0.0 F4.7 B0.1 B0.2 B0.3"
    " B4.4-7 B0.4-7",
    "F1.0-3 F5.0-3 F1.4 B5.0 F1.5 B5.1 F1.6 B5.2 F1.7 B5.3 F5.4 B1.0 F5.5 B1.1 F5.6 B1.2 F5.7 B1.3"
    " B5.4-7 B1.4-7",
    "F2.0-3 F6.0 F6.1 F6.2 B6.0 F6.3 B6.1 F2.4 B6.2 F2.5 B6.3 F2.6 B2.0 F2.7 B2.1 F6.4 B2.2 F6.5 B2.3"
    " F6.6 B6.4 F6.7 B6.5 B6.6 B6.7 B2.4-7",
    "F3.0-3 F7.0 B7.0 F7.1 B7.1 F7.2 B7.2 F7.3 B7.3 F3.4 B3.0 F3.5 B3.1 F3.6 B3.2 F3.7 B3.3 F7.4 B7.4"
    " F7.5 B7.5 F7.6 B7.6 F7.7 B7.7 B3.4-7",
]


def _expand(listing: str) -> list[str]:
    out = []
    for token in listing.split():
        kind, stage, first, last = re.fullmatch(r"([FB])(\d+)\.(\d+)(?:-(\d+))?", token).groups()  # type: ignore[union-attr]
        for micro in range(int(first), int(last or first) + 1):
            out.append(f"{stage}{kind}{micro}")
    return out


def _compute(schedule: Schedule, rank: int) -> list[str]:
    return [str(s) for s in schedule.orders[rank] if s is not None and s.type in
            (StepType.FWD, StepType.BWD)]


def test_interleaved_compute_orders_match_hyper_parallel() -> None:
    schedule = interleaved_1f1b_compute(4, 8, 2)
    for rank, listing in enumerate(HYPER_PARALLEL_INTERLEAVED_P4_V2_M8):
        assert _compute(schedule, rank) == _expand(listing)
    # Rank r starts after r idle slots; rank 0 waits 3 slots before its first backward.
    assert [schedule.orders[r][:r] for r in range(4)] == [(), (None,), (None,) * 2, (None,) * 3]
    assert schedule.orders[0][10:13] == (None, None, None)


def test_interleaved_with_one_stage_per_rank_warms_up_deeper_than_1f1b() -> None:
    # MindSpore hyper-parallel keeps this difference: its classic interleaved warm-up is
    # 2(P-1-r) deep.
    deep = interleaved_1f1b_compute(4, 8, 1)
    shallow = interleaved_1f1b_compute(4, 8, 1, less_memory=True)

    def warmup(schedule: Schedule) -> int:
        kinds = [s.type for s in schedule.orders[0] if s is not None]
        return kinds.index(StepType.BWD)

    assert warmup(deep) == 2 * 3 + 1
    assert warmup(shallow) == 3 + 1
    assert _compute(shallow, 0) != _compute(deep, 0)


@pytest.mark.parametrize(("ranks", "micros"), [(4, 8), (4, 2), (3, 7), (5, 5), (1, 3), (8, 3)])
def test_1f1b_compute_slots_follow_the_closed_form(ranks: int, micros: int) -> None:
    schedule = one_f_one_b(ranks, micros)
    for r in range(ranks):
        w = min(ranks - r, micros)
        slots = [s for s in schedule.orders[r] if s is not None and s.type in (StepType.FWD, StepType.BWD)]
        f_slot = {s.micro: i for i, s in enumerate(slots) if s.type is StepType.FWD}
        b_slot = {s.micro: i for i, s in enumerate(slots) if s.type is StepType.BWD}
        for m in range(micros):
            assert f_slot[m] == (m if m < w else 2 * m - w + 1)
            assert b_slot[m] == (w + 2 * m if m < micros - w else micros + m)


def test_gpipe_runs_all_forwards_then_all_backwards_with_sends_right_after() -> None:
    schedule = gpipe(3, 4)
    middle = [str(s) for s in schedule.orders[1]]
    assert middle[:3] == ["1RECV_F0", "1F0", "1SEND_F0"]
    kinds = [s.type for s in schedule.orders[1] if s is not None]
    assert kinds.index(StepType.BWD) > max(i for i, k in enumerate(kinds) if k is StepType.FWD)
    assert middle[-3:] == ["1RECV_B3", "1B3", "1SEND_B3"]


def test_every_generator_option_combination_validates() -> None:
    # ...with every microbatch computed: validate() refuses a schedule that skips one; on
    # nccl, which also holds batched P2P to both ends of each message alike.
    for ranks, micros in itertools.product(range(1, 6), range(1, 10)):
        for fsdp, batch, swap in itertools.product((False, True), repeat=3):
            for kind in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B):
                validate(build_schedule(ScheduleSpec(kind, ranks, micros, fsdp=fsdp,
                                                     batch_p2p=batch, swap=swap)),
                         transport="nccl", microbatches=micros)
            # interleaved: microbatches below, at and above the ranks, a multiple of them
            # and not, and the most (its warm-up and rounds change only there)
            if micros not in {1, ranks - 1, ranks, ranks + 1, 2 * ranks, 2 * ranks + 1, 9}:
                continue
            for v, (overlap, dxdw, less) in itertools.product(
                range(1, 4), [(False, False, False), (False, False, True), (True, False, False),
                              (True, True, False), (True, False, True), (True, True, True)]
            ):
                spec = ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks, micros, v,
                                    overlap_b_f=overlap, dxdw_split=dxdw, less_memory=less,
                                    fsdp=fsdp, batch_p2p=batch, swap=swap)
                validate(build_schedule(spec), transport="nccl", microbatches=micros)


@pytest.mark.parametrize("kind", [ScheduleKind.LOOPED_BFS, ScheduleKind.INTERLEAVED_ZB,
                                  ScheduleKind.ZBV, ScheduleKind.DUALPIPEV],
                         ids=lambda k: k.value)
def test_every_pytorch_family_option_combination_validates(kind: ScheduleKind) -> None:
    """The default (early) lowering runs on NCCL, batched or not; the deferred one on a
    tagged transport (gloo)."""
    for ranks, micros, v in itertools.product(range(1, 5), range(1, 9), (1, 2)):
        for fsdp, batch, swap in itertools.product((False, True), repeat=3):
            runs: tuple[tuple[Lowering | None, TransportModel], ...] = (
                (None, "nccl"), (Lowering.DEFERRED, "tagged"))
            for lowering, transport in runs:
                try:
                    schedule = build_schedule(ScheduleSpec(
                        kind, ranks, micros, v, fsdp=fsdp, batch_p2p=batch, swap=swap,
                        lowering=lowering))
                except ScheduleError:  # e.g. dualpipev with fewer microbatches than stages
                    continue
                validate(schedule, transport=transport, microbatches=micros)


Spec = Callable[[], ScheduleSpec]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 0, 8), "ranks must be an integer >= 1, got 0"),
        (lambda: ScheduleSpec(ScheduleKind.GPIPE, 2, 0), "microbatches must be an integer >= 1"),
        (lambda: ScheduleSpec(ScheduleKind.GPIPE, 2, True), "microbatches"),
        (lambda: ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 2, 4, 0), "stages_per_rank"),
        (lambda: ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 2, 4, 2), "stages_per_rank must be 1"),
        (lambda: ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 2, 4, overlap_b_f=True),
         "overlap_b_f applies to interleaved-1f1b only"),
        (lambda: ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 2, 4, 2, dxdw_split=True),
         "dxdw_split=True requires overlap_b_f=True"),
        (lambda: ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 2, 4, 2, overlap_b_f=True,
                              less_memory=True, lowering=Lowering.COLUMNS),
         "the columns lowering cannot order less_memory with overlap_b_f"),
        (lambda: ScheduleSpec(ScheduleKind.ZBV, 2, 4, lowering=Lowering.COLUMNS),
         "zbv takes 'early' (the default) or 'deferred'"),
        (lambda: ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 2, 4, lowering=Lowering.EARLY),
         "1f1b is generated with its sends and receives in place"),
        (lambda: ScheduleSpec(ScheduleKind.ZBV, 2, 4, lowering="late"),  # type: ignore[arg-type]
         "unknown lowering 'late'; allowed: early, deferred, columns"),
        (lambda: ScheduleSpec("zigzag", 2, 4), "unknown schedule 'zigzag'; allowed: gpipe, 1f1b"),  # type: ignore[arg-type]
    ],
)
def test_invalid_arguments_name_the_argument(make: Spec, message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        make()


def test_stage_mappings() -> None:
    assert stage_to_rank(4, 8, StageMapping.LOOP) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_to_rank(4, 8, "v") == (0, 1, 2, 3, 3, 2, 1, 0)
    assert stage_to_rank(2, 6, "v") == (0, 1, 1, 0, 0, 1)
    with pytest.raises(ScheduleError, match="multiple of ranks; got 6 stages on 4 ranks"):
        stage_to_rank(4, 6, "v")
    with pytest.raises(ScheduleError, match="unknown stage mapping 'ring'; allowed: 'loop', 'v'"):
        stage_to_rank(4, 8, "ring")
