"""Rank functions for the checkpoint tests: train a small GPT on 2 pipeline ranks (and 2
replicas with FSDP2), save part way, and resume in fresh processes from the checkpoint."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeswap.runtime import DataParallel
from pipeswap.runtime import PipelineExecutor, PipelineStage
from pipeswap.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pipeswap.runtime.models.data import Corpus, batches
from pipeswap.runtime.models.gpt import lm_loss
from pipeswap.runtime.train import TrainConfig, build_stages
from pipeswap.schedule import ScheduleKind, ScheduleSpec, build_schedule

PP = TrainConfig.of(ranks=2, microbatches=4, steps=4, batch_size=8, seq_len=16, width=32,
                    verbose=False, timeout_s=30)
PP_DP = PP.but(dp=2, fsdp=True)
SAVED_AT = 2  # the interrupted run saves after this many steps


@dataclass(frozen=True)
class Job:
    """One rank's training set-up, as pipeswap-train builds it."""

    stages: list[PipelineStage]
    optimizer: torch.optim.Optimizer
    executor: PipelineExecutor | None  # None: only loaded into, never run
    data: list[tuple[torch.Tensor, torch.Tensor]]  # this replica's part of every batch


def _job(rank: int, config: TrainConfig, model_seed: int, run: bool = True) -> Job:
    """Stages of a model built from ``model_seed`` (the data always comes from
    ``config.training.seed``), AdamW over them, and (``run``) an executor."""
    mesh = None
    parallel, training = config.parallel, config.training
    if parallel.meshed:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (parallel.ranks, parallel.dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = divmod(rank, parallel.dp)
    corpus = Corpus.bundled()
    spec = ScheduleSpec(ScheduleKind(parallel.schedule), ranks=parallel.ranks,
                        microbatches=parallel.microbatches,
                        stages_per_rank=parallel.stages_per_rank, fsdp=parallel.fsdp)
    stages = build_stages(config.but(seed=model_seed), len(corpus.vocab),
                          build_schedule(spec).stage_ranks, pp_rank, mesh, torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for s in stages for p in s.module.parameters()],
                                  lr=training.lr)
    executor = PipelineExecutor(stages, spec, parallel.microbatches, lm_loss,
                                data_parallel=DataParallel(mesh)) if run else None
    rows = slice(dp_rank * training.batch_size // parallel.dp,
                 (dp_rank + 1) * training.batch_size // parallel.dp)
    data = [(x[rows], y[rows]) for x, y in
            batches(corpus.encode(), training.batch_size, config.model.seq_len, training.steps,
                    training.seed)]
    return Job(stages, optimizer, executor, data)


def _train(job: Job, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[float]]:
    """One step a batch; each step's microbatch losses (on the last stage's rank)."""
    assert job.executor is not None
    losses = []
    for inputs, targets in data:
        job.optimizer.zero_grad(set_to_none=True)
        losses.append(list(job.executor.step(inputs, targets).losses))
        job.optimizer.step()
    return losses


def _params(stages: list[PipelineStage]) -> dict[str, torch.Tensor]:
    """This rank's parameters (its shards, under FSDP), copied."""
    from torch.distributed.tensor import DTensor

    return {f"{stage.stage_index}.{name}":
            (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for stage in stages for name, p in stage.module.named_parameters()}


def train_and_save(rank: int, world_size: int, config: TrainConfig, directory: Path
                   ) -> dict[str, Any]:
    """The uninterrupted run of ``config.training.steps`` steps, then, from the same weights, a run
    that saves after 1 and after ``SAVED_AT`` steps (each rank's generators set apart), having
    tried to save before its first step."""
    torch.set_num_threads(1)
    torch.manual_seed(100 + rank)
    torch.rand(rank + 1)
    job = _job(rank, config, config.training.seed)
    losses = _train(job, job.data)
    params = _params(job.stages)
    job = _job(rank, config, config.training.seed)
    try:
        save_checkpoint(directory, step=0, stages=job.stages, optimizer=job.optimizer,
                        data_position=0)
        too_early = None
    except CheckpointError as exc:
        too_early = str(exc)
    for step in range(1, SAVED_AT + 1):
        _train(job, job.data[step - 1:step])
        rng = torch.get_rng_state()
        save_checkpoint(directory, step=step, stages=job.stages, optimizer=job.optimizer,
                        data_position=step, keep=1)
    return {"losses": losses, "params": params, "rng_at_save": rng, "too_early": too_early}


def resume(rank: int, world_size: int, config: TrainConfig, directory: Path,
           refusals: dict[str, tuple[TrainConfig, Path]]) -> dict[str, Any]:
    """First, each of ``refusals`` (a job's config, a directory it must fail to load); then a
    fresh model of other weights loads ``directory`` and trains the remaining steps."""
    torch.set_num_threads(1)
    refused = {name: _refused(rank, other, path) for name, (other, path) in refusals.items()}
    torch.manual_seed(7)  # the same generators on every rank until the load
    job = _job(rank, config, config.training.seed + 1)
    built = _params(job.stages)
    point = load_checkpoint(directory, stages=job.stages, optimizer=job.optimizer)
    rng = torch.get_rng_state()
    loaded = _params(job.stages)
    losses = _train(job, job.data[point.data_position:])
    return {"step": point.step, "data_position": point.data_position, "path": point.path,
            "rng_after_load": rng, "losses": losses, "params": _params(job.stages),
            "weights_changed": any(not torch.equal(built[k], loaded[k]) for k in built),
            "refused": refused}


def _refused(rank: int, config: TrainConfig, directory: Path) -> dict[str, Any]:
    """Load ``directory`` into a job built from ``config`` (no executor: the checks come
    before anything runs); the error this rank saw, and how long it took to come."""
    job = _job(rank, config, config.training.seed, run=False)
    start = time.perf_counter()
    try:
        load_checkpoint(directory, stages=job.stages, optimizer=job.optimizer)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.perf_counter() - start}
