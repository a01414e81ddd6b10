"""A completed send is let go as the next transfer is posted, not held to the step's end."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pipeswap.runtime.executor.interpreter import Interpreter


class Work:
    def __init__(self, completed: bool) -> None:
        self.completed = completed

    def is_completed(self) -> bool:
        return self.completed


def test_completed_sends_are_waited_and_dropped_and_the_rest_kept() -> None:
    done, half, pending = ([Work(True)], [Work(True), Work(False)], [Work(False)])
    sends = [SimpleNamespace(works=works) for works in (done, half, pending)]
    waited: list[Any] = []
    state: Any = SimpleNamespace(sends=list(sends), transport=SimpleNamespace(
        wait=waited.append))
    Interpreter._release_sent(state)
    assert state.sends == sends[1:]  # a send of several tensors goes once all are done
    assert waited == [sends[0]]  # waited for: a failed send's error is raised, not lost
