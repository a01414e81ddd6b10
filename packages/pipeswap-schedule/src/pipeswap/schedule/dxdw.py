"""The dx/dw split pass: overlapped backwards compute input grads first, weight grads later."""

from __future__ import annotations

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import Order, Step, StepType

_GRADIENT_P2P = frozenset({StepType.BWD_SEND, StepType.BWD_RECV})
_MARKED = frozenset({StepType.OVERLAP_B_F, StepType.BATCH_SEND_RECV})


@gc_paused
def split_dxdw(schedule: Schedule) -> Schedule:
    """Split the backward inside every ``OVERLAP_B_F`` into dx (I) and dw (W).

    ``(sB m;F)OVERLAP_B_F`` becomes ``(sI m;F)OVERLAP_B_F`` and ``sW m`` runs right after the
    gradient P2P that follows the overlap, so the input gradient leaves for the previous stage
    before the weight gradient is computed, while forward P2P still waits behind dw (this is
    where MindSpore hyper-parallel puts W; its worked examples show it). Stage 0 keeps whole
    backwards: it sends no input gradient, so splitting would gain nothing. P2P order is
    unchanged. Run it before P2P batching, which would hide the gradient P2P in batches.
    """
    return schedule.map_orders(lambda _rank, order: _split(order))


def _split(order: Order) -> list[Step | None]:
    out: list[Step | None] = []
    done = 0  # order[:done] is already in out
    marked = [i for i, s in enumerate(order) if s is not None and s.type in _MARKED]
    for index in marked:
        step = order[index]
        assert step is not None
        if step.type is StepType.BATCH_SEND_RECV:
            raise ScheduleError(
                f"split_dxdw runs before P2P batching (found {step}): W must follow the "
                "gradient sends, which a batch hides; split first, then coalesce")
        bwd, fwd = step.sub_steps
        if bwd.type is not StepType.BWD or bwd.stage == 0:
            continue
        stage, micro = bwd.key
        end = index + 1
        while end < len(order):
            following = order[end]
            if following is None or following.type not in _GRADIENT_P2P:
                break
            end += 1
        out += order[done:index]
        dx = Step(StepType.BWD_INPUT, stage, micro)
        out.append(Step(StepType.OVERLAP_B_F, sub_steps=(dx, fwd)))
        out += order[index + 1:end]
        out.append(Step(StepType.BWD_WEIGHT, stage, micro))
        done = end
    out += order[done:]
    return out
