"""The FSDP pass: gather parameters ahead of use, free them after, reduce gradients once."""

from __future__ import annotations

from collections.abc import Collection

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import COMPUTE, FSDP, OVERLAPS, Order, Step, StepType

DEFAULT_WINDOW = 3
_PARAM_GRADS = frozenset({StepType.BWD, StepType.BWD_WEIGHT})


@gc_paused
def add_fsdp_steps(
    schedule: Schedule,
    managed_stages: Collection[int] | None = None,
    *,
    window: int = DEFAULT_WINDOW,
) -> Schedule:
    """Insert ``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` for FSDP-managed stages.

    Before each step, the parameters of the next ``window`` distinct managed stages that
    compute (looking ahead from that step; more if the step itself, an overlap, computes
    more) are gathered and every other gathered stage is freed; at the end the remaining
    ones are freed in gather order. ``REDUCE_GRAD`` follows the step holding a stage's last
    parameter-gradient computation (B or W). ``managed_stages`` defaults to every stage.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ScheduleError(f"window must be an integer >= 1, got {window!r}")
    managed = frozenset(range(schedule.num_stages) if managed_stages is None else managed_stages)
    unknown = sorted(s for s in managed if not 0 <= s < schedule.num_stages)
    if unknown:
        raise ScheduleError(
            f"managed_stages names stage(s) {unknown}, but the schedule has stages "
            f"0..{schedule.num_stages - 1}"
        )
    for order in schedule.orders:
        existing = next((s for s in order if s is not None and s.type in FSDP), None)
        if existing is not None:
            raise ScheduleError(f"the schedule already has FSDP steps ({existing}); add them once")
    return schedule.map_orders(lambda _rank, order: _add(order, managed, window))


def _add(order: Order, managed: frozenset[int], window: int) -> list[Step | None]:
    # Walk backwards once: wanted[i] is the first `window` distinct managed stages computing
    # at or after step i (recorded where it changes), and the first B/W met for a stage is
    # its last parameter-gradient step.
    wanted_from: dict[int, tuple[int, ...]] = {}  # i -> wanted[i], where wanted[i-1] differs
    reduce_after: dict[int, list[int]] = {}  # i -> stages whose gradients are done after i
    last_grad: dict[int, int] = {}
    ahead: tuple[int, ...] = ()
    for i in range(len(order) - 1, -1, -1):
        step = order[i]
        if step is None or (step.type not in COMPUTE and step.type not in OVERLAPS):
            continue
        stages = tuple(dict.fromkeys(leaf.stage for leaf in step.compute_leaves
                                     if leaf.stage in managed))
        if stages and stages != ahead[: len(stages)]:
            wanted_from[i + 1] = ahead
            ahead = tuple(dict.fromkeys([*stages, *ahead]))[: max(window, len(stages))]
        for leaf in step.compute_leaves:
            stage = leaf.stage
            if leaf.type in _PARAM_GRADS and stage in managed and stage not in last_grad:
                last_grad[stage] = i
                reduce_after.setdefault(i, []).append(stage)
    wanted_from[0] = ahead

    out: list[Step | None] = []
    active: list[int] = []
    done = 0  # order[:done] is in out
    for i in sorted(wanted_from.keys() | {i + 1 for i in reduce_after}):
        out += order[done:i]
        done = i
        for stage in sorted(reduce_after.get(i - 1, ())):
            out.append(Step(StepType.FSDP_REDUCE_GRAD, stage))
        if i in wanted_from and i < len(order):
            wanted = wanted_from[i]
            for stage in [s for s in active if s not in wanted]:
                active.remove(stage)
                out.append(Step(StepType.FSDP_RESHARD, stage))
            for stage in wanted:
                if stage not in active:
                    active.append(stage)
                    out.append(Step(StepType.FSDP_UNSHARD, stage))
    out += order[done:]
    out += [Step(StepType.FSDP_RESHARD, stage) for stage in active]
    return out
