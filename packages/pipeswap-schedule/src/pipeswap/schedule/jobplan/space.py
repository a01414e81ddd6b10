"""The configurations a plan searches: the pipeline degree (and so the data-parallel one),
the schedule family, the stages per rank, the micro-batch size (and so the microbatch count),
each narrowed by the user; and each configuration's costs, as the simulator takes them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pipeswap.schedule.build import MULTI_STAGE, V_SHAPED, ScheduleKind
from pipeswap.schedule.costs import CostModel, StageCosts
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.jobplan.activations import (
    first_stage_bytes,
    last_stage_after_input_bytes,
    last_stage_bytes,
    layer_after_input_bytes,
    layer_bytes,
)
from pipeswap.schedule.jobplan.machines import Machine
from pipeswap.schedule.jobplan.memory import Job, stage_layers
from pipeswap.schedule.jobplan.models import ModelShape
from pipeswap.schedule.schedule import StageMapping, stage_to_rank


@dataclass(frozen=True)
class Config:
    """One way to run the job: ``ranks`` pipeline ranks times ``dp`` replicas, ``kind``
    with ``stages_per_rank``, each replica's batch as ``microbatches`` of ``micro_batch``
    sequences."""

    kind: ScheduleKind
    ranks: int
    dp: int
    stages_per_rank: int
    microbatches: int
    micro_batch: int

    @property
    def stages(self) -> int:
        return self.ranks * self.stages_per_rank

    def stage_ranks(self) -> tuple[int, ...]:
        mapping = StageMapping.V if self.kind in V_SHAPED else StageMapping.LOOP
        return stage_to_rank(self.ranks, self.stages, mapping)

    def describe(self) -> str:
        v = f" V={self.stages_per_rank}" if self.kind in MULTI_STAGE else ""
        return (f"{self.kind.value} P={self.ranks} DP={self.dp}{v} M={self.microbatches} "
                f"b={self.micro_batch}")


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose; None: anything. ``max_microbatch_factor``: at most this
    many microbatches per pipeline rank."""

    ranks: tuple[int, ...] | None = None
    schedules: tuple[ScheduleKind, ...] = tuple(ScheduleKind)
    stages_per_rank: tuple[int, ...] = (1, 2, 3, 4)
    micro_batches: tuple[int, ...] | None = None
    max_microbatch_factor: int = 8
    swap: bool = True  # may swap and recompute; else every rank keeps everything


def configurations(model: ModelShape, job: Job, space: SearchSpace) -> Iterator[Config]:
    """Every configuration of ``space`` the job can run: pipeline degrees that divide the
    GPUs, replicas that split the batch, stages no more than the layers."""
    for ranks in _divisors(job.gpus):
        if space.ranks is not None and ranks not in space.ranks:
            continue
        dp = job.gpus // ranks
        if job.global_batch % dp:
            continue
        per_replica = job.global_batch // dp
        for kind in space.schedules:
            for v in _stages_per_rank(kind, space.stages_per_rank):
                if ranks * v > model.layers or (ranks == 1 and kind in MULTI_STAGE):
                    continue
                for b in _divisors(per_replica):
                    microbatches = per_replica // b
                    if space.micro_batches is not None and b not in space.micro_batches:
                        continue
                    if microbatches > space.max_microbatch_factor * ranks:
                        continue
                    yield Config(kind, ranks, dp, v, microbatches, b)


def _stages_per_rank(kind: ScheduleKind, allowed: tuple[int, ...]) -> tuple[int, ...]:
    if kind in V_SHAPED:
        return (2,) if 2 in allowed else ()
    if kind in MULTI_STAGE:
        return tuple(v for v in allowed if v >= 2)
    return (1,) if 1 in allowed else ()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cost_model(model: ModelShape, job: Job, machine: Machine, config: Config) -> CostModel:
    """The simulator's costs of ``config``: each stage's compute (its blocks, and the head
    on the last), its saved activations (its blocks', the embedding's on the first, the head's
    and the loss's on the last) and what of them a split backward holds from I to W, its
    layers, the boundary message, the links."""
    layers = stage_layers(model.layers, config.stages)
    b, s = config.micro_batch, job.seq_len
    block = model.layer_forward_flops(b, s) / machine.flops
    head = model.head_forward_flops(b, s) / machine.flops
    saved = layer_bytes(model, b, s, job.dtype_bytes)
    last = config.stages - 1
    # the first stage's positions stay with the embedding, a weight node, until W
    extra = {0: first_stage_bytes(model, s)}
    extra_for_w = dict(extra)
    extra[last] = extra.get(last, 0) + last_stage_bytes(model, b, s, job.dtype_bytes)
    extra_for_w[last] = extra_for_w.get(last, 0) + last_stage_after_input_bytes(
        model, b, s, job.dtype_bytes)
    for_w = layer_after_input_bytes(model, b, s, job.dtype_bytes)  # held from I to W
    stages = {stage: StageCosts(forward=count * block + (head if stage == last else 0.0),
                                backward=2 * (count * block + (head if stage == last else 0.0)),
                                activation_bytes=count * saved + extra.get(stage, 0),
                                layers=count,
                                after_input_bytes=count * for_w + extra_for_w.get(stage, 0))
              for stage, count in enumerate(layers)}
    return CostModel(forward=block, backward=2 * block, activation_bytes=saved,
                     boundary_bytes=model.boundary_bytes(b, s, job.dtype_bytes),
                     p2p_latency=machine.p2p_latency, p2p_bandwidth=machine.p2p_bandwidth,
                     link=machine.link, stages=stages, layers=1)


def lower_bound(config: Config, costs: CostModel) -> float:
    """No step of ``config`` is shorter: each rank computes all its chunks, and cannot start
    before its first stage's first input has come through every stage before it."""
    ranks = config.stage_ranks()
    best = 0.0
    for rank in range(config.ranks):
        mine = [stage for stage, owner in enumerate(ranks) if owner == rank]
        work = config.microbatches * sum(costs.stage(stage).forward
                                         + costs.stage(stage).backward for stage in mine)
        before = sum(costs.stage(stage).forward for stage in range(min(mine)))
        best = max(best, before + work)
    return best


def check_job(model: ModelShape, job: Job, space: SearchSpace) -> None:
    """One line for a job no configuration can run at all."""
    degrees = [r for r in _divisors(job.gpus) if space.ranks is None or r in space.ranks]
    if not degrees:
        raise ScheduleError(f"no pipeline degree in --ranks {space.ranks} divides --gpus "
                            f"{job.gpus}: give a degree that divides it")
    if all(job.global_batch % (job.gpus // r) for r in degrees):
        raise ScheduleError(
            f"--global-batch {job.global_batch} does not split over the data-parallel "
            f"replicas of any pipeline degree ({', '.join(map(str, degrees))} on {job.gpus} "
            "GPUs): use a batch that a replica count divides")
    if min(degrees) > model.layers:
        raise ScheduleError(f"{model.name} has {model.layers} layers, fewer than the "
                            f"smallest pipeline degree {min(degrees)}")
