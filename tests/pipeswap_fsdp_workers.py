"""Rank functions for the pipeline x FSDP x data-parallel tests: 2 pipeline ranks x 2
replicas, each stage sharded with FSDP2 over its data-parallel group."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipeswap.runtime import DataParallel, Measure, SwapOptions
from pipeswap.runtime import (
    PeerFailedError,
    PipelineError,
    PipelineExecutor,
    PipelineSetupError,
    PipelineStage,
)
from pipeswap.runtime.models.data import Corpus, batches
from pipeswap.runtime.executor.sharded_stage import fsdp_modules
from pipeswap.runtime.models.gpt import lm_loss
from pipeswap.runtime.train import TrainConfig, build_stages
from pipeswap.schedule import MinGapPolicy, ScheduleKind, ScheduleSpec, StepType, build_schedule

SLOW_REPLICA_S = 0.8  # how late one replica starts the measured step
CONFIG = TrainConfig.of(schedule="interleaved-1f1b", ranks=2, dp=2, fsdp=True,
                        stages_per_rank=4, microbatches=4, batch_size=8, seq_len=16, width=32,
                        verbose=False)


def _executor(rank: int, by_groups: bool = False
              ) -> tuple[PipelineExecutor, list[Any], tuple[torch.Tensor, ...]]:
    """This rank's executor (with swap, the gap rule) on the mesh (or, ``by_groups``, given
    the data-parallel group, the stages holding the pipeline's), its stages, and the first
    two batches of its replica."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    parallel = CONFIG.parallel
    mesh = init_device_mesh("cpu", (parallel.ranks, parallel.dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = divmod(rank, parallel.dp)
    corpus = Corpus.bundled()
    spec = ScheduleSpec(ScheduleKind(parallel.schedule), ranks=parallel.ranks,
                        microbatches=parallel.microbatches,
                        stages_per_rank=parallel.stages_per_rank, fsdp=True, swap=True)
    stages = build_stages(CONFIG, len(corpus.vocab), build_schedule(spec).stage_ranks,
                          pp_rank, mesh, torch.device("cpu"))
    executor = PipelineExecutor(
        stages, spec, CONFIG.parallel.microbatches, lm_loss, swap=SwapOptions(MinGapPolicy()),
        data_parallel=DataParallel(group=mesh.get_group("dp")) if by_groups
        else DataParallel(mesh))
    half = CONFIG.training.batch_size // CONFIG.parallel.dp
    data = [t[dp_rank * half:(dp_rank + 1) * half] for pair in
            batches(corpus.encode(), CONFIG.training.batch_size, CONFIG.model.seq_len, 2, 0)
            for t in pair]
    return executor, stages, tuple(data)


def _parameter_groups(stage: torch.nn.Module) -> int:
    """FSDP modules of a stage that hold parameters of their own (not those of FSDP modules
    inside them): each gathers and reduces its parameters in one collective."""
    modules = fsdp_modules(stage)
    groups = 0
    for module in modules:
        inner = {id(p) for other in modules if other is not module
                 and any(other is m for m in module.modules()) for p in other.parameters()}
        groups += any(id(p) not in inner for p in module.parameters())
    return groups


def collectives_of_a_step(rank: int, world_size: int) -> dict[str, int]:
    """How many all-gathers and reduce-scatters FSDP ran in one step (the second: the first
    also gathers once for the shape exchange), and how many the schedule's UNSHARD and
    REDUCE_GRAD steps ask for (one per FSDP parameter group of the stage); then the
    slowest forward a measured step times, one replica starting it late."""
    executor, stages, (x1, y1, x2, y2) = _executor(rank)
    executor.step(x1, y1)
    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name)
                 for name in ("all_gather_single", "reduce_scatter_single")}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    # Each offload, as it starts: would it move a parameter's storage? (The stages are
    # gathered then, so their registered parameters are the gathered ones.)
    manager = executor.manager
    launch_offload = manager.launch_offload

    def checked_offload(name: str, *, copy_referenced: bool = False) -> None:
        params = {p.untyped_storage()._cdata for stage in stages
                  for p in stage.module.parameters() if not isinstance(p, DTensor)}
        moving = {key for key, entry in manager._groups[name].storages.items()
                  if not entry.protected}
        counts["offloads"] += 1
        counts["parameters_offloaded"] += len(moving & params)
        counts["gathered_parameters"] += len(params)
        launch_offload(name, copy_referenced=copy_referenced)

    manager.launch_offload = checked_offload  # type: ignore[method-assign]
    for name in originals:
        setattr(dist, name, counting(name))
    try:
        executor.step(x2, y2)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    # A measured step behind a slow replica (rank 1, pipeline rank 0's other shard, starts
    # late): the gathers its peer waits for are not that peer's forward time.
    if rank == 1:
        time.sleep(SLOW_REPLICA_S)
    measured = executor.step(x2, y2, measure=Measure(compute=True)).compute_seconds
    modules = {stage.stage_index: _parameter_groups(stage.module) for stage in stages}
    order = [s for s in executor.schedule.orders[executor.rank] if s is not None]
    return {
        "slowest_forward_ms": round(1e3 * max(seconds for (kind, _), seconds in measured.items()
                                              if kind is StepType.FWD)),
        "all_gathers": counts["all_gather_single"],
        "unshard_gathers": sum(modules[s.stage] for s in order
                               if s.type is StepType.FSDP_UNSHARD and s.stage is not None),
        "reduce_scatters": counts["reduce_scatter_single"],
        "reduce_grad_scatters": sum(modules[s.stage] for s in order
                                    if s.type is StepType.FSDP_REDUCE_GRAD
                                    and s.stage is not None),
        "loads_at_unshard": sum(1 for a, b in zip(order, order[1:])
                                if a.type is StepType.SWAP_LAUNCH_LOAD
                                and b.type is StepType.FSDP_UNSHARD),
        "offloads": counts["offloads"],
        "parameters_offloaded": counts["parameters_offloaded"],
        "gathered_parameters": counts["gathered_parameters"],
    }


