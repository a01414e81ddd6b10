"""What a simulation logs of the messages between ranks, to bound a step it has not run.

A rank that only adds swap or recompute steps to its order runs no compute earlier, so by
the model's monotony (every time is a maximum of earlier times plus fixed durations) no
message arrives earlier either, anywhere. The log keeps, per message, the least time the
schedule still needs once the message is there: the longest path from its receiving
compute to the step's end, counting compute alone (a copy's stall or a step's wait may
shrink when inputs come later; compute never does), and the transfers on the way. One
compute can shrink: a recomputed layer moves its share of a split backward's W into the I,
so the rank whose order changes counts its W as nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: A message: ("F", stage, micro) is stage's output for the next stage, ("B", stage, micro)
#: the gradient of stage's input for the stage before.
Message = tuple[str, int, int]


@dataclass
class MessageLog:
    """The computes of a run in the order it ran them (a topological order: a compute runs
    after the computes before it on its rank and after what it waits for), each with its
    rank and compute seconds, which message it waited for and which messages it sent."""

    ranks: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    weight: list[bool] = field(default_factory=list)  # a W (of a split backward)
    receiver: dict[Message, int] = field(default_factory=dict)  # the compute waiting for it
    sent: list[list[Message]] = field(default_factory=list)  # per compute, what followed it
    _last: dict[int, int] = field(default_factory=dict)  # rank: its latest compute

    def computed(self, rank: int, wanted: Message | None, seconds: float, weight: bool
                 ) -> None:
        self._last[rank] = len(self.ranks)
        self.ranks.append(rank)
        self.seconds.append(seconds)
        self.weight.append(weight)
        self.sent.append([])
        if wanted is not None:
            self.receiver[wanted] = len(self.ranks) - 1

    def published(self, rank: int, message: Message) -> None:
        """``rank`` sent ``message`` after its latest compute."""
        self.sent[self._last[rank]].append(message)

    def tails(self, transfer: float, changing: int | None) -> dict[Message, float]:
        """Per message received, the longest path of computes (and ``transfer`` per message
        between ranks) from its receiving compute's start to the end of the step, the Ws
        of rank ``changing`` (None: of every rank, for orders of any ranks that change)
        taken as nothing."""
        tail = [0.0] * len(self.ranks)
        after: dict[int, float] = {}  # rank: the tail of its compute seen last (the next)
        for node in reversed(range(len(self.ranks))):
            rank = self.ranks[node]
            longest = after.get(rank, 0.0)
            for message in self.sent[node]:
                receiver = self.receiver.get(message)
                if receiver is not None:
                    hop = 0.0 if self.ranks[receiver] == rank else transfer
                    longest = max(longest, hop + tail[receiver])
            own = 0.0 if self.weight[node] and changing in (None, rank) else (
                self.seconds[node])
            tail[node] = after[rank] = own + longest
        return {message: tail[node] for message, node in self.receiver.items()}
