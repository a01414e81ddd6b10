"""All ranks' sends and receives run together under a transport, to find a message without
its counterpart or ranks that wait for each other for ever.

``ordered`` (:func:`simulate_p2p`) treats every send and receive as a rendezvous (the
strictest transport: a send completes only when its receive is posted), matches them first-in
first-out per ordered rank pair, and reports a deadlock as the cycle of ranks waiting on each
other. A ``BATCH_P2P`` step posts all its leaves at once and completes when all are matched,
which is what one ``torch.distributed.batch_isend_irecv`` call over all of them does; an
executor must issue a batch that way (not one batch per peer, one after the other) for a
schedule this module accepts to be deadlock-free. ``tagged`` (:func:`simulate_tagged`) lets
a send never wait and a message meet the receive with its tag; only a compute waits, for the
data it receives. ``nccl`` adds :func:`check_batches_alike` to ``ordered``: both ends of a
message posted inside a batch, or both alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NoReturn

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.errors import DeadlockError, P2PError
from pipeswap.schedule.lockstep import Visibility, lockstep
from pipeswap.schedule.order_checks import needless_p2p
from pipeswap.schedule.schedule import Message, Schedule
from pipeswap.schedule.steps import COMM, COMPUTE, P2P, SENDS, Step, StepType


@gc_paused
def simulate_tagged(schedule: Schedule) -> None:
    """Run all ranks with tagged, non-blocking transfers; raise if a message has no
    counterpart or the ranks wait for each other's data in a cycle."""
    orders = schedule.orders
    sends: dict[tuple[bool, int, int], int] = {}  # (activation?, sending stage, micro) -> rank
    receives: dict[tuple[bool, int, int], int] = {}
    for rank, order in enumerate(orders):
        for step in order:
            for leaf in (step.p2p_leaves if step is not None else ()):
                key = _payload(leaf)
                if key in (sends if leaf.type in SENDS else receives):
                    raise P2PError(f"rank {rank}: {leaf} appears twice", rank=rank)
                (sends if leaf.type in SENDS else receives)[key] = rank
    for key in sends.keys() ^ receives.keys():
        activation, stage, micro = key
        what = f"the {'activation' if activation else 'gradient'} of stage {stage} micro {micro}"
        if key in sends:
            raise P2PError(f"rank {sends[key]} sends {what}, which no rank receives",
                           rank=sends[key])
        raise P2PError(f"rank {receives[key]} receives {what}, which no rank sends",
                       rank=receives[key])
    # Leaves one by one (with the step that holds them): a send never waits, a compute
    # waits for the data it receives.
    leaves = [[(step, leaf) for step in order if step is not None
               for leaf in step.sub_steps or (step,)] for order in orders]

    def needs(item: tuple[Step, Step]) -> list[Message]:
        leaf = item[1]
        need = schedule.remote_input(leaf) if leaf.type in COMPUTE else None
        return [] if need is None else [need]

    def take(_rank: int, item: tuple[Step, Step]) -> list[Message]:
        leaf = item[1]
        return [Message(*_payload(leaf))] if leaf.type in SENDS else []

    waiting = lockstep(leaves, needs, take, visibility=Visibility.AT_ONCE, run_on=True)
    if waiting:
        _report_tagged_deadlock({w.rank: (w.item[0], w.missing) for w in waiting}, sends)


def _report_tagged_deadlock(waits: dict[int, tuple[Step, Message]],
                            sends: dict[tuple[bool, int, int], int]) -> NoReturn:
    rank = next(iter(waits))
    path: list[int] = []
    while rank not in path and rank in waits:
        path.append(rank)
        rank = sends[waits[rank][1]]
    start = path.index(rank) if rank in path else 0
    cycle = tuple((r, str(waits[r][0]), sends[waits[r][1]]) for r in path[start:])
    links = "; ".join(f"rank {r} waits at {s} for data from rank {p}" for r, s, p in cycle)
    raise DeadlockError(f"deadlock: {links}. Each rank waits for data the other sends later: "
                        "reorder the computes", cycle)


# A posted P2P leaf whose counterpart is not posted yet: (leaf, peer rank, the peer's posted
# leaves on this channel, this leaf's place on the channel).
_Pending = tuple[Step, int, list[Step], int]


