"""How a rank of a spawned job ended, and which rank's ending is the job's cause.

When one rank fails, its peers fail too: they time out or are told by the failure protocol,
and the launcher kills any that run on. A user needs the first of these stories, not every
rank's traceback: :func:`cause` picks it (a rank that died, else the first error a rank
raised by itself, else a rank that hung), and :meth:`RankFailure.headline` says it in one line,
naming the rank and the step it had begun (which each rank reports with
:func:`~pipeswap.runtime.distributed.launch.mark_step`).
"""

from __future__ import annotations

import re
import signal
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pipeswap.runtime.errors import (
    CheckpointError,
    CheckpointIOError,
    PeerFailedError,
    PipelineCommError,
    PipelineSetupError,
)


#: What torch's transports say when a peer is gone or silent (gloo raises a plain
#: RuntimeError from a collective's wait; which of its two timeout messages depends on which
#: side of the pair gives up first): a consequence of another rank's failure.
_BROKEN_TRANSFER = re.compile(r"timed out waiting|application timeout caused pair closure|"
                              r"connection closed by peer|connection reset by peer|broken pipe|"
                              r"nccl (error|watchdog)", re.IGNORECASE)


#: How the runtime's transport names the peer a failed transfer waited on.
_PEER = re.compile(r"(?:receiving from|sending to) rank (\d+)")
_LONGEST = 400  # characters of an error message in a headline


class Ending(Enum):
    RAISED = "raised"  # the rank reported an exception
    DIED = "died"  # the process ended without a report (a signal, os._exit, a crash)
    KILLED = "killed"  # the launcher killed it: still running after another rank failed


@dataclass(frozen=True)
class RankFailure:
    """One rank's part in a failed job."""

    rank: int
    ending: Ending
    summary: str  # one line: the error's type and message, or the exit code or signal
    story: str  # the traceback, or what the launcher saw
    step: int | None  # the step the rank had begun, None before the first
    #: the rank raised an error about the job's input (its set-up, stages or checkpoint),
    #: which the user fixes, rather than a failure of the run
    user_error: bool = False
    #: the rank stopped because another failed: told by the failure protocol, or a
    #: transfer with a failed peer broke or timed out
    secondary: bool = False
    #: the peer a failed transfer of this rank waited on, where its error names one
    blames: int | None = None

    def headline(self, timeout_s: float) -> str:
        """One line for the user: which rank, what happened, at which step."""
        at = "before its first step" if self.step is None else f"at step {self.step}"
        if self.ending is Ending.DIED:
            return f"rank {self.rank} {self.summary} {at}; the other ranks stopped"
        if self.ending is Ending.KILLED:
            return (f"rank {self.rank} hung {at}: the other ranks waited their timeout "
                    f"({timeout_s:g} s) for it and stopped, and it was killed")
        if self.user_error:  # the message says what to fix; its type adds nothing
            return f"rank {self.rank}: {self.summary.partition(': ')[2]}"
        return f"rank {self.rank} failed {at}: {self.summary}"


def exit_summary(exitcode: int | None) -> str:
    """What a rank's exit code says, as the words after "rank R"."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"died ({name})"
    return f"died with exit code {exitcode}"


def cause(failures: Mapping[int, RankFailure]) -> RankFailure:
    """The failure that explains the others (``failures`` in the order the launcher learned
    of them): a rank that died by itself comes first (its peers' transfers broke), then the
    first rank's own error (not a peer's, not a broken transfer), then a rank that hung (the
    one its peers' failed transfers name most, else the one at the earliest step), then a
    rank aborted (NCCL's watchdog ends a rank whose operation timed out with SIGABRT)."""
    blamed = Counter(f.blames for f in failures.values() if f.blames is not None)

    def weight(item: tuple[int, RankFailure]) -> tuple[int, int, int, int]:
        arrival, failure = item
        aborted = failure.summary == exit_summary(-signal.SIGABRT)
        if failure.ending is Ending.DIED:
            kind = 3 if aborted else 0
        elif failure.ending is Ending.RAISED:
            kind = 4 if failure.secondary else 1
        else:
            kind = 2
        step = (-1 if failure.step is None else failure.step) if kind == 2 else 0
        return kind, -blamed[failure.rank], step, arrival

    return min(enumerate(failures.values()), key=weight)[1]


def _one_line(message: str) -> str:
    """A message as one line of reasonable length; one that carries other ranks' tracebacks
    (DCP's errors do) is told by its last line, the error they ended in."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        lines = lines[-1:]
    text = " ".join(" ".join(lines).split()) or "(no message)"
    return text if len(text) <= _LONGEST else text[:_LONGEST - 3] + "..."


def describe(error: BaseException, story: str, rank: int, step: int | None) -> RankFailure:
    """A rank's report of the exception that ended it."""

    message = _one_line(str(error))
    secondary = isinstance(error, PipelineCommError) or (
        isinstance(error, RuntimeError) and _BROKEN_TRANSFER.search(message) is not None)
    try:
        from torch.distributed import DistError

        secondary = secondary or isinstance(error, DistError)
    except ImportError:  # a torch without these types: judge by the message
        pass
    peer = _PEER.search(message)
    blames = (int(peer.group(1)) if peer is not None and isinstance(error, PipelineCommError)
              and not isinstance(error, PeerFailedError) else None)
    user_error = (isinstance(error, (PipelineSetupError, CheckpointError))
                  and not isinstance(error, CheckpointIOError))
    return RankFailure(rank, Ending.RAISED, f"{type(error).__name__}: {message}", story, step,
                       user_error=user_error, secondary=secondary, blames=blames)
