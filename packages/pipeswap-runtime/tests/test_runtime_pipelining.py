"""pipeswap.runtime.pipelining's classes take PyTorch's arguments in PyTorch's order, and
refuse, before anything is built, what pipeswap cannot honour."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

import pipeswap.runtime.pipelining as ours
from pipeswap.runtime import PipelineSetupError
from pipeswap.runtime.pipelining import schedules
from pipeswap.runtime.pipelining.schedules import _bad_value, _refusal
from pipeswap.schedule import MinGapPolicy

theirs = pytest.importorskip("torch.distributed.pipelining")
CLASSES = [name for name in ours.__all__ if name.startswith("Schedule")]


@pytest.mark.parametrize("name", CLASSES)
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


@pytest.mark.parametrize(("arguments", "message"), [
    ({"args_chunk_spec": (object(),)},
     "splits every input and merges every output along dimension 0; drop args_chunk_spec"),
    ({"swap_granularity": "layers"},
     "unknown swap_granularity 'layers'; use one of auto, chunk, layer"),
    ({"backward_requires_autograd": False}, "pipeswap's backward runs autograd"),
    ({"budget": 10, "policy": object()}, "budget=10 plans with the default policy; drop"),
    ({"custom_backward": 1}, "stage 1 was built with dw_builder"),
])
def test_what_cannot_be_honoured_is_named(arguments: dict[str, Any], message: str) -> None:
    """Checked inside the executor's agreed set-up (so every rank raises, see
    tests/test_pipelining_dropin.py); here the check itself."""
    defaults: dict[str, Any] = {
        "args_chunk_spec": None, "kwargs_chunk_spec": None, "output_merge_spec": None,
        "backward_requires_autograd": True, "swap_granularity": "auto", "budget": None,
        "policy": None, "custom_backward": None}
    assert _refusal(**defaults) is None
    said = _refusal(**{**defaults, **arguments})
    assert said is not None and message in said


@pytest.mark.parametrize(("arguments", "message"), [
    ({"n_microbatches": 0}, "n_microbatches=0: give a whole number of microbatches, 1 or"),
    ({"n_microbatches": 4.0}, "n_microbatches=4.0: give a whole number"),
    ({"n_microbatches": True}, "n_microbatches=True: give a whole number"),
    ({"scale_grads": "yes"}, "scale_grads='yes': give True or False"),
    ({"swap": 1}, "swap=1: give True or False"),
    ({"budget": "abc"}, "budget='abc': give the activation bytes a rank may hold as a whole"),
    ({"budget": 1.5e6}, "budget=1500000.0: give the activation bytes"),
    ({"budget": 2e9}, "(2_000_000_000, not 2e9)"),
    ({"budget": True}, "budget=True: give the activation bytes"),
    ({"budget": 0}, "budget=0: give the activation bytes a rank may hold as a whole number, "
                    "1 or more"),
    ({"policy": "peak"}, "policy='peak' is no swap policy (it has no select method)"),
    ({"check_transport": "NCCL"}, "check_transport='NCCL': give one of ordered, nccl, tagged"),
    ({"failure_timeout_s": 0}, "failure_timeout_s=0: give the seconds a silent peer"),
    ({"failure_timeout_s": -1.0}, "failure_timeout_s=-1.0: give the seconds"),
    ({"failure_timeout_s": float("inf")}, "failure_timeout_s=inf: give the seconds"),
    ({"failure_timeout_s": "10"}, "failure_timeout_s='10': give the seconds"),
    ({"failure_timeout_s": True}, "failure_timeout_s=True: give the seconds"),
])
def test_an_argument_of_the_wrong_type_or_range_is_named(arguments: dict[str, Any],
                                                          message: str) -> None:
    """Each drop-in argument of a wrong type or range (a bool is no number, a float no byte
    count) is named with what to give; checked inside the agreed set-up, so every rank
    raises it. Good values pass."""
    good: dict[str, Any] = {
        "n_microbatches": 4, "scale_grads": True, "swap": False, "budget": None,
        "policy": None, "check_transport": "nccl", "failure_timeout_s": None}
    assert _bad_value(**good) is None
    assert _bad_value(**{**good, "budget": 1 << 30, "failure_timeout_s": 2.5,
                         "policy": MinGapPolicy()}) is None
    said = _bad_value(**{**good, **arguments})
    assert said is not None and message in said, said


def test_an_object_that_is_no_stage_is_refused() -> None:
    with pytest.raises(PipelineSetupError,
                       match="is neither torch.distributed.pipelining's PipelineStage nor"):
        ours.Schedule1F1B(object(), 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", CLASSES)
def test_a_class_is_one_of_pytorchs_kinds_of_schedule(name: str) -> None:
    """isinstance and issubclass answer for pipeswap's class as for PyTorch's of that name,
    so code that picks a code path by PyTorch's base classes takes the same one."""
    mine, pytorchs = getattr(ours, name), getattr(theirs, name)
    for base in (theirs.schedules.PipelineScheduleSingle,
                 theirs.schedules.PipelineScheduleMulti):
        assert issubclass(mine, base) == issubclass(pytorchs, base)
    assert issubclass(mine, theirs.schedules._PipelineSchedule)


def test_a_stage_with_a_weight_backward_of_its_own_is_refused() -> None:
    """PyTorch's ``dw_builder`` is refused by name, not ignored (its weights' gradients
    would stay None): checked in the agreed set-up, so here the check itself."""
    class Stage:
        stage_index, dw_builder = 2, staticmethod(lambda: (lambda: None))

    assert schedules._custom_backward([Stage()]) == 2  # type: ignore[list-item]
    assert schedules._custom_backward([]) is None


def test_a_class_by_pytorchs_name_with_options_bound() -> None:
    """``get_schedule_class`` takes PyTorch's names in any case and refuses others as
    PyTorch's does; with options, a subclass that still answers PyTorch's base classes;
    the bases' own names give PyTorch's bases."""
    assert ours.get_schedule_class("zbvzerobubble") is ours.ScheduleZBVZeroBubble
    assert ours.get_schedule_class("1F1B") is ours.Schedule1F1B
    bound = ours.get_schedule_class("Interleaved1F1B", swap=True, budget=1 << 20)
    assert issubclass(bound, ours.ScheduleInterleaved1F1B)
    assert issubclass(bound, theirs.schedules.PipelineScheduleMulti)
    assert inspect.signature(bound).parameters.keys() >= {"stages", "n_microbatches"}
    with pytest.raises(ValueError, match=r"Unknown schedule name 'ZB'.*'DualPipeV'"):
        ours.get_schedule_class("ZB")
    # the names of PyTorch's two bases give them, as PyTorch's function does
    for name in ("PipelineScheduleSingle", "pipelineschedulemulti"):
        assert ours.get_schedule_class(name) is theirs.schedules.get_schedule_class(name)
    with pytest.raises(ValueError, match="PipelineScheduleSingle is PyTorch's abstract base"):
        ours.get_schedule_class("PipelineScheduleSingle", swap=True)