@dataclass
class _RankState:
    pc: int = 0
    posted: bool = False  # the step at pc has posted its P2P leaves
    pending: list[_Pending] = field(default_factory=list)


_RECEIVER = {StepType.FWD_SEND: StepType.FWD_RECV, StepType.BWD_SEND: StepType.BWD_RECV}
_STEP = {StepType.FWD_SEND: 1, StepType.BWD_SEND: -1}  # receiving stage - sending stage


def _payload(step: Step) -> tuple[bool, int, int]:
    """What a P2P leaf carries: (activation?, sending stage, micro)."""
    stage, micro, kind = step.stage, step.micro, step.type
    assert stage is not None and micro is not None
    if kind is StepType.FWD_SEND:
        return (True, stage, micro)
    if kind is StepType.FWD_RECV:
        return (True, stage - 1, micro)
    if kind is StepType.BWD_SEND:
        return (False, stage, micro)
    return (False, stage + 1, micro)


@gc_paused
def simulate_p2p(schedule: Schedule) -> None:
    """Run all ranks' P2P as rendezvous and raise on a mismatch, a dangling op or a deadlock.

    Each rank advances until a P2P step has a leaf whose counterpart the peer has not posted;
    posting a counterpart wakes the waiting rank. Work is linear in the number of steps.
    """
    orders = schedule.orders
    routes = _routes(schedule)
    states = [_RankState() for _ in orders]
    queue = deque(range(len(orders)))
    while queue:
        rank = queue.popleft()
        state, order = states[rank], orders[rank]
        pc, end, pending = state.pc, len(order), state.pending
        while pc < end:
            step = order[pc]
            if step is None or step.type not in COMM:
                pc += 1
                continue
            if not state.posted:
                state.posted = True
                for leaf in step.sub_steps or (step,):
                    route = routes.get((leaf.type, leaf.stage))
                    if route is None:
                        needless_p2p(schedule, rank, leaf)
                    posted, counterparts, peer, is_send = route
                    posted.append(leaf)
                    index = len(posted) - 1
                    if index < len(counterparts):
                        other = counterparts[index]
                        send, recv = (leaf, other) if is_send else (other, leaf)
                        sender, receiver = send.stage, recv.stage
                        assert sender is not None and receiver is not None  # P2P leaves
                        if send.micro != recv.micro or recv.type is not _RECEIVER[send.type] or (
                            receiver != sender + _STEP[send.type]
                        ):
                            _mismatch(leaf, other, rank, peer, index, is_send)
                        queue.append(peer)
                    else:
                        pending.append((leaf, peer, counterparts, index))
            if pending:
                pending = [p for p in pending if len(p[2]) <= p[3]]
                if pending:
                    break
            state.posted = False
            pc += 1
        state.pc, state.pending = pc, pending
    blocked = [r for r, s in enumerate(states) if s.pc < len(orders[r])]
    if blocked:
        _report_stuck(schedule, states, blocked[0])


_Route = tuple[list[Step], list[Step], int, bool]


def _routes(schedule: Schedule) -> dict[tuple[StepType, int | None], _Route]:
    """For each P2P leaf kind and stage: (the list its kind is posted to on its channel, the
    list of counterparts posted on that channel, the peer rank, is it a send).

    A channel is an ordered rank pair (sender, receiver); both ends match first in, first out.
    """
    sent: dict[tuple[int, int], list[Step]] = {}
    received: dict[tuple[int, int], list[Step]] = {}
    routes: dict[tuple[StepType, int | None], _Route] = {}
    for stage in range(schedule.num_stages):
        for kind in P2P:
            channel = schedule.channel(kind, stage)
            if channel is None:
                continue  # no P2P here: such a leaf is reported as needless
            is_send = kind in SENDS
            mine, theirs = (sent, received) if is_send else (received, sent)
            routes[kind, stage] = (mine.setdefault(channel, []), theirs.setdefault(channel, []),
                                   channel[1] if is_send else channel[0], is_send)
    return routes


# One end of a message as posted: (the P2P leaf, the step that posts it, the rank).
_End = tuple[Step, Step, int]


