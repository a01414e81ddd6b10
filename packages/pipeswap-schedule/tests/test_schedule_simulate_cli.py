"""`pipeswap-schedule simulate`: costs from options, the policies, the JSON and table, files."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeswap.schedule import parse_bytes
from pipeswap.schedule.units import MAX_BYTES, parse_size, parse_time

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py

BASE = ["simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None



def test_json_has_the_documented_fields(cli: Cli) -> None:
    code, out, _ = cli(*BASE, "--policy", "gap", "--forward-time", "1", "--activation-bytes",
                       "1KiB", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert data["step_time_s"] == 33.0  # (M + P - 1) * (F + B) for 1F1B with B = 2F
    ranks = data["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for entry in ranks:
        assert {"rank", "step_time_s", "bubble_fraction", "exposed_copy_s",
                "peak_activation_bytes", "peak_activation_bytes_no_swap",
                "swapped_chunks"} <= entry.keys()
    assert [r["peak_activation_bytes_no_swap"] for r in ranks] == [4096, 3072, 2048, 1024]
    assert [r["peak_activation_bytes"] for r in ranks] == [3072, 3072, 2048, 1024]
    assert [r["swapped_chunks"] for r in ranks] == [8, 6, 0, 0]
    # Without FSDP steps nothing is gathered: memory is the activations.
    assert data["fsdp"] is False
    assert [r["peak_parameter_bytes"] for r in ranks] == [0, 0, 0, 0]
    assert [r["peak_memory_bytes"] for r in ranks] == [3072, 3072, 2048, 1024]
    assert [r["peak_memory_bytes_no_swap"] for r in ranks] == [4096, 3072, 2048, 1024]


FSDP = ["simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--fsdp",
        "--activation-bytes", "100"]


def test_fsdp_counts_the_gathered_parameters(cli: Cli) -> None:
    # Rank 0 holds its parameters (1000) and at most two chunks (200); rank 1 one chunk.
    code, out, _ = cli(*FSDP, "--param-bytes", "1000", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert data["fsdp"] is True
    assert [(r["peak_activation_bytes"], r["peak_parameter_bytes"], r["peak_memory_bytes"],
             r["peak_memory_bytes_no_swap"]) for r in data["per_rank"]] == [
        (200, 1000, 1200, 1200), (100, 1000, 1100, 1100)]


def test_fsdp_adds_parameter_rows_to_the_table(cli: Cli) -> None:
    code, out, _ = cli(*FSDP, "--param-bytes", "1KiB")
    assert code == 0
    rows = {name: cells for name, *cells in (re.split(r"\s{2,}", line.strip())
                                             for line in out.splitlines()[:10])}
    assert rows["peak, swap"] == ["200 B", "100 B"]
    assert rows["params gathered"] == ["1.00 KiB", "1.00 KiB"]
    assert rows["peak with params, no swap"] == ["1.20 KiB", "1.10 KiB"]
    assert rows["peak with params, swap"] == ["1.20 KiB", "1.10 KiB"]
    assert "the most\nsaved activations and gathered parameters held at once" in out
    code, plain, _ = cli(*BASE, "--swap")
    assert code == 0 and "params" not in plain


@pytest.mark.parametrize(("dtype", "size"), [("bf16", 2), ("fp32", 4)])
def test_model_dimensions_give_the_parameter_bytes(cli: Cli, dtype: str, size: int) -> None:
    model = ["--hidden", "1024", "--seq-len", "128", "--layers-per-stage", "3", "--dtype", dtype,
             "--format", "json"]
    code, out, _ = cli(*FSDP, *model)
    assert code == 0
    ranks = json.loads(out)["per_rank"]
    assert [r["peak_parameter_bytes"] for r in ranks] == [12 * 1024**2 * 3 * size] * 2
    code, out, _ = cli(*FSDP, *model, "--param-bytes", "5")  # the explicit value wins
    assert [r["peak_parameter_bytes"] for r in json.loads(out)["per_rank"]] == [5, 5]


def test_parameter_bytes_without_fsdp_are_refused(cli: Cli) -> None:
    code, out, err = cli(*BASE, "--param-bytes", "1GiB")
    assert (code, out) == (2, "")
    assert err == ("pipeswap-schedule: error: --param-bytes sizes the parameters FSDP gathers, "
                   "but without --fsdp the schedule gathers none, so it would change nothing: "
                   "add --fsdp, or drop --param-bytes\n")


def test_the_help_teaches_parameter_bytes(cli: Cli) -> None:
    code, out, _ = cli("simulate", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "--param-bytes BYTES one stage's parameters as FSDP gathers them" in text
    assert "needs --fsdp" in text and "12*hidden^2 weights per layer" in text


def test_model_dimensions_and_a_preset(cli: Cli) -> None:
    code, out, _ = cli(*BASE, "--preset", "h100-pcie5", "--hidden", "4096",
                       "--seq-len", "4096", "--layers-per-stage", "2", "--policy", "gap",
                       "--format", "json")
    assert code == 0
    rank0 = json.loads(out)["per_rank"][0]
    assert rank0["peak_activation_bytes_no_swap"] == 4 * 34 * 4096 * 4096 * 2
    assert rank0["swapped_chunks"] == 8


def test_the_budget_policy_reports_what_it_could_not_meet(
        cli: Cli) -> None:
    code, out, _ = cli(*BASE, "--activation-bytes", "100", "--policy", "budget", "--budget",
                       "250")
    assert code == 0
    budget = next(line for line in out.splitlines() if line.startswith("budget"))
    assert budget.split()[1:] == ["short", "50", "B", "short", "50", "B", "met", "met"]


def test_the_table_puts_ranks_side_by_side(cli: Cli) -> None:
    code, out, _ = cli(*BASE, "--swap")
    assert code == 0
    header = out.splitlines()[0].split()
    assert header == ["rank", "0", "1", "2", "3"]
    assert any(line.startswith("peak, swap") for line in out.splitlines())
    assert "simulated step time: 33 s" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--policy", "budget"], "--policy budget needs --budget BYTES"),
    (["--policy", "cost", "--budget", "1GiB"], "--budget applies to --policy peak and --policy budget, not cost"),
    (["--hidden", "4096"], "needs all of --hidden, --seq-len and --layers-per-stage"),
    (["--preset", "tpu"], "unknown preset 'tpu'"),
    (["--d2h-bandwidth", "0", "--swap"],
     "argument --d2h-bandwidth: '0' is out of range: give 1 to 2**60 bytes per second"),
    (["--activation-bytes", "lots"], "not a size: 'lots'"),
])
def test_bad_options_say_what_to_fix(cli: Cli, argv: list[str],
                                     message: str) -> None:
    code, _, err = cli(*BASE, *argv)
    assert code == 2 and message in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--activation-bytes", "1e400"], "'1e400' is out of range: give 0 to 2**60 bytes (1 EiB)"),
    (["--pinned-bytes", "2e18"], "'2e18' is out of range: give 0 to 2**60 bytes"),
    (["--boundary-bytes", "1e400"], "'1e400' is out of range"),
    (["--param-bytes", "1e400"], "'1e400' is out of range: give 0 to 2**60 bytes"),
    (["--budget", "1e400"], "'1e400' is out of range"),
    (["--forward-time", "1e400"],
     "'1e400' is out of range: give a time above 0 (1ns at least) up to 1e6 s (about 11.6 days)"),
    (["--forward-time", "1e308"], "'1e308' is out of range: give a time above 0"),
    (["--backward-time", "2e6s"], "'2e6s' is out of range"),
    (["--p2p-latency", "1e400"], "'1e400' is out of range"),
    (["--d2h-bandwidth", "1e-400"], "'1e-400' is out of range: give 1 to 2**60 bytes per second"),
    (["--h2d-bandwidth", "0.5"], "'0.5' is out of range"),
    (["--p2p-bandwidth", "1e400"], "'1e400' is out of range"),
    (["--flops", "0"], "'0' is out of range: give 1 to 1e21 FLOP/s"),
    (["--micro-batch-size", "0"], "0 is out of range: give 1 to 16,777,216"),
    (["--hidden", "1e3"], "not an integer: '1e3'"),
    (["--seq-len", "99999999999"], "99999999999 is out of range"),
    (["--layers-per-stage", "-2"], "-2 is out of range"),
])
def test_cost_options_must_be_finite_and_in_range(cli: Cli, argv: list[str],
                                                  message: str) -> None:
    # Before, 1e400 was inf: an OverflowError, or a report of "inf s" and "nan%".
    code, out, err = cli(*BASE, *argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.splitlines()[-1].startswith(
        f"pipeswap-schedule simulate: error: argument {argv[0]}: {message}")


def test_a_trace_that_cannot_be_written_is_a_one_line_error(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "trace.json"
    code, _, err = cli(*BASE, "--trace", str(missing))
    assert (code, err) == (2, f"pipeswap-schedule: error: cannot write {missing}: the "
                              f"directory {missing.parent} does not exist; create it first\n")


def test_a_trace_file_is_written(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "step.json"
    code, _, _ = cli(*BASE, "--policy", "gap", "--trace", str(path))
    assert code == 0
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert any(e["ph"] == "C" for e in events) and any(e["name"] == "0LO0" for e in events)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the [plot] extra is not installed here")
def test_a_plot_is_drawn(cli: Cli, tmp_path: Path) -> None:
    for name in ("step.png", "step.svg"):
        code, _, err = cli(*BASE, "--swap", "--plot", str(tmp_path / name))
        assert code == 0, err
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "step.svg").read_bytes()[:1000]


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="matplotlib is installed here")
def test_plotting_without_the_extra_says_how_to_get_it(
        cli: Cli, tmp_path: Path) -> None:
    code, _, err = cli(*BASE, "--swap", "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "pip install 'pipeswap-schedule[plot]'" in err


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the [plot] extra is not installed here")
def test_a_plot_format_matplotlib_cannot_write_is_a_one_line_error(
        cli: Cli, tmp_path: Path) -> None:
    code, _, err = cli(*BASE, "--plot", str(tmp_path / "step.xyz"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"pipeswap-schedule: error: cannot draw {tmp_path / 'step.xyz'}: ")
    assert err.endswith("; name it .png, .svg or .pdf\n")


def test_units() -> None:
    assert parse_size("1GiB") == 2**30 and parse_size("55GB") == 55e9
    assert parse_size("1.5e3") == 1500.0 and parse_time("12ms") == pytest.approx(0.012)
    assert parse_time("800us") == pytest.approx(8e-4) and parse_time("2") == 2.0


def test_parse_bytes_takes_what_the_byte_options_take() -> None:
    assert parse_bytes("3MiB") == 3 * 2**20 and parse_bytes(" 55 GB ") == 55 * 10**9
    assert parse_bytes("1.5e3") == 1500 and parse_bytes("1073741824") == 2**30
    assert parse_bytes("2Ki") == 2048 and parse_bytes("0.5") == 0  # a fraction is dropped
    assert parse_bytes("1TiB") == 2**40 and parse_bytes(str(MAX_BYTES)) == MAX_BYTES


@pytest.mark.parametrize(("text", "message"), [
    ("lots", "not a size: 'lots' (examples: "),
    ("-1", "not a size: '-1'"),
    ("3 MiBs", "not a size"),
    ("2e18", "'2e18' is out of range: give 0 to 2**60 bytes (1 EiB)"),
    ("1e400", "'1e400' is out of range"),
])
def test_parse_bytes_refuses_with_a_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_bytes(text)


def test_a_bad_time_or_size_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=re.escape("not a time: '3h'")):
        parse_time("3h")
    with pytest.raises(ValueError, match=re.escape("not a size: ''")):
        parse_size("")
