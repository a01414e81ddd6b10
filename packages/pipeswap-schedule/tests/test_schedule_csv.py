"""PyTorch's CSV schedule format, and `pipeswap-schedule convert`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeswap.schedule import MinGapPolicy, ScheduleKind, ScheduleSpec, build_schedule, validate
from pipeswap.schedule.formats import dumps_csv, loads, loads_csv
from pipeswap.schedule.pytorch_family import dualpipev, zbv

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py


def test_csv_round_trips_every_step_kind() -> None:
    schedule = build_schedule(ScheduleSpec(ScheduleKind.DUALPIPEV, ranks=2, microbatches=4,
                                           batch_p2p=True, swap=True), MinGapPolicy())
    text = dumps_csv(schedule)
    assert loads_csv(text) == schedule and loads(text) == schedule  # loads detects CSV
    assert "(0F3;3B1)OVERLAP_F_B" in text and "BATCH_P2P" in text and "0LO0" in text


def test_compute_only_csv_keeps_computes_and_idle_slots() -> None:
    schedule = zbv(2, 4)  # compute orders, with PyTorch's leading idle slot on rank 1
    text = dumps_csv(schedule, compute_only=True)
    rows = text.splitlines()
    assert rows[1].startswith(",1F0,2F0,")  # the idle slot is an empty cell
    assert loads_csv(text).orders == schedule.orders
    # Lowering adds only P2P; PyTorch's early placement also drops the idle slot.
    without_idle = text.replace("\r\n,1F0", "\r\n1F0")
    assert without_idle != text
    for lowering, expected in (("early", without_idle), ("deferred", text)):
        lowered = build_schedule(ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=4,
                                              lowering=lowering))  # type: ignore[arg-type]
        assert dumps_csv(lowered, compute_only=True) == expected



def test_convert_lowers_swaps_and_validates_a_compute_only_csv(
        cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "dualpipev.csv"
    path.write_text(dumps_csv(dualpipev(2, 8)))
    code, out, err = cli("convert", str(path), "--lower", "--swap", "--to", "json")
    assert code == 0, err
    schedule = loads(out)
    validate(schedule)  # the early lowering runs on an in-order transport (NCCL)
    assert any(step is not None and step.type.value == "LO" for order in schedule.orders
               for step in order)
    code, _, err = cli("convert", str(path), "--lower", "--lowering", "deferred", "--swap")
    assert code == 2 and "--transport tagged on the command line" in err  # ordered: NCCL hangs
    code, out, _ = cli("convert", str(path), "--lower", "--lowering", "deferred",
                       "--transport", "tagged", "--to", "csv", "-o", str(tmp_path / "out.csv"))
    assert code == 0 and loads((tmp_path / "out.csv").read_text()).num_ranks == 2


def test_convert_refuses_to_lower_what_has_p2p(cli: Cli,
                                               tmp_path: Path) -> None:
    path = tmp_path / "gpipe.csv"
    path.write_text(dumps_csv(build_schedule(ScheduleSpec(ScheduleKind.GPIPE, 2, 4))))
    code, _, err = cli("convert", str(path), "--lower")
    assert code == 2 and "has them already" in err


def test_a_bad_cell_names_its_row(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Q0\n")
    code, _, err = cli("convert", str(path))
    assert code == 2 and "row 2 (rank 1)" in err and "1Q0" in err
