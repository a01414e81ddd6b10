"""Validation: per-rank well-formedness and a cross-rank P2P simulation.

:func:`validate` raises the first problem as a typed :class:`ValidationError` whose message
names the rank, the step and what to change. The cross-rank simulation treats every send and
receive as a rendezvous (the strictest transport: a send completes only when its receive is
posted), matches them first-in first-out per ordered rank pair, and reports a deadlock as the
cycle of ranks waiting on each other.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pipeswap.schedule.errors import (
    ChunkOrderError,
    DeadlockError,
    P2PError,
    SwapLifecycleError,
    ValidationError,
)
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import COMPOSITES, P2P, SENDS, SWAP, Order, Step, StepType

ChunkKey = tuple[int, int]
_SWAP_SEQUENCE = (
    StepType.SWAP_LAUNCH_OFFLOAD,
    StepType.SWAP_WAIT_OFFLOAD,
    StepType.SWAP_LAUNCH_LOAD,
    StepType.SWAP_WAIT_LOAD,
)


def validate(schedule: Schedule) -> None:
    """Check every rank's order, then simulate all ranks' P2P together."""
    for rank in range(schedule.num_ranks):
        validate_rank(schedule, rank)
    simulate_p2p(schedule)


@dataclass
class _Chunk:
    """Where a chunk's steps sit in one order (container indices)."""

    fwd: list[int] = field(default_factory=list)
    consumer: list[tuple[int, StepType]] = field(default_factory=list)  # B or I
    weight: list[int] = field(default_factory=list)
    swap: dict[StepType, list[int]] = field(default_factory=dict)
    p2p: dict[StepType, list[int]] = field(default_factory=dict)


def validate_rank(schedule: Schedule, rank: int) -> None:
    """Check one rank's order on its own.

    Every step's stage lives on this rank; each forwarded chunk has exactly one backward
    after it (B, or I followed by W); swapped chunks run ``F < LO < WO < LL < WL <
    backward``; P2P steps go to a remote neighbour, receives precede the compute that needs
    them and sends follow the compute that produces them.
    """
    order = schedule.orders[rank]
    chunks: dict[ChunkKey, _Chunk] = {}
    for index, step in enumerate(order):
        if step is None:
            continue
        for leaf in step.sub_steps or (step,):
            _check_placement(schedule, rank, leaf, step)
            if leaf.micro is None:
                continue
            chunk = chunks.setdefault(leaf.key, _Chunk())
            kind = leaf.type
            if kind is StepType.FWD:
                chunk.fwd.append(index)
            elif kind in (StepType.BWD, StepType.BWD_INPUT):
                chunk.consumer.append((index, kind))
            elif kind is StepType.BWD_WEIGHT:
                chunk.weight.append(index)
            elif kind in SWAP:
                if step.type in COMPOSITES:
                    raise SwapLifecycleError(
                        f"rank {rank}: swap step {leaf} sits inside {step}; swap steps go "
                        "between steps, never inside a composite", rank=rank)
                chunk.swap.setdefault(kind, []).append(index)
            else:
                chunk.p2p.setdefault(kind, []).append(index)
    for key, chunk in chunks.items():
        _check_compute(rank, order, key, chunk)
        if chunk.swap:
            _check_swap(rank, order, key, chunk)
        _check_p2p(schedule, rank, order, key, chunk)


def _check_placement(schedule: Schedule, rank: int, leaf: Step, container: Step) -> None:
    assert leaf.stage is not None
    if leaf.stage >= schedule.num_stages or schedule.stage_ranks[leaf.stage] != rank:
        where = (f"runs on rank {schedule.stage_ranks[leaf.stage]}"
                 if leaf.stage < schedule.num_stages
                 else f"does not exist (stages 0..{schedule.num_stages - 1})")
        raise ChunkOrderError(
            f"rank {rank}: {container} names stage {leaf.stage}, which {where}; each rank's "
            "order holds only its own stages' steps", rank=rank)
    if leaf.type not in P2P:
        return
    peer_stage = leaf.stage + (1 if leaf.type in (StepType.FWD_SEND, StepType.BWD_RECV) else -1)
    if not 0 <= peer_stage < schedule.num_stages:
        raise P2PError(
            f"rank {rank}: {leaf} talks to stage {peer_stage}, which does not exist; drop it",
            rank=rank)
    if schedule.stage_ranks[peer_stage] == rank:
        raise P2PError(
            f"rank {rank}: {leaf} talks to stage {peer_stage} on the same rank; local "
            "neighbours exchange tensors without P2P, drop it", rank=rank)


def _fmt(order: Order, index: int) -> str:
    return f"{order[index]} (position {index})"


