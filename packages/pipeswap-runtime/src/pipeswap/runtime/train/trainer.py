"""One rank of a ``pipeswap-train`` job: a :class:`Trainer` set up from the config (device,
mesh, data, schedule) that trains each mode in turn, one :meth:`~Trainer.train_step` at a
time, and returns this rank's figures.

:func:`run_rank` is what :func:`~pipeswap.runtime.spawn` and torchrun start on every rank.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, TextIO

from pipeswap.platform import get_platform
from pipeswap.runtime.checkpoint.manifest import describe_skipped
from pipeswap.runtime.checkpoint.save_load import load_checkpoint
from pipeswap.runtime.distributed.launch import mark_step, pipeline_mesh
from pipeswap.runtime.distributed.process_groups import bound_cpu_half
from pipeswap.runtime.executor.measurements import measured_costs, probe_link
from pipeswap.runtime.executor.options import DataParallel, FailureHandling, Numerics, SwapOptions
from pipeswap.runtime.executor.pipeline_executor import PipelineExecutor
from pipeswap.runtime.executor.planning import MEASURE_TO_PLAN, budget_policy, named_swap
from pipeswap.runtime.train.components import (
    build_stages,
    replay_of,
    replay_stages,
    stage_layer_counts,
    tied_parameters,
)
from pipeswap.runtime.train.config import LogLevel, Mode, TrainConfig
from pipeswap.runtime.train.checkpoints import RunCheckpoints
from pipeswap.runtime.train.metrics import ModeResult, write_metrics
from pipeswap.runtime.train.summary import mib
from pipeswap.schedule import (
    ScheduleKind,
    ScheduleSpec,
    StageCosts,
    build_schedule,
    format_order,
    simulate,
)
from pipeswap.swap import SwapManager

if TYPE_CHECKING:
    import torch

    from pipeswap.platform import AllocationPeak
    from pipeswap.runtime.executor.stage import PipelineStage
    from pipeswap.runtime.models.tied import TiedGradients
    from pipeswap.schedule import ChunkBytes, CostModel, Link, PeakPolicy

log = logging.getLogger("pipeswap.runtime.train")

Batch = tuple["torch.Tensor", "torch.Tensor"]


def run_rank(rank: int, world_size: int, config: TrainConfig) -> dict[str, ModeResult]:
    """Train ``config.training.steps`` steps in each mode on this rank; this rank's
    figures."""
    return Trainer(config, rank, world_size).run()


class Trainer:
    """This rank's part of the job: its device, place in the (pp, dp) mesh, data and
    schedule, set up once; then each mode built and trained from the same weights."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        import torch

        from pipeswap.runtime.models.data import Corpus

        parallel = config.parallel
        self.config, self.rank = config, rank
        self.replaying = config.job.replay_rank is not None
        if self.replaying:
            if rank != config.job.replay_rank or parallel.meshed:
                raise ValueError(f"a replay of rank {config.job.replay_rank} runs as that rank "
                                 "alone, without data parallel")
        elif world_size != parallel.world:
            raise ValueError(f"config needs {parallel.world} ranks ({parallel.ranks} pipeline "
                             f"ranks x {parallel.dp} replicas) but {world_size} were started")
        else:
            torch.set_num_threads(1)  # several ranks share the cores
        setup_logging(rank, config.job.log_level,
                      sys.stdout if config.job.verbose else sys.stderr)
        # torchrun and spawn both set LOCAL_RANK; a replay takes the first device
        local_rank = 0 if self.replaying else int(os.environ.get("LOCAL_RANK", rank))
        device = config.training.device
        self.platform = get_platform(device if device == "cpu"
                                     else f"{device}:{local_rank % max(1, _device_count(device))}")
        self.mesh = None
        if parallel.meshed:
            self.mesh = pipeline_mesh(self.platform.device.type, parallel.ranks, parallel.dp,
                                      config.group_timeout_s)
        bounded = datetime.timedelta(seconds=config.job.timeout_s)
        if not self.replaying:  # waits outside a step (set-up, saves) end after --timeout
            for group in [None, *([] if self.mesh is None else self.mesh.get_all_groups())]:
                bound_cpu_half(group, bounded)
        self.checkpoints = RunCheckpoints(config, background=config.checkpoint.asynchronous
                                          and not self.replaying)
        self.pp_rank, self.dp_rank = divmod(rank, parallel.dp)  # the mesh: pp outer, dp inner
        corpus = Corpus.bundled()
        self.vocab = len(corpus.vocab)
        self.ids = corpus.encode()
        self.spec = ScheduleSpec(
            ScheduleKind(parallel.schedule), ranks=parallel.ranks,
            microbatches=parallel.microbatches, stages_per_rank=parallel.stages_per_rank,
            overlap_b_f=parallel.overlap_b_f, dxdw_split=parallel.dxdw_split,
            batch_p2p=parallel.batch_p2p, fsdp=parallel.fsdp)
        self.placement = build_schedule(self.spec).stage_ranks  # loop, or V for zbv, dualpipev
        self.layer_counts = stage_layer_counts(config, self.vocab)
        metrics = config.job.metrics
        first_writer = rank == 0 or self.replaying
        if metrics is not None and first_writer and config.checkpoint.resume is None:
            open(metrics, "w", encoding="utf-8").close()  # filled step by step
        self.replay = None
        self._link: Link | None = None  # the host link, probed once when a plan needs it
        if self.replaying:
            first, _ = next(self.batches(0))
            self.replay = replay_of(config, self.vocab, self.placement, self.layer_counts,
                                    first, self.platform.device)

    def batches(self, done: int) -> Iterator[Batch]:
        """This replica's part of every batch after the first ``done`` steps, each made and
        moved to the device when its step comes."""
        from pipeswap.runtime.models.data import batches

        config, dp = self.config, self.config.parallel.dp
        size = config.training.batch_size
        rows = slice(self.dp_rank * size // dp, (self.dp_rank + 1) * size // dp)
        every = batches(self.ids, size, config.model.seq_len, config.training.steps,
                        config.training.seed)
        device = self.platform.device
        for inputs, targets in itertools.islice(every, done, None):
            yield inputs[rows].to(device), targets[rows].to(device)

    def run(self) -> dict[str, ModeResult]:
        results: dict[str, ModeResult] = {}
        for mode in self.config.swap.modes:
            results[mode] = self.run_mode(mode, results)
        return results

    def run_mode(self, mode: Mode, earlier: dict[str, ModeResult]) -> ModeResult:
        """Build this rank's stages afresh and train them in ``mode`` (``earlier``: the
        modes already run, whose measured chunk sizes a budget plans on)."""
        import torch

        from pipeswap.runtime.models.gpt import lm_loss
        from pipeswap.runtime.models.tied import TiedGradients

        config = self.config
        begun = time.perf_counter()
        mark_step(-1)  # no step of this mode begun yet: a failure in its set-up says so
        # What an earlier run in this process left as garbage (the mode before, its cycles
        # of stages, hooks and executor) is freed now, not inside the measurement below,
        # where its frees would count against this mode's parameters.
        gc.collect()
        measuring: AbstractContextManager[AllocationPeak | None] = (
            self.platform.measure_allocations() if config.job.measure_allocator
            else nullcontext())
        with measuring as built:
            stages = (replay_stages(config, self.vocab, self.placement, self.platform.device)
                      if self.replaying else
                      build_stages(config, self.vocab, self.placement, self.pp_rank, self.mesh,
                                   self.platform.device))
        # one entry per parameter, also where two stages of this rank share one
        params = list({id(p): p for stage in stages for p in stage.module.parameters()}.values())
        optimizer = torch.optim.AdamW(params, lr=config.training.lr)
        # a replay drops the sum of a tied embedding's gradients, as it drops sends
        tied = None if self.replaying else TiedGradients(
            stages, self.placement, tied_parameters(config, self.vocab),
            None if self.mesh is None else self.mesh.get_group("pp"))
        done = 0  # steps taken before this run: a resumed one goes on after them
        if config.checkpoint.resume is not None and mode not in config.checkpoint.fresh_modes:
            point = load_checkpoint(config.checkpoint.resume_path(mode), stages=stages,
                                    optimizer=optimizer)
            if point.skipped and self.rank == 0:
                log.warning("[%7s] resumed from %s; skipped, as they do not verify: %s", mode,
                            point.path, describe_skipped(point.skipped))
            done = point.data_position
        # Both modes account every chunk's saved activations, to compare their peaks. The
        # swap plan weighs what the mode without swap measured, where it ran.
        costs = self._measured_costs(earlier.get("no-swap")) if mode == "swap" else None
        swap, planner = self._swap_options(mode, earlier, costs)
        executor = PipelineExecutor(
            stages, self.spec, config.parallel.microbatches, lm_loss,
            swap=swap or False, count_activations=True,
            data_parallel=DataParallel(self.mesh), platform=self.platform, replay=self.replay,
            numerics=Numerics(autocast_dtype=torch.bfloat16 if config.model.dtype == "bf16"
                              else None),
            failure=FailureHandling(None if self.replay else config.job.timeout_s))
        result = ModeResult(first_step=done + 1, swapped_chunks=len(executor.swapped),
                            streamed_chunks=len(executor.streamed),
                            parameter_bytes=None if built is None else built.held_bytes,
                            gathered_bytes=executor.gathered_bytes,
                            order=format_order(executor.schedule.orders[executor.rank]))
        self._record_plan(mode, executor, result, planner, costs)
        result.setup_seconds = time.perf_counter() - begun
        if config.job.verbose and (self.replaying or self.rank == 0):
            log.info("[%7s] set up in %.2f s (stages, schedule, swap plan)", mode,
                     result.setup_seconds)
        for number, batch in enumerate(self.batches(done), done + 1):
            self.train_step(mode, number, batch, executor, stages, optimizer, tied, result)
        self.checkpoints.wait()  # the mode's last checkpoint written before the next mode
        executor.close()  # its groups, before the next mode makes its own
        return result

    def _swap_options(self, mode: Mode, earlier: dict[str, ModeResult], costs: CostModel | None
                      ) -> tuple[SwapOptions | None, PeakPolicy | None]:
        """How ``mode`` swaps (None: it does not), with a swap manager of the host pool's
        cap where one is given, and the peak policy under the budget where one is given."""
        options, planner = self._swap_policy(mode, earlier, costs)
        cap = self.config.swap.host_pool_bytes
        if options is None or cap is None:
            return options, planner
        return replace(options, manager=SwapManager(self.platform, pool_bytes=cap)), planner

    def _swap_policy(self, mode: Mode, earlier: dict[str, ModeResult], costs: CostModel | None
                     ) -> tuple[SwapOptions | None, PeakPolicy | None]:
        """How ``mode`` swaps (None: it does not), and the peak policy under the budget
        where one is given (planned on what the mode without swap measured)."""
        config = self.config
        if mode != "swap":
            return None, None
        if config.swap.budget is None:
            return named_swap(config.swap.policy, self.layer_counts, config.swap.granularity,
                              costs), None
        measured, varying = earlier["no-swap"].measured().at_largest()
        if config.job.verbose:
            for stages in varying:
                log.info("[%7s] %s", mode, stages.describe(self.rank))
        planner = budget_policy(
            measured, self.layer_counts, config.swap.budget,
            granularity=config.swap.granularity, recompute=config.swap.recompute,
            costs=costs, everyone=None if self.replaying else _everyone)
        if config.job.verbose and (self.replaying or self.rank == 0):
            log.info("[%7s] planning swap%s under the budget of %s bytes a rank, weighed %s "
                     "(a search over plans: under a second at 8 stages, about 5 s at 64)",
                     mode, " and recompute" if config.swap.recompute == "auto" else "",
                     f"{config.swap.budget:,}",
                     "on this rank's own timeline" if self.replaying else
                     "in the whole pipeline on every rank's measured costs")
        return SwapOptions(planner), planner

    def _record_plan(self, mode: Mode, executor: PipelineExecutor, result: ModeResult,
                     planner: PeakPolicy | None, costs: CostModel | None) -> None:
        """What this rank's swap plan expects, into ``result``: the peak and shortfall
        under a budget (warned where it is not met), the step time and exposed copy
        predicted on measured costs."""
        plan = executor.plan
        outcome = None if plan is None else plan.outcome
        if outcome is not None and planner is not None:
            result.planned_in_pipeline = plan is not None and plan.chosen_in_pipeline
            result.planned_peak_bytes, result.budget_shortfall_bytes = (outcome.peak,
                                                                        outcome.shortfall)
            if outcome.shortfall:
                log.warning("[%7s] the budget of %s bytes is not met: the plan's best peaks "
                            "at %s (%s over), %d layers recomputed per step", mode,
                            f"{outcome.budget:,}", mib(outcome.peak),
                            mib(outcome.shortfall), outcome.recomputed_layers)
        # what the plan expects (the budget's planned on the measured layer sizes too,
        # which its recomputed layers need)
        if costs is not None and outcome is not None:
            result.predicted_exposed_copy = outcome.exposed_copy
            result.predicted_step_seconds = self._predicted_step(
                executor, costs if planner is None else planner.costs)

    def _measured_costs(self, plain: ModeResult | None) -> CostModel | None:
        """This rank's costs as the mode without swap measured them (its computes, its
        chunks' bytes) and its host link as a probe measures it; None where the plan weighs
        layer counts alone (``--swap-costs layers``) or that mode did not run."""

        if self.config.swap.costs != "measured" or plain is None or not plain.compute_seconds:
            return None
        if self._link is None:
            self._link = probe_link(self.platform)
        mine = {stage: count for stage, count in self.layer_counts.items()
                if self.placement[stage] == self.pp_rank}
        return measured_costs(plain.compute_seconds, plain.chunk_bytes, self._link, mine)

    def _predicted_step(self, executor: PipelineExecutor, costs: CostModel) -> float:
        """This rank's step time as the simulator predicts it for the schedule it runs (its
        own swap steps, every rank's compute as measured: gathered from the others; a replay
        takes its own stages' mean for the stages it does not run)."""
        import torch.distributed as dist


        everyone: list[dict[int, StageCosts]] = [dict(costs.stages)]
        if not self.replaying:
            everyone = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(everyone, dict(costs.stages))
        stages = {stage: found for each in everyone for stage, found in each.items()}
        mean = StageCosts(statistics.mean(s.forward for s in stages.values()),
                          statistics.mean(s.backward for s in stages.values()))
        stages = {stage: stages.get(stage, mean) for stage in range(self.config.num_stages)}
        ranks = simulate(executor.schedule, replace(costs, stages=stages), timeline=False).ranks
        return ranks[self.pp_rank].step_time

    def train_step(self, mode: Mode, number: int, batch: Batch, executor: PipelineExecutor,
                   stages: list[PipelineStage], optimizer: torch.optim.Optimizer,
                   tied: TiedGradients | None, result: ModeResult) -> None:
        """Step ``number``: one pipeline step, the optimizer's, a checkpoint when due, and
        the step's figures into ``result`` (and the metrics file)."""

        config = self.config
        mark_step(number)
        measured = config.job.measure_allocator and number % 2 == 1
        # the last step times its computes and copy waits: the costs a swap plan weighs
        timing = number == config.training.steps
        optimizer.zero_grad(set_to_none=True)
        # each chunk's layers measured in every step: what a budget plans on
        report = executor.step(*batch, measure=replace(
            MEASURE_TO_PLAN, allocator=measured, compute=timing))
        if tied is not None:
            tied.sum_gradients()
        if config.job.keep_grads and number == 1:
            result.grads = {f"{stage.stage_index}.{name}": _local(p.grad).detach().clone()
                            for stage in stages for name, p in stage.module.named_parameters()
                            if p.grad is not None}
        optimizer.step()
        if self.checkpoints.due(number):
            self.checkpoints.save(mode, number, stages, optimizer)
        # a run with no other step to time (one step, a resumed one too) times this one
        only = number == config.training.steps and not result.step_seconds
        result.record(report, measured=measured, timed=not (measured or timing) or only)
        if config.job.metrics is not None:
            write_metrics(config, mode, number,
                          {**result.per_step[-1], "losses": list(report.losses)}, self.rank)
        result.groups_alive_after_step.append(executor.manager.active_group_count())
        result.host_bytes_in_use_after_step.append(executor.manager.stats().host_bytes_in_use)
        if config.job.verbose:
            self._progress(mode, number, report.seconds, report.losses,
                           report.peak_activation_bytes, report.peak_allocated_bytes, measured)

    def _progress(self, mode: Mode, number: int, seconds: float, losses: tuple[float, ...],
                  peak: int | None, allocated: int | None, measured: bool) -> None:
        steps = self.config.training.steps
        if self.replaying:
            log.info("[%7s] step %d/%d  %.2f s  peak activations %s%s", mode, number, steps,
                     seconds, mib(peak),
                     "" if allocated is None else f", allocated {mib(allocated)}")
        elif losses:
            dp = self.config.parallel.dp
            tokens = self.config.training.batch_size // dp * self.config.model.seq_len
            replica = f" replica {self.dp_rank}" if dp > 1 else ""
            log.info("[%7s%s] step %d/%d  loss %.4f  %.2f s  %s tokens/s%s", mode, replica,
                     number, steps, sum(losses) / len(losses), seconds,
                     f"{tokens / seconds:,.0f}", "  (allocator measured)" if measured else "")


def _everyone(model: CostModel) -> CostModel:
    """``model`` with every rank's stages and chunks, gathered from all ranks (the first
    rank to give a stage or chunk counts: data-parallel replicas give the same ones), so
    that the plan can weigh the whole pipeline."""
    import torch.distributed as dist

    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dict(model.stages), dict(model.chunks)))
    stages: dict[int, StageCosts] = {}
    chunks: dict[tuple[int, int], ChunkBytes] = {}
    for given in gathered:
        assert isinstance(given, tuple)
        their_stages, their_chunks = given
        for stage, found in their_stages.items():
            stages.setdefault(stage, found)
        for key, chunk in their_chunks.items():
            chunks.setdefault(key, chunk)
    return replace(model, stages=stages, chunks=chunks)


def setup_logging(rank: int, level: LogLevel, stream: TextIO) -> None:
    """The job's ranks log through ``logging``: the ``pipeswap`` loggers to ``stream``
    (standard error under --json, whose output is the summary alone), each line prefixed
    with the rank that wrote it (a user's own configuration of the ``pipeswap`` logger,
    made before, is kept)."""
    root = logging.getLogger("pipeswap")
    root.setLevel(level.upper())
    if not root.handlers:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
        root.addHandler(handler)
        root.propagate = False


def _local(tensor: torch.Tensor | None) -> torch.Tensor:
    """A gradient as this rank holds it (its shard, under FSDP)."""
    from torch.distributed.tensor import DTensor

    assert tensor is not None
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _device_count(device: str) -> int:
    import torch

    return torch.accelerator.device_count() if device != "cpu" else 1
