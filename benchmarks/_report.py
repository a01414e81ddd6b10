"""Shared by the benchmarks: the machine line, a command pinned to one core (and a child
process's last line), and writing a section of BENCHMARKS.md."""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()} "
            f"({platform.python_implementation()}), {platform.system()}")


def write_section(title: str, report: str) -> None:
    """Put ``report`` under the ``title`` heading of BENCHMARKS.md, replacing what was there."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"{re.escape(title)}\n.*?(?=\n## |\Z)", re.S)
    section = f"{title}\n\n{report.rstrip()}\n"
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else (
        text.rstrip("\n") + "\n\n" + section)
    BENCHMARKS_MD.write_text(text)


def best_of(run: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timed runs of ``run``, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def publish(title: str, report: str, write: bool) -> int:
    """Print ``report``; with ``write``, also put it under ``title`` in BENCHMARKS.md. The
    benchmark's exit status."""
    print(report)
    if write:
        write_section(title, report)
    return 0


def one_core(argv: list[str]) -> list[str]:
    """``argv`` pinned to one core where ``taskset`` is at hand: the timings are one core's."""
    if hasattr(os, "sched_getaffinity") and _has_taskset():
        return ["taskset", "-c", str(min(os.sched_getaffinity(0))), *argv]
    return argv


def child_line(python: str, code: str, what: str) -> str:
    """The last line ``code`` prints, run by ``python`` in a fresh process on one core;
    ends the benchmark with its stderr, naming ``what``, where it fails."""
    done = subprocess.run(one_core([python, "-c", code]), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def _has_taskset() -> bool:
    return any((Path(d) / "taskset").exists() for d in os.environ.get("PATH", "").split(":"))


def benchmark_parser(doc: str | None, quick: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring as the help, ``--write`` and ``--quick``
    (``quick`` says what the quick run is)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser

