"""The simulator's FSDP memory: parameters gathered from UNSHARD to RESHARD count next to the
saved activations, by hand and over every built-in schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeswap.schedule import (
    FSDPOrderError,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    StepType,
    add_fsdp_steps,
    build_schedule,
    parse_order,
)
from pipeswap.schedule.build import generate, passes
from pipeswap.schedule.costs import (
    CostModel,
    StageCosts,
    TransformerShape,
    from_preset,
    transformer_costs,
)
from pipeswap.schedule.simulate import RankResult, simulate
from pipeswap.schedule.steps import OVERLAPS, Order

# Stage 0: chunks of 100 bytes, parameters of 500; stage 1: chunks of 30, parameters of 7000.
TWO_STAGES = CostModel(stages={0: StageCosts(1.0, 2.0, activation_bytes=100, param_bytes=500),
                               1: StageCosts(1.0, 2.0, activation_bytes=30, param_bytes=7000)})


def _peaks(rank: RankResult) -> tuple[int, int, int, int, int]:
    """Activations with and without swap, parameters, both with and without swap."""
    return (rank.peak_activation_bytes, rank.peak_activation_bytes_no_swap,
            rank.peak_parameter_bytes, rank.peak_memory_bytes, rank.peak_memory_bytes_no_swap)


def test_1f1b_on_two_ranks_by_hand() -> None:
    # rank 0: 0UNSHARD 0F0 0SEND_F0 0F1 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD
    #   parameters 500, then chunks 100 + 100: 700 at most.
    # rank 1: 1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1REDUCE_GRAD 1RESHARD ...
    #   parameters 7000, then one chunk of 30 at a time: 7030 at most.
    spec = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=2, microbatches=2, fsdp=True)
    zero, one = simulate(build_schedule(spec), TWO_STAGES).ranks
    assert _peaks(zero) == (200, 200, 500, 700, 700)
    assert _peaks(one) == (30, 30, 7000, 7030, 7030)
    assert [held for _, held in zero.memory] == [100, 200, 100, 0]  # activations only


# One rank holding stages 0 and 1, each gathered only while it computes; chunks (0, 0) and
# (0, 1) are offloaded while stage 1 runs. Memory after each change, parameters + activations:
#   0UNSHARD 500  0F0 600  0F1 700  0WO0 600  0WO1 500  0RESHARD 0
#   1UNSHARD 7000  1F0 7030  1F1 7060  1B0 7030  1B1 7000  1RESHARD 0
#   0UNSHARD 500  0LL0 600  0LL1 700  0B0 600  0B1 500  0RESHARD 0
# Without the swap steps, stage 0's 200 bytes stay through stage 1: 7260 at most. The peak of
# both together is below the sum of the two peaks (200 + 7000) with swap.
SWAPPED = ("0UNSHARD 0F0 0LO0 0F1 0LO1 0WO0 0WO1 0RESHARD "
           "1UNSHARD 1F0 1F1 1B0 1B1 1REDUCE_GRAD 1RESHARD "
           "0UNSHARD 0LL0 0LL1 0WL0 0WL1 0B0 0B1 0REDUCE_GRAD 0RESHARD")


def test_stages_gathered_in_turn_with_swap_by_hand() -> None:
    (rank,) = simulate(Schedule.from_orders([parse_order(SWAPPED)]), TWO_STAGES).ranks
    assert _peaks(rank) == (200, 260, 7000, 7060, 7260)
    assert [held for _, held in rank.memory] == [100, 200, 100, 0, 30, 60, 30, 0, 100, 200,
                                                 100, 0]


@pytest.mark.parametrize(("window", "gathered", "peak"), [(1, 7000, 7260), (2, 7500, 7760)])
def test_the_fsdp_window_sets_what_is_gathered_at_once(window: int, gathered: int,
                                                      peak: int) -> None:
    # window 1: 0UNSHARD 0F0 0F1 0RESHARD 1UNSHARD 1F0 1F1 1B0 1B1 ... 1RESHARD 0UNSHARD ...,
    #   so stage 1's parameters meet stage 0's 200 bytes of activations: 7000 + 260.
    # window 2: 0UNSHARD 1UNSHARD 0F0 0F1 1F0 1F1 ...: both stages' parameters, 7500 + 260.
    computes = Schedule.from_orders([parse_order("0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1")])
    (rank,) = simulate(add_fsdp_steps(computes, window=window), TWO_STAGES).ranks
    assert (rank.peak_parameter_bytes, rank.peak_memory_bytes) == (gathered, peak)
    assert rank.peak_memory_bytes_no_swap == peak


@pytest.mark.parametrize(("order", "message"), [
    ("0UNSHARD 0UNSHARD 0F0 0B0 0REDUCE_GRAD 0RESHARD", "gathered already"),
    ("0UNSHARD 0F0 0B0 0REDUCE_GRAD 0RESHARD 0RESHARD", "which is not gathered there"),
])
def test_a_gather_or_free_out_of_turn_is_refused(order: str, message: str) -> None:
    with pytest.raises(FSDPOrderError, match=message):
        simulate(Schedule.from_orders([parse_order(order)]), TWO_STAGES)


def test_gathered_bytes_default_and_per_stage() -> None:
    costs = CostModel(param_bytes=64, stages={1: StageCosts(1.0, 2.0, param_bytes=0),
                                              2: StageCosts(1.0, 2.0, activation_bytes=5)})
    assert [costs.gathered_bytes(s) for s in (0, 1, 2, 3)] == [64, 0, 64, 64]
    assert CostModel().gathered_bytes(0) == 0


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_parameter_bytes_must_be_whole_and_not_negative(value: object) -> None:
    with pytest.raises(ScheduleError, match=rf"^param_bytes must be a whole number of bytes "
                                            rf">= 0 .*, got {value!r}$"):
        CostModel(param_bytes=value)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="stage costs param_bytes must be a whole number"):
        StageCosts(1.0, 2.0, param_bytes=value)  # type: ignore[arg-type]


def test_a_transformer_stage_gathers_12_h_squared_weights_per_layer() -> None:
    shape = TransformerShape(hidden=1024, seq_len=128, layers=3, dtype_bytes=4)
    assert transformer_costs(shape, flops=1e12).param_bytes == 12 * 1024 * 1024 * 3 * 4
    model = from_preset("h100-pcie5", shape)
    assert model.param_bytes == 12 * 1024 * 1024 * 3 * 4
    assert model.gathered_bytes(5) == model.param_bytes


# Every built-in schedule, small, with FSDP steps; the interleaved ones also with a window of
# one stage, so that stages are gathered, freed and gathered again between swap steps.
SPECS = [
    ScheduleSpec(ScheduleKind.GPIPE, ranks=2, microbatches=4, fsdp=True),
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, fsdp=True),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=8, stages_per_rank=2,
                 fsdp=True),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=8, stages_per_rank=2,
                 overlap_b_f=True, dxdw_split=True, batch_p2p=True, fsdp=True),
    ScheduleSpec(ScheduleKind.LOOPED_BFS, ranks=2, microbatches=4, stages_per_rank=3,
                 fsdp=True),
    ScheduleSpec(ScheduleKind.INTERLEAVED_ZB, ranks=2, microbatches=4, stages_per_rank=2,
                 fsdp=True),
    ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=4, fsdp=True),
    ScheduleSpec(ScheduleKind.DUALPIPEV, ranks=2, microbatches=4, fsdp=True),
]
CASES = [(spec, swap, window) for spec in SPECS for swap in (False, True)
         for window in ((3, 1) if spec.stages_per_rank > 1 else (3,))]


def _build(spec: ScheduleSpec, swap: bool, window: int) -> Schedule:
    schedule = generate(replace(spec, swap=swap))
    for name, apply in passes(replace(spec, swap=swap)):
        schedule = (add_fsdp_steps(schedule, window=window) if name == "fsdp"
                    else apply(schedule))
    return schedule


def _uniform(param_bytes: int) -> CostModel:
    # Stage s: chunks of 7 + s bytes, parameters of param_bytes * (s + 1).
    return CostModel(stages={s: StageCosts(1.0, 2.0, activation_bytes=7 + s,
                                           param_bytes=param_bytes * (s + 1))
                             for s in range(8)})


def _reference(order: Order, costs: CostModel, with_swap: bool) -> tuple[int, int, int]:
    """(activation, parameter, both) peaks, walking ``order`` leaf by leaf on its own: F adds
    a chunk, WO frees it and LL brings it back, B (or the W of a split backward) frees it;
    UNSHARD adds the stage's parameters, RESHARD frees them."""
    split = {s.key for s in order if s is not None and s.type is StepType.BWD_WEIGHT}
    held = gathered = peaks_held = peaks_gathered = peaks_both = 0
    for step in order:
        for leaf in (step.sub_steps if step is not None and step.type in OVERLAPS else (step,)):
            if leaf is None or leaf.stage is None:  # an idle slot, a batch of P2P
                continue
            kind, stage = leaf.type, leaf.stage
            chunk = 7 + stage
            if kind is StepType.FWD or (with_swap and kind is StepType.SWAP_LAUNCH_LOAD):
                held += chunk
            elif (kind is StepType.BWD or kind is StepType.BWD_WEIGHT
                  or (kind is StepType.BWD_INPUT and leaf.key not in split)
                  or (with_swap and kind is StepType.SWAP_WAIT_OFFLOAD)):
                held -= chunk
            elif kind is StepType.FSDP_UNSHARD:
                gathered += costs.gathered_bytes(stage)
            elif kind is StepType.FSDP_RESHARD:
                gathered -= costs.gathered_bytes(stage)
            peaks_held = max(peaks_held, held)
            peaks_gathered = max(peaks_gathered, gathered)
            peaks_both = max(peaks_both, held + gathered)
    assert held == gathered == 0
    return peaks_held, peaks_gathered, peaks_both


