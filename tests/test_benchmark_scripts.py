"""The benchmark scripts still run: each on tiny sizes, checking the shape of what it reports.

No figure is asserted here (speed belongs in BENCHMARKS.md, not in tests); this keeps the
scripts from rotting between the runs that record them, in particular the GPU check, which
otherwise runs only where an accelerator is lent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


# copies, overlap, the preset and three one-rank replays; not its tests part, which would
# run the swap and platform stress tests again (this suite runs them itself)
def test_gpu_check_runs_its_parts_on_the_cpu_platform() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--quick",
         "--skip", "tests", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    figures = json.loads(out.stdout)
    assert figures["device"] == "cpu" and "tests" not in figures
    for direction, through_manager in (("d2h", "offload"), ("h2d", "load")):
        assert figures["copies"][f"{direction}_gb_s"] > 0
        assert 0.0 <= figures["overlap"][f"{direction}_hidden"] <= 1.0
        assert 0.0 <= figures["overlap"][f"manager_{through_manager}_hidden"] <= 1.0
    assert figures["copies"]["both_gb_s_per_direction"] > 0
    assert figures["overlap"]["manager_group_bytes"] >= 1 << 20  # the manager moved the MiB
    assert [row["figure"] for row in figures["preset"]][:2] == ["D2H bandwidth", "H2D bandwidth"]
    replay = figures["replay"]
    assert replay["ok"], replay
    rows = replay["rows"]
    assert list(rows) == ["no swap", "swap, whole chunks", "swap, streamed"]
    assert rows["no swap"]["swapped"] == 0
    assert rows["swap, whole chunks"]["swapped"] > 0 and rows["swap, whole chunks"]["streamed"] == 0
    assert rows["swap, streamed"]["streamed"] == rows["swap, streamed"]["swapped"] > 0
    for row in list(rows.values())[1:]:
        assert 0 < row["counted"] < rows["no swap"]["counted"]
        assert row["allocated_saving"] is not None and row["allocated_saving"] > 0


@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine has an accelerator")
def test_gpu_check_explains_a_missing_accelerator() -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "no accelerator on this machine; pass --device cpu" in out.stderr


# the two-rank cases, in one spawn (the four-rank 1F1B case would take a second one; the
# end-to-end tests check 1F1B against the unsplit model)
def test_executor_vs_torch_runs_and_agrees() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "executor_vs_torch.py"), "--quick",
         "--cases", "interleaved-zb,zbv", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout)
    assert [case["case"] for case in figures["cases"]] == [
        "Interleaved ZB P=2 V=2 M=8", "ZBV P=2 M=8"]
    for case in figures["cases"]:
        assert case["agree"] and not case["refused"], case
        assert set(case["step_s"]) == {"pipeswap", "pipeswap-swap", "torch"}
        assert all(seconds > 0 for seconds in case["step_s"].values())


def test_swap_planning_times_every_phase_of_every_case() -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "swap_planning.py"), "--quick"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split(" | ") for line in out.stdout.splitlines()
            if line.startswith("| ") and " MiB |" in line]
    assert [row[0].lstrip("| ") for row in rows] == [
        "1F1B P=64", "Interleaved 1F1B P=64 V=2", "ZBV P=64", "DualPipeV P=32"]
    for row in rows:  # plan, inject, validate, simulate and the command timed; memory read
        assert all(cell.endswith(" s") and float(cell[:-2]) > 0 for cell in row[3:8]), row
        assert row[8].endswith("MiB |") and int(row[8].split()[0]) > 0, row


def test_compiled_build_times_each_case_in_both_builds() -> None:
    """Run with this interpreter as the compiled one too (the suite has no compiled build):
    both runs of each case give the same figures."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / "compiled_build.py"), "--quick",
                          "--compiled", sys.executable, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)["rows"]
    assert [row["case"].split(",")[0] for row in rows] == ["simulate --budget", "plan"]
    for row in rows:
        assert row["pure_s"] > 0 and row["compiled_s"] > 0 and row["same_figures"], row
        assert row["builds"] == [False, False], row  # this suite runs the source


def test_pipeline_choice_plans_each_case_both_ways() -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "pipeline_choice.py"), "--quick",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)["rows"]
    assert [row["case"].split(",")[0] for row in rows] == ["1f1b", "zbv"]
    for row in rows:
        for choice in ("turns", "alike"):
            assert row[choice]["met"] and row[choice]["seconds"] > 0, row
        assert row["alike"]["step"] > 0 and row["turns"]["step"] > 0, row


def test_plan_search_times_each_pipeline_degree() -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "plan_search.py"), "--quick",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)["rows"]
    assert [row["ranks"] for row in rows] == [2, 4]
    for row in rows:  # each degree searched, its best found at that degree
        assert row["no_fit"] is None and not row["stopped"], row
        assert 0 < row["simulated"] <= row["considered"], row
        assert row["seconds"] > 0 and row["step_time_s"] > 0 and row["tokens_per_s"] > 0, row
        assert f" P={row['ranks']} " in row["best"] and row["rss"] > 0, row


def test_layer_offload_runs_and_agrees_bit_for_bit() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "layer_offload.py"), "--quick", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout)
    assert figures["device"] == "cpu" and figures["sizes"]["layers"] == 4
    assert [c["name"] for c in figures["contenders"]] == [
        "plain autograd", "save_on_cpu(pin_memory=False)", "LayerOffload(lag=1)"]
    for contender in figures["contenders"]:
        assert contender["bit_identical"], contender
        assert contender["step_s"] > 0
        assert contender["peak_bytes"] is None or contender["peak_bytes"] > 0
    counted = figures["layer_offload"]
    assert counted["offloaded_bytes_per_step"] == counted["reloaded_bytes_per_step"] > 0
    assert 0 < counted["peak_held_bytes"] < counted["saved_bytes"]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_executor_vs_torch_runs_each_contender_after_each_other_equally_often(
        count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("executor_vs_torch")
    names = ["pipeswap", "pipeswap-swap", "torch"][:count]
    orders = module.balanced_orders(names)
    assert all(sorted(order) == sorted(names) for order in orders)  # each once a step
    run = [name for order in orders for name in order]  # one period, repeated step after step
    after = {(a, b): 0 for a in names for b in names if a != b}
    for before, name in zip(run, run[1:] + run[:1]):
        if before != name:
            after[before, name] += 1
    assert len(set(after.values())) <= 1, after  # every ordered pair alike


def test_keep_offload_recompute_plans_a_budget_three_ways() -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "keep_offload_recompute.py"),
                          "--quick", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    (row,) = json.loads(out.stdout)["rows"]
    offload, recompute, mixed = row["offload"], row["recompute"], row["mixed"]
    assert offload["met"] and recompute["met"] and mixed["met"]
    assert offload["recomputed_layers_rank0"] == 0 < recompute["recomputed_layers_rank0"]
    assert recompute["exposed_copy_s"] == 0.0 and recompute["ratio"] > 1.0
    assert mixed["ratio"] <= min(offload["ratio"], recompute["ratio"]) and row["mixed_plan_s"] > 0
    assert list(json.loads(out.stdout)["setup_s"]) == ["8"]
    whole = json.loads(out.stdout)["whole"]
    assert {entry["choice"] for entry in whole} == {"turns", "alike"}
    assert len({entry["step_time_s"] for entry in whole if entry["choice"] == "turns"}) == 1
    assert all(entry["s"] > 0 and entry["step_time_s"] > 0 for entry in whole)
