"""Passes that place and batch point-to-point steps."""

from __future__ import annotations

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Message, Schedule
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


@gc_paused
def insert_send_recv_by_dependency(schedule: Schedule) -> Schedule:
    """Add sends and receives to compute orders by running all ranks together.

    Each tick, every rank takes its next step if the inputs of its computes are there: made
    earlier on this rank, or sent by another rank in an earlier tick. The step enters the
    order behind a receive for each input from another rank, and before a send for each
    output another rank needs. A rank whose next step must wait loses the tick. This suits
    orders that are not aligned in time columns (DualPipeV, ZBV, zero bubble), and gives
    every send a receive that is posted after it in the ranks' common time, so the result
    runs under the validator's rendezvous model too.
    """
    orders = schedule.orders
    position = [0] * len(orders)
    result: list[list[Step | None]] = [[] for _ in orders]
    sent: set[Message] = set()

    while any(p < len(o) for p, o in zip(position, orders)):
        now: set[Message] = set()
        moved = False
        for rank, order in enumerate(orders):
            if position[rank] >= len(order):
                continue
            step = order[position[rank]]
            if step is None:
                result[rank].append(None)
                position[rank] += 1
                moved = True
                continue
            leaves = step.compute_leaves
            inputs = [i for i in map(schedule.remote_input, leaves) if i is not None]
            if any(i not in sent for i in inputs):
                continue
            for activation, sender, micro in inputs:
                result[rank].append(Step(StepType.FWD_RECV, sender + 1, micro) if activation
                                    else Step(StepType.BWD_RECV, sender - 1, micro))
            result[rank].append(step)
            for leaf in leaves:
                output = schedule.remote_output(leaf)
                if output is not None:
                    result[rank].append(Step(
                        StepType.FWD_SEND if output.activation else StepType.BWD_SEND,
                        output.sender, output.micro))
                    now.add(output)
            position[rank] += 1
            moved = True
        if not moved:
            stuck = ", ".join(f"rank {r} at {orders[r][p]}" for r, p in enumerate(position)
                              if p < len(orders[r]))
            raise ScheduleError(f"the compute orders cannot run together: {stuck} all wait "
                                "for inputs no rank will produce first")
        sent |= now
    return Schedule(tuple(tuple(order) for order in result), schedule.stage_ranks)
