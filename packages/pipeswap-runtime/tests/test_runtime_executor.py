"""The executor on one process: two stages on one rank (local hand-off), a real gloo group of
one, real autograd. Multi-process runs are in the root suite (tests/test_runtime_e2e.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import pytest
import torch

from pipeswap.runtime import (
    Measure,
    Microbatches,
    PipelineError,
    PipelineExecutor,
    PipelineSetupError,
    PipelineStage,
    StepReport,
    SwapOptions,
)
from pipeswap.runtime.distributed.transport import TensorMeta
from pipeswap.runtime.executor.microbatch import split_microbatches
from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, lm_loss, split_stages
from pipeswap.runtime.train import parse_args
from pipeswap.schedule import (
    ChunkBytes,
    ChunkKey,
    CostModel,
    Lowering,
    MinGapPolicy,
    Order,
    RankPlan,
    ScheduleKind,
    ScheduleSpec,
    StageCosts,
    StepType,
    SwapCandidate,
    SwapPlacement,
    build_schedule,
    loads,
    simulate,
)




CONFIG = GPTConfig(vocab=16, seq_len=8, width=16, heads=2, layers=2)
SPEC = ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=1, microbatches=4, stages_per_rank=2)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 16, (8, 8), generator=generator),
            torch.randint(0, 16, (8, 8), generator=generator))


class Flaky(torch.nn.Module):
    """Wraps a stage and raises in one chosen forward call."""

    def __init__(self, inner: torch.nn.Module, fail_at: int) -> None:
        super().__init__()
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("flaky stage")
        out: torch.Tensor = self.inner(x)
        return out


def _executor(swap: bool, fail_at: int = 0) -> tuple[PipelineExecutor, torch.nn.Module]:
    model = build_gpt(CONFIG, seed=0)
    first, second = split_stages(model, 2)
    stages = [PipelineStage(first, 0, 2), PipelineStage(Flaky(second, fail_at), 1, 2)]
    # The gap rule swaps every chunk it can: exactness is tested on real copies.
    return PipelineExecutor(stages, SPEC, 4, lm_loss,
                            swap=SwapOptions(MinGapPolicy(3)) if swap else False), model


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_two_local_stages_swap_without_changing_a_bit(group: None) -> None:
    reports: dict[bool, StepReport] = {}
    grads = {}
    for swap in (False, True):
        executor, model = _executor(swap)
        reports[swap] = executor.step(*_batch(1))
        grads[swap] = _grads(model)
        assert executor.manager.active_group_count() == 0
    assert reports[True].swapped_chunks > 0 and reports[True].bytes_offloaded > 0
    assert reports[False].bytes_offloaded == 0
    assert reports[True].losses == reports[False].losses and len(reports[True].losses) == 4
    assert len(grads[True]) == len(grads[False]) == len(list(build_gpt(CONFIG, 0).parameters()))
    for with_swap, without in zip(grads[True], grads[False]):
        assert torch.equal(with_swap, without)


def test_without_swap_nothing_goes_through_the_swap_manager(group: None) -> None:
    """A run without swap costs what plain autograd costs: no saved-tensor hook sees a
    tensor, so no peak is reported; asked to account, it counts every chunk and gives the
    same numerics."""
    plain, plain_model = _executor(swap=False)
    report = plain.step(*_batch(4))
    assert report.peak_activation_bytes is None and report.chunk_bytes == {}
    stats = plain.manager.stats()
    assert stats.peak_device_bytes_held == 0 and not stats.skipped
    model = build_gpt(CONFIG, seed=0)
    first, second = split_stages(model, 2)
    counted = PipelineExecutor([PipelineStage(first, 0, 2), PipelineStage(second, 1, 2)],
                               SPEC, 4, lm_loss, count_activations=True)
    accounted = counted.step(*_batch(4))
    assert accounted.peak_activation_bytes is not None and accounted.peak_activation_bytes > 0
    assert len(accounted.chunk_bytes) == 2 * 4
    assert accounted.losses == report.losses
    for got, want in zip(_grads(model), _grads(plain_model)):
        assert torch.equal(got, want)


def test_matches_the_unsplit_model(group: None) -> None:
    executor, model = _executor(swap=True)
    inputs, targets = _batch(2)
    report = executor.step(inputs, targets)
    reference = build_gpt(CONFIG, seed=0)
    loss = lm_loss(reference(inputs), targets)
    loss.backward()  # type: ignore[no-untyped-call]
    assert sum(report.losses) / 4 == pytest.approx(float(loss.detach()), rel=1e-6)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert got.grad is not None and want.grad is not None
        assert torch.allclose(got.grad, want.grad, rtol=1e-4, atol=1e-7)


def test_a_failed_step_leaves_nothing_behind_and_the_next_one_works(group: None) -> None:
    executor, model = _executor(swap=True, fail_at=4)  # dry run, micro 0, 1, then micro 2
    with pytest.raises(RuntimeError, match="flaky stage"):
        executor.step(*_batch(3))
    stats = executor.manager.stats()
    assert executor.manager.active_group_count() == 0
    assert stats.host_bytes_in_use == 0 and stats.device_bytes_held == 0
    model.zero_grad(set_to_none=True)
    with pytest.raises(PipelineError, match=r"call recover\(\) on every rank"):
        executor.step(*_batch(3))
    executor.recover()
    report = executor.step(*_batch(3))
    fresh, fresh_model = _executor(swap=True)
    assert fresh.step(*_batch(3)).losses == report.losses
    for got, want in zip(_grads(model), _grads(fresh_model)):
        assert torch.equal(got, want)


def test_set_up_errors_say_what_to_fix(group: None) -> None:
    model = build_gpt(CONFIG, seed=0)
    first, second = split_stages(model, 2)
    stages = [PipelineStage(first, 0, 2), PipelineStage(second, 1, 2)]
    executor = PipelineExecutor(stages, SPEC, 4, lm_loss)
    inputs, targets = _batch(4)
    with pytest.raises(PipelineSetupError, match="batch size 6 .* into 4 equal microbatches"):
        executor.step(inputs[:6], targets[:6])
    with pytest.raises(PipelineError, match="a previous step failed .* call recover"):
        executor.step(inputs, targets)
    executor.recover()
    with pytest.raises(PipelineSetupError, match="runs the first stage: pass inputs"):
        executor.step(None, targets)
    executor.recover()
    assert len(executor.step(inputs, targets).losses) == 4
    with pytest.raises(PipelineSetupError, match="FSDP"):
        PipelineExecutor(stages, ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=1,
                                              microbatches=4, stages_per_rank=2, fsdp=True),
                         4, lm_loss)
    with pytest.raises(PipelineSetupError, match="an explicit Schedule runs as given"):
        PipelineExecutor(stages, loads("rank 0: 0F0 1F0 1B0 0B0"), 1, lm_loss, swap=True)
    with pytest.raises(PipelineSetupError, match="the schedule cannot run: .*"):
        PipelineExecutor(stages, loads("rank 0: 0F0 1F0 1B0"), 1, lm_loss)
    with pytest.raises(PipelineSetupError, match="was given stages \\[0\\]"):
        PipelineExecutor(stages[:1], SPEC, 4, lm_loss)
    with pytest.raises(PipelineSetupError, match="unknown schedule 'zigzag'"):
        PipelineExecutor(stages, "zigzag", 4, lm_loss)


def test_schedules_are_checked_on_the_in_order_transport_unless_asked(group: None) -> None:
    """A CPU run validates as NCCL would: receives placed right before their consumers
    (the deferred lowering) are refused on ZBV, and pass the check with 'tagged' (then fail
    only because this group has one rank, not two)."""
    stages = [PipelineStage(torch.nn.Linear(4, 4), 0, 4)]
    deferred = build_schedule(ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=4,
                                           lowering=Lowering.DEFERRED))
    with pytest.raises(PipelineSetupError, match="the schedule cannot run: deadlock.*on NCCL "
                                                 "it would hang"):
        PipelineExecutor(stages, deferred, 4, lm_loss)
    with pytest.raises(PipelineSetupError, match="for 2 ranks but the process group has 1"):
        PipelineExecutor(stages, deferred, 4, lm_loss, check_transport="tagged")
    with pytest.raises(PipelineSetupError, match="check_transport='fast': use 'nccl'"):
        PipelineExecutor(stages, deferred, 4, lm_loss,
                         check_transport="fast")  # type: ignore[arg-type]


def test_refuses_to_run_without_a_process_group() -> None:
    stage = PipelineStage(torch.nn.Linear(2, 2), 0, 1)
    with pytest.raises(PipelineSetupError, match="torch.distributed is not initialized"):
        PipelineExecutor([stage], "gpipe", 2, lm_loss)


def test_microbatches_are_equal_views() -> None:
    batch = torch.arange(12).reshape(6, 2)
    parts = split_microbatches(batch, 3, "inputs")
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert all(p.untyped_storage().data_ptr() == batch.untyped_storage().data_ptr()
               for p in parts)


def test_boundary_metadata_round_trips_and_refuses_what_cannot_cross() -> None:
    meta = TensorMeta((2, 3, 4), torch.bfloat16)
    assert TensorMeta.decode(meta.encode()) == meta
    with pytest.raises(PipelineSetupError, match="complex64"):
        TensorMeta((2,), torch.complex64).encode()


def test_the_command_line_refuses_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [
        (["--batch-size", "10", "--microbatches", "4"], "does not split into 4 microbatches"),
        (["--stages-per-rank", "2"], "stages_per_rank must be 1"),
        (["--ranks", "0"], "--ranks must be at least 1"),
        (["--dxdw-split", "--schedule", "interleaved-1f1b", "--ranks", "2",
          "--stages-per-rank", "2"], "dxdw_split=True requires overlap_b_f=True"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    config, _ = parse_args(["--schedule", "gpipe", "--ranks", "2", "--no-swap"])
    assert config.swap.modes == ("no-swap",) and config.num_stages == 2 and config.num_layers == 4


def test_overlap_dxdw_on_one_rank_with_a_frozen_stage(group: None) -> None:
    spec = ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=1, microbatches=2,
                        stages_per_rank=2, overlap_b_f=True, dxdw_split=True)
    grads = []
    for swap in (False, True):
        model = build_gpt(CONFIG, seed=0)
        first, second = split_stages(model, 2)
        second.requires_grad_(False)  # its W step has no weight to update
        stages = [PipelineStage(first, 0, 2), PipelineStage(second, 1, 2)]
        executor = PipelineExecutor(stages, spec, 2, lm_loss, swap=swap)
        executor.step(*_batch(5))
        assert executor.manager.active_group_count() == 0
        grads.append(_grads(model))
    assert grads[0] and len(grads[0]) == len(list(split_stages(build_gpt(CONFIG, 0), 2)[0]
                                                 .parameters()))
    for without, with_swap in zip(*grads):
        assert torch.equal(without, with_swap)


def test_executors_sharing_a_manager_keep_their_groups_apart(group: None) -> None:
    from pipeswap.platform import get_platform
    from pipeswap.swap import SwapManager

    manager = SwapManager(get_platform("cpu"))
    executors = []
    for _ in range(2):
        first, second = split_stages(build_gpt(CONFIG, seed=0), 2)
        executors.append(PipelineExecutor(
            [PipelineStage(first, 0, 2), PipelineStage(second, 1, 2)], SPEC, 4, lm_loss,
            swap=SwapOptions(manager=manager)))
    first_report = executors[0].step(*_batch(6))
    assert executors[1].step(*_batch(6)).losses == first_report.losses
    assert manager.active_group_count() == 0


def test_stage_outputs_and_microbatch_counts_that_cannot_work(group: None) -> None:
    class Ids(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.argmax(dim=-1)

    stages = [PipelineStage(Ids(), 0, 2), PipelineStage(torch.nn.Identity(), 1, 2)]
    executor = PipelineExecutor(stages, SPEC, 4, lm_loss)
    with pytest.raises(PipelineSetupError, match=r"stage 0's output \(torch.int64\) has no "
                       "tensor computed with grad"):
        executor.step(torch.randn(8, 3), torch.zeros(8, dtype=torch.int64))
    with pytest.raises(PipelineSetupError, match="the schedule runs 8 microbatches but "
                       "microbatches=4"):
        PipelineExecutor(stages, ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=1,
                                              microbatches=8, stages_per_rank=2), 4, lm_loss)


def test_a_stage_output_that_is_not_a_tensor_pytree_is_refused(group: None) -> None:
    """Anything but tensors (tuples, lists and dicts of them) cannot cross a boundary: the
    error names what was found and what is allowed, before any step runs."""
    class WithCount(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, object]:
            return {"hidden": x * 2, "count": 3, "name": "x"}

    class Nothing(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[()]:
            return ()

    for module, found in ((WithCount(), "dict holding int, str"),
                          (Nothing(), "tuple with no tensor")):
        stages = [PipelineStage(module, 0, 2), PipelineStage(torch.nn.Identity(), 1, 2)]
        executor = PipelineExecutor(stages, SPEC, 4, lm_loss)
        with pytest.raises(PipelineSetupError, match=f"stage 0's output is {found}: what "
                           "crosses a stage boundary .* is a tensor, or tuples, lists and "
                           "dicts of tensors"):
            executor.step(torch.randn(8, 3, requires_grad=True),
                          torch.zeros(8, dtype=torch.int64))


class _ExpThenInPlace(torch.nn.Module):
    """``lin(x).exp().mul_(0.5)``: exp saves its output, which the in-place write changes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x).exp().mul_(0.5)
        return out


