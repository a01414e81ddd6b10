"""The simulator: hand-computed cases, limits of the bandwidth, deadlocks, traces."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from pipeswap.schedule import (
    DeadlockError,
    MinGapPolicy,
    PeakPolicy,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    StepType,
    build_schedule,
    loads,
    parse_order,
    validate,
)
from pipeswap.schedule.costs import (
    ChunkBytes,
    CostModel,
    Link,
    StageCosts,
    TransformerShape,
    from_preset,
    transformer_costs,
)
from pipeswap.schedule.simulate import peak_without_swap, simulate
from pipeswap.schedule.steps import OVERLAPS, SWAP, Order
from pipeswap.schedule.trace import chrome_trace

GPIPE = ScheduleSpec(ScheduleKind.GPIPE, ranks=2, microbatches=4, swap=True)
FAST = CostModel(forward=1.0, backward=2.0, activation_bytes=100, p2p_latency=0.5,
                 link=Link(400.0, 400.0))  # a copy of 100 bytes takes 0.25 s


def test_two_rank_gpipe_by_hand() -> None:
    # Rank 0 forwards at 0-4; each activation reaches rank 1 0.5 s later, so rank 1
    # forwards at 1.5-5.5 and backwards at 5.5-13.5; each gradient reaches rank 0 0.5 s
    # after it is computed, so rank 0's backwards run at 8-10, 10-12, 12-14 and 14-16.
    result = simulate(build_schedule(GPIPE, MinGapPolicy()), FAST)
    assert result.step_time == 16.0
    zero, one = result.ranks
    assert [(s.label, s.start, s.end) for s in zero.spans if s.stream == "compute"] == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0F2", 2, 3), ("0F3", 3, 4),
        ("0B0", 8, 10), ("0B1", 10, 12), ("0B2", 12, 14), ("0B3", 14, 16)]
    assert (zero.step_time, one.step_time) == (16.0, 13.5)
    assert zero.busy == one.busy == 12.0
    assert zero.bubble_fraction == one.bubble_fraction == 0.25
    # Every chunk is swapped; at most three are on the device at once instead of four.
    for rank in result.ranks:
        assert rank.peak_activation_bytes == 300 and rank.peak_activation_bytes_no_swap == 400
        assert len(rank.swapped) == 4 and all(c.hidden for c in rank.swapped)
        assert rank.exposed_copy == 0.0
    first = zero.swapped[0]
    assert (first.offload, first.wait_offload, first.load, first.wait_load) == (
        (1.0, 1.25), 2.0, (3.0, 3.25), 4.0)
    assert first.off_device == 1.0  # from WO at 2 s to LL at 3 s
    assert first.lifespan == 7.0  # forward ends at 1 s, backward starts at 8 s


def _count_peak(order: Order, with_swap: bool) -> int:
    """Chunks held at most: F adds one, WO frees one, LL brings it back, B (or W) frees."""
    split = {s.key for s in order if s is not None and s.type is StepType.BWD_WEIGHT}
    held = peak = 0
    for step in order:
        for leaf in (step.sub_steps if step is not None and step.type in OVERLAPS else (step,)):
            if leaf is None:
                continue
            kind = leaf.type
            if kind is StepType.FWD or (with_swap and kind is StepType.SWAP_LAUNCH_LOAD):
                held += 1
                peak = max(peak, held)
            elif (kind is StepType.BWD or kind is StepType.BWD_WEIGHT
                  or (kind is StepType.BWD_INPUT and leaf.key not in split)
                  or (with_swap and kind is StepType.SWAP_WAIT_OFFLOAD)):
                held -= 1
    return peak


SPECS = [
    GPIPE,
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=8, stages_per_rank=2,
                 overlap_b_f=True, dxdw_split=True, batch_p2p=True, swap=True),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=4, microbatches=8, stages_per_rank=2,
                 fsdp=True, swap=True),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind.value}-P{s.ranks}")
def test_unlimited_bandwidth_peak_is_the_count_based_peak(spec: ScheduleSpec) -> None:
    schedule = build_schedule(spec)
    result = simulate(schedule, CostModel(activation_bytes=7))
    for rank, order in zip(result.ranks, schedule.orders):
        assert rank.peak_activation_bytes == 7 * _count_peak(order, with_swap=True)
        assert rank.peak_activation_bytes_no_swap == 7 * _count_peak(order, with_swap=False)
        assert rank.peak_activation_bytes_no_swap == peak_without_swap(order,
                                                                       CostModel(activation_bytes=7))
        assert rank.exposed_copy == 0.0 and all(c.hidden for c in rank.swapped)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind.value}-P{s.ranks}")
def test_a_starved_link_exposes_the_copies(spec: ScheduleSpec) -> None:
    schedule = build_schedule(spec)
    slow = CostModel(activation_bytes=1 << 20, link=Link(1.0, 1.0))  # days per copy
    result = simulate(schedule, slow)
    swapping = [rank for rank in result.ranks if rank.swapped]
    assert swapping
    for rank in swapping:
        # Offloads queue on one stream and every one is waited for: compute stands still for
        # nearly all of them.
        assert rank.exposed_copy >= len(rank.swapped) * (1 << 20) - rank.busy
        assert not all(c.hidden for c in rank.swapped)
    if spec is GPIPE:  # one chunk at a time: each chunk's own waits stall
        assert not any(c.hidden for r in swapping for c in r.swapped)


def test_a_link_of_zero_bandwidth_is_refused() -> None:
    with pytest.raises(ScheduleError, match="d2h_bandwidth must be > 0 bytes/s"):
        CostModel(link=Link(0.0, 1e9))


@pytest.mark.parametrize("name", ["forward", "backward", "p2p_latency"])
def test_an_infinite_or_negative_time_is_refused(name: str) -> None:
    # An infinite time would make the whole step "inf s" and its bubble NaN.
    for value in (math.inf, math.nan, -1.0):
        with pytest.raises(ScheduleError, match=f"cost {name} must be a finite number of "
                                                "seconds >= 0"):
            CostModel(**{name: value})  # type: ignore[arg-type]


def test_non_duplex_links_queue_offloads_behind_loads() -> None:
    schedule = build_schedule(ScheduleSpec(ScheduleKind.GPIPE, ranks=2, microbatches=8,
                                           swap=True))
    costs = CostModel(activation_bytes=100, link=Link(100.0, 100.0))  # 1 s copies
    duplex = simulate(schedule, costs)
    shared = simulate(schedule, CostModel(activation_bytes=100,
                                          link=Link(100.0, 100.0, duplex=False)))
    assert {s.stream for r in shared.ranks for s in r.spans} >= {"copy"}
    for rank in shared.ranks:
        copies = sorted((s.start, s.end) for s in rank.spans if s.stream == "copy")
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(copies, copies[1:]))
    assert shared.step_time >= duplex.step_time


def test_per_stage_chunk_and_rank_overrides() -> None:
    schedule = build_schedule(GPIPE)
    costs = CostModel(forward=1.0, backward=2.0, activation_bytes=100,
                      stages={1: StageCosts(forward=2.0, backward=4.0)},
                      chunks={(0, 0): ChunkBytes(1000, pinned=1000)},
                      compute_scale={0: 2.0})
    result = simulate(schedule, costs)
    zero, one = result.ranks
    assert [s.end - s.start for s in zero.spans if s.label == "0F0"] == [2.0]  # scaled
    assert [s.end - s.start for s in one.spans if s.label == "1B0"] == [4.0]  # stage 1
    # Chunk (0, 0) never leaves the device: its copies move nothing.
    assert zero.swapped[0].offload[0] == zero.swapped[0].offload[1]
    assert zero.peak_activation_bytes == 1000 + 100 + 100


def test_a_deadlock_is_reported_as_the_validator_does() -> None:
    # Stages 0, 1, 2 on ranks 0, 1, 0: rank 0 runs stage 2 before stage 0, so it waits for
    # stage 1's output while rank 1 waits for stage 0's.
    orders = ("2RECV_F0 2F0 2B0 2SEND_B0 0F0 0SEND_F0 0RECV_B0 0B0",
              "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0")
    schedule = Schedule(tuple(parse_order(o) for o in orders), (0, 1, 0))
    with pytest.raises(DeadlockError) as info:
        simulate(schedule, CostModel())
    assert info.value.cycle == ((0, "2F0", 1), (1, "1F0", 0))
    # The simulator's transfers are tagged and do not wait: what only the ordered model
    # (a send waits for its receive) calls a deadlock runs here.
    ordered_only = loads("rank 0: 0F0 0RECV_B0 0SEND_F0 0B0\n"
                         "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    with pytest.raises(DeadlockError):
        validate(ordered_only)
    assert simulate(ordered_only, CostModel()).step_time == 6.0


def test_transformer_costs_and_presets() -> None:
    shape = TransformerShape(hidden=4096, seq_len=4096, layers=2, micro_batch=1)
    stage = transformer_costs(shape, flops=400e12)
    assert stage.activation_bytes == 34 * 4096 * 4096 * 2
    assert stage.forward == pytest.approx(24 * 4096 * 4096**2 * (1 + 1 / 6) * 2 / 400e12)
    assert stage.backward == 2 * stage.forward
    model = from_preset("gh200-nvlink-c2c", shape)
    assert model.link.h2d_bandwidth > model.link.d2h_bandwidth > 100e9
    assert model.boundary_bytes == 4096 * 4096 * 2
    with pytest.raises(ScheduleError, match="unknown preset 'a100'; known: h100-pcie5"):
        from_preset("a100")


def test_the_chrome_trace_has_streams_spans_and_memory() -> None:
    result = simulate(build_schedule(GPIPE), FAST)
    trace = json.loads(json.dumps(chrome_trace(result)))
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(0, "compute"), (0, "d2h"), (0, "h2d"), (1, "compute")} <= names
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(len(r.spans) for r in result.ranks)
    b0 = next(e for e in spans if e["name"] == "0B0")
    assert (b0["ts"], b0["dur"]) == (8e6, 2e6)
    counters = [e["args"]["held"] for e in events if e["ph"] == "C" and e["pid"] == 0]
    assert max(counters) == 300 and counters[-1] == 0


def test_nothing_is_infinite_or_negative() -> None:
    for spec in SPECS:
        result = simulate(build_schedule(spec), from_preset("h100-pcie5", TransformerShape(
            hidden=2048, seq_len=2048, layers=2)))
        for rank in result.ranks:
            assert math.isfinite(rank.step_time) and 0 <= rank.bubble_fraction < 1
            assert all(held >= 0 for _, held in rank.memory)
            assert rank.memory[-1][1] == 0  # everything freed by the end


@pytest.mark.parametrize(("spec", "streamed"), [
    (ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True, fsdp=True), True),
    (ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=6, swap=True), False),
    (ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=4, stages_per_rank=2,
                  swap=True, overlap_b_f=True, dxdw_split=True, batch_p2p=True), True),
], ids=["1f1b-fsdp-streamed", "zbv", "interleaved-split-batched-streamed"])
def test_a_simulation_without_its_timeline_gives_the_same_figures(spec: ScheduleSpec,
                                                                  streamed: bool) -> None:
    costs = CostModel(forward=1.0, backward=2.0, activation_bytes=400, layers=4,
                      link=Link(150.0, 300.0), param_bytes=50)
    policy = PeakPolicy(costs, granularity="layer") if streamed else MinGapPolicy()
    schedule = build_schedule(spec, policy)
    full, lean = simulate(schedule, costs), simulate(schedule, costs, timeline=False)
    assert any(chunk.streamed == streamed for rank in full.ranks for chunk in rank.swapped)
    assert full.step_time == lean.step_time
    for whole, bare in zip(full.ranks, lean.ranks):
        assert whole.spans and whole.memory and not bare.spans and not bare.memory
        assert replace(whole, spans=(), memory=()) == bare
    # The peaks without swap, counted along the way, are those of the order without its
    # swap steps, simulated.
    plain = simulate(Schedule(tuple(
        tuple(s for s in order if s is None or s.type not in SWAP) for order in schedule.orders),
        schedule.stage_ranks), costs)
    for swapped, alone in zip(full.ranks, plain.ranks):
        assert swapped.peak_activation_bytes_no_swap == alone.peak_activation_bytes
        assert swapped.peak_memory_bytes_no_swap == alone.peak_memory_bytes
