"""Building finished schedules: what to build (:mod:`~pipeswap.schedule.build.spec`), the
passes in order (:mod:`~pipeswap.schedule.build.passes`) and the swap pass, which puts a
swap policy to work (:mod:`~pipeswap.schedule.build.swap_pass`).

A folder of its own because it uses the policies (:mod:`pipeswap.schedule.policies`), which
use the modules beside it: the imports between the folders go one way.
"""

from pipeswap.schedule.build.passes import (
    LOWERINGS,
    build_planned,
    build_schedule,
    generate,
    passes,
)
from pipeswap.schedule.build.spec import (
    MULTI_STAGE,
    V_SHAPED,
    Lowering,
    ScheduleKind,
    ScheduleSpec,
)
from pipeswap.schedule.build.swap_pass import apply_swap, inject_swap, plan_swap, rank_plan

__all__ = [
    "LOWERINGS",
    "Lowering",
    "MULTI_STAGE",
    "ScheduleKind",
    "ScheduleSpec",
    "V_SHAPED",
    "apply_swap",
    "build_planned",
    "build_schedule",
    "generate",
    "inject_swap",
    "passes",
    "plan_swap",
    "rank_plan",
]