@pytest.mark.parametrize("swap", [False, True], ids=["no swap", "swap"])
def test_an_in_place_write_to_a_saved_activation_fails_as_in_plain_autograd(
    group: None, swap: bool
) -> None:
    torch.manual_seed(0)
    module = _ExpThenInPlace()
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.nn.functional.mse_loss(module(x), y).backward()  # type: ignore[no-untyped-call]
    executor = PipelineExecutor([PipelineStage(module, 0, 1)], "gpipe", 2,
                                torch.nn.functional.mse_loss, swap=swap)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        executor.step(x, y)
    assert executor.manager.active_group_count() == 0
    assert executor.manager.stats().host_bytes_in_use == 0


def test_a_schedule_missing_a_microbatch_is_refused(group: None) -> None:
    schedule = loads("rank 0: 0F0 0B0 0F1 0B1 0F3 0B3")
    with pytest.raises(PipelineSetupError, match=r"micro.*2"):
        PipelineExecutor([PipelineStage(torch.nn.Linear(4, 4), 0, 1)], schedule, 4,
                         torch.nn.functional.mse_loss)


def test_the_allocator_peak_is_measured_on_request(group: None) -> None:
    """``Measure(allocator=True)``: the allocator's peak above the step's start (torch's
    profiler on CPU). It holds at least the saved activations the manager counts (allocated in the
    step and all alive at the counted peak), falls with swap, and is None when not measured."""
    spec = ScheduleSpec(ScheduleKind.GPIPE, ranks=1, microbatches=4)
    reports: dict[bool, StepReport] = {}
    for swap in (False, True):
        model = build_gpt(CONFIG, seed=0)
        executor = PipelineExecutor([PipelineStage(model, 0, 1)], spec, 4, lm_loss, swap=swap,
                                    count_activations=True)
        report = reports[swap] = executor.step(*_batch(7), measure=Measure(allocator=True))
        allocated, counted = report.peak_allocated_bytes, report.peak_activation_bytes
        assert allocated is not None and counted is not None
        assert allocated >= counted > 0
        model.zero_grad(set_to_none=True)
        unmeasured = executor.step(*_batch(7))
        assert unmeasured.peak_allocated_bytes is None
        assert unmeasured.losses == report.losses
    assert reports[True].swapped_chunks > 0
    with_swap, without = reports[True].peak_allocated_bytes, reports[False].peak_allocated_bytes
    assert with_swap is not None and without is not None and with_swap < without
    off = PipelineExecutor([PipelineStage(build_gpt(CONFIG, seed=0), 0, 1)], spec, 4, lm_loss)
    assert off.step(*_batch(7)).peak_allocated_bytes is None


