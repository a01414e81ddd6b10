"""Recomputed layers (RC): written, parsed, validated, and simulated to the byte."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeswap.schedule import (
    ChunkOrderError,
    ParseError,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    Step,
    StepError,
    StepType,
    apply_swap,
    build_schedule,
    parse_order,
    parse_step,
    plan_swap,
    validate,
)
from pipeswap.schedule.costs import ChunkBytes, CostModel, Link, StageCosts
from pipeswap.schedule.formats import dumps_csv, dumps_json, dumps_lines, loads, swap_summary
from pipeswap.schedule.simulate import SimulationResult, simulate
from pipeswap.schedule.simulate_report import report

# Four layers of 100 bytes a chunk; a recomputed layer keeps its input, 10 bytes, and its
# recompute makes the other 90 again.
Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py
COSTS = CostModel(forward=1.0, backward=2.0, activation_bytes=400, boundary_bytes=10, layers=4)


def _run(text: str, costs: CostModel = COSTS) -> SimulationResult:
    return simulate(Schedule.from_orders([parse_order(text)]), costs)


@pytest.mark.parametrize(("text", "layers"), [("0RC3:0-1,3", (0, 1, 3)), ("2RC0:4", (4,)),
                                              ("1RC7:0-3", (0, 1, 2, 3))])
def test_rc_text_reads_and_writes_its_layers(text: str, layers: tuple[int, ...]) -> None:
    step = parse_step(text)
    assert step.type is StepType.RECOMPUTE and step.layers == layers
    assert str(step) == text and parse_step(str(step)) == step


@pytest.mark.parametrize(("text", "message"), [
    ("0RC3", "RC names the layers it recomputes after a colon, such as 0RC3:0-1"),
    ("0RC3:2-1", "must ascend without repeats"),
    ("0RC3:1,1", "must ascend without repeats"),
    ("0RC3:1,,2", "are not indices and runs"),
    ("0RC3:0-999999999", "name more than 4096 layers"),
    ("0F3:0-1", "only RC names layers (0RC3:0-1); after F a colon gives SO's or SL's layer lag"),
    ("0SO3:1,2", "only RC names layers"),
])
def test_bad_rc_text_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=re.escape(message)):
        parse_step(text)


def test_a_schedule_with_rc_steps_survives_json_csv_and_lines() -> None:
    schedule = Schedule.from_orders([parse_order("0RC0:0-1,3 0F0 0RC1:2 0F1 0B0 0B1")])
    for dumps in (dumps_json, dumps_csv, dumps_lines):
        assert loads(dumps(schedule)) == schedule, dumps.__name__
    assert '"0RC0:0-1,3"' in dumps_csv(schedule)  # quoted: the layers hold a comma


def test_only_rc_takes_layers_and_they_ascend() -> None:
    with pytest.raises(StepError, match="FWD takes no layers"):
        Step(StepType.FWD, 0, 0, layers=(0,))
    for bad in [(), (1, 0), (0, 0), (-1,)]:
        with pytest.raises(StepError, match="RC's layers are one or more layer indices"):
            Step(StepType.RECOMPUTE, 0, 0, layers=bad)


@pytest.mark.parametrize(("text", "message"), [
    ("0F0 0RC0:0 0B0", r"0RC0:0 \(position 1\) comes after the forward it changes"),
    ("0RC1:0 0F0 0B0", r"recomputes layers of \(stage 0, micro 1\), which this rank never"),
])
def test_an_rc_comes_before_its_forward_on_its_rank(text: str, message: str) -> None:
    with pytest.raises(ChunkOrderError, match=message):
        validate(Schedule.from_orders([parse_order(text)]))


def test_a_layer_the_chunk_does_not_have_is_refused() -> None:
    schedule = Schedule.from_orders([parse_order("0RC0:1,4 0F0 0B0")])
    with pytest.raises(ChunkOrderError, match=r"recomputes layer 4 of \(stage 0, micro 0\), "
                       "but the cost model gives a chunk of stage 0 4 layer"):
        simulate(schedule, COSTS)
    with pytest.raises(ChunkOrderError, match="name layers from 0 to 3"):
        validate(schedule, layers=4)
    validate(schedule, layers=5)


def test_a_whole_backward_runs_each_recomputed_layer_again_before_its_own() -> None:
    # Chunk 0 keeps 10 + 100 + 10 + 100 bytes; its backward, from layer 3 down, holds a
    # recomputed layer's 90 bytes from the recompute (a quarter of the forward, 0.25 s)
    # to the end of the layer's part (a quarter of B, 0.5 s), and frees each layer's bytes
    # as its part ends.
    result = _run("0RC0:0,2 0F0 0F1 0B0 0B1")
    (rank,) = result.ranks
    assert rank.memory == ((1.0, 220), (2.0, 620), (2.5, 520), (2.75, 610), (3.25, 520),
                           (3.25, 510), (3.75, 410), (4.0, 500), (4.5, 410), (4.5, 400),
                           (6.5, 0))
    assert rank.peak_activation_bytes == 620 and rank.peak_activation_bytes_no_swap == 800
    assert result.step_time == rank.busy == 6.5
    assert (rank.recomputed_layers, rank.recompute_s) == (2, 0.5)


def test_a_recompute_that_takes_no_time_still_holds_what_it_makes() -> None:
    result = _run("0RC0:3 0F0 0B0", dataclasses.replace(COSTS, forward=0.0))
    # made again at once, then each layer's bytes freed as its part of B ends
    assert [held for _, held in result.ranks[0].memory] == [310, 400, 310, 300, 200, 100, 0]
    assert result.ranks[0].recompute_s == 0.0 and result.ranks[0].recomputed_layers == 1


def test_a_split_backward_recomputes_in_i_and_does_that_layers_w_there() -> None:
    # Each layer holds 50 of its 100 bytes from I to W; the recomputed layer 1 keeps 10 and
    # nothing after I. I takes 1 s, a quarter of the forward again and a quarter of W's 1 s.
    costs = dataclasses.replace(COSTS, chunks={(0, 0): ChunkBytes(400, after_input=200)})
    result = _run("0RC0:1 0F0 0I0 0W0", costs)
    (rank,) = result.ranks
    assert rank.memory == ((1.0, 310), (2.0, 400), (2.25, 310), (2.5, 150), (3.25, 0))
    assert result.step_time == rank.busy == 3.25
    assert (rank.recomputed_layers, rank.recompute_s) == (1, 0.25)


def test_a_streamed_chunk_moves_what_its_forward_kept() -> None:
    # Lag 1 over a link of no limit: each layer leaves as the next one ends; layer 0 moves
    # 10 bytes, and the backward makes its other 90 again before its part.
    result = _run("0RC0:0 0SO0 0F0 0WO0 0SL0 0WL0 0B0")
    (rank,) = result.ranks
    assert [held for _, held in rank.memory] == [10, 110, 100, 200, 100, 200, 100, 0, 100,
                                                 200, 100, 200, 100, 110, 10, 100, 10, 0]
    assert result.step_time == 3.25 and rank.exposed_copy == 0
    assert rank.swapped[0].streamed and rank.swapped[0].hidden


def test_a_chunk_swapped_whole_moves_what_its_forward_kept() -> None:
    # Every layer recomputed keeps 20 bytes, 10 of them pinned: LO moves 40 bytes in 0.1 s.
    costs = dataclasses.replace(COSTS, boundary_bytes=20, pinned_bytes=40,
                                link=Link(400.0, 400.0))
    result = _run("0RC0:0-3 0F0 0LO0 0WO0 0LL0 0WL0 0B0", costs)
    (rank,) = result.ranks
    # B, from layer 3 down: 80 made again, then freed with the layer's 20 kept
    assert [held for _, held in rank.memory] == [80, 40, 80, 160, 80, 60, 140, 60, 40, 120,
                                                 40, 20, 100, 20, 0]
    assert rank.exposed_copy == pytest.approx(0.2)  # nothing to hide the copies behind
    assert rank.recompute_s == 1.0 and rank.peak_activation_bytes_no_swap == 400


@pytest.mark.parametrize("kind", [ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZBV])
def test_recomputing_keeps_the_no_swap_figures_and_reports_its_cost(kind: ScheduleKind) -> None:
    spec = ScheduleSpec(kind, ranks=2, microbatches=4, stages_per_rank=1 if kind is
                        ScheduleKind.ONE_F_ONE_B else 2)
    plain = build_schedule(spec)
    marked = dataclasses.replace(plain, orders=tuple(
        tuple(step for s in order for step in (
            (Step(StepType.RECOMPUTE, s.stage, s.micro, layers=(0, 1)), s)
            if s is not None and s.type is StepType.FWD else (s,)))
        for order in plain.orders))
    validate(marked, transport="ordered")
    before, after = simulate(plain, COSTS), simulate(marked, COSTS)
    assert after.step_time > before.step_time
    for was, now in zip(before.ranks, after.ranks):
        assert now.peak_activation_bytes_no_swap == was.peak_activation_bytes_no_swap
        assert now.peak_activation_bytes < was.peak_activation_bytes
        backwards = sum(1 for s in plain.orders[now.rank] if s is not None
                        for leaf in s.compute_leaves if leaf.type in (StepType.BWD,
                                                                      StepType.BWD_INPUT))
        assert now.recomputed_layers == 2 * backwards
        assert math.isclose(now.recompute_s, now.recomputed_layers * COSTS.forward / 4)
        assert math.isclose(now.busy, was.busy + now.recompute_s)
    quiet = simulate(marked, COSTS, timeline=False)
    assert [dataclasses.replace(r, memory=(), spans=()) for r in after.ranks] == list(quiet.ranks)
    figures = report(after, None, fsdp=False)["per_rank"][0]
    assert figures["recomputed_layers"] == after.ranks[0].recomputed_layers
    assert figures["recompute_s"] == after.ranks[0].recompute_s
    assert "chunks recompute" in swap_summary(marked).splitlines()[0]


REFERENCE = ["--schedule", "1f1b", "--ranks", "8", "--microbatches", "16", "--preset",
             "h100-pcie5", "--hidden", "8192", "--seq-len", "4096", "--layers-per-stage", "4"]


def _reference_costs() -> CostModel:
    from pipeswap.schedule.costs import TransformerShape, from_preset

    return from_preset("h100-pcie5", TransformerShape(hidden=8192, seq_len=4096, layers=4))


@pytest.mark.parametrize("budget", ["8.5GiB", "4.25GiB"])
def test_recompute_alone_recomputes_as_few_first_layers_as_meet_the_budget(budget: str) -> None:
    from pipeswap.schedule import parse_bytes
    from pipeswap.schedule.policies import RecomputePolicy
    from pipeswap.schedule.simulate import peak_without_swap

    costs, limit = _reference_costs(), parse_bytes(budget)
    plain = build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=8, microbatches=16))
    plan = plan_swap(plain, RecomputePolicy(costs, limit))
    planned = apply_swap(plain, plan)
    result = simulate(planned, costs)
    assert not any(s.type in (StepType.SWAP_LAUNCH_OFFLOAD, StepType.SWAP_STREAM_OFFLOAD)
                   for order in planned.orders for s in order if s is not None)
    firsts = {rank: max(map(len, plan.ranks[rank].recomputed.values()), default=0)
              for rank in plan.ranks}  # the first layers of every chunk, per rank
    for rank, order in zip(result.ranks, plain.orders):
        outcome, first = plan.outcome(rank.rank), firsts[rank.rank]
        assert outcome is not None
        assert outcome.met and rank.peak_activation_bytes == outcome.peak <= limit
        forwards = [leaf.key for s in order if s is not None for leaf in s.compute_leaves
                    if leaf.type is StepType.FWD]
        assert rank.recomputed_layers == outcome.recomputed_layers == first * len(forwards)
        assert outcome.recompute_s == pytest.approx(rank.recompute_s)
        if first:  # one layer fewer would not fit
            fewer = {key: tuple(range(first - 1)) for key in forwards}
            assert peak_without_swap(order, costs, fewer if first > 1 else None) > limit
    assert firsts[0] > firsts[7]  # the first rank holds most


def test_a_budget_recompute_cannot_reach_is_reported_per_rank(cli: Cli) -> None:
    code, out, _ = cli("simulate", *REFERENCE, "--policy", "recompute", "--budget", "1GiB",
                       "--format", "json")
    assert code == 0
    ranks = json.loads(out)["per_rank"]
    assert all(r["recomputed_layers"] == 4 * 16 for r in ranks)  # everything, still short
    assert all(not r["budget"]["met"] and r["budget"]["shortfall_bytes"] > 0 for r in ranks[:2])


@pytest.mark.parametrize(("extra", "message"), [
    ([], "--policy recompute needs --budget BYTES"),
    (["--budget", "8GiB", "--swap"], "--policy recompute swaps nothing: drop --swap"),
])
def test_recompute_alone_says_what_it_needs(cli: Cli, extra: list[str], message: str) -> None:
    code, _, err = cli("simulate", *REFERENCE, "--policy", "recompute", *extra)
    assert code == 2 and message in err


def test_orders_and_convert_place_the_rc_steps(cli: Cli, tmp_path: Path) -> None:
    code, out, _ = cli("orders", *REFERENCE, "--policy", "recompute", "--budget", "8.5GiB")
    assert code == 0 and "0RC0:0-3 0F0" in out
    source = tmp_path / "plain.txt"
    source.write_text(cli("orders", *REFERENCE)[1])
    code, converted, _ = cli("convert", str(source), "--policy", "recompute", "--budget",
                             "8.5GiB", "--preset", "h100-pcie5", "--hidden", "8192",
                             "--seq-len", "4096", "--layers-per-stage", "4", "--to", "grid")
    assert code == 0 and converted.strip() == out.strip()


def test_inject_recompute_refuses_a_chunk_nobody_forwards_and_a_second_rc() -> None:
    from pipeswap.schedule.recompute_pass import inject_recompute

    schedule = Schedule.from_orders([parse_order("0F0 0B0")])
    with pytest.raises(ScheduleError, match=r"no rank forwards chunk \(stage, micro\) \(0, 1\)"):
        inject_recompute(schedule, {(0, 1): (0,)})
    once = inject_recompute(schedule, {(0, 0): (0,)})
    assert [str(s) for s in once.orders[0]] == ["0RC0:0", "0F0", "0B0"]
    with pytest.raises(ScheduleError, match="already recomputes layers"):
        inject_recompute(once, {(0, 0): (1,)})


def test_the_peak_refuses_a_layer_the_chunk_does_not_have() -> None:
    from pipeswap.schedule.simulate import peak_without_swap

    order = parse_order("0F0 0B0")
    assert peak_without_swap(order, COSTS, {(0, 0): (0, 3)}) == 220 + 90
    with pytest.raises(ScheduleError, match=r"chunk \(stage 0, micro 0\) has 4 layer\(s\) in "
                       "the cost model; it cannot recompute layer 4"):
        peak_without_swap(order, COSTS, {(0, 0): (0, 4)})


def test_describe_counts_rc_steps_and_w_never_runs_backwards() -> None:
    from pipeswap.schedule.formats import describe_schedule

    schedule = Schedule.from_orders([parse_order("0RC0:0-13 0F0 0I0 0W0")])
    assert describe_schedule(schedule) == ("rank 0: 4 steps: 3 compute slots, 0 P2P, 0 swap, "
                                  "1 recompute, 0 idle")
    # every layer's W share moves to I; 0.015 - (0.015 / 14) * 14 rounds below 0
    costs = CostModel(activation_bytes=1400, stages={0: StageCosts(
        forward=0.0, backward=0.03, backward_input=0.0, backward_weight=0.015, layers=14)})
    (rank,) = simulate(schedule, costs).ranks
    assert [span.label for span in rank.spans] == ["0F0", "0I0", "0W0"]
    assert all(span.end >= span.start for span in rank.spans)


def test_a_measured_kept_size_is_what_a_recomputed_layer_keeps() -> None:
    layers = tuple(ChunkBytes(100, kept=30) for _ in range(4))
    costs = dataclasses.replace(COSTS, chunks={(0, 0): ChunkBytes(400, kept=120, layers=layers)})
    (rank,) = _run("0RC0:0 0F0 0B0", costs).ranks
    # 30 kept, 70 made again once layers 3 to 1 are freed
    assert [held for _, held in rank.memory] == [330, 230, 130, 30, 100, 30, 0]
    with pytest.raises(ScheduleError, match="the layers' kept bytes add up to 120, but the "
                       "chunk's kept is 100"):
        ChunkBytes(400, kept=100, layers=layers)
