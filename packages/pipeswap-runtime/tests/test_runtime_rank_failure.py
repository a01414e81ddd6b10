"""Which rank's ending explains a failed job, and the one line that says it."""

from __future__ import annotations

import signal

from pipeswap.runtime import CheckpointError, PeerFailedError, PipelineCommError
from pipeswap.runtime.errors import CheckpointIOError
from pipeswap.runtime.distributed.rank_failure import (
    Ending,
    RankFailure,
    cause,
    describe,
    exit_summary,
)


def _raised(rank: int, error: BaseException, step: int | None = 3) -> RankFailure:
    return describe(error, "Traceback ...", rank, step)


def test_a_rank_that_died_explains_its_peers_broken_transfers() -> None:
    died = RankFailure(2, Ending.DIED, exit_summary(-signal.SIGKILL), "", 5)
    failures = {0: _raised(0, RuntimeError("[gloo] Connection closed by peer [127.0.0.1]")),
                1: _raised(1, PeerFailedError("rank 2 failed", 2)), 2: died}
    assert cause(failures) is died
    assert died.headline(60) == "rank 2 died (SIGKILL) at step 5; the other ranks stopped"
    assert all(failures[rank].secondary for rank in (0, 1))


def test_a_hung_rank_explains_its_peers_timeouts() -> None:
    hung = RankFailure(1, Ending.KILLED, "was killed", "", 4)
    timed_out = _raised(0, RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed "
                                        "out waiting 10000ms for recv operation to complete"))
    assert timed_out.secondary
    assert cause({0: timed_out, 1: hung}) is hung
    assert hung.headline(10) == ("rank 1 hung at step 4: the other ranks waited their timeout "
                                 "(10 s) for it and stopped, and it was killed")


def test_the_first_own_error_comes_before_later_ones_and_a_hung_rank() -> None:
    first = _raised(3, ValueError("boom"), step=None)
    failures = {3: first, 0: _raised(0, KeyError("later")),
                1: RankFailure(1, Ending.KILLED, "was killed", "", 2)}
    assert cause(failures) is first
    assert first.headline(60) == "rank 3 failed before its first step: ValueError: boom"
    assert not first.user_error


def test_a_user_error_is_its_message_alone() -> None:
    failure = _raised(0, CheckpointError("checkpoint x does not fit:\n  give the same model"))
    assert failure.user_error and not failure.secondary
    assert failure.headline(60) == "rank 0: checkpoint x does not fit: give the same model"


def test_a_message_carrying_tracebacks_is_told_by_its_last_line() -> None:
    message = ("CheckpointException ranks:dict_keys([0, 1])\nTraceback (most recent call "
               "last): (RANK 0)\n  File \"x.py\", line 1\nOSError: [Errno 28] No space left "
               "on device")
    failure = _raised(1, RuntimeError(message))
    assert failure.summary == "RuntimeError: OSError: [Errno 28] No space left on device"
    assert len(_raised(0, RuntimeError("x" * 5000)).summary) < 500


def test_exit_codes_read_as_signals_or_codes() -> None:
    assert exit_summary(-signal.SIGSEGV) == "died (SIGSEGV)"
    assert exit_summary(3) == "died with exit code 3"


def test_of_several_ranks_killed_the_one_its_peers_waited_on_hung() -> None:
    """pp x dp: rank 3 hangs; rank 1's receive from it times out, rank 2 waits in a
    collective with it and is killed too, as is rank 3."""
    waited = _raised(1, PipelineCommError("rank 1: 1RECV_F0 (receiving from rank 3) failed: "
                                          "Timed out waiting 10000ms"))
    assert waited.blames == 3 and waited.secondary
    failures = {1: waited, 0: _raised(0, PeerFailedError("rank 0 stopped at 0SEND_F1 "
                                                         "(sending to rank 1): rank 1 failed", 1)),
                2: RankFailure(2, Ending.KILLED, "was killed", "", 4),
                3: RankFailure(3, Ending.KILLED, "was killed", "", 4)}
    assert failures[0].blames is None  # a peer's report names who told it, not who hung
    assert cause(failures).rank == 3
    unnamed = {2: RankFailure(2, Ending.KILLED, "was killed", "", 5),
               3: RankFailure(3, Ending.KILLED, "was killed", "", 4)}
    assert cause(unnamed).rank == 3  # else the one at the earliest step


def test_a_gathers_timeout_is_a_consequence_whichever_words_gloo_uses() -> None:
    """An FSDP gather whose replica peer hangs times out in one of gloo's two phrasings; in
    neither is it the rank's own error, so the rank its pipeline peers waited on is blamed."""
    for said in ("Timed out waiting 10000ms for recv operation to complete",
                 "Application timeout caused pair closure"):
        gather = _raised(0, RuntimeError(said))
        assert gather.secondary, said
        waited = _raised(2, PipelineCommError("rank 2: 1RECV_F0 (receiving from rank 1) "
                                              "failed: Timed out waiting 10000ms"))
        hung = RankFailure(1, Ending.KILLED, "was killed", "", 3)
        assert cause({0: gather, 2: waited, 1: hung}).rank == 1, said


def test_a_rank_aborted_after_a_timeout_does_not_hide_the_hung_one() -> None:
    """NCCL's watchdog ends a rank whose operation timed out with SIGABRT."""
    aborted = RankFailure(0, Ending.DIED, exit_summary(-signal.SIGABRT), "", 4)
    hung = RankFailure(1, Ending.KILLED, "was killed", "", 4)
    assert cause({0: aborted, 1: hung}) is hung
    assert cause({0: aborted, 1: _raised(1, PeerFailedError("rank 0 failed", 0))}) is aborted


def test_a_checkpoint_that_could_not_be_written_is_a_failure_not_a_user_error() -> None:
    full = _raised(0, CheckpointIOError("committing ck failed on rank 0: OSError: [Errno 28] "
                                        "No space left on device"))
    assert not full.user_error
    assert full.headline(60).startswith("rank 0 failed at step 3: CheckpointIOError: ")
