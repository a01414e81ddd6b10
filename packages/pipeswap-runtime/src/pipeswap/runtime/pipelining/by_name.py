"""pipeswap's schedule classes by PyTorch's schedule names, as
``torch.distributed.pipelining.schedules.get_schedule_class`` gives PyTorch's: the one
place a trainer that picks its schedule by name (torchtitan's ``build_pipeline_schedule``
does) switches to pipeswap's, with swap options bound to the class it gets."""

from __future__ import annotations

from functools import partialmethod
from typing import TYPE_CHECKING

from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from pipeswap.runtime.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from pipeswap.runtime.pipelining.schedules import PipeswapOptions

__all__ = ["get_schedule_class"]

#: PyTorch's names of its seven schedules.
_BY_NAME: dict[str, type[_PipelineSchedule]] = {
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "GPipe": ScheduleGPipe,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


#: The names PyTorch's function also answers with its abstract bases (which pipeswap's
#: classes are registered with), for code that asks which kind a name is.
_BASES: dict[str, type[PipelineScheduleSingle] | type[PipelineScheduleMulti]] = {
    "PipelineScheduleSingle": PipelineScheduleSingle,
    "PipelineScheduleMulti": PipelineScheduleMulti,
}


def get_schedule_class(schedule_name: str, **options: Unpack[PipeswapOptions]
                       ) -> type[_PipelineSchedule | PipelineScheduleSingle
                                 | PipelineScheduleMulti]:
    """pipeswap's class of ``schedule_name`` (PyTorch's names, any case: ``"1F1B"``,
    ``"ZBVZeroBubble"``, ...); with ``options`` (``swap=True``, ``budget=``, ...) a subclass
    that passes them to every schedule it builds, so code that only names the class (and
    calls it with PyTorch's arguments) swaps. ``"PipelineScheduleSingle"`` and
    ``"PipelineScheduleMulti"`` give PyTorch's abstract bases, as PyTorch's function does
    (they build no schedule, so they take no options). An unknown name raises
    ``ValueError`` naming the known ones, as PyTorch's function does."""
    base = {name.lower(): cls for name, cls in _BASES.items()}.get(schedule_name.lower())
    if base is not None:
        if options:
            raise ValueError(f"{schedule_name} is PyTorch's abstract base, which builds no "
                             f"schedule: options {sorted(options)} go with a schedule's name")
        return base
    found = {name.lower(): cls for name, cls in _BY_NAME.items()}.get(schedule_name.lower())
    if found is None:
        raise ValueError(f"Unknown schedule name '{schedule_name}'. The valid options are "
                         f"{[*_BY_NAME, *_BASES]}")
    if not options:
        return found
    bound = dict(options)  # the caller's own keywords, where given, take precedence
    return type(found.__name__, (found,), {"__init__": partialmethod(found.__init__, **bound),
                                          "__doc__": f"{found.__doc__} With {bound}."})