@gc_paused
def check_batches_alike(schedule: Schedule) -> None:
    """Raise unless both ends of every message are posted alike: both inside a ``BATCH_P2P``
    step or both as steps of their own.

    NCCL pairs an op posted inside ``batch_isend_irecv`` on the group's communicator and one
    posted alone (plain ``isend``/``irecv``) on the two ranks' own, so two ends posted
    differently never meet. Ends pair first in, first out per rank pair, as in
    :func:`simulate_p2p`, which should pass first. Work is linear in the number of steps.
    """
    ends: dict[tuple[int, int, bool], list[_End]] = {}
    routes: dict[tuple[StepType, int | None], tuple[list[_End], list[_End]]] = {}
    for stage in range(schedule.num_stages):
        for kind in P2P:
            channel = schedule.channel(kind, stage)
            if channel is not None:
                is_send = kind in SENDS
                routes[kind, stage] = (ends.setdefault((*channel, is_send), []),
                                       ends.setdefault((*channel, not is_send), []))
    for rank, order in enumerate(schedule.orders):
        for step in order:
            if step is None or step.type not in COMM:
                continue
            for leaf in step.sub_steps or (step,):
                route = routes.get((leaf.type, leaf.stage))
                if route is None:
                    needless_p2p(schedule, rank, leaf)
                mine, theirs = route
                mine.append((leaf, step, rank))
                if len(mine) <= len(theirs):
                    other = theirs[len(mine) - 1]
                    if (other[1].type is StepType.BATCH_SEND_RECV) != (
                            step.type is StepType.BATCH_SEND_RECV):
                        _one_sided((leaf, step, rank), other)


def _one_sided(end: _End, other: _End) -> NoReturn:
    send, recv = (end, other) if end[0].type in SENDS else (other, end)

    def posted(leaf: Step, step: Step) -> str:
        return f"inside a batch ({step})" if step is not leaf else f"alone ({leaf})"

    raise P2PError(
        f"rank {send[2]} sends the {_describe(send[0])} {posted(*send[:2])} but rank {recv[2]} "
        f"receives it {posted(*recv[:2])}; NCCL pairs an op in a batch only with one in a "
        "batch, so the message never arrives and both ranks hang: batch both ends "
        "(coalesce_p2p batches pairs alike) or neither", rank=recv[2])


def _describe(step: Step) -> str:
    activation, stage, micro = _payload(step)
    return f"{'activation' if activation else 'gradient'} of stage {stage} micro {micro}"


def _mismatch(leaf: Step, other: Step, rank: int, peer: int, index: int, is_send: bool
              ) -> NoReturn:
    send, recv = (leaf, other) if is_send else (other, leaf)
    src, dst = (rank, peer) if is_send else (peer, rank)
    nth = _ordinal(index + 1)
    raise P2PError(
        f"rank {src}'s {nth} send to rank {dst} is {send} (the {_describe(send)}) but rank "
        f"{dst}'s {nth} receive from rank {src} is {recv} (expecting the {_describe(recv)}); "
        "sends and receives between two ranks must come in the same order", rank=dst)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _report_stuck(schedule: Schedule, states: list[_RankState], start: int) -> NoReturn:
    def waiting(rank: int) -> tuple[str, int]:
        state = states[rank]
        return str(schedule.orders[rank][state.pc]), state.pending[0][1]

    path: list[int] = []
    seen: dict[int, int] = {}
    rank = start
    while rank not in seen:
        seen[rank] = len(path)
        path.append(rank)
        step, peer = waiting(rank)
        if states[peer].pc >= len(schedule.orders[peer]):
            leaf = states[rank].pending[0][0]
            missing = "receive" if leaf.type in SENDS else "send"
            raise P2PError(
                f"rank {rank} waits at {step} for rank {peer}, whose order ends without the "
                f"matching {missing} of {leaf}; add it to rank {peer} or drop {leaf}", rank=rank)
        rank = peer
    cycle = tuple((r, *waiting(r)) for r in path[seen[rank]:])
    links = "; ".join(f"rank {r} waits at {s} for rank {p}" for r, s, p in cycle)
    raise DeadlockError(
        f"deadlock: {links}. Reorder these steps so that one side of each pair posts its "
        "send or receive first", cycle)
