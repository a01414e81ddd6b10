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
    done = 0  # order[:done] is already in out
    overlaps = [i for i, s in enumerate(order) if s is not None and s.type is StepType.OVERLAP_B_F]
    for index in overlaps:
        bwd, fwd = order[index].sub_steps  # type: ignore[union-attr]
        if bwd.type is not StepType.BWD or bwd.stage == 0:
            continue
        stage, micro = bwd.key
        end = index + 1
        while end < len(order) and (step := order[end]) is not None and (
            step.type in _GRADIENT_P2P
        ):
            end += 1
        out += order[done:index]
        out.append(Step(StepType.OVERLAP_B_F, sub_steps=(Step(StepType.BWD_INPUT, stage, micro), fwd)))
        out += order[index + 1:end]
        out.append(Step(StepType.BWD_WEIGHT, stage, micro))
        done = end
    out += order[done:]
    return out
