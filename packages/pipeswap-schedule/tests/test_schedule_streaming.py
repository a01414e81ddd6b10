"""Streaming swap: chunks that move layer by layer (SO/SL), their costs, how the simulator
counts them, and the peak policy's choice of granularity."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeswap.schedule import (
    PlanOutcome,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    Step,
    StepType,
    SwapCandidate,
    SwapLifecycleError,
    SwapPlacement,
    SwapPlan,
    build_planned,
    build_schedule,
    from_json,
    inject_swap,
    swapped_chunks,
    to_json,
    validate,
)
from pipeswap.schedule._rank_walk import RankState, wait
from pipeswap.schedule.costs import (
    ChunkBytes,
    CostModel,
    Link,
    StageCosts,
    TransformerShape,
    from_preset,
)
from pipeswap.schedule.formats import swap_summary
from pipeswap.schedule.policies import GRANULARITIES, Granularity, PeakPolicy
from pipeswap.schedule.simulate import simulate
from pipeswap.schedule.steps import OVERLAPS, ChunkKey, Order
from pipeswap.schedule.text import format_rank_lines, parse_rank_lines, parse_step

PROPERTY_SETTINGS = settings(
    max_examples=120, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=os.environ.get("CI") == "true")


# -- the cost model ---------------------------------------------------------------------------

def test_chunks_split_evenly_into_their_stages_layers() -> None:
    costs = CostModel(activation_bytes=10, pinned_bytes=3, layers=4,
                      stages={1: StageCosts(1.0, 2.0, layers=2)})
    assert costs.stage_layers(0) == 4 and costs.stage_layers(1) == 2
    layers = costs.layer_bytes((0, 0))
    assert [(x.total, x.pinned) for x in layers] == [(2, 0), (2, 1), (3, 1), (3, 1)]
    assert [x.total for x in costs.layer_bytes((1, 5))] == [5, 5]
    split = replace(costs, chunks={(0, 1): ChunkBytes(7, 0, after_input=5)})
    assert [x.held_after_input for x in split.layer_bytes((0, 1))] == [1, 1, 1, 2]


def test_measured_layers_win_and_must_add_up() -> None:
    layers = (ChunkBytes(6, 1), ChunkBytes(4, 0))
    costs = CostModel(layers=3, chunks={(0, 0): ChunkBytes(10, 1, layers=layers)})
    assert costs.layer_bytes((0, 0)) == layers
    with pytest.raises(ScheduleError, match="the layers' total bytes add up to 9, but the "
                                            "chunk's total is 10"):
        ChunkBytes(10, 1, layers=(ChunkBytes(5, 1), ChunkBytes(4, 0)))
    with pytest.raises(ScheduleError, match="the layers' pinned bytes add up to 0, but the "
                                            "chunk's pinned is 1"):
        ChunkBytes(10, 1, layers=(ChunkBytes(6), ChunkBytes(4)))
    with pytest.raises(ScheduleError, match="the layers' after_input bytes add up to 10"):
        ChunkBytes(10, 0, after_input=4, layers=(ChunkBytes(6), ChunkBytes(4)))


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_layers_are_whole_numbers_from_one(value: object) -> None:
    with pytest.raises(ScheduleError, match=rf"^layers must be a whole number >= 1 .*, "
                                            rf"got {value!r}$"):
        CostModel(layers=value)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="stage costs layers must be a whole number >= 1"):
        StageCosts(1.0, 2.0, layers=value)  # type: ignore[arg-type]


def test_a_transformer_has_its_layers_per_chunk() -> None:
    costs = from_preset("h100-pcie5", TransformerShape(8192, 4096, 4))
    assert costs.layers == 4 and costs.stage_layers(3) == 4
    assert sum(x.total for x in costs.layer_bytes((0, 0))) == costs.activation_bytes


# -- the simulator, by hand -------------------------------------------------------------------

def _one_rank(order: str) -> Schedule:
    return Schedule.from_orders(parse_rank_lines(f"rank 0: {order}"))


def test_a_streamed_chunk_by_hand() -> None:
    # Two layers of 100 bytes; a layer's forward takes 1 s, its backward 2 s, its copy 1 s.
    costs = CostModel(forward=2.0, backward=4.0, activation_bytes=200, layers=2,
                      link=Link(100.0, 100.0))
    rank = simulate(_one_rank("0SO0 0F0 0F1 0WO0 0SL0 0WL0 0B0 0B1"), costs).ranks[0]
    # F0: layer 0 ends at 1 (100 held) and goes to the host 1-2; layer 1 ends at 2 (200),
    # goes 2-3, and layer 0 (lag 1) is freed. F1 adds its 200 at 4. WO0 finds layer 1 home
    # and frees it; SL0 brings it back 4-5, and WL0 waits for it (1 s exposed). B0 allocates
    # layer 0 and loads it 5-6 while computing layer 1 (5-7), then computes layer 0 (7-9).
    assert rank.memory == ((1.0, 100), (2.0, 200), (2.0, 100), (4.0, 300), (4.0, 200),
                           (4.0, 300), (5.0, 400), (7.0, 300), (9.0, 200), (13.0, 0))
    copies = [(s.label, s.start, s.end) for s in rank.spans if s.stream != "compute"]
    assert copies == [("0LO0.l0", 1.0, 2.0), ("0LO0.l1", 2.0, 3.0), ("0LL0.l1", 4.0, 5.0),
                      ("0LL0.l0", 5.0, 6.0)]
    assert rank.exposed_copy == 1.0
    (chunk,) = rank.swapped
    assert (chunk.offload, chunk.wait_offload, chunk.load, chunk.wait_load) == (
        (1.0, 3.0), 4.0, (4.0, 6.0), 5.0)
    assert chunk.layer_lag == 1 and chunk.streamed and not chunk.hidden


def test_a_load_depth_by_hand() -> None:
    # Three layers of 100 bytes; a layer's forward and backward take 1 s each, a load 2 s
    # (longer than a layer's backward), an offload no time. SL comes a compute before B0.
    costs = CostModel(forward=3.0, backward=3.0, activation_bytes=300, layers=3,
                      link=Link(1e12, 50.0))
    order = "0SO0 0F0 0WO0 0SL0{} 0F1 0WL0 0B0 0B1"
    one = simulate(_one_rank(order.format("")), costs).ranks[0]
    two = simulate(_one_rank(order.format(":2")), costs).ranks[0]
    # 0SL0:2 at 3 loads layers 2 and 1 behind F1 (3-5, 5-7); B0's layer 2 (6-7) loads
    # layer 0 (7-9), so layer 1 (7-8) finds its load done and layer 0 waits 8-9.
    def spans(stream: str) -> list[tuple[str, float, float]]:  # offloads take 1e-10 s
        return [(s.label, round(s.start, 6), round(s.end, 6)) for s in two.spans
                if (s.stream == "compute") == (stream == "compute") and s.stream != "d2h"]

    assert spans("h2d") == [("0LL0.l2", 3.0, 5.0), ("0LL0.l1", 5.0, 7.0),
                            ("0LL0.l0", 7.0, 9.0)]
    assert spans("compute")[-4:] == [("0B0", 6.0, 8.0), ("wait layer", 8.0, 9.0),
                                     ("0B0", 9.0, 10.0), ("0B1", 10.0, 13.0)]
    # One layer ahead, layer 1's load starts only with B0 (6-8) and layer 0's after it
    # (8-10): a second wait.
    assert (round(one.exposed_copy, 6), round(two.exposed_copy, 6)) == (2.0, 1.0)
    # Two layers ahead holds one layer more: SL's two layers with F1's 300 bytes, and
    # layer 0 as B0 starts.
    assert (one.peak_activation_bytes, two.peak_activation_bytes) == (500, 600)
    (chunk,) = two.swapped
    assert (chunk.layer_lag, chunk.load_depth, round(chunk.load[1], 6)) == (1, 2, 9.0)
    assert one.swapped[0].load_depth == 1


def test_a_forward_waits_for_the_copy_a_lag_back() -> None:
    # Copies of 2 s behind layers of 1 s: with lag 1 the forward waits at the end of each
    # layer from the second on; the compute span is cut around the wait.
    costs = CostModel(forward=3.0, backward=6.0, activation_bytes=300, layers=3,
                      link=Link(50.0, 1e9))
    rank = simulate(_one_rank("0SO0 0F0 0F1 0WO0 0SL0 0WL0 0B0 0B1"), costs).ranks[0]
    compute = [(s.label, s.start, s.end) for s in rank.spans if s.stream == "compute"]
    # Layer 0: 0-1, copied 1-3; layer 1: 1-2, copied 3-5, waits for layer 0 until 3;
    # layer 2: 3-4, copied 5-7, waits for layer 1 until 5.
    assert compute[:5] == [("0F0", 0.0, 2.0), ("wait layer", 2.0, 3.0), ("0F0", 3.0, 4.0),
                           ("wait layer", 4.0, 5.0), ("0F1", 5.0, 8.0)]
    assert rank.swapped[0].offload == (1.0, 7.0)
    assert rank.exposed_copy >= 2.0
    lag_two = simulate(_one_rank("0SO0:2 0F0 0F1 0WO0 0SL0 0WL0 0B0 0B1"), costs).ranks[0]
    assert [s.label for s in lag_two.spans if s.stream == "compute"][0:2] == ["0F0", "0F1"]


def test_without_duplex_loads_queue_behind_offloads() -> None:
    costs = CostModel(forward=2.0, backward=4.0, activation_bytes=200, layers=2,
                      link=Link(100.0, 100.0, duplex=False))
    rank = simulate(_one_rank("0SO0 0F0 0F1 0WO0 0SL0 0WL0 0B0 0B1"), costs).ranks[0]
    assert {s.stream for s in rank.spans if s.stream != "compute"} == {"copy"}


def _outcome(plan: SwapPlan | None, rank: int) -> PlanOutcome:
    """What the policy expected of ``rank``."""
    found = None if plan is None else plan.outcome(rank)
    assert found is not None
    return found


# -- the simulator against a recount of the program order -------------------------------------

class _RandomPlacements:
    """Swap each candidate whole, streamed or not at all, with random slots and lags."""

    def __init__(self, rng: random.Random, costs: CostModel) -> None:
        self.rng, self.costs = rng, costs

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> dict[ChunkKey, SwapPlacement]:
        chosen = {}
        for c in candidates:
            way = self.rng.choice(["none", "whole", "streamed", "streamed"])
            if way == "none":
                continue
            off = self.rng.randint(0, c.gap - 1)
            load = self.rng.randint(0, c.gap - 1 - off)
            count = len(self.costs.layer_bytes(c.key))
            lag = 0 if way == "whole" else self.rng.randint(1, count)  # longer is refused
            chosen[c.key] = SwapPlacement(off, load, lag, self.rng.randint(1, count))
        return chosen


def _recount(order: Order, costs: CostModel) -> tuple[int, int]:
    """(peak, bytes held at the end) of ``order``: its memory changes walked in program
    order by the streaming rules, with no notion of time."""
    split = {s.key for s in order if s is not None and s.type is StepType.BWD_WEIGHT}
    lags: dict[ChunkKey, int] = {}
    depths: dict[ChunkKey, int] = {}
    held = peak = 0
    for step in order:
        if step is None:
            continue
        for leaf in step.sub_steps if step.type in OVERLAPS else (step,):
            kind = leaf.type
            if leaf.micro is None:
                continue
            key = leaf.key
            chunk, layers = costs.chunk_bytes(key), costs.layer_bytes(key)
            lag = lags.get(key)
            changes: list[int] = []
            if kind is StepType.SWAP_STREAM_OFFLOAD:
                lags[key] = leaf.lag or 1
            elif kind is StepType.FWD and lag:
                for k, layer in enumerate(layers):
                    changes.append(layer.total)
                    if k >= lag:
                        changes.append(-layers[k - lag].movable)
            elif kind is StepType.FWD:
                changes.append(chunk.total)
            elif kind is StepType.SWAP_WAIT_OFFLOAD:
                gone = layers[max(0, len(layers) - lag):] if lag else (chunk,)
                changes.append(-sum(x.movable for x in gone))
            elif kind is StepType.SWAP_LAUNCH_LOAD:
                changes.append(chunk.movable)
            elif kind is StepType.SWAP_STREAM_LOAD:  # the last ``depth`` layers
                depth = depths[key] = leaf.lag or 1
                changes += [x.movable for x in reversed(layers[len(layers) - depth:])]
            elif kind in (StepType.BWD, StepType.BWD_INPUT):
                keeps = kind is StepType.BWD_INPUT and key in split
                if lag:
                    depth = depths.get(key, 1)
                    for k in reversed(range(len(layers))):
                        if k >= depth:  # layer k's start loads the layer ``depth`` below
                            changes.append(layers[k - depth].movable)
                        if not keeps:  # B frees as it goes, a split I only at its end
                            changes.append(-layers[k].total)
                    if keeps:
                        changes.append(-sum(x.total - x.held_after_input for x in layers))
                else:
                    changes.append(-(chunk.total - (chunk.held_after_input if keeps else 0)))
            elif kind is StepType.BWD_WEIGHT:
                changes.append(-chunk.held_after_input)
            for change in changes:
                held += change
                peak = max(peak, held)
    return peak, held


SPECS = [
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=3, microbatches=5),
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=2, microbatches=4, fsdp=True),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=4, stages_per_rank=2),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=4, stages_per_rank=2,
                 overlap_b_f=True, dxdw_split=True, batch_p2p=True),
    ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=3, stages_per_rank=2),
]


def _layered(rng: random.Random, spec: ScheduleSpec) -> CostModel:
    """Random per-layer bytes for every chunk (or chunks split evenly), random bandwidths."""
    link = Link(rng.uniform(100.0, 5000.0), rng.uniform(100.0, 5000.0),
                duplex=rng.random() < 0.7)
    if rng.random() < 0.3:
        total = rng.randint(0, 1000)
        return CostModel(activation_bytes=total, pinned_bytes=rng.randint(0, total),
                         layers=rng.randint(1, 5), link=link)
    chunks = {}
    for stage in range(spec.ranks * spec.stages_per_rank):
        count = rng.randint(1, 4)
        for micro in range(spec.microbatches):
            layers = []
            for _ in range(count):
                total = rng.randint(0, 1000)
                after = rng.choice([None, rng.randint(0, total)])
                layers.append(ChunkBytes(total, rng.randint(0, total), after))
            chunks[(stage, micro)] = ChunkBytes(
                sum(x.total for x in layers), sum(x.pinned for x in layers),
                None if all(x.after_input is None for x in layers)
                else sum(x.held_after_input for x in layers), tuple(layers))
    return CostModel(forward=1.0, backward=2.0, chunks=chunks, link=link, param_bytes=7)


@PROPERTY_SETTINGS
@given(st.sampled_from(SPECS), st.randoms(use_true_random=False))
def test_the_simulator_counts_what_the_program_order_says(spec: ScheduleSpec,
                                                          rng: random.Random) -> None:
    costs = _layered(rng, spec)
    schedule = inject_swap(build_schedule(spec), _RandomPlacements(rng, costs))
    validate(schedule)
    result = simulate(schedule, costs)
    for rank, order in zip(result.ranks, schedule.orders):
        peak, end = _recount(order, costs)
        assert rank.peak_activation_bytes == peak, rank.rank
        assert end == 0 and (not rank.memory or rank.memory[-1][1] == 0)
        assert all(held >= 0 for _, held in rank.memory)
        streamed = {s.key: s.lag for s in order if s is not None
                    and s.type is StepType.SWAP_STREAM_OFFLOAD}
        assert {(c.stage, c.micro): c.layer_lag for c in rank.swapped if c.streamed} == streamed
        depths = {s.key: s.lag for s in order if s is not None
                  and s.type is StepType.SWAP_STREAM_LOAD}
        assert {(c.stage, c.micro): c.load_depth for c in rank.swapped if c.streamed} == depths
    # Both text forms give back the same schedule, layer lags included.
    assert Schedule.from_orders(parse_rank_lines(format_rank_lines(schedule.orders))) == schedule
    assert from_json(to_json(schedule)) == schedule


def test_whole_chunk_runs_as_before_when_layers_are_given() -> None:
    """Layers change nothing for chunks swapped whole or not at all."""
    spec = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True)
    one = CostModel(forward=1.0, backward=2.0, activation_bytes=100, link=Link(80.0, 80.0))
    schedule = build_schedule(spec, PeakPolicy(one, granularity="chunk"))
    assert simulate(schedule, one) == simulate(schedule, replace(one, layers=4))


# -- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize(("order", "message"), [
    ("0F0 0LO0 0WO0 0F1 0SL0 0WL0 0B0 0B1",
     "rank 0: swapped chunk (stage 0, micro 0) mixes whole-chunk and streaming swap steps; "
     "a chunk is swapped either with 0LO0 and 0LL0 or with 0SO0 and 0SL0"),
    ("0F0 0SO0 0F1 0WO0 0SL0 0WL0 0B0 0B1",
     "rank 0: swapped chunk (stage 0, micro 0): 0F0 (position 0) comes before 0SO0 "
     "(position 1); the order must be 0SO0 < 0F0 < 0WO0 < 0SL0 < 0WL0 < its backward"),
    ("0SO0 0F0 0F1 0WO0 0WL0 0B0 0B1",
     "rank 0: swapped chunk (stage 0, micro 0) lacks 0SL0; a swapped chunk needs exactly one "
     "of each: 0SO0 < 0F0 < 0WO0 < 0SL0 < 0WL0 < its backward"),
    ("0SO0 0F0 0F1 0SL0 0WO0 0WL0 0B0 0B1",
     "rank 0: swapped chunk (stage 0, micro 0): 0SL0 (position 3) comes before 0WO0 "
     "(position 4)"),
])
def test_validation_names_the_chunk_a_streaming_swap_gets_wrong(order: str,
                                                                message: str) -> None:
    with pytest.raises(SwapLifecycleError) as caught:
        validate(_one_rank(order))
    assert message in str(caught.value)


def test_a_layer_lag_belongs_to_so_and_sl_only() -> None:
    for kind in (StepType.SWAP_STREAM_OFFLOAD, StepType.SWAP_STREAM_LOAD):
        code = kind.value
        assert str(Step(kind, 0, 3, lag=2)) == f"0{code}3:2"
        assert str(Step(kind, 0, 3)) == f"0{code}3"
        assert Step(kind, 0, 3) == Step(kind, 0, 3, lag=1) == parse_step(f"0{code}3:1")
        assert parse_step(f"0{code}3:2").lag == 2
        with pytest.raises(ScheduleError, match=f"{code}'s layer lag is a whole number >= 1"):
            Step(kind, 0, 3, lag=0)
    for text in ("0LO3:2", "0LL3:2", "0WL3:2"):
        with pytest.raises(ScheduleError, match="takes no layer lag .only SO and SL"):
            parse_rank_lines(f"rank 0: {text}")


# -- the peak policy --------------------------------------------------------------------------

H100 = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=8, microbatches=16, swap=True)


def _h100(layers: int = 4) -> CostModel:
    """hidden 8192, seq 4096 on h100-pcie5: per layer 1.06 GiB of activations, a forward of
    17.9 ms and a copy of 20.7 ms (55 GB/s)."""
    return from_preset("h100-pcie5", TransformerShape(8192, 4096, layers))


def test_streaming_cuts_the_largest_peak_to_about_a_third_with_every_copy_hidden() -> None:
    """Whole chunks leave 1F1B P=8 at half of its largest peak (17 of 34 GiB); streamed
    chunks, at 11 layers of rank 0's 32, with no copy exposed.

    A quarter (8 layers) is out of reach without exposing copies: a copy (20.7 ms) outlasts
    a layer's forward (17.9 ms), so a layer can be freed no sooner than two layers after it
    ends (lag 2), and a chunk's last layers stay until the compute after its forward. At the
    end of rank 0's eighth forward it so holds at least 3 layers of that chunk and 2 of the
    one before, plus the first layer loaded back for the backward that comes next; and the
    D2H stream, 16% slower than the forwards, falls behind by one chunk per six (else a
    chunk left on the device holds all of its 4 layers)."""
    costs = _h100()
    schedule, plan = build_planned(H100, PeakPolicy(costs))
    result = simulate(schedule, costs)
    largest = max(r.peak_activation_bytes_no_swap for r in result.ranks)
    layer = costs.activation_bytes // 4
    assert max(r.peak_activation_bytes for r in result.ranks) <= 11 * layer < 0.35 * largest
    for rank in result.ranks:
        assert rank.exposed_copy == 0.0 and all(c.hidden for c in rank.swapped), rank.rank
        assert rank.peak_activation_bytes == _outcome(plan, rank.rank).peak  # same count
    assert sum(c.streamed for r in result.ranks for c in r.swapped) > 0
    whole = simulate(build_schedule(H100, PeakPolicy(costs, granularity="chunk")), costs)
    assert max(r.peak_activation_bytes for r in whole.ranks) * 2 == largest


def test_the_reference_case_keeps_its_plans() -> None:
    """``simulate --schedule 1f1b --ranks 8 --microbatches 16 --preset h100-pcie5 --hidden
    8192 --seq-len 4096 --layers-per-stage 4``: rank 0 at 11 layers with every copy hidden;
    whole chunks at 17 GiB; 8.5 GiB met on every rank with rank 0's copies exposed 72 ms
    at most (what the plans reached before planning was made near-linear)."""
    costs, gib = _h100(), 1 << 30
    auto = simulate(build_schedule(H100, PeakPolicy(costs)), costs).ranks
    assert auto[0].peak_activation_bytes <= 11.6875 * gib and auto[0].exposed_copy == 0.0
    whole = simulate(build_schedule(H100, PeakPolicy(costs, granularity="chunk")), costs)
    assert max(r.peak_activation_bytes for r in whole.ranks) <= 17 * gib
    budget = int(8.5 * gib)
    met = simulate(build_schedule(H100, PeakPolicy(costs, budget=budget)), costs).ranks
    assert all(r.peak_activation_bytes <= budget for r in met)
    assert met[0].exposed_copy <= 0.072


def test_a_quarter_needs_a_budget_and_costs_less_stall_streamed() -> None:
    costs = _h100()
    layer = costs.activation_bytes // 4
    stalls = {}
    granularities: tuple[Granularity, ...] = ("chunk", "auto")
    for granularity in granularities:
        schedule, plan = build_planned(H100, PeakPolicy(costs, budget=8 * layer,
                                                        granularity=granularity))
        result = simulate(schedule, costs)
        assert max(r.peak_activation_bytes for r in result.ranks) <= 8 * layer
        assert all(_outcome(plan, rank).met for rank in range(len(result.ranks)))
        stalls[granularity] = sum(r.exposed_copy for r in result.ranks)
    assert 0 < stalls["auto"] < stalls["chunk"] / 2


def test_layer_granularity_streams_every_chunk_it_swaps() -> None:
    costs = _h100()
    schedule, plan = build_planned(H100, PeakPolicy(costs, granularity="layer"))
    kinds = {s.type for order in schedule.orders for s in order if s is not None}
    assert StepType.SWAP_STREAM_OFFLOAD in kinds and StepType.SWAP_LAUNCH_OFFLOAD not in kinds
    result = simulate(schedule, costs)
    assert all(r.exposed_copy == 0.0 for r in result.ranks)
    assert plan is not None and all(  # the plan says so too, chunk by chunk
        not ranked.whole and ranked.streamed == ranked.placements
        and sorted(ranked.streamed) == sorted(swapped_chunks(schedule)[rank])
        for rank, ranked in plan.ranks.items())


@pytest.mark.parametrize("spec", [
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=4, stages_per_rank=2,
                 overlap_b_f=True, dxdw_split=True, swap=True),
], ids=["1f1b", "interleaved-dxdw"])
def test_auto_with_one_layer_a_chunk_is_the_chunk_policy(spec: ScheduleSpec) -> None:
    costs = CostModel(forward=1.0, backward=2.0, activation_bytes=100, link=Link(120.0, 90.0))
    assert build_schedule(spec, PeakPolicy(costs)) == build_schedule(
        spec, PeakPolicy(costs, granularity="chunk"))


@pytest.mark.parametrize("granularity", ["auto", "layer"])
@pytest.mark.parametrize("spec", [
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=6, stages_per_rank=2,
                 overlap_b_f=True, dxdw_split=True, swap=True),
    ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=4, stages_per_rank=2, swap=True),
], ids=["1f1b", "interleaved-dxdw", "zbv"])
def test_the_policy_counts_peaks_as_the_simulator_and_hides_its_copies(
        spec: ScheduleSpec, granularity: Granularity) -> None:
    costs = _h100(layers=3)
    schedule, plan = build_planned(spec, PeakPolicy(costs, granularity=granularity))
    result = simulate(schedule, costs)
    for rank in result.ranks:
        outcome = _outcome(plan, rank.rank)
        assert rank.peak_activation_bytes == outcome.peak
        assert outcome.peak <= outcome.peak_no_swap == rank.peak_activation_bytes_no_swap
        assert rank.exposed_copy == 0.0, rank.rank


def test_auto_does_no_worse_than_whole_chunks() -> None:
    costs = _h100(layers=2)
    spec = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=8, microbatches=24, swap=True)
    peaks = {granularity: [r.peak_activation_bytes for r in simulate(
        build_schedule(spec, PeakPolicy(costs, granularity=granularity)), costs).ranks]
        for granularity in ("chunk", "auto")}
    assert all(a <= c for a, c in zip(peaks["auto"], peaks["chunk"]))
    assert sum(peaks["auto"]) < sum(peaks["chunk"])


@settings(PROPERTY_SETTINGS, max_examples=40)
@given(st.sampled_from(SPECS), st.sampled_from(GRANULARITIES), st.randoms(use_true_random=False))
def test_the_policy_plans_what_the_simulator_finds(spec: ScheduleSpec,
                                                  granularity: Granularity,
                                                  rng: random.Random) -> None:
    """On any costs: the policy's peak is the simulator's, its copies hide, and with a
    budget the policy says truly whether it was met."""
    per_layer = rng.randint(1, 100)
    layers = rng.randint(1, 4)
    costs = CostModel(forward=rng.uniform(0.5, 2.0), backward=rng.uniform(1.0, 4.0),
                      activation_bytes=per_layer * layers, layers=layers,
                      pinned_bytes=rng.choice([0, per_layer // 2]),
                      link=Link(rng.uniform(10.0, 400.0), rng.uniform(10.0, 400.0),
                                duplex=rng.random() < 0.7))
    budget = rng.choice([None, None, rng.randint(per_layer, 4 * per_layer * layers)])
    schedule, plan = build_planned(replace(spec, swap=True),
                                   PeakPolicy(costs, budget, granularity=granularity))
    result = simulate(schedule, costs)
    for rank in result.ranks:
        outcome = _outcome(plan, rank.rank)
        assert rank.peak_activation_bytes == outcome.peak or granularity == "chunk" or (
            layers == 1 and granularity == "auto")
        assert rank.peak_activation_bytes <= rank.peak_activation_bytes_no_swap
        if budget is None:
            assert rank.exposed_copy == 0.0, rank.rank
        elif outcome.met:
            assert rank.peak_activation_bytes <= budget


def test_an_unknown_granularity_is_refused() -> None:
    assert GRANULARITIES == ("auto", "chunk", "layer")
    with pytest.raises(ScheduleError, match="unknown swap granularity 'layers'; use one of "
                                            "auto, chunk, layer"):
        PeakPolicy(CostModel(), granularity="layers")  # type: ignore[arg-type]


def test_nothing_is_streamed_for_nothing() -> None:
    """Rank 7 (the last stage) runs each backward right after its forward: no chunk there
    can leave, and none is swapped."""
    schedule = build_schedule(H100, PeakPolicy(_h100()))
    assert swapped_chunks(schedule)[7] == ()


# -- the command line -------------------------------------------------------------------------

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py
TARGET = ["simulate", "--schedule", "1f1b", "--ranks", "8", "--microbatches", "16",
          "--preset", "h100-pcie5", "--hidden", "8192", "--seq-len", "4096",
          "--layers-per-stage", "4", "--swap"]


def test_simulate_streams_by_default_and_says_how_much(cli: Cli) -> None:
    code, out, _ = cli(*TARGET, "--format", "json")
    assert code == 0
    ranks = json.loads(out)["per_rank"]
    largest = max(r["peak_activation_bytes_no_swap"] for r in ranks)
    assert max(r["peak_activation_bytes"] for r in ranks) < 0.35 * largest
    assert all(r["exposed_copy_s"] == 0 for r in ranks)
    assert ranks[0]["streamed_chunks"] > 0 and ranks[7]["streamed_chunks"] == 0
    lags = {c["layer_lag"] for r in ranks for c in r["chunks"]}
    assert lags - {0} and min(lags - {0}) >= 2  # a copy outlasts a layer: lag 1 would stall
    code, table, _ = cli(*TARGET)
    assert code == 0 and table.splitlines()[7].split()[0] == "streamed"


def test_chunk_granularity_prints_what_whole_chunk_swap_always_did(cli: Cli) -> None:
    code, out, _ = cli(*TARGET, "--swap-granularity", "chunk")
    assert code == 0
    assert out == """\