def one_replica_fails(rank: int, world_size: int, failing: int) -> dict[str, object]:
    """Rank ``failing`` raises in a forward of the second step. Every rank of both
    replicas must stop that step with an error naming it, promptly, and recover() must say
    the run cannot go on. (The executor is given the two groups here, not the mesh.)"""
    executor, stages, (x1, y1, x2, y2) = _executor(rank, by_groups=True)
    executor.step(x1, y1)
    if rank == failing:
        calls = [0]

        def fail(module: torch.nn.Module, args: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise ValueError("injected failure in a forward")

        stages[0].module.register_forward_pre_hook(fail)
    start = time.perf_counter()
    outcome: dict[str, object] = {}
    try:
        executor.step(x2, y2)
        outcome["error"] = None
    except PeerFailedError as exc:
        outcome.update(error="peer", failed_rank=exc.failed_rank, message=str(exc))
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank saw
        outcome.update(error=type(exc).__name__, message=str(exc))
    outcome["seconds"] = time.perf_counter() - start
    outcome["groups_alive"] = executor.manager.active_group_count()
    outcome["host_bytes_in_use"] = executor.manager.stats().host_bytes_in_use
    try:
        executor.recover()
        outcome["recover"] = "recovered"
    except PipelineError as exc:
        outcome["recover"] = str(exc)
    return outcome


def replicas_without_fsdp(rank: int, world_size: int) -> str:
    """One pipeline rank in each of two replicas, the stage not sharded: refused."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("pp", "dp"))
    stage = PipelineStage(torch.nn.Linear(4, 4), 0, 1, mesh.get_group("pp"))
    try:
        PipelineExecutor([stage], "gpipe", 2, torch.nn.functional.mse_loss,
                         data_parallel=DataParallel(mesh))
    except PipelineSetupError as exc:
        return str(exc)
    return "built"
