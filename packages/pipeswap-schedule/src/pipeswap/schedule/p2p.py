"""Passes that place and batch point-to-point steps."""

from __future__ import annotations

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import (
    ACTIVATION_CONSUMERS,
    COMPUTE,
    OVERLAPS,
    P2P,
    Order,
    Step,
    StepType,
)


@gc_paused
def insert_send_recv(schedule: Schedule) -> Schedule:
    """Add sends and receives to aligned compute columns (column t = time t on every rank).

    After column t's compute, each forward at stage s sends to stage s+1 and each backward
    sends to stage s-1 (unless the neighbour is on the same rank); the receive goes to the
    neighbour's order at the same point, so it precedes the neighbour's column t+1. Ranks are
    visited even ones first, then odd ones, which gives every adjacent pair one recv-first and
    one send-first end. An overlap fills two columns: its first sub-step's P2P follows column
    t, its second's column t+1.
    """
    ranks, num_stages = schedule.num_ranks, schedule.num_stages
    rank_of = schedule.stage_ranks
    # Per rank and column: what enters the order there (an overlap enters once, at its first
    # column, so its second column holds nothing), and the compute leaf whose P2P follows.
    entries: list[list[list[Step | None]]] = []
    leaves: list[list[Step | None]] = []
    for order in schedule.orders:
        entry: list[list[Step | None]] = []
        leaf: list[Step | None] = []
        for step in order:
            if step is not None and step.type not in COMPUTE:
                if step.type not in OVERLAPS:
                    raise ScheduleError(
                        f"insert_send_recv takes compute-only orders (F, B, I, W, overlaps, "
                        f"idle slots); found {step}: run it before any other pass")
                entry += [[step], []]
                leaf += step.sub_steps
            else:
                entry.append([step])
                leaf.append(step)
        entries.append(entry)
        leaves.append(leaf)
    visit = list(range(0, ranks, 2)) + list(range(1, ranks, 2))
    out: list[list[Step | None]] = [[] for _ in range(ranks)]
    for t in range(max(len(leaf) for leaf in leaves)):
        for r in range(ranks):
            if t < len(entries[r]):
                out[r] += entries[r][t]
        for r in visit:
            if t >= len(leaves[r]) or (compute := leaves[r][t]) is None:
                continue
            stage, micro = compute.key
            if compute.type is StepType.FWD and stage + 1 < num_stages and rank_of[stage + 1] != r:
                out[r].append(Step(StepType.FWD_SEND, stage, micro))
                out[rank_of[stage + 1]].append(Step(StepType.FWD_RECV, stage + 1, micro))
            elif compute.type in ACTIVATION_CONSUMERS and stage > 0 and rank_of[stage - 1] != r:
                out[r].append(Step(StepType.BWD_SEND, stage, micro))
                out[rank_of[stage - 1]].append(Step(StepType.BWD_RECV, stage - 1, micro))
    return Schedule(tuple(tuple(o) for o in out), schedule.stage_ranks)


@gc_paused
def coalesce_p2p(schedule: Schedule) -> Schedule:
    """Replace each run of two or more adjacent P2P leaves by one ``BATCH_P2P`` step.

    Flattening the batches gives back the input exactly, so the P2P order (and with it
    deadlock freedom) is unchanged.
    """
    return schedule.map_orders(lambda _rank, order: _coalesce(order))


def _coalesce(order: Order) -> list[Step | None]:
    out: list[Step | None] = []
    run: list[Step] = []
    for step in order:
        if step is not None and step.type in P2P:
            run.append(step)
            continue
        if run:
            _flush(run, out)
        out.append(step)
    _flush(run, out)
    return out


def _flush(run: list[Step], out: list[Step | None]) -> None:
    if len(run) >= 2:
        out.append(Step(StepType.BATCH_SEND_RECV, sub_steps=tuple(run)))
    else:
        out += run
    run.clear()
