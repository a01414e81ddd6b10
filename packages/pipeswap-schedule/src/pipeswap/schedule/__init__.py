"""Pipeline schedules as data: the step IR, generators, passes (swap injection included),
swap policies, validation and simulation.

Pure Python with no dependencies: install ``pipeswap-schedule`` alone to build and analyse
schedules without torch or a GPU.
"""

from pipeswap.schedule.__about__ import __version__
from pipeswap.schedule.build import (
    V_SHAPED,
    Lowering,
    ScheduleKind,
    ScheduleSpec,
    apply_swap,
    build_planned,
    build_schedule,
    inject_swap,
    plan_swap,
)
from pipeswap.schedule.costs import ChunkBytes, CostModel, Link, StageCosts
from pipeswap.schedule.dxdw import split_dxdw
from pipeswap.schedule.errors import (
    ChunkOrderError,
    DeadlockError,
    FSDPOrderError,
    P2PError,
    ParseError,
    ScheduleError,
    StepError,
    SwapLifecycleError,
    ValidationError,
)
from pipeswap.schedule.formats import dumps_lines, from_json, loads, to_json
from pipeswap.schedule.forward_only import forward_order
from pipeswap.schedule.fsdp import add_fsdp_steps
from pipeswap.schedule.generators import gpipe, interleaved_1f1b_compute, one_f_one_b
from pipeswap.schedule.order_checks import validate_rank
from pipeswap.schedule.p2p import (
    coalesce_p2p,
    insert_send_recv,
    insert_send_recv_by_dependency,
    insert_send_recv_early,
)
from pipeswap.schedule.policies import (
    GRANULARITIES,
    RECOMPUTE_MODES,
    CostModelPolicy,
    Granularity,
    MemoryBudgetPolicy,
    MinGapPolicy,
    PeakPolicy,
    PreparingPolicy,
    RecomputeMode,
    RecomputePolicy,
    Selection,
    SwapPolicy,
    default_swap_policy,
    uniform_layers,
)
from pipeswap.schedule.schedule import Schedule, StageMapping, stage_to_rank
from pipeswap.schedule.simulate import RankResult, SimulationResult, simulate
from pipeswap.schedule.steps import (
    COMPUTE,
    FSDP,
    OVERLAPS,
    P2P,
    RECOMPUTE,
    SENDS,
    SWAP,
    ChunkKey,
    Order,
    Step,
    StepType,
)
from pipeswap.schedule.swap_order import swap_candidates, swapped_chunks
from pipeswap.schedule.swap_plan import (
    DEFAULT_PLACEMENT,
    PlanOutcome,
    RankPlan,
    SwapCandidate,
    SwapPlacement,
    SwapPlan,
)
from pipeswap.schedule.jobplan import (
    Job,
    Machine,
    ModelShape,
    NoFit,
    Plan,
    SearchSpace,
    plan,
)
from pipeswap.schedule.text import format_order, parse_order, parse_step
from pipeswap.schedule.transport_models import check_batches_alike, simulate_p2p
from pipeswap.schedule.units import parse_bytes
from pipeswap.schedule.validation import (
    TRANSPORTS,
    TransportModel,
    check_order_layer_counts,
    validate,
)

__all__ = [
    "COMPUTE",
    "ChunkBytes",
    "ChunkKey",
    "ChunkOrderError",
    "CostModel",
    "CostModelPolicy",
    "DEFAULT_PLACEMENT",
    "DeadlockError",
    "FSDP",
    "FSDPOrderError",
    "GRANULARITIES",
    "Granularity",
    "Job",
    "Link",
    "Lowering",
    "Machine",
    "MemoryBudgetPolicy",
    "MinGapPolicy",
    "ModelShape",
    "NoFit",
    "OVERLAPS",
    "Order",
    "P2P",
    "P2PError",
    "ParseError",
    "PeakPolicy",
    "Plan",
    "PlanOutcome",
    "PreparingPolicy",
    "RECOMPUTE",
    "RECOMPUTE_MODES",
    "RankPlan",
    "RankResult",
    "RecomputeMode",
    "RecomputePolicy",
    "SENDS",
    "SWAP",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "ScheduleSpec",
    "SearchSpace",
    "Selection",
    "SimulationResult",
    "StageCosts",
    "StageMapping",
    "Step",
    "StepError",
    "StepType",
    "SwapCandidate",
    "SwapLifecycleError",
    "SwapPlacement",
    "SwapPlan",
    "SwapPolicy",
    "TRANSPORTS",
    "TransportModel",
    "V_SHAPED",
    "ValidationError",
    "__version__",
    "add_fsdp_steps",
    "apply_swap",
    "build_planned",
    "build_schedule",
    "check_batches_alike",
    "check_order_layer_counts",
    "coalesce_p2p",
    "default_swap_policy",
    "dumps_lines",
    "format_order",
    "forward_order",
    "from_json",
    "gpipe",
    "inject_swap",
    "insert_send_recv",
    "insert_send_recv_by_dependency",
    "insert_send_recv_early",
    "interleaved_1f1b_compute",
    "loads",
    "one_f_one_b",
    "parse_bytes",
    "parse_order",
    "parse_step",
    "plan",
    "plan_swap",
    "simulate",
    "simulate_p2p",
    "split_dxdw",
    "stage_to_rank",
    "swap_candidates",
    "swapped_chunks",
    "to_json",
    "uniform_layers",
    "validate",
    "validate_rank",
]
