"""A streamed swap's layer lag against the layers of its chunk, wherever the count is known:
validation given layer counts, the simulator's cost model, and the command line.

A lag counts layers of the chunk (``0SO3:2``: layer k leaves when the forward ends layer
k + 2, the last two at WO), so a lag past the chunk's layers was written for another model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pipeswap.schedule import (
    ParseError,
    Schedule,
    ScheduleKind,
    ScheduleSpec,
    StepError,
    StepType,
    SwapLifecycleError,
    ValidationError,
    build_schedule,
    validate,
)
from pipeswap.schedule.costs import ChunkBytes, CostModel, Link, StageCosts
from pipeswap.schedule.policies import PeakPolicy
from pipeswap.schedule.simulate import simulate
from pipeswap.schedule.steps import Step
from pipeswap.schedule.text import parse_rank_lines

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py

#: Stage 0 on rank 0, stage 1 on rank 1; rank 1 streams (stage 1, micro 0) with lag 3.
PLAN = """\
rank 0: 0F0 0SEND_F0 0RECV_B0 0B0
rank 1: 1RECV_F0 1SO0:3 1F0 1WO0 1SL0 1WL0 1B0 1SEND_B0
"""
REFUSED = ("rank 1: 1SO0:3 (position 1) streams (stage 1, micro 0) with a layer lag of 3, "
           "but {why}; give a lag from 1 to 2 (1SO0:2), or swap the chunk whole "
           "(1LO0 ... 1LL0)")


def _plan() -> Schedule:
    return Schedule.from_orders(parse_rank_lines(PLAN))


def test_validate_refuses_a_lag_beyond_the_layers_it_is_given() -> None:
    schedule = _plan()
    validate(schedule)  # no layer count: nothing to hold the lag against
    validate(schedule, layers=3)  # as many as the lag: every layer leaves at WO
    validate(schedule, layers={0: 1})  # no count for stage 1
    for layers in (2, {0: 5, 1: 2}):
        with pytest.raises(SwapLifecycleError) as caught:
            validate(schedule, layers=layers)
        assert str(caught.value) == REFUSED.format(why="one chunk of stage 1 has 2 layer(s)")
        assert caught.value.rank == 1


def test_validate_refuses_a_load_depth_beyond_the_layers() -> None:
    schedule = Schedule.from_orders(parse_rank_lines(PLAN.replace("1SO0:3", "1SO0").replace(
        "1SL0", "1SL0:3")))
    validate(schedule, layers=3)  # SL loads all three layers
    with pytest.raises(SwapLifecycleError) as caught:
        validate(schedule, layers=2)
    assert str(caught.value) == (
        "rank 1: 1SL0:3 (position 4) streams (stage 1, micro 0) with a layer lag of 3, but "
        "one chunk of stage 1 has 2 layer(s); give a lag from 1 to 2 (1SL0:2), or swap the "
        "chunk whole (1LO0 ... 1LL0)")


@pytest.mark.parametrize("layers", [0, -1, True, 2.0, "2", {1: 0}, {"1": 2}, [2, 2]])
def test_a_layer_count_is_a_whole_number_from_one(layers: object) -> None:
    with pytest.raises(ValidationError, match="layers must be an integer >= 1 or a mapping"):
        validate(_plan(), layers=layers)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["1SO0:0", "1SO0:-1", "1SO0:"])
def test_a_lag_below_one_cannot_be_written(text: str) -> None:
    with pytest.raises(ParseError, match=r"bad step '1SO0:"):
        parse_rank_lines(f"rank 0: {text}")
    with pytest.raises(StepError, match="layer lag is a whole number >= 1"):
        Step(StepType.SWAP_STREAM_OFFLOAD, 1, 0, lag=0)


def test_the_simulator_holds_the_lag_against_its_cost_model() -> None:
    schedule = _plan()
    assert simulate(schedule, CostModel(layers=3)).ranks[1].swapped[0].layer_lag == 3
    model = ("the cost model gives a chunk of stage 1 2 layer(s) (--layers-per-stage; "
             "CostModel.layers, StageCosts.layers or the chunk's measured ChunkBytes.layers)")
    for costs in (
        CostModel(layers=2),
        CostModel(layers=5, stages={1: StageCosts(1.0, 2.0, layers=2)}),
        CostModel(layers=5, chunks={(1, 0): ChunkBytes(2, layers=(ChunkBytes(1),) * 2)}),
    ):
        with pytest.raises(SwapLifecycleError) as caught:
            simulate(schedule, costs)
        assert str(caught.value) == REFUSED.format(why=model)


@pytest.mark.parametrize("layers", [2, 3, 5])
def test_the_peak_policy_never_writes_a_lag_past_the_layers(layers: int) -> None:
    # A layer's copy (1.25 s / layers) outlasts its forward (1 s / layers): lags above 1.
    costs = CostModel(forward=1.0, backward=2.0, activation_bytes=100 * layers,
                      link=Link(80.0 * layers, 80.0 * layers), layers=layers)
    spec = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True)
    schedule = build_schedule(spec, PeakPolicy(costs, granularity="layer"))
    lags = [s.lag or 0 for order in schedule.orders for s in order
            if s is not None and s.type is StepType.SWAP_STREAM_OFFLOAD]
    assert lags and 1 < max(lags) <= layers
    validate(schedule, layers=layers)
    simulate(schedule, costs)


def test_validate_takes_the_layer_count_on_the_command_line(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "plan.txt"
    path.write_text(PLAN)
    assert cli("validate", str(path))[0] == 0
    assert cli("validate", str(path), "--layers-per-stage", "3")[0] == 0
    code, out, err = cli("validate", str(path), "--layers-per-stage", "2")
    assert (code, out) == (1, "")
    assert err == "invalid: " + REFUSED.format(why="one chunk of stage 1 has 2 layer(s)") + "\n"
    code, out, _ = cli("validate", "--help")
    assert code == 0 and "--layers-per-stage" in " ".join(out.split())
    assert "a lag is only checked to be at least 1" in " ".join(out.split())


def test_convert_checks_lags_when_the_model_dimensions_give_the_layers(
        cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "plan.txt"
    path.write_text(PLAN)
    model = ["--hidden", "64", "--seq-len", "16"]
    assert cli("convert", str(path), *model, "--layers-per-stage", "3")[0] == 0
    code, out, err = cli("convert", str(path), *model, "--layers-per-stage", "2")
    assert (code, out) == (2, "")
    assert err == ("pipeswap-schedule: error: "
                   + REFUSED.format(why="one chunk of stage 1 has 2 layer(s)") + "\n")
