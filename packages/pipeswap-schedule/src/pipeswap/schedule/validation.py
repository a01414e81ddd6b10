"""Validation: every rank's order on its own, every stage running every microbatch, then all
ranks' sends and receives together under a transport.

:func:`validate` raises the first problem as a typed :class:`ValidationError` whose message
names the rank, the step and what to change. The checks of one order are in
:mod:`pipeswap.schedule.order_checks`, the runs of all ranks in
:mod:`pipeswap.schedule.transport_models`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, NoReturn, get_args

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule._numbering import SHOWN, gaps
from pipeswap.schedule.errors import (
    ChunkOrderError,
    DeadlockError,
    P2PError,
    SwapLifecycleError,
    ValidationError,
)
from pipeswap.schedule.order_checks import check_rank
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import ChunkKey, Order, StepType
from pipeswap.schedule.transport_models import check_batches_alike, simulate_p2p, simulate_tagged


#: How sends and receives meet. ``ordered``: a send waits for its receive and the messages
#: between two ranks pair first in, first out (HCCL; MindSpore hyper-parallel's model; NCCL
#: when every op goes through ``batch_isend_irecv``, as the pipeswap runtime posts them).
#: ``nccl``: ``ordered``, and both ends of every message posted alike, inside a batch or
#: alone, for an executor that posts a lone op with plain ``isend``/``irecv``: NCCL pairs
#: the two kinds on different communicators. ``tagged``: a send never waits and a message
#: meets the receive with its tag (gloo, as the pipeswap runtime tags every message); only a
#: compute waits, for the data it receives.
TransportModel = Literal["ordered", "nccl", "tagged"]
TRANSPORTS: tuple[TransportModel, ...] = get_args(TransportModel)


@gc_paused
def validate(
    schedule: Schedule, *, transport: TransportModel = "ordered", microbatches: int | None = None,
    layers: int | Mapping[int, int] | None = None,
) -> None:
    """Check every rank's order, that every stage computes every microbatch (``microbatches``
    of them, when given), then run all ranks' P2P together under ``transport``.

    ``layers`` is the layer count of one chunk of every stage (an int) or of some stages (a
    mapping by stage): a streamed swap's layer lag must not exceed it, nor a recompute's
    layers. A schedule does not carry layer counts, so without them a lag is only checked to
    be at least 1."""
    if transport not in TRANSPORTS:
        raise ValidationError(f"unknown transport {transport!r}; use one of {TRANSPORTS}")
    if microbatches is not None and not _is_count(microbatches):
        raise ValidationError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    per_stage = _layer_counts(layers)
    if schedule.num_stages == 0:
        raise ValidationError("the schedule has no steps: every rank's order is empty or idle")
    forwards = [check_rank(schedule, rank)[StepType.FWD] for rank in range(schedule.num_ranks)]
    _check_complete(schedule, forwards, microbatches)
    if per_stage is not None:
        check_layer_counts(schedule, lambda key: per_stage(key[0]),
                         "one chunk of stage {stage} has {layers} layer(s)")
    if transport == "tagged":
        try:  # what runs with sends paired in order runs with tags too, and is checked faster
            simulate_p2p(schedule)
        except ValidationError:
            simulate_tagged(schedule)
        return
    _run_ordered(schedule)
    if transport == "nccl":
        check_batches_alike(schedule)


def _run_ordered(schedule: Schedule) -> None:
    """:func:`simulate_p2p`, its error saying so when tagged transfers would run it."""
    try:
        simulate_p2p(schedule)
    except (DeadlockError, P2PError) as exc:
        try:
            simulate_tagged(schedule)
        except ValidationError:
            raise exc from None
        hint = (" (with tagged transfers, as gloo has, it runs: validate with "
                "transport='tagged', --transport tagged on the command line; on NCCL it would "
                "hang: lower compute orders with the early lowering for NCCL)")
        if isinstance(exc, DeadlockError):
            raise DeadlockError(str(exc) + hint, exc.cycle) from None
        raise P2PError(str(exc) + hint, rank=exc.rank) from None


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 1


def _layer_counts(layers: int | Mapping[int, int] | None) -> Callable[[int], int | None] | None:
    """``validate``'s ``layers`` as a stage's count (None where a mapping has none)."""
    if layers is None:
        return None
    if isinstance(layers, int) and _is_count(layers):
        every = layers
        return lambda stage: every
    if isinstance(layers, Mapping):
        bad = next(((stage, count) for stage, count in layers.items()
                    if type(stage) is not int or not _is_count(count)), None)
        if bad is None:
            return layers.get
        shown = f"{{{bad[0]!r}: {bad[1]!r}, ...}}"
    else:
        shown = repr(layers)
    raise ValidationError(f"layers must be an integer >= 1 or a mapping of stage to an "
                          f"integer >= 1 (the layers of one chunk), got {shown}")


def check_layer_counts(schedule: Schedule, layers: Callable[[ChunkKey], int | None],
                       counted: str) -> None:
    """Refuse a streamed swap (SO or SL) whose layer lag exceeds its chunk's ``layers``
    (None: not known), and a recompute (RC) naming a layer the chunk does not have. A lag
    counts layers of the chunk (SO: layer k leaves when the forward ends layer k + lag, the
    last lag at WO; SL: the backward loads layer k - lag as it starts layer k), so either is
    a schedule made for another model. ``counted`` says where the count comes
    from, with ``{stage}`` and ``{layers}`` in it. One look at each step."""
    for rank, order in enumerate(schedule.orders):
        check_order_layer_counts(rank, order, layers, counted)


def check_order_layer_counts(rank: int, order: Order,
                             layers: Callable[[ChunkKey], int | None], counted: str) -> None:
    """:func:`check_layer_counts` of one rank's order."""
    stream, load, recompute = (StepType.SWAP_STREAM_OFFLOAD, StepType.SWAP_STREAM_LOAD,
                               StepType.RECOMPUTE)
    for position, step in enumerate(order):
        if step is None or (step.type is not stream and step.type is not recompute
                            and step.type is not load):
            continue
        count = layers(step.key)
        if count is None:
            continue
        stage, micro = step.key
        if step.type is recompute:
            assert step.layers is not None  # Step gives every RC its layers
            if step.layers[-1] >= count:
                raise ChunkOrderError(
                    f"rank {rank}: {step} (position {position}) recomputes layer "
                    f"{step.layers[-1]} of (stage {stage}, micro {micro}), but "
                    + counted.format(stage=stage, layers=count)
                    + f"; name layers from 0 to {count - 1}", rank=rank)
            continue
        lag = step.lag
        assert lag is not None  # Step gives every SO and SL a lag >= 1
        if lag > count:
            code = step.type.value
            raise SwapLifecycleError(
                f"rank {rank}: {step} (position {position}) streams (stage {stage}, micro "
                f"{micro}) with a layer lag of {lag}, but "
                + counted.format(stage=stage, layers=count)
                + f"; give a lag from 1 to {count} ({stage}{code}{micro}:{count}), or swap "
                f"the chunk whole ({stage}LO{micro} ... {stage}LL{micro})", rank=rank)


