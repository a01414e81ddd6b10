"""Time the default swap plan at the scale pipelines run: plan, inject, validate and simulate
each case at four microbatch counts, each in a fresh process on one core.

    python benchmarks/swap_planning.py            # print the table
    python benchmarks/swap_planning.py --write    # also record it in BENCHMARKS.md
    python benchmarks/swap_planning.py --quick    # the smallest size of each case (CI smoke)

Every rank is planned (as ``pipeswap-schedule orders --swap`` and ``simulate --swap`` do) with
the default policy and cost model: the peak policy, granularity auto. Phases: ``plan`` (every
rank's policy), ``inject`` (the rest of the swap pass), ``validate`` (every rank's order and
the P2P of all, in NCCL's model) and ``simulate`` (the simulator, which validates first). The
process's peak resident memory is read at the end. Each case runs at a quarter, half, once and
twice its named M. Targets at the named M: plan, inject and validate at most 3 s each and
simulate at most 5 s; doubling M at most 2.3x the time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeswap.schedule import ChunkKey, Order, SwapCandidate, SwapPlacement, SwapPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, publish  # noqa: E402

SECTION = "## Swap planning at scale (`benchmarks/swap_planning.py`)"
TARGETS = {"plan": 3.0, "inject": 3.0, "validate": 3.0, "simulate": 5.0}
TARGET_RATIO = 2.3


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    ranks: int
    microbatches: int  # the size the targets are for; measured at a quarter to twice it
    stages_per_rank: int = 1


CASES = [
    Case("1F1B P=64", "1f1b", 64, 1024),
    Case("Interleaved 1F1B P=64 V=2", "interleaved-1f1b", 64, 512, 2),
    Case("ZBV P=64", "zbv", 64, 512),
    Case("DualPipeV P=32", "dualpipev", 32, 256),
]


class _Timed:
    """A policy that adds up the time the one it wraps takes to choose."""

    def __init__(self, policy: SwapPolicy) -> None:
        self.policy, self.seconds = policy, 0.0

    def select(self, candidates: Sequence[SwapCandidate], order: Order
               ) -> Collection[ChunkKey] | Mapping[ChunkKey, SwapPlacement]:
        start = time.perf_counter()
        try:
            return self.policy.select(candidates, order)
        finally:
            self.seconds += time.perf_counter() - start


def run_one(kind: str, ranks: int, microbatches: int, stages_per_rank: int) -> dict[str, Any]:
    """One size of one case, in this process: each phase's seconds and the peak RSS."""
    from pipeswap.schedule import CostModel, ScheduleKind, ScheduleSpec, simulate, validate
    from pipeswap.schedule.build import generate, passes
    from pipeswap.schedule.policies import default_policy

    spec = ScheduleSpec(ScheduleKind(kind), ranks=ranks, microbatches=microbatches,
                        stages_per_rank=stages_per_rank if kind == "interleaved-1f1b" else 1,
                        swap=True)
    policy = _Timed(default_policy())
    times: dict[str, float] = {}
    start = time.perf_counter()
    schedule = generate(spec)
    for name, apply in passes(spec, policy):
        if name == "swap":
            times["before swap"] = time.perf_counter() - start
            start = time.perf_counter()
        schedule = apply(schedule)
    swap = time.perf_counter() - start
    times["plan"], times["inject"] = policy.seconds, swap - policy.seconds
    start = time.perf_counter()
    validate(schedule, transport="nccl")
    times["validate"] = time.perf_counter() - start
    start = time.perf_counter()
    result = simulate(schedule, CostModel())
    times["simulate"] = time.perf_counter() - start
    return {"times": times, "steps": sum(len(order) for order in schedule.orders),
            "peak": max(rank.peak_activation_bytes for rank in result.ranks),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(case: Case, microbatches: int) -> dict[str, Any]:
    """One size of ``case`` in a fresh process pinned to one core."""
    argv = [sys.executable, __file__, "--one", case.kind, str(case.ranks), str(microbatches),
            str(case.stages_per_rank)]
    if hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        argv = ["taskset", "-c", str(core), *argv] if _has_taskset() else argv
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def _has_taskset() -> bool:
    return any((Path(d) / "taskset").exists() for d in os.environ.get("PATH", "").split(":"))


def report(results: list[tuple[Case, list[tuple[int, dict[str, Any]]]]]) -> str:
    phases = list(TARGETS)
    lines = ["| case | M | steps | " + " | ".join(phases) + " | memory |",
             "|---|---|---|" + "---|" * len(phases) + "---|"]
    ratios = []
    for case, sizes in results:
        for micro, found in sizes:
            times = found["times"]
            cells = []
            for phase in phases:
                flag = ("" if micro != case.microbatches or times[phase] <= TARGETS[phase]
                        else " **(over)**")
                cells.append(f"{times[phase]:.2f} s{flag}")
            lines.append(f"| {case.name} | {micro} | {found['steps']:,} | "
                         + " | ".join(cells) + f" | {found['rss'] / 2**20:.0f} MiB |")
        for (_, small), (micro, large) in zip(sizes, sizes[1:]):
            total = sum(large["times"][p] for p in phases) / sum(small["times"][p]
                                                                for p in phases)
            ratios.append(f"{case.name} to M={micro}: {total:.2f}x"
                          + ("" if total <= TARGET_RATIO else " **(over)**"))
    return "\n".join(lines) + "\n\nTime of all four phases when M doubles: " + "; ".join(
        ratios) + "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    parser.add_argument("--quick", action="store_true",
                        help="only the smallest size of each case, not recorded")
    parser.add_argument("--one", nargs=4, metavar=("KIND", "P", "M", "V"),
                        help=argparse.SUPPRESS)  # a child's own case
    args = parser.parse_args(argv)
    if args.one:
        kind, ranks, micro, per_rank = args.one
        print(json.dumps(run_one(kind, int(ranks), int(micro), int(per_rank))))
        return 0
    results = []
    for case in CASES:
        sizes = [case.microbatches // 4, case.microbatches // 2, case.microbatches,
                 2 * case.microbatches]
        measured = []
        for micro in sizes[:1] if args.quick else sizes:
            print(f"{case.name}, M={micro} ...", file=sys.stderr, flush=True)
            measured.append((micro, measure(case, micro)))
        results.append((case, measured))
    stamp = datetime.date.today().isoformat()
    text = (f"Measured {stamp} on {machine()}; each size in a fresh process on one core; the "
            "default policy (peak, granularity auto) on the default cost model, every rank "
            "planned. Targets at each case's named M (the third row): plan, inject and validate at most 3 s "
            f"each, simulate at most 5 s; doubling M at most {TARGET_RATIO}x.\n\n"
            "Command: `python benchmarks/swap_planning.py --write` in the default env.\n\n"
            + report(results))
    return publish(SECTION, text, args.write and not args.quick)


if __name__ == "__main__":
    sys.exit(main())
