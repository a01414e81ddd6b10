"""Setting up an executor: the schedule it runs, checked against this rank's stages and
agreed on by every rank before any step, its transport, and the stage boundaries' shapes,
exchanged before the first step.

Functions of what they are given (and of collectives over the groups they are given), so that
the executor's constructor reads as the order of the checks. A problem one rank finds must
raise on every rank, or the others would wait for it forever: :func:`agree_on_schedule` is the
collective that carries it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from pipeswap.runtime.distributed.collectives import all_gather_ints
from pipeswap.runtime.distributed.failure_board import FailureBoard
from pipeswap.runtime.distributed.process_groups import transport_group
from pipeswap.runtime.distributed.transport import BoundaryMeta, PyTree, Transport
from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.executor.options import SwapOptions
from pipeswap.runtime.executor.planning import executor_policy
from pipeswap.runtime.executor.sharded_stage import ShardedStage, fsdp_modules
from pipeswap.runtime.executor.stage import PipelineStage, output_meta
from pipeswap.schedule import (
    FSDP,
    RECOMPUTE,
    SWAP,
    TRANSPORTS,
    RankPlan,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    SwapPlan,
    TransportModel,
    build_planned,
    check_order_layer_counts,
    dumps_lines,
    validate,
)
from pipeswap.runtime.executor.replay import ReplayTransport

#: The steps each rank plans for itself: which chunks it swaps and which layers it recomputes.
OWN_PLAN = SWAP | RECOMPUTE

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from pipeswap.runtime.distributed.peer_watch import GroupStopper
    from pipeswap.runtime.executor.host_reserve import SavedRecorder
    from pipeswap.runtime.executor.replay import Replay


def own_layer_counts(stages: Sequence[PipelineStage], replay: Replay | None) -> dict[int, int]:
    """This rank's stages' layer counts: the default policy plans this rank alone. A
    replay's counts must say the same of them."""
    mine = {stage.stage_index: len(stage.layers) for stage in stages}
    if replay is not None:
        given = {index: replay.layer_counts.get(index) for index in mine}
        if given != mine:
            raise PipelineSetupError(
                f"Replay.layer_counts gives this rank's stages {given} layers, but they "
                f"have {mine}: count every stage's layers as its PipelineStage does")
    return mine


def check_stages_run_here(stages: Sequence[PipelineStage], device: torch.device,
                          loss_fn: object) -> None:
    """Each stage that says where it lives is on ``device`` (the platform's), and the rank of
    the last stage has a loss function."""
    import torch

    for stage in stages:
        if stage.device is None:
            continue
        given = torch.device(stage.device)
        if given.type != device.type or (given.index is not None and device.index is not None
                                         and given.index != device.index):
            raise PipelineSetupError(
                f"stage {stage.stage_index} is on {given} but this rank computes on {device}: "
                f"build the stage on {device} (e.g. torch.device('{device}')), or give the "
                "executor that device's platform")
    if loss_fn is None and any(stage.is_last for stage in stages):
        last = max(stage.stage_index for stage in stages)
        raise PipelineSetupError(
            f"stage {last} is the last stage, and no loss_fn was given: pass the loss "
            "function (output, target) -> loss on this rank")


def find_sharded(stages: Sequence[PipelineStage], dp_group: dist.ProcessGroup | None,
                 dp_size: int, replay: Replay | None) -> dict[int, ShardedStage]:
    """This rank's stages sharded with fully_shard: all of them or none (and all with
    more than one replica, whose gradients FSDP averages)."""
    sharded = {stage.stage_index: ShardedStage(stage.stage_index, stage.module, dp_group)
               for stage in stages if fsdp_modules(stage.module)}
    if sharded and replay is not None:
        raise PipelineSetupError(
            f"stages {sorted(sharded)} are sharded with fully_shard, whose collectives "
            "need the other ranks: replay a rank of unsharded stages")
    if dp_size > 1 and not sharded:
        raise PipelineSetupError(
            f"{dp_size} data-parallel replicas but no stage is sharded with "
            "fully_shard: nothing would average the replicas' gradients; shard each stage "
            "over the data-parallel group (pipeswap.runtime.executor.sharded_stage.shard_stage)")
    if sharded and len(sharded) != len(stages):
        plain = sorted(s.stage_index for s in stages if s.stage_index not in sharded)
        raise PipelineSetupError(
            f"stages {sorted(sharded)} are sharded with fully_shard but stages {plain} "
            "are not: shard every stage of the rank, or none")
    return sharded


