"""pipeswap.runtime.pipelining's classes take PyTorch's arguments in PyTorch's order, and
refuse, before anything is built, what pipeswap cannot honour."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch

import pipeswap.runtime.pipelining as ours
from pipeswap.runtime import PipelineSetupError, PipelineStage

theirs = pytest.importorskip("torch.distributed.pipelining")


@pytest.mark.parametrize("name", ours.__all__)
def test_a_class_takes_pytorchs_arguments_in_pytorchs_order(name: str) -> None:
    def parameters(function: Callable[..., object]) -> list[tuple[str, object]]:
        return [(p.name, p.default) for p in inspect.signature(function).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    want = parameters(getattr(theirs, name).__init__)
    got = parameters(getattr(ours, name).__init__)
    assert [n for n, _ in got[:len(want)]] == [n for n, _ in want]
    assert dict(got)["scale_grads"] is True and dict(got)["loss_fn"] is None
    step = parameters(getattr(ours, name).step)
    assert [n for n, _ in parameters(getattr(theirs, name).step)] == [n for n, _ in step]


def _stage(index: int = 0, count: int = 2) -> PipelineStage:
    return PipelineStage(torch.nn.Linear(2, 2), index, count)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: ours.Schedule1F1B(_stage(), 4, swap_granularity="layers"),
     "unknown swap_granularity 'layers'; use one of auto, chunk, layer"),
    (lambda: ours.ScheduleGPipe(_stage(), 4, args_chunk_spec=(object(),)),
     "splits every input and merges every output along dimension 0; drop args_chunk_spec"),
    (lambda: ours.ScheduleZBVZeroBubble([_stage(0, 4), _stage(3, 4)], 4,
                                        backward_requires_autograd=False),
     "pipeswap's backward runs autograd"),
    (lambda: ours.Schedule1F1B(_stage(), 4, budget=0), "budget=0 keeps nothing"),
    (lambda: ours.Schedule1F1B(_stage(), 4, object(), budget=10, policy=object()),  # type: ignore[arg-type]
     "budget=10 plans with the default policy; drop policy=, or budget="),
    (lambda: ours.Schedule1F1B(object(), 4),
     "is neither torch.distributed.pipelining's PipelineStage nor pipeswap's"),
])
def test_what_cannot_be_honoured_is_refused_first(make: Callable[[], object],
                                                  message: str) -> None:
    with pytest.raises(PipelineSetupError, match=message):
        make()
