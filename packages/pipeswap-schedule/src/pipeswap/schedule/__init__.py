"""Pipeline schedules as data: the step IR, generators, passes (swap injection included),
swap policies, validation and simulation.

Pure Python with no dependencies: install ``pipeswap-schedule`` alone to build and analyse
schedules without torch or a GPU.
"""

from pipeswap.schedule.__about__ import __version__
from pipeswap.schedule.build import Lowering, ScheduleKind, ScheduleSpec, build_schedule
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
    BudgetOutcome,
    CostModelPolicy,
    MemoryBudgetPolicy,
    MinGapPolicy,
    PeakOutcome,
    PeakPolicy,
    SwapCandidate,
    SwapPlacement,
    SwapPolicy,
    default_swap_policy,
    uniform_layers,
)
from pipeswap.schedule.schedule import Schedule, StageMapping, stage_to_rank
from pipeswap.schedule.simulate import RankResult, SimulationResult, simulate
from pipeswap.schedule.steps import ChunkKey, Order, Step, StepType
from pipeswap.schedule.swap import inject_swap, swap_candidates, swapped_chunks
from pipeswap.schedule.text import format_order, parse_order, parse_step
from pipeswap.schedule.transports import check_batches_alike, simulate_p2p
from pipeswap.schedule.units import parse_bytes
from pipeswap.schedule.validation import validate

__all__ = [
    "BudgetOutcome",
    "ChunkBytes",
    "ChunkKey",
    "ChunkOrderError",
    "CostModel",
    "CostModelPolicy",
    "DeadlockError",
    "FSDPOrderError",
    "GRANULARITIES",
    "Link",
    "Lowering",
    "MemoryBudgetPolicy",
    "MinGapPolicy",
    "Order",
    "P2PError",
    "ParseError",
    "PeakOutcome",
    "PeakPolicy",
    "RankResult",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "ScheduleSpec",
    "SimulationResult",
    "StageCosts",
    "StageMapping",
    "Step",
    "StepError",
    "StepType",
    "SwapCandidate",
    "SwapLifecycleError",
    "SwapPlacement",
    "SwapPolicy",
    "ValidationError",
    "__version__",
    "add_fsdp_steps",
    "build_schedule",
    "check_batches_alike",
    "coalesce_p2p",
    "default_swap_policy",
    "dumps_lines",
    "format_order",
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