def _check_compute(rank: int, order: Order, key: ChunkKey, chunk: _Chunk) -> None:
    stage, micro = key
    name = f"rank {rank}: chunk (stage {stage}, micro {micro})"
    if len(chunk.fwd) > 1 or len(chunk.consumer) > 1 or len(chunk.weight) > 1:
        raise ChunkOrderError(f"{name} runs a forward or backward step twice", rank=rank)
    if not chunk.fwd and (chunk.consumer or chunk.weight):
        raise ChunkOrderError(f"{name} has a backward but no forward on this rank", rank=rank)
    if not chunk.fwd:
        return
    if not chunk.consumer:
        raise ChunkOrderError(
            f"{name} is forwarded at {_fmt(order, chunk.fwd[0])} but never backwarded: add "
            f"{stage}B{micro} (or {stage}I{micro} then {stage}W{micro})", rank=rank)
    (c_index, c_kind), f_index = chunk.consumer[0], chunk.fwd[0]
    if c_index <= f_index:
        raise ChunkOrderError(
            f"{name}: backward {_fmt(order, c_index)} must come after forward "
            f"{_fmt(order, f_index)}", rank=rank)
    if c_kind is StepType.BWD and chunk.weight:
        raise ChunkOrderError(
            f"{name} has a full backward B and a weight backward W; use B alone, or I then W",
            rank=rank)
    if c_kind is StepType.BWD_INPUT:
        if not chunk.weight:
            raise ChunkOrderError(
                f"{name} computes dx ({stage}I{micro}) but never dw: add {stage}W{micro} after it",
                rank=rank)
        if chunk.weight[0] <= c_index:
            raise ChunkOrderError(
                f"{name}: dw {_fmt(order, chunk.weight[0])} must come after dx "
                f"{_fmt(order, c_index)}", rank=rank)


def _check_swap(rank: int, order: Order, key: ChunkKey, chunk: _Chunk) -> None:
    stage, micro = key
    name = f"rank {rank}: swapped chunk (stage {stage}, micro {micro})"
    codes = " < ".join(f"{stage}{t.value}{micro}" for t in _SWAP_SEQUENCE)
    expected = f"{stage}F{micro} < {codes} < its backward"
    for kind in _SWAP_SEQUENCE:
        count = len(chunk.swap.get(kind, []))
        if count != 1:
            raise SwapLifecycleError(
                f"{name} has {count} {stage}{kind.value}{micro} step(s); a swapped chunk needs "
                f"exactly one of each: {expected}", rank=rank)
    if not chunk.fwd or not chunk.consumer:
        raise SwapLifecycleError(
            f"{name} needs its forward and backward on this rank: {expected}", rank=rank)
    positions = [chunk.fwd[0]] + [chunk.swap[k][0] for k in _SWAP_SEQUENCE]
    positions.append(chunk.consumer[0][0])
    for earlier, later in zip(positions, positions[1:]):
        if later <= earlier:
            raise SwapLifecycleError(
                f"{name}: {_fmt(order, later)} comes before {_fmt(order, earlier)}; "
                f"the order must be {expected}", rank=rank)


def _check_p2p(schedule: Schedule, rank: int, order: Order, key: ChunkKey, chunk: _Chunk) -> None:
    stage, micro = key
    ranks = schedule.stage_ranks
    remote_prev = stage > 0 and ranks[stage - 1] != rank
    remote_next = stage + 1 < schedule.num_stages and ranks[stage + 1] != rank
    consumer = chunk.consumer[0][0] if chunk.consumer else None
    fwd = chunk.fwd[0] if chunk.fwd else None
    expectations = (
        (StepType.FWD_RECV, remote_prev, fwd, "before", "forward"),
        (StepType.FWD_SEND, remote_next, fwd, "after", "forward"),
        (StepType.BWD_RECV, remote_next, consumer, "before", "backward"),
        (StepType.BWD_SEND, remote_prev, consumer, "after", "backward"),
    )
    for kind, needed, compute, side, what in expectations:
        found = chunk.p2p.get(kind, [])
        token = f"{stage}{kind.value}{micro}"
        if compute is None:
            if found:
                raise P2PError(f"rank {rank}: {token} has no {what} of (stage {stage}, micro "
                               f"{micro}) on this rank", rank=rank)
            continue
        if needed and len(found) != 1:
            raise P2PError(
                f"rank {rank}: the {what} {_fmt(order, compute)} needs exactly one {token} "
                f"{side} it, found {len(found)}", rank=rank)
        if not needed and found:
            raise P2PError(f"rank {rank}: {token} is not needed here", rank=rank)
        if found and (found[0] > compute if side == "before" else found[0] < compute):
            raise P2PError(
                f"rank {rank}: {_fmt(order, found[0])} must come {side} the {what} "
                f"{_fmt(order, compute)}", rank=rank)