def check_transport(transport: str, group: dist.ProcessGroup | None,
                    replay: Replay | None) -> None:
    """``transport`` is a transport model the schedule can be checked under, and one that
    ``group``'s backend keeps."""
    import torch.distributed as dist

    if transport not in TRANSPORTS:
        raise PipelineSetupError(
            f"check_transport={transport!r}: use 'nccl' (the default: NCCL's model, ends "
            "of a message posted alike), 'ordered' (in order only) or 'tagged' (gloo's)")
    if transport == "tagged" and replay is None and dist.get_backend(group) != "gloo":
        raise PipelineSetupError(
            f"check_transport='tagged' matches gloo's tagged messages, but this group "
            f"runs {dist.get_backend(group)}, which pairs sends and receives in "
            "order: keep 'nccl' and build the schedule with the early lowering")


def resolve_schedule(schedule: Schedule | ScheduleSpec | str, *, swap: SwapOptions | None,
                     transport: TransportModel, layer_counts: Mapping[int, int],
                     stages: Sequence[PipelineStage], rank: int, world: int,
                     microbatches: int, sharded: Mapping[int, ShardedStage]
                     ) -> tuple[Schedule, RankPlan | None]:
    """The schedule this rank runs: ``schedule`` as given, or built (with swap steps where
    ``swap`` asks, planned by :func:`~pipeswap.runtime.executor.planning.executor_policy`
    for this rank only: no other rank waits on them), valid under ``transport``, with FSDP
    steps exactly where stages are sharded, and fitting this rank's ``stages`` (sorted by
    index) and microbatch count; with what the swap pass decided for this rank (None where
    the executor planned no swap)."""
    builds_swap = not isinstance(schedule, Schedule) and (
        swap is not None or (isinstance(schedule, ScheduleSpec) and schedule.swap))
    swap_policy = (executor_policy(swap or SwapOptions(), layer_counts, rank) if builds_swap
                   else None)
    plan: SwapPlan | None = None
    try:
        if isinstance(schedule, Schedule):
            if swap is not None:
                raise PipelineSetupError(
                    "swap applies to a schedule the executor builds; an explicit Schedule "
                    "runs as given (inject swap steps into it first)")
            built = schedule
        else:
            if isinstance(schedule, str):
                schedule = ScheduleSpec(
                    _kind(schedule), ranks=world, microbatches=microbatches,
                    stages_per_rank=len(stages), swap=swap is not None, fsdp=bool(sharded))
            elif swap is not None and not schedule.swap:
                schedule = dataclasses.replace(schedule, swap=True)
            # swap steps are this rank's own: plan only them (the other ranks' orders
            # stay as built, their P2P what this rank's validation needs)
            built, plan = build_planned(schedule, swap_policy, swap_ranks={rank})
        # NCCL's model unless asked: NCCL pairs sends and receives in order and by
        # communicator, and a schedule that passes on CPU then passes there. (Every micro
        # below the count: see _check_stages.)
        validate(built, transport=transport)
    except ScheduleError as exc:
        raise PipelineSetupError(f"the schedule cannot run: {exc}") from exc
    mine = built.orders[rank] if rank < built.num_ranks else ()
    named = {step.stage for step in mine
             if step is not None and step.type in FSDP and step.stage is not None}
    if named - sharded.keys():
        raise PipelineSetupError(
            f"the schedule has FSDP steps for stage(s) {sorted(named - sharded.keys())}"
            f" of rank {rank}, which are not sharded with fully_shard: shard them "
            "(pipeswap.runtime.executor.sharded_stage.shard_stage) or build the schedule "
            "with fsdp=False")
    if sharded and not named:
        raise PipelineSetupError(
            "the stages are sharded with fully_shard but the schedule has no FSDP steps "
            "to gather and free their parameters: build it with fsdp=True")
    _check_stages(built, stages, rank=rank, world=world, microbatches=microbatches)
    return built, None if plan is None else plan.ranks.get(rank)