def test_what_a_step_measures_and_keeps_comes_back_in_its_report(group: None) -> None:
    """A step's ``Measure`` is the step's alone: layers measured and outputs kept in that
    step's report, none in the next; losses as tensors always, equal to the floats. Per-layer
    bytes need counted activations, and a step asking for them without is refused."""
    spec = ScheduleSpec(ScheduleKind.GPIPE, ranks=1, microbatches=4)
    model = build_gpt(CONFIG, seed=0)
    executor = PipelineExecutor([PipelineStage(model, 0, 1)], spec, 4, lm_loss,
                                count_activations=True)
    measured = executor.step(*_batch(7), measure=Measure(layers=True, outputs=True))
    assert measured.layer_held.keys() == measured.chunk_bytes.keys() != set()
    assert len(measured.outputs) == 4
    assert all(isinstance(out, torch.Tensor) and not out.requires_grad
               for out in measured.outputs)
    assert [loss.item() for loss in measured.loss_tensors] == list(measured.losses)
    plain = executor.step(*_batch(7))
    assert plain.layer_held == {} and plain.outputs == ()
    assert plain.losses == measured.losses and len(plain.loss_tensors) == 4
    uncounted = PipelineExecutor([PipelineStage(build_gpt(CONFIG, seed=0), 0, 1)], spec, 4,
                                 lm_loss)
    with pytest.raises(PipelineSetupError, match=r"count_activations=True"):
        uncounted.step(*_batch(7), measure=Measure(layers=True))


