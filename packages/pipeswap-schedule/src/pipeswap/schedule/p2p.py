"""Passes that place and batch point-to-point steps."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.lockstep import Visibility, Waiting, lockstep
from pipeswap.schedule.schedule import Message, Schedule
from pipeswap.schedule.steps import (
    ACTIVATION_CONSUMERS,
    COMM,
    COMPUTE,
    OVERLAPS,
    P2P,
    SENDS,
    Order,
    Step,
    StepType,
    chunk_leaf,
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
                out[r].append(chunk_leaf(StepType.FWD_SEND, stage, micro))
                out[rank_of[stage + 1]].append(chunk_leaf(StepType.FWD_RECV, stage + 1, micro))
            elif compute.type in ACTIVATION_CONSUMERS and stage > 0 and rank_of[stage - 1] != r:
                out[r].append(chunk_leaf(StepType.BWD_SEND, stage, micro))
                out[rank_of[stage - 1]].append(chunk_leaf(StepType.BWD_RECV, stage - 1, micro))
    return Schedule(tuple(tuple(o) for o in out), schedule.stage_ranks)


@gc_paused
def coalesce_p2p(schedule: Schedule) -> Schedule:
    """Batch adjacent P2P leaves into ``BATCH_P2P`` steps, both ends of each message alike.

    NCCL pairs an op posted in a batch on the group's communicator and one posted alone on
    the two ranks' own, so a message batched on one end only never arrives. Each rank's runs
    of adjacent P2P leaves are candidates; a leaf stays batched only while its counterpart
    (paired first in, first out per rank pair) is batched and a neighbour in its run is, so
    runs split where a leaf leaves them, until nothing changes. Batches already in the input
    stay as they are (splitting one could deadlock) and count as batched. Flattening the
    batches gives back the input exactly, so the P2P order (and with it deadlock freedom) is
    unchanged.
    """
    run, partner = _runs(schedule)
    return _rebuild(schedule, _batched_alike(run, partner))


def _runs(schedule: Schedule) -> tuple[list[int], list[int]]:
    """Every P2P leaf, numbered rank by rank in order: the run of adjacent loose leaves it is
    in (numbered by its first leaf; -1 for a leaf of an input batch), and its counterpart."""
    run: list[int] = []
    routes: dict[tuple[StepType, int | None], list[int] | None] = {}
    ends: dict[tuple[int, int, bool], list[int]] = {}
    for order in schedule.orders:
        previous: Step | None = None
        for step in order:
            if step is not None and step.type in COMM:
                for leaf in step.sub_steps or (step,):
                    key = (leaf.type, leaf.stage)
                    if key not in routes:
                        routes[key] = _channel_end(schedule, leaf, ends)
                    end = routes[key]
                    if end is not None:
                        end.append(len(run))
                    if step is leaf:
                        loose = previous is not None and previous.type in P2P
                        run.append(run[-1] if loose else len(run))
                    else:
                        run.append(-1)
            previous = step
    return run, _partners(ends, len(run))


def _rebuild(schedule: Schedule, batched: list[bool]) -> Schedule:
    """``schedule`` with each maximal span of adjacent ``batched`` leaves in one batch."""
    orders: list[tuple[Step | None, ...]] = []
    at = 0  # the number of the next P2P leaf
    for order in schedule.orders:
        out: list[Step | None] = []
        batch: list[Step] = []
        for step in order:
            if step is not None and step.type in COMM:
                if step.type in P2P and batched[at]:
                    batch.append(step)
                    at += 1
                    continue
                at += len(step.sub_steps) or 1
            if batch:
                _flush(batch, out)
            out.append(step)
        _flush(batch, out)
        orders.append(tuple(out))
    return Schedule(tuple(orders), schedule.stage_ranks)


def _channel_end(schedule: Schedule, leaf: Step,
                 ends: dict[tuple[int, int, bool], list[int]]) -> list[int] | None:
    """The list of ``leaf``'s kind of end (sends or receives) on its channel, or None for a
    leaf that talks to no other rank."""
    assert leaf.stage is not None  # a P2P leaf
    channel = schedule.channel(leaf.type, leaf.stage)
    return None if channel is None else ends.setdefault((*channel, leaf.type in SENDS), [])


def _partners(ends: dict[tuple[int, int, bool], list[int]], count: int) -> list[int]:
    """Each leaf's counterpart (-1 when it has none): the k-th send on a channel with the k-th
    receive, as an in-order transport pairs them."""
    partner = [-1] * count
    for (sender, receiver, is_send), sends in ends.items():
        if is_send:
            for send, recv in zip(sends, ends.get((sender, receiver, False), ())):
                partner[send], partner[recv] = recv, send
    return partner


def _batched_alike(run: list[int], partner: list[int]) -> list[bool]:
    """Which leaves to batch: the largest set in which each loose leaf has its counterpart
    and a neighbour in its run batched (leaves of input batches always are). Removing a leaf
    re-checks only its counterpart and neighbours, so the work is linear in the leaves."""
    count = len(run)
    batched = [r < 0 or (i > 0 and run[i - 1] == r) or (i + 1 < count and run[i + 1] == r)
               for i, r in enumerate(run)]
    work = [i for i in range(count) if batched[i] and run[i] >= 0]
    while work:
        i = work.pop()
        r = run[i]
        if r < 0 or not batched[i]:
            continue
        j = partner[i]
        left = i > 0 and run[i - 1] == r and batched[i - 1]
        right = i + 1 < count and run[i + 1] == r and batched[i + 1]
        if j >= 0 and batched[j] and (left or right):
            continue
        batched[i] = False
        work += [k for k in (j, i - 1, i + 1) if 0 <= k < count]
    return batched


def _flush(batch: list[Step], out: list[Step | None]) -> None:
    if len(batch) >= 2:
        out.append(Step(StepType.BATCH_SEND_RECV, sub_steps=tuple(batch)))
    else:
        out += batch
    batch.clear()


@gc_paused
def insert_send_recv_early(schedule: Schedule) -> Schedule:
    """Add sends and receives to compute orders the way PyTorch's pipeline runtime lowers a
    compute-only schedule by default: receives posted early, where a run of all ranks
    together reaches them.

    Ranks take turns in rank order, one item a turn; a compute waits until its input exists
    (received, or made by a neighbouring stage on this rank). A compute enters its order
    followed by a send for each output another rank needs, and the matching receive enters
    the receiver's order at that moment, so a rank whose turn comes later in the same round
    can already use it. Idle slots take no turn; the FSDP actions PyTorch adds to every order
    before lowering each take one (see :func:`pytorch_turns`), so that for the same compute
    orders the result equals PyTorch's, step for step. Each pair of ranks then posts its
    messages in one order on both ends, which an in-order transport (NCCL) needs.
    """
    _require_compute_only(schedule, "insert_send_recv_early")
    micros = schedule.num_microbatches
    last = schedule.num_stages - 1
    out: list[list[Step | None]] = [[] for _ in schedule.orders]

    stage_ranks = schedule.stage_ranks

    def needs(step: Step | None) -> Sequence[Message]:
        if step is None:
            return ()
        if not step.sub_steps:  # most steps: one compute, at most one input
            needed = _input(step, last)
            return () if needed is None else (needed,)
        return [m for m in map(_input, step.sub_steps, repeat(last)) if m]

    def take(rank: int, step: Step | None) -> list[Message]:
        if step is None:
            return []
        mine = out[rank]
        mine.append(step)
        made = []
        for leaf in step.sub_steps or (step,):
            stage, micro = leaf.stage, leaf.micro
            assert stage is not None and micro is not None  # compute leaves
            forward = leaf.type is StepType.FWD
            made.append(Message(forward, stage, micro))
            if forward:  # as Schedule.remote_output, inline: this runs once per compute
                peer = stage_ranks[stage + 1] if stage < last else rank
                if peer != rank:
                    mine.append(chunk_leaf(StepType.FWD_SEND, stage, micro))
                    out[peer].append(chunk_leaf(StepType.FWD_RECV, stage + 1, micro))
            elif leaf.type in ACTIVATION_CONSUMERS and stage > 0 and (
                    stage_ranks[stage - 1] != rank):
                mine.append(chunk_leaf(StepType.BWD_SEND, stage, micro))
                out[stage_ranks[stage - 1]].append(chunk_leaf(StepType.BWD_RECV, stage - 1, micro))
        return made

    turns = [pytorch_turns(order, micros) for order in schedule.orders]
    waiting = lockstep(turns, needs, take, visibility=Visibility.AT_ONCE)
    if waiting:
        _cannot_run(waiting)
    return Schedule(tuple(tuple(order) for order in out), schedule.stage_ranks)


def pytorch_turns(order: Order, microbatches: int) -> list[Step | None]:
    """A compute order as PyTorch's runtime hands it to its send/recv lowering: idle slots
    dropped, and a turn (``None``) for each UNSHARD, RESHARD and REDUCE_GRAD it inserts
    first. Those turns delay the rank within the lowering's rounds, so they decide where
    receives land. PyTorch keeps up to three stages gathered, chosen by looking ahead; a
    stage's gradients are reduced after its ``microbatches``-th B or W.
    """
    computes = [step for step in order if step is not None]
    turns: list[Step | None] = []
    gathered: tuple[int, ...] = ()
    reductions: dict[int | None, int] = {}
    for step, upcoming in zip(computes, _upcoming_stages(computes, 3)):
        if upcoming is not gathered:  # equal answers are one tuple: nothing to count
            turns += [None] * (sum(s not in upcoming for s in gathered)
                               + sum(s not in gathered for s in upcoming))
            gathered = upcoming
        turns.append(step)
        for leaf in step.sub_steps or (step,):  # computes and overlaps only
            if leaf.type in _PARAM_GRADS:
                done = reductions[leaf.stage] = reductions.get(leaf.stage, 0) + 1
                if done == microbatches:
                    turns.append(None)
    return turns


def _upcoming_stages(computes: list[Step], count: int) -> list[tuple[int, ...]]:
    """For each position, the first ``count`` distinct stages from there on, as PyTorch's
    FSDP lowering looks ahead (it checks the count only after a whole overlap); equal
    answers are the same tuple.

    Where fewer than ``count`` stages remain, the look-ahead runs to the end: those answers
    come from one backward pass, so the whole costs time linear in the order's length
    rather than quadratic.
    """
    known: dict[tuple[int, ...], tuple[int, ...]] = {}
    ahead: dict[tuple[int | tuple[int, ...], tuple[int, ...]], tuple[int, ...]] = {}
    tails: list[tuple[int, ...]] = [()] * (len(computes) + 1)
    for index in range(len(computes) - 1, -1, -1):
        step, after = computes[index], tails[index + 1]
        here: int | tuple[int, ...] = (tuple(leaf.key[0] for leaf in step.sub_steps)
                                       if step.sub_steps else step.key[0])
        tail = ahead.get((here, after))
        if tail is None:
            first = list(here) if isinstance(here, tuple) else [here]
            tail = tuple(dict.fromkeys(first + list(after)))
            tail = ahead[here, after] = known.setdefault(tail, tail)
        tails[index] = tail
    result = []
    for index in range(len(computes)):
        if len(tails[index]) < count:
            result.append(tails[index])
            continue
        seen: list[int] = []
        for step in computes[index:]:
            for leaf in step.sub_steps or (step,):
                stage = leaf.key[0]
                if stage not in seen:
                    seen.append(stage)
            if len(seen) >= count:
                break
        result.append(known.setdefault(tuple(seen), tuple(seen)))
    return result


@gc_paused
def insert_send_recv_by_dependency(schedule: Schedule) -> Schedule:
    """Add sends and receives to compute orders, each receive right before the compute that
    consumes it (PyTorch calls this placement deferred receives).

    Ranks take turns, one step a turn; a step whose remote inputs were not sent in an
    earlier round waits. The step enters the order behind a receive for each input from
    another rank, and before a send for each output another rank needs. Every receive is
    then posted after its send in the ranks' common time, which runs with tagged transfers
    (gloo); an in-order transport may deadlock on it: use :func:`insert_send_recv_early`
    there.
    """
    _require_compute_only(schedule, "insert_send_recv_by_dependency")
    result: list[list[Step | None]] = [[] for _ in schedule.orders]

    def needs(step: Step | None) -> list[Message]:
        return [] if step is None else [
            m for m in map(schedule.remote_input, step.compute_leaves) if m is not None]

    def take(rank: int, step: Step | None) -> list[Message]:
        if step is None:
            result[rank].append(None)
            return []
        for activation, sender, micro in needs(step):
            result[rank].append(Step(StepType.FWD_RECV, sender + 1, micro) if activation
                                else Step(StepType.BWD_RECV, sender - 1, micro))
        result[rank].append(step)
        made = []
        for leaf in step.compute_leaves:
            output = schedule.remote_output(leaf)
            if output is not None:
                result[rank].append(_pair(output)[0])
                made.append(output)
        return made

    waiting = lockstep(schedule.orders, needs, take, visibility=Visibility.NEXT_ROUND)
    if waiting:
        _cannot_run(waiting)
    return Schedule(tuple(tuple(order) for order in result), schedule.stage_ranks)


_PARAM_GRADS = frozenset({StepType.BWD, StepType.BWD_WEIGHT})


def _require_compute_only(schedule: Schedule, name: str) -> None:
    for order in schedule.orders:
        for step in order:
            if step is not None and step.type not in COMPUTE and step.type not in OVERLAPS:
                raise ScheduleError(
                    f"{name} takes compute-only orders (F, B, I, W, overlaps, idle slots); "
                    f"found {step}: lower the compute orders before any other pass")


def _input(leaf: Step, last: int) -> Message | None:
    """What ``leaf`` needs from a neighbouring stage, on this rank or another."""
    stage, micro = leaf.key
    if leaf.type is StepType.FWD:
        return Message(True, stage - 1, micro) if stage > 0 else None
    if leaf.type in ACTIVATION_CONSUMERS:
        return Message(False, stage + 1, micro) if stage < last else None
    return None


def _pair(message: Message) -> tuple[Step, Step]:
    """The send and the receive that move ``message``."""
    activation, sender, micro = message
    if activation:
        return (Step(StepType.FWD_SEND, sender, micro), Step(StepType.FWD_RECV, sender + 1, micro))
    return (Step(StepType.BWD_SEND, sender, micro), Step(StepType.BWD_RECV, sender - 1, micro))


def _cannot_run(waiting: list[Waiting[Step | None]]) -> None:
    stuck = ", ".join(f"rank {w.rank} at {w.item} (waits for the "
                      f"{'activation' if w.missing.activation else 'gradient'} of stage "
                      f"{w.missing.sender} micro {w.missing.micro})" for w in waiting)
    raise ScheduleError(f"the compute orders cannot run together: {stuck}; no rank produces "
                        "these first. Reorder the computes so each input is made before the "
                        "step that needs it")