@pytest.mark.parametrize(("spec", "swap", "window"), CASES,
                         ids=[f"{s.kind.value}-V{s.stages_per_rank}"
                              f"{'-dxdw' if s.dxdw_split else ''}{'-swap' if w else ''}-w{n}"
                              for s, w, n in CASES])
def test_every_schedule_counts_parameters_as_a_walk_of_its_order(
        spec: ScheduleSpec, swap: bool, window: int) -> None:
    schedule = _build(spec, swap, window)
    without = simulate(schedule, _uniform(0))
    with_params = simulate(schedule, _uniform(1000))
    for plain, rank, order in zip(without.ranks, with_params.ranks, schedule.orders):
        # Parameters of 0 bytes: the combined peaks are the activation peaks.
        assert plain.peak_parameter_bytes == 0
        assert plain.peak_memory_bytes == plain.peak_activation_bytes
        assert plain.peak_memory_bytes_no_swap == plain.peak_activation_bytes_no_swap
        # Parameters change nothing else: times, spans, activations.
        assert replace(rank, peak_parameter_bytes=0, peak_memory_bytes=rank.peak_activation_bytes,
                       peak_memory_bytes_no_swap=rank.peak_activation_bytes_no_swap) == plain
        # Both together: at least each alone, at most the sum of their peaks.
        assert (max(rank.peak_activation_bytes, rank.peak_parameter_bytes)
                <= rank.peak_memory_bytes
                <= rank.peak_activation_bytes + rank.peak_parameter_bytes)
        assert rank.peak_parameter_bytes > 0
        act, params, both = _reference(order, _uniform(1000), with_swap=True)
        assert (rank.peak_activation_bytes, rank.peak_parameter_bytes,
                rank.peak_memory_bytes) == (act, params, both)
        act, _, both = _reference(order, _uniform(1000), with_swap=False)
        assert (rank.peak_activation_bytes_no_swap, rank.peak_memory_bytes_no_swap) == (act, both)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind.value)
