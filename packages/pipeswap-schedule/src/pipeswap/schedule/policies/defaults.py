"""The default policy, on the costs known before anything runs.

Before a step has run nobody knows a chunk's bytes or times, only each stage's layer count;
every rank must still build the same schedule. So the default is the peak policy on a uniform
cost model: layers alike, a backward twice a forward, each stage as many layers as it has.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeswap.schedule.costs import CostModel, StageCosts
from pipeswap.schedule.policies.base import Granularity
from pipeswap.schedule.policies.peak import PeakPolicy


def default_policy() -> PeakPolicy:
    """What the swap pass (:func:`pipeswap.schedule.build.swap_pass.plan_swap`) uses when
    given no policy: the peak policy on the default cost model (uniform chunks of one layer,
    a backward twice a forward), so it swaps only chunks that lower a rank's peak, copies
    hidden, whole (a chunk of one layer has nothing to stream). ``MinGapPolicy()`` gives
    MindSpore hyper-parallel's orders."""
    return PeakPolicy(CostModel())


def default_swap_policy(layer_counts: Mapping[int, int], granularity: Granularity = "auto"
                        ) -> PeakPolicy:
    """The runtime's default: the peak policy on :func:`uniform_layers` of ``layer_counts``
    (stage -> layers), choosing each chunk's granularity as ``granularity`` says
    (``"auto"``, ``"chunk"`` or ``"layer"``; anything else raises :class:`ScheduleError`)."""
    return PeakPolicy(CostModel(stages=uniform_layers(layer_counts)), granularity=granularity)


def uniform_layers(layer_counts: Mapping[int, int]) -> dict[int, StageCosts]:
    """Each stage's costs when only its layer count is known: layers alike (a forward of one
    second per layer), a backward twice a forward."""
    return {stage: StageCosts(float(count), 2.0 * count, layers=count)
            for stage, count in layer_counts.items()}
