"""What a new user gets wrong on the command line, each answered with a short reason and a
usage exit: status 2, at most three lines on stderr (one, in fact), nothing on stdout and no
traceback. ``validate`` is the one exception by design: a file it can read but that is no
valid schedule is its verdict, status 1 with ``invalid: <reason>``.

Run in-process through ``main(argv)`` (the ``cli`` fixture), so the whole table takes about
two seconds.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py

PLAN = ('{"orders": {"0": ["0F0", "0SEND_F0", "0RECV_B0", "0B0"], '
        '"1": ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]}}')
FILES: dict[str, str | bytes] = {
    "plan.json": PLAN,
    "empty.json": "",
    "comment.txt": "# a schedule will go here\n",
    "binary.bin": b"\xff\xfe\x00\x01rank",
    "truncated.json": PLAN[:40],
    "trailing.json": PLAN + " and more",
    "array.json": '[["0F0", "0B0"]]',
    "orders_list.json": '{"orders": [["0F0", "0B0"]]}',
    "orders_null.json": '{"orders": null}',
    "orders_empty.json": '{"orders": {}}',
    "steps_string.json": '{"orders": {"0": "0F0 0B0"}}',
    "steps_numbers.json": '{"orders": {"0": [0, 1]}}',
    "steps_nested.json": '{"orders": {"0": [["0F0"], ["0B0"]]}}',
    "rank_negative.json": '{"orders": {"-1": ["0F0", "0B0"]}}',
    "bad_step.json": '{"orders": {"0": ["0F0", "0X0", "0B0"]}}',
    "rank_twice.json": PLAN[:-2] + ', "0": ["0F0", "0SEND_F0", "0RECV_B0", "0B0"]}}',
    "rank_twice.txt": "rank 0: 0F0 0B0\nrank 0: 0F0 0B0\n",
    "deep.json": '{"orders": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "huge_number.json": '{"orders": {"0": [' + "9" * 5000 + "]}}",
    "garbage.csv": "hello,world\n",
    "lag.txt": "rank 0: 0SO0:5 0F0 0WO0 0SL0 0WL0 0B0\n",
}

BUILD = ["--schedule", "1f1b", "-P", "2", "-M", "4"]
SIM = ["simulate", *BUILD]
BUDGET_ZERO = "a budget of '0' bytes keeps nothing on the device"


def _case(name: str, argv: list[str], phrase: str, code: int = 2) -> object:
    return pytest.param(argv, phrase, code, id=name)


CASES = [
    # files that cannot be read
    _case("missing-validate", ["validate", "{d}/nope.json"], "no such file"),
    _case("missing-convert", ["convert", "{d}/nope.json"], "no such file"),
    _case("directory", ["validate", "{d}"], "it is a directory; give a schedule file"),
    _case("binary-validate", ["validate", "{d}/binary.bin"], "is not a text file"),
    _case("binary-convert", ["convert", "{d}/binary.bin"], "is not a text file"),
    # files that are no schedule: validate's verdict (1), convert's usage error (2)
    _case("empty-validate", ["validate", "{d}/empty.json"], "the text is empty", 1),
    _case("empty-stdin", ["validate", "-"], "the text is empty", 1),
    _case("empty-convert", ["convert", "{d}/empty.json"], "the text is empty"),
    _case("comment-only", ["convert", "{d}/comment.txt"], "empty or only comments"),
    _case("truncated-validate", ["validate", "{d}/truncated.json"], "not valid JSON", 1),
    _case("truncated-convert", ["convert", "{d}/truncated.json"], "not valid JSON"),
    _case("trailing-text", ["convert", "{d}/trailing.json"], "not valid JSON: Extra data"),
    _case("json-array", ["convert", "{d}/array.json"], "expected a JSON object"),
    _case("orders-list", ["convert", "{d}/orders_list.json"], "expected a JSON object"),
    _case("orders-null", ["convert", "{d}/orders_null.json"], "expected a JSON object"),
    _case("orders-empty", ["convert", "{d}/orders_empty.json"], "no ranks found"),
    _case("steps-string", ["convert", "{d}/steps_string.json"], "expected a list of step"),
    _case("steps-numbers", ["convert", "{d}/steps_numbers.json"], "expected a list of step"),
    _case("steps-nested", ["convert", "{d}/steps_nested.json"], "expected a list of step"),
    _case("rank-negative", ["convert", "{d}/rank_negative.json"], "rank keys are ranks"),
    _case("bad-step", ["validate", "{d}/bad_step.json"], "rank 0: bad step '0X0'", 1),
    _case("rank-twice-json", ["validate", "{d}/rank_twice.json"], "rank 0 appears twice", 1),
    _case("rank-twice-convert", ["convert", "{d}/rank_twice.json"], "rank 0 appears twice"),
    _case("rank-twice-text", ["validate", "{d}/rank_twice.txt"],
          "line 2: rank 0 appears twice (first on line 1)", 1),
    _case("deep-json", ["convert", "{d}/deep.json"], "nested too deeply"),
    _case("huge-number", ["convert", "{d}/huge_number.json"], "thousands of digits"),
    _case("garbage-csv", ["convert", "{d}/garbage.csv"], "bad step 'hello'"),
    _case("lag-past-layers", ["validate", "{d}/lag.txt", "--layers-per-stage", "2"],
          "with a layer lag of 5, but one chunk of stage 0 has 2 layer(s)", 1),
    # sizes of the schedule
    _case("ranks-zero", ["orders", "--schedule", "1f1b", "--ranks", "0", "-M", "4"],
          "ranks must be an integer >= 1, got 0"),
    _case("ranks-negative", ["orders", "--schedule", "1f1b", "-P", "-3", "-M", "4"],
          "ranks must be an integer >= 1, got -3"),
    _case("ranks-word", ["orders", "--schedule", "1f1b", "-P", "four", "-M", "4"],
          "argument --ranks/-P: invalid int value: 'four'"),
    _case("microbatches-zero", ["show", "--schedule", "1f1b", "-P", "2", "-M", "0"],
          "microbatches must be an integer >= 1, got 0"),
    _case("microbatches-negative", ["simulate", "--schedule", "1f1b", "-P", "2", "-M", "-1"],
          "microbatches must be an integer >= 1, got -1"),
    _case("stages-per-rank-zero", ["orders", "--schedule", "interleaved-1f1b", "-P", "2",
                                   "-M", "4", "-V", "0"], "stages_per_rank must be"),
    _case("stages-per-rank-negative", ["orders", "--schedule", "interleaved-1f1b", "-P", "2",
                                       "-M", "4", "-V", "-2"], "stages_per_rank must be"),
    _case("absurd-size", ["orders", "--schedule", "1f1b", "-P", "100000000", "-M",
                          "100000000"], "over the 1,048,576 that can be built"),
    _case("v-of-three", ["orders", "--schedule", "zbv", "-P", "2", "-M", "4", "-V", "3"],
          "stages_per_rank must be 2, got 3"),
    _case("dxdw-alone", ["orders", *BUILD, "--dxdw-split"], "requires overlap_b_f=True"),
    _case("min-gap-zero", ["show", *BUILD, "--swap-min-gap", "0"], "min_gap must be"),
    # budgets
    _case("budget-zero", ["show", *BUILD, "--budget", "0"], BUDGET_ZERO),
    _case("budget-zero-policy", [*SIM, "--policy", "budget", "--budget", "0"], BUDGET_ZERO),
    _case("budget-negative", ["show", *BUILD, "--budget", "-1GiB"],
          "a budget of '-1GiB' bytes keeps nothing"),
    _case("budget-negative-equals", [*SIM, "--budget=-5"], "a budget of '-5' bytes"),
    _case("budget-under-a-byte", [*SIM, "--budget", "0.4"], "a budget of '0.4' bytes"),
    _case("budget-bad-unit", ["show", *BUILD, "--budget", "4XB"], "not a size: '4XB'"),
    _case("budget-nan", [*SIM, "--budget", "nan"], "not a size: 'nan'"),
    _case("budget-absurd", [*SIM, "--budget", "1e400"], "'1e400' is out of range"),
    _case("budget-missing", [*SIM, "--policy", "budget"], "--policy budget needs --budget"),
    # costs
    _case("unknown-preset", [*SIM, "--preset", "a100"], "unknown preset 'a100'"),
    _case("time-bad-unit", [*SIM, "--forward-time", "3h"], "not a time: '3h'"),
    _case("time-negative", [*SIM, "--forward-time", "-1"], "not a time: '-1'"),
    _case("compute-time-zero", [*SIM, "--forward-time", "0"],
          "argument --forward-time: '0' is out of range: give a time above 0"),
    _case("backward-time-zero", [*SIM, "--backward-time", "0s"],
          "argument --backward-time: '0s' is out of range: give a time above 0"),
    _case("bandwidth-infinite", [*SIM, "--d2h-bandwidth", "inf"],
          "argument --d2h-bandwidth: not a size: 'inf'"),
    _case("bandwidth-zero", [*SIM, "--d2h-bandwidth", "0"], "'0' is out of range"),
    _case("hidden-zero", [*SIM, "--hidden", "0"], "0 is out of range"),
    _case("layers-absurd", [*SIM, "--hidden", "8", "--seq-len", "8", "--layers-per-stage",
                            "16777216"], "16777216 is out of range: give 1 to 1,024"),
    _case("model-partial", [*SIM, "--hidden", "8"], "the model needs all of"),
    _case("param-bytes-alone", [*SIM, "--param-bytes", "1GiB"], "add --fsdp"),
    # commands and options
    _case("no-command", [], "the following arguments are required: COMMAND"),
    _case("unknown-command", ["frobnicate"], "invalid choice: 'frobnicate'"),
    _case("unknown-option", ["show", *BUILD, "--frob"], "unrecognized arguments: --frob"),
    _case("validate-microbatches-zero", ["validate", "{d}/plan.json", "-M", "0"],
          "0 is out of range"),
    _case("validate-layers-zero", ["validate", "{d}/plan.json", "--layers-per-stage", "0"],
          "0 is out of range"),
    _case("unknown-transport", ["validate", "{d}/plan.json", "--transport", "udp"],
          "invalid choice: 'udp'"),
    _case("unknown-format", ["convert", "{d}/plan.json", "--to", "xml"],
          "invalid choice: 'xml'"),
    _case("lower-twice", ["convert", "{d}/plan.json", "--lower"], "has them already"),
    # output paths
    _case("output-directory", ["convert", "{d}/plan.json", "-o", "{d}"],
          "it is a directory; give a file name"),
    _case("output-missing-directory", ["convert", "{d}/plan.json", "-o", "{d}/no/out.json"],
          "does not exist; create it first"),
    _case("trace-directory", [*SIM, "--trace", "{d}"], "it is a directory"),
    _case("trace-missing-directory", [*SIM, "--trace", "{d}/no/trace.json"],
          "does not exist; create it first"),
    pytest.param(["convert", "{d}/plan.json", "-o", "/dev/full"], "No space left", 2,
                 id="output-device-full", marks=pytest.mark.skipif(
                     not Path("/dev/full").exists(), reason="no /dev/full here")),
]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    for name, content in FILES.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize(("argv", "phrase", "code"), CASES)
def test_bad_input_gets_a_short_reason_and_a_usage_exit(
        cli: Cli, files: Path, monkeypatch: pytest.MonkeyPatch,
        argv: list[str], phrase: str, code: int) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    exit_code, out, err = cli(*(arg.format(d=files) for arg in argv))
    assert (exit_code, out) == (code, ""), err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert 1 <= len(lines) <= 3 and err.endswith("\n"), err
    assert lines[0].startswith("invalid: " if code == 1 else "pipeswap-schedule"), err
    assert phrase in err, err


def test_a_usage_error_points_at_the_commands_help(cli: Cli) -> None:
    # argparse would print the whole usage first: twenty lines for the cost options.
    code, _, err = cli("simulate", *BUILD, "--forward-time", "3h")
    assert code == 2 and err == (
        "pipeswap-schedule simulate: error: argument --forward-time: not a time: '3h' "
        "(examples: 0.012, 12ms, 800us) (see 'pipeswap-schedule simulate --help')\n")


def test_a_budget_of_zero_says_what_to_give_instead(cli: Cli) -> None:
    code, _, err = cli("show", *BUILD, "--budget", "0")
    assert code == 2 and err == (
        "pipeswap-schedule show: error: argument --budget: a budget of '0' bytes keeps nothing "
        "on the device, not even the chunk being computed: give the activation bytes one rank "
        "may hold (e.g. 40GiB), or drop --budget to swap only chunks whose copies hide (see "
        "'pipeswap-schedule show --help')\n")


def test_values_that_start_with_a_dash_still_parse_where_they_did(
        cli: Cli, files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # argparse reads plain negative numbers as values, and '-1GiB' as an unknown option;
    # only the latter is now handed to the option before it.
    assert "ranks must be an integer >= 1, got -3" in cli("orders", *BUILD[:2], "-P", "-3",
                                                            "-M", "4")[2]
    monkeypatch.chdir(files)
    for name in ("-1", "-1.json"):
        (files / name).write_text(PLAN)
    assert cli("validate", "-1")[0] == 0
    assert cli("validate", "--transport", "tagged", "-1")[0] == 0
    assert cli("validate", "--", "-1.json")[0] == 0
    assert cli("validate", "./-1.json")[0] == 0