def test_an_evaluation_runs_forwards_only_and_leaves_the_next_step_as_it_was(
        group: None) -> None:
    """``evaluate``: the step's forwards alone, its losses and outputs bit for bit, no
    gradient, and no loss without targets. Run first, under ``torch.no_grad()``, it still
    learns which boundary tensors carry a gradient: the step after it equals a step of an
    executor that never evaluated."""
    first, second = split_stages(build_gpt(CONFIG, seed=0), 2)
    fresh = PipelineExecutor([PipelineStage(first, 0, 2), PipelineStage(second, 1, 2)], SPEC,
                             4, lm_loss, swap=True)
    want = fresh.step(*_batch(5), measure=Measure(outputs=True))
    grads = [p.grad.clone() for p in (*first.parameters(), *second.parameters())
             if p.grad is not None]
    first, second = split_stages(build_gpt(CONFIG, seed=0), 2)
    executor = PipelineExecutor([PipelineStage(first, 0, 2), PipelineStage(second, 1, 2)],
                                SPEC, 4, lm_loss, swap=True)
    with torch.no_grad():
        evaluated = executor.evaluate(*_batch(5))
    unlabelled = executor.evaluate(_batch(5)[0])
    assert all(p.grad is None for p in (*first.parameters(), *second.parameters()))
    assert evaluated.losses == want.losses and unlabelled.losses == ()
    assert want.swapped_chunks > 0 and evaluated.swapped_chunks == evaluated.bytes_offloaded == 0
    for got in (evaluated, unlabelled):
        assert len(got.outputs) == len(want.outputs) == 4
        assert all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                   and torch.equal(a, b) for a, b in zip(got.outputs, want.outputs))
    stepped = executor.step(*_batch(5))
    assert stepped.losses == want.losses
    after = [p.grad for p in (*first.parameters(), *second.parameters()) if p.grad is not None]
    assert len(after) == len(grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, after))


