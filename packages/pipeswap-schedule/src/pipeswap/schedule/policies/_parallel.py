"""Making the ranks' plans under a budget in worker processes.

Each rank's plans depend on its own order and the cost model alone (the pipeline chooses
among them afterwards), so the command that plans every rank of a large pipeline can make
them on several cores and get the same plans. Workers are spawned, not forked: the caller
may hold threads (a test runner, a training script), and a forked copy of a lock one of
them holds would hang the worker. A worker leaves as soon as its parent does, however the
parent ends (an error, Ctrl-C, a kill): it watches a pipe only the parent writes to.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing.connection import Connection
from typing import Protocol, TypeVar, cast

from pipeswap.schedule.schedule import Schedule


_Options = TypeVar("_Options", covariant=True)
_Made = TypeVar("_Made")


class Planner(Protocol[_Options]):
    """What the workers run: a policy without callbacks (it is pickled to each)."""

    def options_for(self, schedule: Schedule, rank: int) -> _Options: ...


#: The worker process's planner and schedule, set once by _start (a spawned worker serves
#: one call of plan_ranks only).
_work: tuple[Planner[object], Schedule] | None = None


def _start(planner: Planner[object], schedule: Schedule, parent: Connection) -> None:
    global _work
    _work = (planner, schedule)
    threading.Thread(target=_leave_with, args=(parent,), daemon=True).start()


def _leave_with(parent: Connection) -> None:
    """Return never while the parent lives; end the worker once it is gone (the pipe's
    only writer closed)."""
    try:
        parent.recv()
    except EOFError:
        pass
    os._exit(1)


def _plan(rank: int) -> tuple[int, object]:
    assert _work is not None  # _start ran first: it is the pool's initializer
    planner, schedule = _work
    return rank, planner.options_for(schedule, rank)


def plan_ranks(planner: Planner[_Made], schedule: Schedule, ranks: Sequence[int], jobs: int,
               done: Callable[[int, int], None]) -> dict[int, _Made]:
    """``planner.options_for(schedule, rank)`` for each of ``ranks``, in ``jobs`` worker
    processes; ``done`` is told (rank, ranks done so far) as each finishes. A worker's
    error is raised here (a worker that dies as BrokenProcessPool); however this ends, the
    workers end with it."""
    context = multiprocessing.get_context("spawn")
    watched, held = context.Pipe(duplex=False)  # nothing is sent: closing it stops them
    out: dict[int, _Made] = {}
    pool = ProcessPoolExecutor(min(jobs, len(ranks)), context, _start,
                               (planner, schedule, watched))
    finished = False
    try:
        for future in as_completed([pool.submit(_plan, rank) for rank in ranks]):
            rank, options = future.result()
            out[rank] = cast(_Made, options)  # what planner.options_for returns, pickled
            done(rank, len(out))
        finished = True
    finally:
        if not finished:
            held.close()  # the workers leave now, planning or not
        pool.shutdown(wait=True, cancel_futures=True)  # and are gone when it returns
        held.close()
        watched.close()
    return out
