"""Swap policies: which chunks the swap pass swaps, and where each chunk's copies go.

:mod:`~pipeswap.schedule.policies.base` is the interface the pass calls and the plain gap rule
(MindSpore hyper-parallel's); :mod:`~pipeswap.schedule.policies.peak` the default, which
swaps only what lowers a rank's peak; :mod:`~pipeswap.schedule.policies.cost_model` two
policies that swap whole chunks on a cost model; :mod:`~pipeswap.schedule.policies.defaults`
the default policy on the costs known before anything runs;
:mod:`~pipeswap.schedule.policies.recompute_only` recompute alone, which swaps nothing. What
they decide are values of :mod:`pipeswap.schedule.swap_plan`.
"""

from pipeswap.schedule.policies.base import (
    GRANULARITIES,
    MIN_FEASIBLE_GAP,
    PIPELINE_CHOICES,
    RECOMPUTE_MODES,
    Granularity,
    MinGapPolicy,
    PipelineChoice,
    PreparingPolicy,
    RecomputeMode,
    Selection,
    SwapPolicy,
)
from pipeswap.schedule.policies.cost_model import CostModelPolicy, MemoryBudgetPolicy
from pipeswap.schedule.policies.defaults import default_policy, default_swap_policy, uniform_layers
from pipeswap.schedule.policies.peak import PeakPlanner, PeakPolicy
from pipeswap.schedule.policies.recompute_only import RecomputePolicy

__all__ = [
    "CostModelPolicy",
    "GRANULARITIES",
    "Granularity",
    "MIN_FEASIBLE_GAP",
    "MemoryBudgetPolicy",
    "MinGapPolicy",
    "PIPELINE_CHOICES",
    "PeakPlanner",
    "PeakPolicy",
    "PipelineChoice",
    "PreparingPolicy",
    "RECOMPUTE_MODES",
    "RecomputeMode",
    "RecomputePolicy",
    "Selection",
    "SwapPolicy",
    "default_policy",
    "default_swap_policy",
    "uniform_layers",
]
