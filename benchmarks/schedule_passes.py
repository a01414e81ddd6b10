"""Time schedule generation, every pass, swap injection and cross-rank validation at scale.

    python benchmarks/schedule_passes.py            # print the table
    python benchmarks/schedule_passes.py --write    # also record it in BENCHMARKS.md

Each case is timed end to end (best of --repeat runs) and phase by phase; each case runs again
with twice the microbatches to show how the time scales (the passes are linear in the order
length, so the ratio should stay near 2). Targets on a 2-core machine: under 2 s a case, and
at most 2.2x for doubling M.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pipeswap.schedule import Schedule, ScheduleKind, ScheduleSpec, simulate_p2p, validate_rank
from pipeswap.schedule.build import generate, passes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import BENCHMARKS_MD, machine, write_section  # noqa: E402

TARGET_SECONDS = 2.0
TARGET_RATIO = 2.2
SECTION = "## Schedule passes (`benchmarks/schedule_passes.py`)"


@dataclass(frozen=True)
class Case:
    name: str
    spec: ScheduleSpec


CASES = [
    Case("1F1B P=64", ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 64, 1024, swap=True)),
    Case("Interleaved 1F1B P=32 V=4, overlap + dx/dw",
         ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 32, 512, 4, overlap_b_f=True,
                      dxdw_split=True, swap=True)),
    Case("1F1B P=64 + FSDP + batched P2P",
         ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 64, 1024, fsdp=True, batch_p2p=True, swap=True)),
    Case("Interleaved 1F1B P=32 V=4, overlap + dx/dw + FSDP + batched P2P",
         ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, 32, 512, 4, overlap_b_f=True,
                      dxdw_split=True, fsdp=True, batch_p2p=True, swap=True)),
]


def _phases(spec: ScheduleSpec) -> list[tuple[str, Callable[[Schedule], Schedule]]]:
    """The build of ``spec`` as named phases (build_schedule's own), then validation."""

    def validate_ranks(schedule: Schedule) -> Schedule:
        for rank in range(schedule.num_ranks):
            validate_rank(schedule, rank)
        return schedule

    def simulate(schedule: Schedule) -> Schedule:
        simulate_p2p(schedule)
        return schedule

    return [
        ("generate", lambda _: generate(spec)),
        *passes(spec),
        ("validate ranks", validate_ranks),
        ("simulate p2p", simulate),
    ]


@dataclass(frozen=True)
class Result:
    case: Case
    microbatches: int
    steps: int
    total: float
    phases: dict[str, float]


def measure(case: Case, microbatches: int, repeat: int) -> Result:
    spec = replace(case.spec, microbatches=microbatches)
    best: dict[str, float] = {}
    best_total = float("inf")
    steps = 0
    for _ in range(repeat):
        schedule: Schedule | None = None
        times: dict[str, float] = {}
        for name, phase in _phases(spec):
            start = time.perf_counter()
            schedule = phase(schedule)  # type: ignore[arg-type]
            times[name] = time.perf_counter() - start
        assert schedule is not None
        steps = sum(len(order) for order in schedule.orders)
        total = sum(times.values())
        if total < best_total:
            best_total, best = total, times
    return Result(case, microbatches, steps, best_total, best)


def table(results: list[tuple[Result, Result]]) -> str:
    lines = [
        "| case | M | steps | time | M doubled | steps | time | ratio | phases at M (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for base, doubled in results:
        ratio = doubled.total / base.total
        phases = ", ".join(f"{k} {v:.2f}" for k, v in base.phases.items())
        flag = "" if base.total < TARGET_SECONDS and ratio <= TARGET_RATIO else " **(over target)**"
        lines.append(
            f"| {base.case.name} | {base.microbatches} | {base.steps:,} | {base.total:.2f} s | "
            f"{doubled.microbatches} | {doubled.steps:,} | {doubled.total:.2f} s | "
            f"{ratio:.2f}x{flag} | {phases} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; best is kept")
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    args = parser.parse_args(argv)
    results = []
    for case in CASES:
        pair = []
        for microbatches in (case.spec.microbatches, 2 * case.spec.microbatches):
            print(f"{case.name}, M={microbatches} ...", file=sys.stderr, flush=True)
            pair.append(measure(case, microbatches, args.repeat))
        results.append((pair[0], pair[1]))
    stamp = datetime.date.today().isoformat()
    report = (
        f"Measured {stamp} on {machine()}; best of {args.repeat} runs; the whole pipeline "
        f"(generate, every pass the case names, swap injection, per-rank validation and the "
        f"cross-rank P2P simulation). Targets: under {TARGET_SECONDS:.0f} s a case, doubling M at "
        f"most {TARGET_RATIO}x.\n\n"
        f"Command: `python3 dev.py bench` (or `python benchmarks/schedule_passes.py --write` in "
        f"the default env).\n\n{table(results)}"
    )
    print(report)
    if args.write:
        write_section(SECTION, report)
        print(f"\nwritten to {BENCHMARKS_MD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
