"""pipeswap behind ``torch.distributed.pipelining``'s schedule classes.

A script written for PyTorch's pipelining (or torchtitan, which builds on it) holds
``PipelineStage`` objects and calls ``ScheduleX(stages, n_microbatches, loss_fn).step(...)``.
The classes here take the same arguments and keep the same ``step`` contract, so such a
script switches by changing its import::

    from pipeswap.runtime.pipelining import Schedule1F1B   # was torch.distributed.pipelining

    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn, swap=True)
    losses = []
    output = schedule.step(x, target=y, losses=losses)  # x on the first stage's rank, y on
                                                        # the last's; output returned there

They take PyTorch's ``PipelineStage`` objects (their submodule, stage index, stage count,
device and group) or pipeswap's own, and run pipeswap's executor
(:class:`~pipeswap.runtime.executor.PipelineExecutor`) on the same compute order as PyTorch's
class, with swap steps where ``swap=True`` asks (the default peak policy, or ``policy=``).

Gradients follow PyTorch's ``scale_grads``: each microbatch's loss is backpropagated as it
is, and with ``scale_grads=True`` (the default) every gradient of the rank's stages is
divided by ``n_microbatches`` once the step is done, as PyTorch does. The executor is built
(one collective of the stages' group) when the schedule is: every rank constructs its
schedule, as with PyTorch's classes.
"""

from pipeswap.runtime.pipelining.by_name import get_schedule_class
from pipeswap.runtime.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

__all__ = [
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "Schedule1F1B",
    "get_schedule_class",
]