@dataclass
class _RankState:
    pc: int = 0
    pending: list[tuple[tuple[int, int], int, bool]] = field(default_factory=list)
    posted: bool = False


def simulate_p2p(schedule: Schedule) -> None:
    """Run all ranks' P2P as rendezvous and raise on a mismatch, a dangling op or a deadlock."""
    ranks = schedule.stage_ranks
    orders = schedule.orders
    # Per ordered rank pair: what each send carries and what each receive expects, in order.
    sent: dict[tuple[int, int], list[Step]] = {}
    received: dict[tuple[int, int], list[Step]] = {}
    states = [_RankState() for _ in orders]
    queue = deque(range(len(orders)))

    while queue:
        rank = queue.popleft()
        state, order = states[rank], orders[rank]
        while state.pc < len(order):
            step = order[state.pc]
            leaves = step.p2p_leaves if step is not None else ()
            if not leaves:
                state.pc += 1
                continue
            if not state.posted:
                state.posted = True
                for leaf in leaves:
                    peer = _peer(ranks, leaf)
                    is_send = leaf.type in SENDS
                    channel = (rank, peer) if is_send else (peer, rank)
                    mine, theirs = (sent, received) if is_send else (received, sent)
                    queue_mine = mine.setdefault(channel, [])
                    queue_mine.append(leaf)
                    index = len(queue_mine) - 1
                    other = theirs.get(channel, [])
                    if index < len(other):
                        _check_match(leaf, other[index], channel, index, is_send)
                        queue.append(peer)
                    state.pending.append((channel, index, is_send))
            state.pending = [
                p for p in state.pending
                if len((received if p[2] else sent).get(p[0], [])) <= p[1]
            ]
            if state.pending:
                break
            state.posted = False
            state.pc += 1
    blocked = [r for r, s in enumerate(states) if s.pc < len(orders[r])]
    if blocked:
        _report_stuck(schedule, states, blocked[0])


def _peer(stage_ranks: tuple[int, ...], step: Step) -> int:
    stage = step.stage
    assert stage is not None
    to_next = step.type in (StepType.FWD_SEND, StepType.BWD_RECV)
    return stage_ranks[stage + 1 if to_next else stage - 1]


def _payload(step: Step) -> str:
    """What a P2P leaf carries: the activation or gradient of one sending stage and micro."""
    stage, micro = step.key
    if step.type in (StepType.FWD_SEND, StepType.FWD_RECV):
        sender = stage if step.type is StepType.FWD_SEND else stage - 1
        return f"activation of stage {sender} micro {micro}"
    sender = stage if step.type is StepType.BWD_SEND else stage + 1
    return f"gradient of stage {sender} micro {micro}"


def _check_match(
    leaf: Step, other: Step, channel: tuple[int, int], index: int, is_send: bool
) -> None:
    send, recv = (leaf, other) if is_send else (other, leaf)
    if _payload(send) != _payload(recv):
        src, dst = channel
        nth = _ordinal(index + 1)
        raise P2PError(
            f"rank {src}'s {nth} send to rank {dst} is {send} (the {_payload(send)}) but rank "
            f"{dst}'s {nth} receive from rank {src} is {recv} (expecting the {_payload(recv)}); "
            "sends and receives between two ranks must come in the same order", rank=dst)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _report_stuck(schedule: Schedule, states: list[_RankState], start: int) -> None:
    def waiting(rank: int) -> tuple[str, int]:
        state = states[rank]
        channel, _, is_send = state.pending[0]
        step = schedule.orders[rank][state.pc]
        return str(step), channel[1] if is_send else channel[0]

    path: list[int] = []
    seen: dict[int, int] = {}
    rank = start
    while rank not in seen:
        seen[rank] = len(path)
        path.append(rank)
        step, peer = waiting(rank)
        if states[peer].pc >= len(schedule.orders[peer]):
            raise P2PError(
                f"rank {rank} waits at {step} for rank {peer}, whose order ends without the "
                f"matching {'receive' if 'SEND' in step else 'send'}; add it to rank {peer} or "
                f"drop {step}", rank=rank)
        rank = peer
    cycle_ranks = path[seen[rank]:]
    cycle = tuple((r, *waiting(r)) for r in cycle_ranks)
    links = "; ".join(f"rank {r} waits at {s} for rank {p}" for r, s, p in cycle)
    raise DeadlockError(
        f"deadlock: {links}. Reorder these steps so that one side of each pair posts its "
        "send or receive first", cycle)
