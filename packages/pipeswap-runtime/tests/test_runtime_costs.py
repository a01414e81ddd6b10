"""The costs the executor's default swap policy plans on: a cost model of the user's, checked
before anything plans on it; a slow host link, which makes the plan swap less and expose
nothing; and the probe that measures a link."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipeswap.platform import get_platform
from pipeswap.runtime import Measure, SwapOptions
from pipeswap.runtime import PipelineExecutor, PipelineSetupError, PipelineStage, Replay
from pipeswap.runtime.executor.measurements import (
    check_costs,
    measured_costs,
    probe_link,
    with_layer_counts,
)
from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, lm_loss, split_stages
from pipeswap.schedule import (
    CostModel,
    Link,
    MinGapPolicy,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    StageCosts,
    StepType,
)

CONFIG = GPTConfig(vocab=13, seq_len=8, width=16, layers=8)
SPEC = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8)
#: a chunk of 1 MiB a forward of 1 ms: over 1 TB/s its copies take a microsecond
FAST = CostModel(forward=1e-3, backward=2e-3, activation_bytes=1 << 20, link=Link(1e12, 1e12))


def _rank_zero(**options: object) -> PipelineExecutor:
    """Rank 0 of a 4-rank 1F1B pipeline, replayed, with swap by the default policy."""
    stages = [PipelineStage(module, index, 4)
              for index, module in enumerate(split_stages(build_gpt(CONFIG, 0), 4))]
    replay = Replay(0, 4, {s.stage_index: len(s.layers) for s in stages}, {})
    return PipelineExecutor([stages[0]], SPEC, 8, lm_loss,
                            swap=SwapOptions(**options),  # type: ignore[arg-type]
                            replay=replay)


def test_a_slow_link_makes_the_plan_swap_less_and_expose_nothing() -> None:
    fast = _rank_zero(costs=FAST)
    # 1 MB/s: a chunk's copy takes a second, a thousand forwards
    slow = _rank_zero(costs=CostModel(forward=1e-3, backward=2e-3,
                                      activation_bytes=1 << 20, link=Link(1e6, 1e6)))
    assert fast.plan is not None and slow.plan is not None
    assert fast.plan.outcome is not None and slow.plan.outcome is not None
    assert fast.plan.outcome.peak < fast.plan.outcome.peak_no_swap and fast.swapped
    assert len(slow.swapped) < len(fast.swapped)
    assert fast.plan.outcome.exposed_copy == 0.0 and slow.plan.outcome.exposed_copy == 0.0
    # and a moderate link: some chunks, still nothing exposed
    middle = _rank_zero(costs=CostModel(forward=1e-3, backward=2e-3,
                                        activation_bytes=1 << 20, link=Link(1e9, 5e8)))
    assert (middle.plan is not None and middle.plan.outcome is not None
            and middle.plan.outcome.exposed_copy == 0.0)


def test_without_a_cost_model_the_plan_has_no_link_to_weigh() -> None:
    plain = _rank_zero()
    assert (plain.plan is not None and plain.plan.outcome is not None
            and plain.plan.outcome.exposed_copy == 0.0)
    assert plain.swapped  # every copy hides over a link of no limit


@pytest.mark.parametrize(("costs", "named"), [
    (CostModel(link=Link(math.inf, 1e9)), "rank 0's link d2h_bandwidth must be a finite"),
    (CostModel(link=Link(1e9, math.inf)), "rank 0's link h2d_bandwidth must be a finite"),
    (CostModel(forward=0.0, link=Link(1e9, 1e9)), "stage 0's forward time must be"),
    (CostModel(link=Link(1e9, 1e9), stages={0: StageCosts(1.0, math.inf)}),
     "stage 0's backward time must be"),
    (CostModel(link=Link(1e9, 1e9), stages={0: StageCosts(1.0, 2.0, backward_input=0.0)}),
     "stage 0's backward_input time must be"),
])
def test_a_cost_model_that_cannot_be_planned_on_is_refused_by_name(costs: CostModel,
                                                                   named: str) -> None:
    with pytest.raises(PipelineSetupError, match=f"^cost_model: {named}"):
        _rank_zero(costs=costs)
    with pytest.raises(PipelineSetupError, match=named):
        check_costs(costs, [0], 0)


@pytest.mark.parametrize("field", ["d2h_bandwidth", "h2d_bandwidth"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_a_link_of_no_bandwidth_is_refused_where_it_is_made(field: str, value: float) -> None:
    link = Link(value, 1e9) if field == "d2h_bandwidth" else Link(1e9, value)
    with pytest.raises(ScheduleError, match=f"{field} must be > 0"):
        CostModel(link=link)


def test_a_cost_model_is_for_the_default_policy_only() -> None:
    with pytest.raises(PipelineSetupError,
                       match="costs in SwapOptions applies to the default policy"):
        _rank_zero(costs=FAST, policy=MinGapPolicy())


def test_the_stages_layer_counts_fill_in_where_the_model_has_none() -> None:
    given = CostModel(stages={1: StageCosts(1.0, 2.0, layers=5), 2: StageCosts(3.0, 6.0)})
    filled = with_layer_counts(given, {0: 2, 1: 3, 2: 4})
    assert filled.stage_layers(0) == 2 and filled.stage(0).forward == given.forward
    assert filled.stage_layers(1) == 5  # the model's own count stays
    assert filled.stage_layers(2) == 4 and filled.stage(2).forward == 3.0


class _Logged:
    """The CPU platform, its streams and events logging what is queued where."""

    def __init__(self) -> None:
        self.real = get_platform("cpu")
        self.log: list[str] = []
        self.current = self._stream("compute")
        self._count = 0
        self._on = "compute"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _stream(self, name: str) -> Any:
        return SimpleNamespace(name=name, synchronize=lambda: None)

    def current_stream(self) -> Any:
        return self.current

    def new_stream(self) -> Any:
        self._count += 1
        return self._stream(f"copy{self._count}")

    @contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        before, self._on = self._on, stream.name
        yield
        self._on = before

    def new_event(self) -> Any:
        log = self.log
        return SimpleNamespace(record=lambda stream: log.append(f"record on {stream.name}"),
                               wait=lambda stream: log.append(f"wait on {stream.name}"))

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(f"copy on {self._on}")
        dst.copy_(src)


def test_the_probe_measures_both_ways_of_the_link() -> None:
    link = probe_link(get_platform("cpu"), nbytes=1 << 20, repeats=2)
    assert 0 < link.d2h_bandwidth < math.inf and 0 < link.h2d_bandwidth < math.inf
    assert isinstance(link.duplex, bool)


def test_the_probes_copies_wait_for_the_queued_compute() -> None:
    """Its device buffer comes from the compute stream's memory: both copy streams wait
    for what was queued there before any copy runs."""
    platform = _Logged()
    probe_link(platform, nbytes=1 << 10, repeats=1)
    first_copy = platform.log.index(next(line for line in platform.log
                                         if line.startswith("copy on")))
    assert platform.log[:first_copy] == ["record on compute", "wait on copy1", "wait on copy2"]
    assert set(platform.log[first_copy:]) == {"copy on copy1", "copy on copy2"}


def test_a_measured_step_times_its_computes_and_makes_the_cost_model_a_plan_weighs() -> None:
    executor = _rank_zero()
    inputs = torch.randint(0, CONFIG.vocab, (8, CONFIG.seq_len))
    assert executor.step(inputs).compute_seconds == {}  # not measured unless asked
    report = executor.step(inputs, measure=Measure(compute=True))
    assert set(report.compute_seconds) == {(StepType.FWD, 0), (StepType.BWD, 0)}
    assert all(seconds > 0 for seconds in report.compute_seconds.values())
    assert report.copy_wait_seconds is not None and report.copy_wait_seconds >= 0
    layers = {0: len(executor.stages[0].layers)}
    costs = measured_costs(report.compute_seconds, {
        key: (found.held, found.movable) for key, found in report.chunk_bytes.items()},
        Link(1e9, 1e9), layers)
    assert costs.stage(0).forward == report.compute_seconds[StepType.FWD, 0]
    assert costs.stage_layers(0) == layers[0] and len(costs.chunks) == 8
    assert all(costs.chunk_bytes(key).total == found.held
               for key, found in report.chunk_bytes.items())
    planned = _rank_zero(costs=costs)
    assert (planned.plan is not None and planned.plan.outcome is not None
            and planned.plan.outcome.exposed_copy == 0.0)
    with pytest.raises(PipelineSetupError, match="no measured forward and backward of stage 1"):
        measured_costs(report.compute_seconds, {}, Link(1e9, 1e9), {0: 2, 1: 2})
