"""Simulation results as a Chrome trace (Perfetto, chrome://tracing): one process per rank,
one thread per stream, and a counter of activation bytes held."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

from pipeswap.schedule.simulate import SimulationResult

_THREADS = {"compute": 0, "d2h": 1, "h2d": 2, "copy": 1}
_MICROSECONDS = 1e6


class _EventBase(TypedDict):
    ph: str  # the phase: M metadata, X a span, C a counter
    name: str
    pid: int  # the rank


class TraceEvent(_EventBase, total=False):
    """One event of the trace; which other keys it has depends on its phase."""

    tid: int  # the stream
    cat: str
    ts: float  # microseconds
    dur: float
    args: dict[str, str | int]


class ChromeTrace(TypedDict):
    """The JSON object Perfetto and chrome://tracing open."""

    traceEvents: list[TraceEvent]
    displayTimeUnit: str


def chrome_trace(result: SimulationResult) -> ChromeTrace:
    """The trace as a JSON-ready object (times in microseconds, as the format wants)."""
    events: list[TraceEvent] = []
    for rank in result.ranks:
        events.append({"ph": "M", "name": "process_name", "pid": rank.rank,
                       "args": {"name": f"rank {rank.rank}"}})
        streams = {span.stream for span in rank.spans} | {"compute"}
        for stream in sorted(streams, key=_THREADS.__getitem__):
            events.append({"ph": "M", "name": "thread_name", "pid": rank.rank,
                           "tid": _THREADS[stream], "args": {"name": stream}})
        for span in rank.spans:
            events.append({"ph": "X", "name": span.label, "cat": span.stream, "pid": rank.rank,
                           "tid": _THREADS[span.stream], "ts": span.start * _MICROSECONDS,
                           "dur": (span.end - span.start) * _MICROSECONDS})
        for time, held in rank.memory:
            events.append({"ph": "C", "name": "activation bytes", "pid": rank.rank,
                           "ts": time * _MICROSECONDS, "args": {"held": held}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimulationResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(result)))