def _check_stages(schedule: Schedule, stages: Sequence[PipelineStage], *, rank: int,
                  world: int, microbatches: int) -> None:
    """This rank's stages and microbatch count fit ``schedule``."""
    num_stages, group = stages[0].num_stages, stages[0].group
    if schedule.num_ranks != world:
        raise PipelineSetupError(
            f"the schedule is for {schedule.num_ranks} ranks but the process group has "
            f"{world}")
    if schedule.num_stages != num_stages:
        raise PipelineSetupError(
            f"the schedule has {schedule.num_stages} stages but the stages say "
            f"num_stages={num_stages}")
    micros = schedule.num_microbatches
    if micros != microbatches:
        raise PipelineSetupError(
            f"the schedule runs {micros} microbatches but microbatches={microbatches}; "
            "give the executor the microbatch count the schedule was built for")
    mine = sorted(s for s, r in enumerate(schedule.stage_ranks) if r == rank)
    given = [stage.stage_index for stage in stages]
    if mine != given:
        raise PipelineSetupError(
            f"rank {rank} runs stages {mine} in this schedule but was given stages "
            f"{given}; build each rank's PipelineStage objects for the stages the schedule "
            "places on it")
    if any(stage.num_stages != num_stages or stage.group is not group for stage in stages):
        raise PipelineSetupError(
            "all stages of an executor need the same num_stages and process group")
    layers = {stage.stage_index: len(stage.layers) for stage in stages}
    try:  # recomputed layers and a streamed swap's lags (SO's, SL's) count stage layers
        check_order_layer_counts(rank, schedule.orders[rank], lambda key: layers.get(key[0]),
                                 "stage {stage} has {layers} layer(s) (PipelineStage.layers)")
    except ScheduleError as exc:
        raise PipelineSetupError(f"the schedule cannot run: {exc}") from exc


def _kind(name: str) -> ScheduleKind:
    try:
        return ScheduleKind(name)
    except ValueError:
        allowed = ", ".join(kind.value for kind in ScheduleKind)
        raise PipelineSetupError(f"unknown schedule {name!r}; allowed: {allowed}") from None


