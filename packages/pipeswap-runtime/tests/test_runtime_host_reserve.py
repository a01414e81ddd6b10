"""Host buffers reserved before the first step: the sizes a dry run records, the most of them
a rank's order holds at once, and a replayed rank's first step that then pins nothing."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from pipeswap.platform import get_platform
from pipeswap.runtime import SwapOptions
from pipeswap.runtime import PipelineExecutor, PipelineSetupError, PipelineStage, Replay
from pipeswap.runtime.distributed.transport import BoundaryMeta
from pipeswap.runtime.executor.host_reserve import SavedRecorder, SavedSizes, host_reservation
from pipeswap.runtime.executor.microbatch import split_tree
from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, lm_loss, split_stages
from pipeswap.runtime.executor.stage import output_meta
from pipeswap.schedule import Granularity, MinGapPolicy, ScheduleKind, ScheduleSpec, StepType, loads
from pipeswap.swap import SwapManager

CPU = torch.device("cpu")


def _tanh_stage() -> PipelineStage:
    """Three layers; each Tanh saves its output, which the next layer's Linear saves again."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh()),
              torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()),
              torch.nn.Linear(64, 8)]
    return PipelineStage(torch.nn.Sequential(*layers), 0, 2)


def _input_meta(shape: tuple[int, ...]) -> BoundaryMeta:
    return BoundaryMeta.of(torch.zeros(shape), "x")[0].with_grads([True])


def test_a_dry_run_records_what_each_layer_and_the_whole_chunk_would_copy() -> None:
    """The input (the stage's boundary) and the weights stay; each Tanh output (16 x 64
    floats) is copied once by the whole chunk, and by both layers that save it when
    streamed; below the manager's min_bytes nothing is."""
    stage = _tanh_stage()
    recorder = SavedRecorder(SwapManager(get_platform("cpu")))
    with recorder.stage(stage):
        boundary = output_meta(stage, _input_meta((16, 32)), CPU, nullcontext)
    assert [leaf.shape for leaf in boundary.leaves] == [(16, 8)]
    assert recorder.sizes == {0: SavedSizes(chunk=(4096, 4096),
                                            layers=((4096,), (4096, 4096), (4096,)))}
    skipping = SavedRecorder(SwapManager(get_platform("cpu"), min_bytes=4097))
    with skipping.stage(stage):
        output_meta(stage, _input_meta((16, 32)), CPU, nullcontext)
    assert skipping.sizes == {0: SavedSizes(chunk=(), layers=((), (), ()))}
    elsewhere = SavedRecorder(SwapManager(get_platform("cpu")), stages={1})
    with elsewhere.stage(stage):
        output_meta(stage, _input_meta((16, 32)), CPU, nullcontext)

    def unused(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a stage not recorded is not run")

    elsewhere.last_stage(stage, _input_meta((16, 32)), torch.zeros(16), unused, CPU,
                         nullcontext)
    assert elsewhere.sizes == {}


SAVED = {0: SavedSizes(chunk=(5000, 100), layers=((5000,), (20000,)))}


@pytest.mark.parametrize(("order", "expected"), [
    # two whole chunks between their LO and WL at once; the third reuses the first's
    ("0F0 0LO0 0F1 0LO1 0WO0 0WO1 0LL0 0WL0 0B0 0F2 0LO2 0WO2 0LL1 0WL1 0B1 0LL2 0WL2 0B2",
     [8192, 8192, 4096, 4096]),
    # streamed chunks hold every layer's blocks from their forward to their W
    ("0SO0 0F0 0SO1 0F1 0WO0 0SL0 0WL0 0I0 0WO1 0SL1 0WL1 0I1 0W0 0SO2 0F2 0W1 0WO2 0SL2 "
     "0WL2 0B2", [32768, 32768, 8192, 8192]),
    # an overlap's sub-steps in their order: F before B holds both chunks, B before F one
    ("0SO0 0F0 0WO0 0SL0 0WL0 0SO1 (0F1;0B0)OVERLAP_F_B 0WO1 0SL1 0WL1 0B1",
     [32768, 32768, 8192, 8192]),
    ("0SO0 0F0 0WO0 0SL0 0WL0 0SO1 (0B0;0F1)OVERLAP_B_F 0WO1 0SL1 0WL1 0B1", [32768, 8192]),
    ("0F0 0B0", []),
])
def test_the_reservation_is_the_most_blocks_of_each_class_held_at_once(
        order: str, expected: list[int]) -> None:
    assert host_reservation(loads(f"rank 0: {order}"), 0, SAVED) == expected


def test_a_swapped_stage_without_recorded_sizes_is_named() -> None:
    schedule = loads("rank 0: 0F0 0LO0 0WO0 0LL0 0WL0 0B0")
    with pytest.raises(PipelineSetupError, match=r"rank 0 swaps chunks of stage 0 \(0LO0\) "
                                                 "but no saved sizes were recorded"):
        host_reservation(schedule, 0, {})


CONFIG = GPTConfig(vocab=64, seq_len=32, width=64, heads=2, layers=2)
SPEC = ScheduleSpec(ScheduleKind.GPIPE, ranks=2, microbatches=4)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, 64, (8, 32), generator=generator),
            torch.randint(0, 64, (8, 32), generator=generator))


