"""Swap policies: which chunks the swap pass swaps, and where each chunk's copies go.

:mod:`~pipeswap.schedule.policies.base` is the interface the pass calls and the plain gap rule
(MindSpore hyper-parallel's); :mod:`~pipeswap.schedule.policies.peak` the default, which
swaps only what lowers a rank's peak; :mod:`~pipeswap.schedule.policies.cost_model` two
policies that swap whole chunks on a cost model; :mod:`~pipeswap.schedule.policies.defaults`
the default policy on the costs known before anything runs;
:mod:`~pipeswap.schedule.policies.recompute` recompute alone, which swaps nothing.
"""

from pipeswap.schedule.policies.base import (
    DEFAULT_PLACEMENT,
    MIN_FEASIBLE_GAP,
    MinGapPolicy,
    SwapCandidate,
    SwapPlacement,
    RecomputingPolicy,
    SwapPolicy,
)
from pipeswap.schedule.policies.cost_model import (
    BudgetOutcome,
    CostModelPolicy,
    MemoryBudgetPolicy,
)
from pipeswap.schedule.policies.defaults import default_policy, default_swap_policy, uniform_layers
from pipeswap.schedule.policies.peak import (
    GRANULARITIES,
    RECOMPUTE_MODES,
    PeakOutcome,
    PeakPolicy,
)
from pipeswap.schedule.policies.recompute import RecomputeOutcome, RecomputePolicy

__all__ = [
    "BudgetOutcome",
    "CostModelPolicy",
    "DEFAULT_PLACEMENT",
    "GRANULARITIES",
    "MIN_FEASIBLE_GAP",
    "MemoryBudgetPolicy",
    "MinGapPolicy",
    "PeakOutcome",
    "PeakPolicy",
    "RECOMPUTE_MODES",
    "RecomputeOutcome",
    "RecomputingPolicy",
    "RecomputePolicy",
    "SwapCandidate",
    "SwapPlacement",
    "SwapPolicy",
    "default_policy",
    "default_swap_policy",
    "uniform_layers",
]