def agree_on_schedule(schedule: Schedule | None, problem: PipelineSetupError | None, *,
          microbatches: int, group: dist.ProcessGroup | None,
          dp_group: dist.ProcessGroup | None, dp_size: int, replay: Replay | None,
          agreed: str = "") -> None:
    """One collective before any step (two with data parallel: over the pipeline, then
    over the data-parallel group): every rank has a schedule its stages fit, and all run
    the same one, given the same ``agreed`` options. Any problem raises on every rank of
    every replica, so none waits forever. A replayed rank has nobody to agree with."""
    if replay is not None:
        if problem is not None:
            raise problem
        return
    fingerprint = 0
    if schedule is not None:  # swap and recompute steps are each rank's own plan: the rest
        shared = schedule.map_orders(lambda _, order: tuple(  # must agree
            step for step in order if step is None or step.type not in OWN_PLAN))
        text = f"{dumps_lines(shared)}|{schedule.stage_ranks}|{microbatches}|{agreed}"
        fingerprint = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
    everyone = all_gather_ints(fingerprint * 2 + (problem is not None), group)
    bad = [rank for rank, value in enumerate(everyone) if value % 2]
    replicas = [everyone[0]]
    if dp_size > 1:  # this replica's verdict, to every replica
        ours = fingerprint * 2 + bool(bad or len({v // 2 for v in everyone}) != 1)
        replicas = all_gather_ints(ours, dp_group)
    if problem is not None:
        raise problem
    if bad:
        raise PipelineSetupError(
            f"rank(s) {bad} could not set up (see their errors): a schedule, stages or "
            "microbatch count that do not fit; nothing ran")
    if any(value % 2 for value in replicas):
        raise PipelineSetupError(
            "another pipeline replica could not set up (see its ranks' errors); nothing "
            "ran")
    if len({value // 2 for value in replicas}) != 1:
        raise PipelineSetupError(
            "the pipeline replicas were given different schedules: build the executor "
            "with the same schedule, options and microbatch count in every replica")
    if len({value // 2 for value in everyone}) != 1:
        prints = [f"{value // 2:014x}" for value in everyone]
        if agreed:
            raise PipelineSetupError(
                f"the ranks were given different schedules or arguments (fingerprints by "
                f"rank: {prints}; this rank: {agreed}): give every rank the same ones")
        raise PipelineSetupError(
            f"the ranks were given different schedules (fingerprints by rank: {prints}); "
            "build the executor with the same schedule, options and microbatch count on "
            "every rank")


def neighbours(schedule: Schedule, rank: int, group: dist.ProcessGroup | None,
               dp_group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks this rank waits on in a step: those running the stages next to
    its own, and its data-parallel peers (FSDP's collectives)."""
    import torch.distributed as dist

    ranks = schedule.stage_ranks
    near = {ranks[other] for stage, owner in enumerate(ranks) if owner == rank
            for other in (stage - 1, stage + 1) if 0 <= other < len(ranks)}
    mine = {r if group is None else dist.get_global_rank(group, r) for r in near}
    if dp_group is not None:
        mine |= set(dist.get_process_group_ranks(dp_group))
    return sorted(mine)


def new_transport(schedule: Schedule, *, microbatches: int, device: torch.device,
                  group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
                  dp_size: int, spans_world: bool, replay: Replay | None,
                  boundary: dict[int, BoundaryMeta] | None,
                  timeout: datetime.timedelta | None, stopper: GroupStopper) -> Transport:
    """A transport over a communication group of its own (created by the pipeline's ranks
    alone), so that a failed step can break it without touching the caller's process group;
    ``boundary``: the stage boundaries' meta a previous transport learned. ``dp_group``: the
    data-parallel group of the control traffic. ``timeout``: the group's per-operation
    timeout, where not ``group``'s; ``stopper``: what stops the groups on a failure, which
    the transport asks before it posts."""
    if replay is not None:

        return ReplayTransport(replay, schedule.stage_ranks, microbatches, device)
    # A pipeline that spans the world: every rank creates the group, and torch names it
    # from a count all ranks share. Otherwise (one replica of several) only the
    # pipeline's ranks do, and torch names it from its ranks and the number of groups
    # this rank has, which the pipeline's ranks share (same executors, same recoveries)
    # but which a destroyed group would lower and so repeat a live group's name: such a
    # pipeline keeps its broken groups (see FailureProtocol.recover).
    comm = transport_group(group, device, local=not spans_world, timeout=timeout)
    groups = [comm] if dp_size == 1 else [comm, dp_group]
    transport = Transport(comm, schedule.stage_ranks, microbatches, device,
                          FailureBoard.of(*groups), stopper=stopper)
    if boundary is not None:
        transport.boundary = boundary
    return transport


def exchange_shapes(example: PyTree | None, transport: Transport, *, schedule: Schedule,
                    rank: int, stages: Mapping[int, PipelineStage],
                    sharded: Mapping[int, ShardedStage], device: torch.device,
                    autocast: Callable[[], AbstractContextManager[object]],
                    recorder: SavedRecorder | None = None, target: PyTree | None = None,
                    loss_fn: Callable[..., torch.Tensor] | None = None,
                    kwargs: Mapping[str, object] | None = None) -> None:
    """Run each stage of this rank once on zeros, in stage order, passing what its output
    holds (the structure, shapes, dtypes, and which tensors carry a gradient) down the
    chain into ``transport.boundary`` (see :func:`pipeswap.runtime.executor.stage.output_meta`);
    ``example``: a microbatch of the inputs, on the rank of the first stage. ``recorder``:
    also record what each stage's forward saves (the last stage's with its loss on
    ``target``, a microbatch of the targets, by ``loss_fn``), for the host buffers to
    reserve. ``kwargs``: a microbatch's keyword arguments for every stage."""
    ranks = schedule.stage_ranks
    for index in range(schedule.num_stages):
        if ranks[index] != rank:
            continue
        if index == 0:
            assert example is not None
            meta, _ = BoundaryMeta.of(example, "the inputs")
            meta = meta.with_grads([False] * len(meta.leaves))
        elif ranks[index - 1] == rank:
            meta = transport.boundary[index - 1]
        else:
            meta = transport.boundary[index - 1] = transport.recv_meta(index)
        stage = stages[index]
        if stage.is_last and recorder is None:
            break
        gathered = sharded.get(index)
        if gathered is not None:  # gathered for the dry run alone, and freed again
            gathered.unshard()
            gathered.ready("the exchange of stage boundary shapes")
        try:
            if stage.is_last:
                assert recorder is not None and loss_fn is not None and target is not None
                recorder.last_stage(stage, meta, target, loss_fn, device, autocast, kwargs)
                break
            with recorder.stage(stage) if recorder is not None else nullcontext():
                boundary = output_meta(stage, meta, device, autocast, kwargs)
        finally:
            if gathered is not None:
                gathered.reshard()
        transport.boundary[index] = boundary
        if ranks[index + 1] != rank:
            transport.send_meta(index, boundary)
