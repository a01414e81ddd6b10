"""The recompute pass: an RC step before the forward of each chunk that recomputes layers."""

from __future__ import annotations

from collections.abc import Mapping

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import ChunkKey, Order, Step, StepType


def recomputed_in(order: Order) -> dict[ChunkKey, tuple[int, ...]]:
    """The layers each RC step of ``order`` recomputes, by chunk."""
    return {step.key: step.layers for step in order
            if step is not None and step.type is StepType.RECOMPUTE and step.layers}


def inject_recompute(schedule: Schedule,
                     layers: Mapping[ChunkKey, tuple[int, ...]]) -> Schedule:
    """``schedule`` with ``layers[key]`` of chunk ``key`` recomputed: an RC step right before
    the chunk's forward. A schedule that has RC steps already, or a chunk no rank forwards,
    is refused."""
    if not layers:
        return schedule
    placed: set[ChunkKey] = set()

    def rewrite(_: int, order: Order) -> list[Step | None]:
        out: list[Step | None] = []
        for step in order:
            if step is not None and step.type is StepType.RECOMPUTE:
                raise ScheduleError(f"{step}: the schedule already recomputes layers; "
                                    "plan recompute on a schedule without RC steps")
            for leaf in () if step is None else step.sub_steps or (step,):
                if leaf.type is StepType.FWD and leaf.key in layers:
                    out.append(Step(StepType.RECOMPUTE, leaf.stage, leaf.micro,
                                    layers=layers[leaf.key]))
                    placed.add(leaf.key)
            out.append(step)
        return out

    result = schedule.map_orders(rewrite)
    missing = sorted(set(layers) - placed)
    if missing:
        raise ScheduleError(f"no rank forwards chunk (stage, micro) {missing[0]}, so it has "
                            "no layers to recompute")
    return result
