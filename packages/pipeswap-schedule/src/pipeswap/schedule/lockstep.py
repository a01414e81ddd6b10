"""Running every rank's order together, in turns: the one place that decides when a rank may
take its next item, given the messages the other ranks have produced so far.

Ranks take turns in rank order, round after round. In its turn a rank takes its next item if
every message the item needs has been produced and is visible, and taking it may produce
messages. Three things vary between the users of this engine, and are its parameters:

- what an item needs and produces (a compute's input and output, a send's payload...);
- when a produced message becomes visible: at once (to ranks whose turn comes later in the
  same round, as PyTorch's lowering sees it) or from the next round on;
- how much a rank takes in its turn: one item (a lowering advances time one slot per round)
  or everything it can (a validator asks only whether all ranks can finish).

The send/recv lowerings (:mod:`pipeswap.schedule.p2p`), the tagged-transport validator and
the forward delays of PyTorch's zero-bubble orders run on it. The ordered validator keeps
its own event queue: rendezvous pairing first in, first out is a different question (who
posts first on each channel), answered in linear time there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from pipeswap.schedule.schedule import Message

Item = TypeVar("Item")


class Visibility(Enum):
    """When a message produced in a turn can be used."""

    AT_ONCE = "at-once"  # by any later turn, in this round too
    NEXT_ROUND = "next-round"  # from the next round on


@dataclass(frozen=True)
class Waiting(Generic[Item]):
    """A rank that cannot take its next item: the item, its place and a message it lacks."""

    rank: int
    index: int
    item: Item
    missing: Message


def lockstep(
    items: Sequence[Sequence[Item]],
    needs: Callable[[Item], Iterable[Message]],
    take: Callable[[int, Item], Iterable[Message]],
    *,
    visibility: Visibility,
    run_on: bool = False,
    wait: Callable[[int], None] | None = None,
) -> list[Waiting[Item]]:
    """Run rank r's ``items[r]`` in turns until every rank is done or none can move.

    ``take(rank, item)`` is called when a rank takes an item and returns the messages it
    produces; ``wait(rank)``, when given, when a rank with items left cannot take one in its
    turn. ``run_on``: a rank takes as many items as it can in one turn. Returns the ranks left
    waiting (empty when all finished), each with the first message it lacks.
    """
    produced: set[Message] = set()
    fresh: set[Message] = set() if visibility is Visibility.NEXT_ROUND else produced
    position = [0] * len(items)
    left = [rank for rank, own in enumerate(items) if own]
    while left:
        moved = False
        for rank in left:
            own, index = items[rank], position[rank]
            while index < len(own):
                item = own[index]
                for message in needs(item):
                    if message not in produced:
                        break
                else:
                    fresh.update(take(rank, item))
                    index += 1
                    if run_on:
                        continue
                break
            if index == position[rank] and wait is not None:
                wait(rank)
            moved = moved or index > position[rank]
            position[rank] = index
        if fresh is not produced:
            produced |= fresh
            fresh.clear()
        left = [rank for rank in left if position[rank] < len(items[rank])]
        if not moved:
            break
    return [Waiting(rank, position[rank], items[rank][position[rank]],
                    next(m for m in needs(items[rank][position[rank]]) if m not in produced))
            for rank in left]
