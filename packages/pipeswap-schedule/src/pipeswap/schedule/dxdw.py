"""The dx/dw split pass: overlapped backwards compute input grads first, weight grads later."""

from __future__ import annotations

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import Order, Step, StepType

_GRADIENT_P2P = frozenset({StepType.BWD_SEND, StepType.BWD_RECV})


@gc_paused
def split_dxdw(schedule: Schedule) -> Schedule:
    """Split the backward inside every ``OVERLAP_B_F`` into dx (I) and dw (W).

    ``(sB m;F)OVERLAP_B_F`` becomes ``(sI m;F)OVERLAP_B_F`` and ``sW m`` runs right after the
    gradient P2P that follows the overlap, so the input gradient leaves for the previous stage
    before the weight gradient is computed, while forward P2P still waits behind dw. Stage 0
    keeps whole backwards: it sends no input gradient, so splitting would gain nothing. P2P
    order is unchanged.
    """
    return schedule.map_orders(lambda _rank, order: _split(order))


def _split(order: Order) -> list[Step | None]:
    out: list[Step | None] = []
    pending: Step | None = None  # the W waiting for the end of the gradient P2P run
    for step in order:
        if pending is not None and not (step is not None and step.type in _GRADIENT_P2P):
            out.append(pending)
            pending = None
        if step is not None and step.type is StepType.OVERLAP_B_F:
            bwd, fwd = step.sub_steps
            if bwd.type is StepType.BWD and bwd.stage != 0:
                stage, micro = bwd.key
                step = Step(
                    StepType.OVERLAP_B_F, sub_steps=(Step(StepType.BWD_INPUT, stage, micro), fwd)
                )
                pending = Step(StepType.BWD_WEIGHT, stage, micro)
        out.append(step)
    if pending is not None:
        out.append(pending)
    return out