rank                      0          1          2          3          4          5         6         7
step time           4.939 s    4.796 s    4.653 s     4.51 s    4.367 s    4.224 s    4.08 s   3.937 s
bubble                30.5%      30.5%      30.5%      30.5%      30.5%      30.5%     30.5%     30.5%
exposed copy            0 s        0 s        0 s        0 s        0 s        0 s       0 s       0 s
peak, no swap     34.00 GiB  29.75 GiB  25.50 GiB  21.25 GiB  17.00 GiB  12.75 GiB  8.50 GiB  4.25 GiB
peak, swap        17.00 GiB  17.00 GiB  17.00 GiB  17.00 GiB  17.00 GiB  12.75 GiB  8.50 GiB  4.25 GiB
swapped (hidden)    12 (12)    11 (11)    10 (10)      8 (8)      0 (0)      0 (0)     0 (0)     0 (0)

simulated step time: 4.939 s
"""


@pytest.mark.parametrize("argv", [
    ["--policy", "gap"], ["--swap-min-gap", "4"], ["--policy", "cost"],
    ["--policy", "budget", "--budget", "1GiB"],
])
def test_only_the_peak_policy_takes_a_granularity(cli: Cli, argv: list[str]) -> None:
    code, out, err = cli(*TARGET, *argv, "--swap-granularity", "layer")
    name = "gap" if "--swap-min-gap" in argv else argv[1]
    assert (code, out) == (2, "")
    assert err == (f"pipeswap-schedule: error: --swap-granularity layer applies to the peak "
                   f"policy; the {name} policy swaps whole chunks: drop --swap-granularity, "
                   "or use --policy peak\n")
    code, _, _ = cli(*TARGET, *argv, "--swap-granularity", "auto")
    assert code == 0


def test_the_help_teaches_streaming(cli: Cli) -> None:
    code, out, _ = cli("simulate", "--help")
    text = " ".join(out.split())
    assert code == 0 and "--swap-granularity {auto,chunk,layer}" in text
    assert "streamed layer by layer: SO arms the forward to copy out each layer" in text
    assert "Only --policy peak streams" in text
    code, out, _ = cli("--help")
    assert "SO / SL" in out and "0SO3:2, lag 2" in out
    for command in ("orders", "show", "convert"):
        code, out, _ = cli(command, "--help")
        assert code == 0 and "--swap-granularity" in out, command


def test_show_marks_streaming_steps_and_counts_them(cli: Cli) -> None:
    code, out, _ = cli("show", *TARGET[1:], "--swap-granularity", "layer")
    assert code == 0
    cells = out.split()
    assert any(re.fullmatch(r"0SO[0-9]+(:[0-9]+)?\*", cell) for cell in cells)
    assert "0SL0*" in cells and "0LO0*" not in cells
    assert re.search(r"rank 0: 13 of 16 chunks swapped \(stage 0 micro [0-9,-]+\), 13 of them "
                     r"streamed layer by layer", out)
    code, orders, _ = cli("orders", *TARGET[1:], "--swap-granularity", "layer")
    assert code == 0 and re.search(r"\b0SO[0-9]+:[2-9]\b", orders)
    validate(Schedule.from_orders(parse_rank_lines(orders)))
    deeper = Schedule.from_orders(parse_rank_lines(orders.replace("0SL0 ", "0SL0:2 ")))
    assert "13 of them streamed layer by layer (1 loading more than one layer ahead)" in (
        swap_summary(deeper).splitlines()[0])


def test_a_copy_ending_a_rounding_error_after_compute_is_hidden() -> None:
    """The plans and the simulator sum the same times in other orders: a copy that ends
    1e-16 s after compute reaches its wait (0.1 + 0.2 against 0.3) stalls nothing; one a
    microsecond later does."""
    state = RankState(0, [], Link(1.0, 1.0), timeline=True)
    state.compute = 0.3
    record: dict[str, float] = {}
    wait(state, 0.1 + 0.2, record, "wait_offload")
    assert (state.exposed, state.compute, "stalled" in record, state.spans) == (
        0.0, 0.3, False, [])
    wait(state, 0.3 + 1e-6, record, "wait_offload")
    assert state.exposed == pytest.approx(1e-6) and record["stalled"] == 1.0
