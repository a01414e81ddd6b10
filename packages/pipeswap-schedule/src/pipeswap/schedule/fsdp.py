"""The FSDP pass: gather parameters ahead of use, free them after, reduce gradients once."""

from __future__ import annotations

from collections.abc import Collection

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import FSDP, Order, Step, StepType

DEFAULT_WINDOW = 3
_PARAM_GRADS = frozenset({StepType.BWD, StepType.BWD_WEIGHT})


def add_fsdp_steps(
    schedule: Schedule,
    managed_stages: Collection[int] | None = None,
    *,
    window: int = DEFAULT_WINDOW,
) -> Schedule:
    """Insert ``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` for FSDP-managed stages.

    Before each step, the parameters of the next ``window`` distinct managed stages that
    compute (looking ahead from that step) are gathered and every other gathered stage is
    freed; at the end the remaining ones are freed in gather order. ``REDUCE_GRAD`` follows
    the step holding a stage's last parameter-gradient computation (B or W).
    ``managed_stages`` defaults to every stage.
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


def _managed_compute_stages(step: Step | None, managed: frozenset[int]) -> list[int]:
    if step is None:
        return []
    return [leaf.stage for leaf in step.compute_leaves if leaf.stage in managed]  # type: ignore[misc]


def _add(order: Order, managed: frozenset[int], window: int) -> list[Step | None]:
    # lookahead[i]: the first `window` distinct managed stages computing at or after step i.
    lookahead: list[tuple[int, ...]] = [()] * (len(order) + 1)
    for i in range(len(order) - 1, -1, -1):
        ahead = list(dict.fromkeys(_managed_compute_stages(order[i], managed) +
                                   list(lookahead[i + 1])))
        lookahead[i] = tuple(ahead[:window])
    last_grad: dict[int, int] = {}
    for i, step in enumerate(order):
        for leaf in step.compute_leaves if step is not None else ():
            if leaf.type in _PARAM_GRADS and leaf.stage in managed:
                assert leaf.stage is not None
                last_grad[leaf.stage] = i

    out: list[Step | None] = []
    active: list[int] = []
    for i, step in enumerate(order):
        wanted = lookahead[i]
        for stage in [s for s in active if s not in wanted]:
            active.remove(stage)
            out.append(Step(StepType.FSDP_RESHARD, stage))
        for stage in wanted:
            if stage not in active:
                active.append(stage)
                out.append(Step(StepType.FSDP_UNSHARD, stage))
        out.append(step)
        reduced = {
            leaf.stage for leaf in (step.compute_leaves if step is not None else ())
            if leaf.stage is not None and last_grad.get(leaf.stage) == i
        }
        out += [Step(StepType.FSDP_REDUCE_GRAD, stage) for stage in sorted(reduced)]
    out += [Step(StepType.FSDP_RESHARD, stage) for stage in active]
    return out