def test_microbatches_given_split_are_used_as_given_and_counted(group: None) -> None:
    """Inputs and targets already split (``Microbatches``) give the step on the whole
    batch bit for bit; a wrong count of parts, or of per-microbatch keyword arguments, is
    refused naming both counts."""
    executor, _ = _executor(swap=False)
    inputs, targets = _batch(5)
    whole = executor.step(inputs, targets)
    split = executor.step(Microbatches(tuple(inputs.chunk(4))),
                          Microbatches(tuple(targets.chunk(4))))
    assert split.losses == whole.losses
    fresh, _ = _executor(swap=False)
    with pytest.raises(PipelineSetupError,
                       match="inputs given in 2 microbatches, but the step runs 4"):
        fresh.step(Microbatches(tuple(inputs.chunk(2))), targets)
    fresh, _ = _executor(swap=False)
    with pytest.raises(PipelineSetupError,
                       match="keyword arguments for 3 microbatches, but the step runs 4"):
        fresh.step(inputs, targets, stage_kwargs=[{}] * 3)


class _StreamEvery:
    """Streams every chunk with room for its copies, its loads ``depth`` layers ahead, and
    recomputes ``recompute`` of every chunk's layers."""

    def __init__(self, depth: int, recompute: tuple[int, ...] = ()) -> None:
        self.depth, self.recompute = depth, recompute

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> RankPlan:
        return RankPlan(rank, {c.key: SwapPlacement(1, min(1, c.gap - 2), 1, self.depth)
                               for c in candidates if c.gap >= 2},
                        recomputed={c.key: self.recompute for c in candidates}
                        if self.recompute else {})


