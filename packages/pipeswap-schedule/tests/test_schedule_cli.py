"""The pipeswap-schedule command line, run in-process and once as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeswap.schedule import MinGapPolicy, ScheduleKind, ScheduleSpec, build_schedule, to_json
from pipeswap.schedule.formats import loads

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py



def test_orders_json_is_the_documented_shape(cli: Cli) -> None:
    code, out, _ = cli("orders", "--schedule", "interleaved-1f1b", "--ranks", "4",
                       "--microbatches", "8", "--stages-per-rank", "2", "--swap",
                       "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert list(data) == ["orders"] and list(data["orders"]) == ["0", "1", "2", "3"]
    assert data["orders"]["0"][:3] == ["0F0", "0LO0", "0SEND_F0"]
    assert None in data["orders"]["0"]
    spec = ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 4, 8, 2, swap=True)
    assert data == to_json(build_schedule(spec))


def test_orders_grid_reads_back(cli: Cli) -> None:
    code, out, _ = cli("orders", "--schedule", "1f1b", "-P", "4", "-M", "8", "--fsdp",
                       "--batch-p2p", "--policy", "gap")
    assert code == 0 and out.startswith("rank 0: 0UNSHARD 0F0 0LO0")
    spec = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 4, 8, fsdp=True, batch_p2p=True, swap=True)
    assert loads(out) == build_schedule(spec, MinGapPolicy())


def test_validate_accepts_what_orders_prints(
    cli: Cli, tmp_path: Path
) -> None:
    for fmt in ("json", "grid"):
        _, out, _ = cli("orders", "--schedule", "interleaved-1f1b", "-P", "2", "-V", "2",
                        "-M", "4", "--overlap-b-f", "--dxdw-split", "--swap", "--format", fmt)
        path = tmp_path / f"plan.{fmt}"
        path.write_text(out)
        code, out, err = cli("validate", str(path))
        assert (code, err) == (0, "")
        spec = ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 2, 4, 2, overlap_b_f=True,
                            dxdw_split=True, swap=True)
        steps = sum(s is not None for order in build_schedule(spec).orders for s in order)
        assert out.strip() == f"valid: 2 ranks, 4 stages, {steps} steps"


def test_validate_reports_a_deadlock_and_exits_1(
    cli: Cli, tmp_path: Path
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"orders": {"0": ["0F0", "0RECV_B0", "0SEND_F0", "0B0"],
                                           "1": ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]}}))
    code, out, err = cli("validate", str(path))
    assert code == 1 and out == ""
    assert err.startswith("invalid: deadlock: rank 0 waits at 0RECV_B0 for rank 1")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("rank 0: 0F0 0Q0\n", "invalid: line 1 (rank 0): bad step '0Q0'"),
        ('{"orders": ', "invalid: not valid JSON"),
        ("rank 0: 0F0 0SEND_F0 0RECV_B0 0B0\nrank 1: 1RECV_F0 1F0 1B0\n",
         "invalid: rank 1: the backward 1B0 (position 2) needs 1SEND_B0 after it"),
    ],
)
def test_validate_explains_bad_files(
    cli: Cli, tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "plan.txt"
    path.write_text(content)
    code, _, err = cli("validate", str(path))
    assert code == 1
    assert err.startswith(message)


def test_validate_refuses_binary_and_empty_files(
    cli: Cli, tmp_path: Path
) -> None:
    binary = tmp_path / "plan.bin"
    binary.write_bytes(b"\xff\xfe\x00rank")
    code, _, err = cli("validate", str(binary))
    assert code == 2 and "is not a text file" in err
    empty = tmp_path / "empty.json"
    empty.write_text('{"orders": {"0": []}}')
    code, _, err = cli("validate", str(empty))
    assert code == 1 and "no steps" in err


def test_validate_missing_file_is_a_usage_error(
    cli: Cli, tmp_path: Path
) -> None:
    code, _, err = cli("validate", str(tmp_path / "nope.json"))
    assert code == 2 and "cannot read" in err and "nope.json" in err


def test_show_marks_swap_steps_and_summarises_chunks(cli: Cli) -> None:
    code, out, _ = cli("show", "--schedule", "1f1b", "-P", "4", "-M", "8", "--policy", "gap")
    assert code == 0
    header = out.splitlines()[0]
    assert [h.strip() for h in header.split("|")[1:]] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert "0LO0*" in out and "0F0*" not in out
    assert "rank 0: 8 of 8 chunks swapped (stage 0 micro 0-7)" in out
    assert "rank 1: 6 of 8 chunks swapped (stage 1 micro 1-6)" in out
    assert "rank 3: 0 of 8 chunks swapped\n" in out
    assert "rank 0: 64 steps: 16 compute slots, 16 P2P, 32 swap, 0 idle" in out


def test_show_summary_only(cli: Cli) -> None:
    code, out, _ = cli("show", "--schedule", "interleaved-1f1b", "-P", "4", "-V", "2",
                       "-M", "8", "--policy", "gap", "--no-grid")
    assert code == 0 and "|" not in out
    assert "rank 2: 14 of 16 chunks swapped (stage 2 micro 0-7; stage 6 micro 1-6)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["orders", "--schedule", "1f1b", "-P", "4", "-M", "8", "--dxdw-split"],
         "dxdw_split=True requires overlap_b_f=True"),
        (["orders", "--schedule", "gpipe", "-P", "0", "-M", "8"], "ranks must be an integer >= 1"),
        (["orders", "--schedule", "1f1b", "-P", "4", "-M", "8", "--swap", "--swap-min-gap", "1"],
         "min_gap must be an integer >= 3"),
        (["orders", "--schedule", "1f1b", "-P", "4", "-M", "8", "--swap-min-gap", "2"],
         "min_gap must be an integer >= 3"),
    ],
)
def test_bad_options_exit_2_with_the_reason(
    cli: Cli, argv: list[str], message: str
) -> None:
    code, out, err = cli(*argv)
    assert code == 2 and out == ""
    assert err.startswith(f"pipeswap-schedule: error: {message}")


def test_help_teaches_the_notation_and_commands(cli: Cli) -> None:
    code, out, _ = cli("--help")
    assert code == 0
    for text in ("orders", "validate", "show", "LO / WO", "0F3 is stage 0's forward",
                 "examples:"):
        assert text in out
    code, out, _ = cli("orders", "--help")
    assert code == 0 and "--swap-min-gap" in out and "--format" in out


def test_runs_as_a_module_and_reads_stdin() -> None:
    plan = subprocess.run(
        [sys.executable, "-m", "pipeswap.schedule.cli", "orders", "--schedule", "gpipe",
         "-P", "2", "-M", "4", "--swap", "--format", "json"],
        check=True, capture_output=True, text=True)
    checked = subprocess.run(
        [sys.executable, "-m", "pipeswap.schedule.cli", "validate", "-"],
        input=plan.stdout, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("valid: 2 ranks, 2 stages")


def _one_line_error(code: int, err: str, expected: int = 2) -> str:
    """The command failed with ``expected`` and said why in one line, without a traceback."""
    assert code == expected, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["convert", "validate"])
def test_unreadable_files_are_one_line_errors(cli: Cli, tmp_path: Path, command: str) -> None:
    binary = tmp_path / "plan.bin"
    binary.write_bytes(b"\xff\xfe\x00rank")
    for path, message in (
        (tmp_path / "nope.json", f"cannot read {tmp_path / 'nope.json'}: no such file; check "
                                 "the path, or give - to read standard input"),
        (tmp_path, f"cannot read {tmp_path}: it is a directory; give a schedule file"),
        (binary, f"{binary} is not a text file: expected a schedule in UTF-8"),
    ):
        code, out, err = cli(command, str(path))
        assert out == ""
        assert _one_line_error(code, err).startswith(f"pipeswap-schedule: error: {message}")


def test_convert_output_that_cannot_be_written_is_a_one_line_error(
        cli: Cli, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(to_json(build_schedule(ScheduleSpec(ScheduleKind.GPIPE, 2, 2)))))
    missing = tmp_path / "no" / "such" / "dir" / "out.json"
    code, _, err = cli("convert", str(plan), "-o", str(missing))
    assert _one_line_error(code, err) == (
        f"pipeswap-schedule: error: cannot write {missing}: the directory {missing.parent} "
        "does not exist; create it first\n")
    code, _, err = cli("convert", str(plan), "--output", str(tmp_path))
    assert "it is a directory; give a file name" in _one_line_error(code, err)
    code, _, err = cli("convert", str(plan), "-o", str(tmp_path / "out.json"))
    assert (code, err) == (0, "")
    assert loads((tmp_path / "out.json").read_text()) == loads(plan.read_text())


def test_validate_refuses_a_schedule_that_skips_a_microbatch(
        cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "gap.txt"
    path.write_text("rank 0: 0F0 0B0 0F1 0B1 0F3 0B3\n")
    code, _, err = cli("validate", str(path))
    assert "never computes chunk(s) (stage 0, micro 2)" in _one_line_error(code, err, 1)
    path.write_text("rank 0: 0F0 0B0 0F1 0B1\n")
    code, out, _ = cli("validate", str(path), "--microbatches", "2")
    assert (code, out) == (0, "valid: 1 ranks, 1 stages, 4 steps\n")
    code, _, err = cli("validate", str(path), "--microbatches", "4")
    assert _one_line_error(code, err, 1) == (
        "invalid: the schedule runs 2 microbatches (micro 0..1), not the 4 expected: add the "
        "steps of micro 2..3 to every stage, or give 2 as the microbatch count\n")
    code, _, err = cli("validate", str(path), "-M", "0")
    assert code == 2 and "argument --microbatches/-M: 0 is out of range: give 1 to" in err


@pytest.mark.parametrize(("content", "message"), [
    ("rank 0: 0F0 0UNSHARD 0B0\n", "invalid: rank 0: 0F0 (position 0) computes stage 0 while "
                                   "its parameters are not gathered"),
    ("rank 0: 0UNSHARD 0UNSHARD 0F0 0B0 0REDUCE_GRAD 0RESHARD 0RESHARD\n",
     "invalid: rank 0: 0UNSHARD (position 1) gathers stage 0, which 0UNSHARD (position 0) "
     "gathered already"),
    ("rank \u0663: 0F0 0B0\n", "invalid: line 1: expected 'rank N: <steps>' with N in "
                              "digits 0-9"),
    ("rank 0: " + "0" * 200_000 + "F0\n", "invalid: line 1 (rank 0): bad step '000"),
    ("0F0," + "x" * 140_000 + "\n", "invalid: not a schedule in PyTorch's CSV form: line 1: "
                                    "field larger than field limit (131072)"),
])
def test_validate_probes_exit_1_with_one_line(
        cli: Cli, tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "plan.txt"
    path.write_text(content)
    code, _, err = cli("validate", str(path))
    assert _one_line_error(code, err, 1).startswith(message)
    assert len(err) < 1000


def test_a_schedule_too_big_to_build_is_refused_up_front(cli: Cli) -> None:
    code, out, err = cli("orders", "--schedule", "1f1b", "-P", "512", "-M", "100000")
    assert out == ""
    assert _one_line_error(code, err) == (
        "pipeswap-schedule: error: 512 ranks x 1 stages per rank x 100000 microbatches make "
        "51,200,000 chunks, over the 1,048,576 that can be built (about 1 GiB of memory); ask "
        "for fewer ranks, stages per rank or microbatches\n")


@pytest.mark.parametrize("argv", [
    ["orders", "--schedule", "1f1b", "-P", "2", "-M", "4"],
    ["show", "--schedule", "1f1b", "-P", "2", "-M", "4"],
    ["validate", "PLAN"],
    ["convert", "PLAN"],
    ["simulate", "--schedule", "1f1b", "-P", "2", "-M", "4"],
], ids=lambda argv: argv[0])
def test_a_reader_that_leaves_early_ends_it_quietly(tmp_path: Path, argv: list[str]) -> None:
    # As `... | head` does: nobody reads stdout any more. No traceback, no "Exception
    # ignored" at interpreter exit, and no error status.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(to_json(build_schedule(ScheduleSpec(ScheduleKind.GPIPE, 2, 2)))))
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pipeswap.schedule.cli",
             *(str(plan) if a == "PLAN" else a for a in argv)],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


def test_policy_options_are_the_same_on_every_command(cli: Cli, tmp_path: Path) -> None:
    """--policy and --budget (and the cost options) work on orders, show, convert and
    simulate alike; the default is the peak policy, and --swap-min-gap means the gap rule."""
    base = ["--schedule", "1f1b", "-P", "4", "-M", "8"]
    code, peak, _ = cli("orders", *base, "--swap")
    assert code == 0 and loads(peak) == build_schedule(ScheduleSpec(
        ScheduleKind.ONE_F_ONE_B, 4, 8, swap=True))
    code, gap, _ = cli("orders", *base, "--swap-min-gap", "4")
    assert code == 0 and loads(gap) == build_schedule(ScheduleSpec(
        ScheduleKind.ONE_F_ONE_B, 4, 8, swap=True), MinGapPolicy())
    assert gap != peak
    code, out, _ = cli("show", *base, "--policy", "peak", "--budget", "1GiB", "--no-grid")
    assert code == 0 and "rank 3: 0 of 8 chunks swapped" in out
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(to_json(build_schedule(ScheduleSpec(
        ScheduleKind.ONE_F_ONE_B, 4, 8)))))
    code, out, _ = cli("convert", str(path), "--policy", "gap", "--to", "grid")
    assert code == 0 and loads(out) == loads(gap)
    code, _, err = cli("orders", *base, "--policy", "peak", "--swap-min-gap", "5")
    assert code == 2 and "--swap-min-gap sets the gap policy's threshold" in err
    code, _, err = cli("orders", *base, "--policy", "cost", "--budget", "1GiB")
    assert code == 2 and "--budget applies to --policy peak and --policy budget" in err


@pytest.mark.parametrize("argv", [
    ("simulate", "--swap", "--schedule", "1f1b", "-P", "2", "-M", "4"),
    ("simulate", "--schedule", "1f1b", "-P", "0", "-M", "4"),  # refused
], ids=["ran", "refused"])
def test_a_command_run_in_process_leaves_the_collector_as_it_found_it(
        cli: Cli, argv: tuple[str, ...]) -> None:
    # A command pauses the cyclic collector while it works; a program that calls main()
    # must get it back, whether the command ran or was refused.
    import gc

    assert gc.isenabled()
    cli(*argv)
    assert gc.isenabled()
