"""The typed errors of the schedule package.

Every error derives from :class:`ScheduleError` (a ``ValueError``), so callers can catch the
whole family at once, and each message says what was wrong and how to fix it.
"""

from __future__ import annotations


class ScheduleError(ValueError):
    """Base class of every error raised by ``pipeswap.schedule``."""


class StepError(ScheduleError):
    """A step value that cannot exist (wrong fields for its type, bad composite)."""


class ParseError(ScheduleError):
    """Text that is not a step, an order or a schedule in pipeswap's text form."""


class ValidationError(ScheduleError):
    """A schedule that is well-formed text but cannot run correctly.

    ``rank`` is the rank whose order is at fault, when one rank is.
    """

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class ChunkOrderError(ValidationError):
    """A chunk's compute steps are missing, duplicated or out of order on a rank."""


class FSDPOrderError(ValidationError):
    """A stage's FSDP steps are out of order: gathers and frees that do not alternate, a
    compute while the parameters are not gathered, or a gradient reduction missing, repeated
    or before the stage's last gradient computation."""


class SwapLifecycleError(ValidationError):
    """A swapped chunk's steps are not ``F < LO < WO < LL < WL < backward``."""


class P2PError(ValidationError):
    """Sends and receives across ranks do not pair up (wrong peer, count or content)."""


class DeadlockError(ValidationError):
    """The ranks wait on each other in a cycle.

    ``cycle`` lists ``(rank, step text, peer rank)`` for each rank in the cycle: that rank is
    blocked at that step waiting for the peer.
    """

    def __init__(self, message: str, cycle: tuple[tuple[int, str, int], ...]) -> None:
        super().__init__(message)
        self.cycle = cycle