def test_loads_further_ahead_change_no_bit_and_hold_what_the_simulator_says(
        group: None) -> None:
    """Streamed loads two or three layers ahead (``0SL3:2``) on real autograd: no loss or
    gradient bit changes, and the simulator, fed the layer bytes the step measured, predicts
    the peak the swap manager counted to the byte; a deeper load holds more. With the last
    or a middle layer recomputed as well, still no bit changes. A depth past a stage's
    layers is refused before anything runs."""
    peaks: dict[int, int] = {}
    plain, plain_model = _executor(swap=False)
    want = plain.step(*_batch(5))
    for depth in (1, 2, 3):
        model = build_gpt(CONFIG, seed=0)
        first, second = split_stages(model, 2)
        executor = PipelineExecutor([PipelineStage(first, 0, 2), PipelineStage(second, 1, 2)],
                                    SPEC, 4, lm_loss, swap=SwapOptions(_StreamEvery(depth)))
        loads = [s for s in executor.schedule.orders[0] if s is not None
                 and s.type is StepType.SWAP_STREAM_LOAD]
        assert loads and all(s.lag == depth for s in loads)
        report = executor.step(*_batch(5))
        assert report.losses == want.losses and report.bytes_offloaded > 0
        for got, expected in zip(_grads(model), _grads(plain_model), strict=True):
            assert torch.equal(got, expected)
        assert executor.manager.active_group_count() == 0
        counted = report.peak_activation_bytes
        assert counted is not None
        chunks = {key: ChunkBytes(held.held, pinned=held.held - held.movable, layers=tuple(
            ChunkBytes(layer.held, pinned=layer.held - layer.movable)
            for layer in report.layer_bytes.get(key, ())))
            for key, held in report.chunk_bytes.items()}
        predicted = simulate(executor.schedule, CostModel(chunks=chunks, stages={
            stage: StageCosts(1.0, 2.0, layers=3) for stage in (0, 1)}))
        assert predicted.ranks[0].peak_activation_bytes == counted
        peaks[depth] = counted
    assert peaks[1] < peaks[2] < peaks[3]
    # the last layer, or the middle one, recomputed under loads two ahead: still exact
    for layers in ((2,), (1,)):
        model = build_gpt(CONFIG, seed=0)
        first, second = split_stages(model, 2)
        executor = PipelineExecutor([PipelineStage(first, 0, 2), PipelineStage(second, 1, 2)],
                                    SPEC, 4, lm_loss, swap=SwapOptions(_StreamEvery(2, layers)))
        report = executor.step(*_batch(5))
        assert report.recomputed_layers > 0 and report.losses == want.losses
        for got, expected in zip(_grads(model), _grads(plain_model), strict=True):
            assert torch.equal(got, expected)
        assert executor.manager.active_group_count() == 0
    with pytest.raises(PipelineSetupError, match=r"0SL0:4 .* layer lag of 4, but stage 0 "
                                                 r"has 3 layer.s. .PipelineStage.layers."):
        PipelineExecutor([PipelineStage(part, index, 2) for index, part in
                          enumerate(split_stages(build_gpt(CONFIG, seed=0), 2))],
                         SPEC, 4, lm_loss, swap=SwapOptions(_StreamEvery(4)))