def _check_complete(schedule: Schedule, forwards: list[dict[ChunkKey, int]],
                    microbatches: int | None) -> None:
    """Every stage forwards every micro of ``0..M-1``, M being ``microbatches`` or else the
    highest micro + 1: a schedule that skips one would train on part of the batch.

    ``forwards`` holds each rank's forward positions by chunk, from :func:`check_rank`, which
    also pairs each forward with one backward (B, or I then W) and refuses duplicates; so
    counting forwards per stage suffices, and costs one look at each chunk.
    """
    counts = [0] * schedule.num_stages
    highest = -1
    for positions in forwards:
        for stage, micro in positions:
            counts[stage] += 1
            if micro > highest:
                highest = micro
    found = highest + 1
    if found == 0:
        raise ChunkOrderError("the schedule computes nothing: add each stage's forwards and "
                              "backwards")
    if microbatches is not None and found != microbatches:
        fix = (f"add the steps of micro {found}..{microbatches - 1} to every stage"
               if found < microbatches else f"drop the steps of micro {microbatches} and above")
        raise ChunkOrderError(
            f"the schedule runs {found} microbatches (micro 0..{found - 1}), not the "
            f"{microbatches} expected: {fix}, or give {found} as the microbatch count")
    short = [stage for stage, count in enumerate(counts) if count != found]
    if short:
        _report_missing(schedule, forwards, short, found)


def _report_missing(schedule: Schedule, forwards: list[dict[ChunkKey, int]],
                    stages: list[int], micros: int) -> NoReturn:
    """Name the first chunks absent from ``stages`` (each forwards fewer than ``micros``)."""
    forwarded: dict[int, set[int]] = {stage: set() for stage in stages}
    for rank in {schedule.stage_ranks[stage] for stage in stages}:
        for stage, micro in forwards[rank]:
            if stage in forwarded:
                forwarded[stage].add(micro)
    chunks = [(stage, micro) for stage in stages for micro in gaps(forwarded[stage], micros)]
    total = sum(micros - len(forwarded[stage]) for stage in stages)
    named = ", ".join(f"(stage {s}, micro {m})" for s, m in chunks[:SHOWN])
    more = f" and {total - SHOWN} more" if total > SHOWN else ""
    stage, micro = chunks[0]
    rank = schedule.stage_ranks[stage]
    raise ChunkOrderError(
        f"the schedule runs micro 0..{micros - 1} but never computes chunk(s) {named}{more}; "
        f"every stage forwards and backwards each microbatch once: add {stage}F{micro} and "
        f"{stage}B{micro} (or {stage}I{micro} then {stage}W{micro}) to rank {rank}'s order",
        rank=rank)