def test_without_fsdp_steps_parameters_count_for_nothing(spec: ScheduleSpec) -> None:
    schedule = build_schedule(replace(spec, fsdp=False, swap=True))
    for rank in simulate(schedule, _uniform(1000)).ranks:
        assert rank.peak_parameter_bytes == 0
        assert rank.peak_memory_bytes == rank.peak_activation_bytes
        assert rank.peak_memory_bytes_no_swap == rank.peak_activation_bytes_no_swap



PLACED_CASES = [
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=4, microbatches=8, stages_per_rank=2),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=2, microbatches=4, stages_per_rank=4),
    ScheduleSpec(ScheduleKind.ZBV, ranks=4, microbatches=8),
]


@pytest.mark.parametrize("spec", PLACED_CASES, ids=lambda s: f"{s.kind.value}-V{s.stages_per_rank}")
def test_the_peak_policy_places_reloads_on_fsdp_stages_as_on_any_other(spec: ScheduleSpec) -> None:
    """The default policy plans each reload to hide behind computes; FSDP's gathers do not
    move it (MindSpore hyper-parallel's rule would put it right before the backward where
    parameters stay gathered), so with FSDP steps taken out the orders are those without
    FSDP, and the simulator finds the same copy time exposed in both."""
    costs = from_preset("h100-pcie5", TransformerShape(hidden=8192, seq_len=4096, layers=4))
    plain = build_schedule(replace(spec, swap=True))
    sharded = build_schedule(replace(spec, swap=True, fsdp=True))
    stripped = tuple(tuple(step for step in order if step is None or step.type not in {
        StepType.FSDP_UNSHARD, StepType.FSDP_RESHARD, StepType.FSDP_REDUCE_GRAD})
        for order in sharded.orders)
    assert stripped == plain.orders
    assert any(step is not None and step.type is StepType.SWAP_LAUNCH_LOAD
               for order in plain.orders for step in order)
    exposed = [[rank.exposed_copy for rank in simulate(schedule, costs).ranks]
               for schedule in (plain, sharded)]
    assert exposed[0] == exposed[1]