_FAKE_GROUP = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from pipeswap.runtime import PipelineExecutor, PipelineSetupError, PipelineStage
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
try:
    PipelineExecutor([PipelineStage(torch.nn.Linear(4, 4), 0, 2)], "1f1b", 2, None)
except PipelineSetupError as exc:
    print(exc)
"""


_ALONE_ON_A_FAKE_GROUP = """
import copy, warnings, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.pipelining import PipelineStage
from pipeswap.runtime.pipelining import Schedule1F1B, ScheduleInterleavedZeroBubble
warnings.simplefilter("error")
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
x, y = torch.randn(4, 8), torch.randn(4, 8)
loss = lambda out, target: torch.nn.functional.mse_loss(out, target)
reference = copy.deepcopy(model)
for xs, ys in zip(x.chunk(2), y.chunk(2)):
    loss(reference(xs), ys).backward()
for cls in (Schedule1F1B, ScheduleInterleavedZeroBubble):
    mine = copy.deepcopy(model)
    stage = PipelineStage(mine, 0, 1, torch.device("cpu"))
    cls(stage if cls is Schedule1F1B else [stage], 2, loss_fn=loss, scale_grads=False).step(
        x, target=y)
    print(all(torch.equal(a.grad, b.grad) for a, b in zip(mine.parameters(),
                                                          reference.parameters())))
    stage = PipelineStage(mine, 0, 1, torch.device("cpu"))
    mine.zero_grad(set_to_none=True)
    schedule = cls(stage if cls is Schedule1F1B else [stage], 2)  # no loss: forward only
    out, losses = schedule.step(x), []
    evaluated = schedule.eval(x, target=y, losses=losses)  # a target, but nothing to use it
    whole = torch.cat([mine(part) for part in x.chunk(2)]).detach()
    print(torch.equal(out, whole) and torch.equal(evaluated, whole) and losses == [],
          all(p.grad is None for p in mine.parameters()))
# a compiled stage (one autograd node for its whole backward) on a zero-bubble class, which
# PyTorch's classes refuse: its input and weight gradients still come apart right
mine = copy.deepcopy(model)
stage = PipelineStage(torch.compile(mine, backend="aot_eager"), 0, 1, torch.device("cpu"))
ScheduleInterleavedZeroBubble([stage], 2, loss_fn=loss, scale_grads=False).step(x, target=y)
print(all(torch.allclose(a.grad, b.grad) for a, b in zip(mine.parameters(),
                                                         reference.parameters())))
"""


def test_a_rank_alone_runs_on_a_fake_group_and_without_a_loss_forward_only() -> None:
    """One rank, one stage, on torch's "fake" backend (as PyTorch's single-stage tests
    run): nothing to agree on or watch, so it trains as plain autograd does, bit for bit,
    with no warning; a schedule given no loss function runs forward only, as PyTorch's
    classes do: the module's output, no gradient; and a compiled stage trains on a
    zero-bubble class (PyTorch's refuse it) with plain autograd's gradients."""
    done = subprocess.run([sys.executable, "-c", _ALONE_ON_A_FAKE_GROUP], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True"] * 2 + ["True"], done.stdout


def test_a_fake_process_group_is_refused_in_one_line() -> None:
    """torch's "fake" backend (a FakeStore) moves no data, so the ranks could not agree on
    the schedule: refused by name, not with a disagreement nobody had."""
    done = subprocess.run([sys.executable, "-c", _FAKE_GROUP], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("the process group is torch's 'fake' backend"), done.stdout
