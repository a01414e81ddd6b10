"""Shared fixtures for the schedule tests: MindSpore hyper-parallel's worked examples as
data, and the command line run in-process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pipeswap.schedule import Schedule
from pipeswap.schedule.cli import main
from pipeswap.schedule.text import parse_rank_lines

WORKED = Path(__file__).parent / "worked"


@pytest.fixture
def worked() -> Callable[[str], Schedule]:
    """Load one of MindSpore hyper-parallel's exact schedules from ``tests/worked/<name>.txt``."""

    def load(name: str) -> Schedule:
        return Schedule.from_orders(parse_rank_lines((WORKED / f"{name}.txt").read_text()))

    return load


Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """Run ``pipeswap-schedule ARGV...`` in-process: (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run