def _replayed(rank: int, granularity: Granularity, reserve: bool, manager: SwapManager | None = None
              ) -> tuple[PipelineExecutor, list[int], torch.nn.Module]:
    """Rank ``rank`` of a 2-rank GPipe pipeline, replayed, its chunks swapped whole (the gap
    rule takes every chunk it can) or streamed; with ``reserve``, its host buffers reserved
    from a dry run of its stage, as the executor's set-up would (the reservation returned)."""
    inputs, targets = _batch()
    modules = split_stages(build_gpt(CONFIG, 0), 2)
    stages = [PipelineStage(module, index, 2) for index, module in enumerate(modules)]
    ids = BoundaryMeta.of(split_tree(inputs, 4, "inputs")[0], "ids")[0].with_grads([False])
    hidden = output_meta(stages[0], ids, CPU, nullcontext)
    replay = Replay(rank, 2, {s.stage_index: len(s.layers) for s in stages},
                    {0: hidden} if rank == 1 else {})
    whole = granularity == "chunk"
    executor = PipelineExecutor(
        [stages[rank]], SPEC, 4, lm_loss, swap=SwapOptions(
            MinGapPolicy(3) if whole else None, granularity="auto" if whole else granularity,
            manager=manager), replay=replay)
    streams = any(step is not None and step.type is StepType.SWAP_STREAM_OFFLOAD
                  for step in executor.schedule.orders[rank])
    assert len(executor.swapped) == 4 and streams is not whole
    reservation: list[int] = []
    if reserve:
        recorder = SavedRecorder(executor.manager, {key[0] for key in executor.swapped})
        if rank == 0:
            with recorder.stage(stages[0]):
                output_meta(stages[0], ids, CPU, nullcontext)
        else:
            recorder.last_stage(stages[1], hidden, split_tree(targets, 4, "targets")[0],
                                lm_loss, CPU, nullcontext)
        reservation = host_reservation(executor.schedule, rank, recorder.sizes)
        executor.manager.reserve_host(reservation)
    return executor, reservation, modules[rank]


@pytest.mark.parametrize("granularity", ["chunk", "layer"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_reserved_rank_pins_no_host_block_in_its_first_step(rank: int,
                                                              granularity: Granularity) -> None:
    """Reserved ahead, the step takes only reserved blocks; and the reservation is exactly
    what the same step pins without one (per class: here in three classes)."""
    inputs, targets = _batch()
    plain, _, plain_module = _replayed(rank, granularity, reserve=False)
    unreserved = plain.step(inputs, targets)
    pinned = plain.manager.stats()
    executor, reservation, module = _replayed(rank, granularity, reserve=True)
    reserved = executor.manager.stats()
    assert len(set(reservation)) == 3
    assert (reserved.host_buffers_allocated, reserved.host_bytes_allocated) == (
        len(reservation), sum(reservation)) == (
        pinned.host_buffers_allocated, pinned.host_bytes_allocated)
    assert reserved.host_bytes_reserved == sum(reservation)
    report = executor.step(inputs, targets)
    after = executor.manager.stats()
    assert report.bytes_offloaded == unreserved.bytes_offloaded > 0
    assert after.host_buffers_allocated == reserved.host_buffers_allocated
    assert after.host_bytes_allocated == reserved.host_bytes_allocated
    assert report.losses == unreserved.losses
    for got, want in zip(module.parameters(), plain_module.parameters()):
        assert got.grad is not None and want.grad is not None
        assert torch.equal(got.grad, want.grad)


def test_the_executor_reserves_its_plan_before_the_first_step() -> None:
    inputs, targets = _batch()
    _, reservation, _ = _replayed(0, "chunk", reserve=True)
    executor, _, _ = _replayed(0, "chunk", reserve=False)
    assert executor.manager.stats().host_buffers_allocated == 0
    executor.step(inputs, targets)
    stats = executor.manager.stats()
    assert stats.host_bytes_reserved == sum(reservation) > 0
    assert (stats.host_buffers_allocated, stats.host_bytes_allocated) == (
        len(reservation), sum(reservation))


def test_a_reservation_the_pool_cannot_hold_is_a_warning_and_the_step_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reservation is a bound (streamed chunks counted whole, say): one over the
    pool's cap warns, reserves nothing, and the step pins as it goes."""
    from pipeswap.runtime.executor import pipeline_executor as executor_module

    inputs, targets = _batch()
    plain, reservation, _ = _replayed(0, "chunk", reserve=True)
    want = plain.step(inputs, targets)
    cap = 2 * sum(reservation)
    monkeypatch.setattr(executor_module, "host_reservation",
                        lambda *args: [*reservation, cap])  # an overestimate
    manager = SwapManager(get_platform("cpu"), pool_bytes=cap)
    executor, _, _ = _replayed(0, "chunk", reserve=False, manager=manager)
    with pytest.warns(UserWarning, match="were not reserved before the first step"):
        got = executor.step(inputs, targets)
    stats = manager.stats()
    assert stats.host_bytes_reserved == 0 and stats.host_bytes_allocated == sum(reservation)
    assert got.losses == want.losses and got.bytes_offloaded == want.bytes_offloaded
