"""Time the default swap plan at the scale pipelines run: plan, inject, validate and simulate
each case at four microbatch counts, each in a fresh process on one core.

    python benchmarks/swap_planning.py            # print the table
    python benchmarks/swap_planning.py --write    # also record it in BENCHMARKS.md
    python benchmarks/swap_planning.py --quick    # the smallest size of each case (CI smoke)

Every rank is planned (as ``pipeswap-schedule orders --swap`` and ``simulate --swap`` do) with
the default policy and cost model: the peak policy, granularity auto. Phases: ``plan`` (every
rank's policy), ``inject`` (the rest of the swap pass), ``validate`` (every rank's order and
the P2P of all, in NCCL's model) and ``simulate`` (the simulator, which validates first, as the
command runs it: without the timeline traces and plots draw). The process's peak resident
memory is read at the end. Then ``command`` times the whole ``pipeswap-schedule simulate
--swap`` of the same, in another fresh process: start-up, generation, lowering, the swap pass,
simulation and the table. Each case runs at a quarter, half, once and twice its named M, each
size ``--repeat`` times (default 3), keeping each phase's fastest.
Targets at the named M: plan, inject and validate at most 3 s each, simulate and the whole
command at most 5 s each; doubling M at most 2.3x the time of the four phases.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeswap.schedule import Order, SwapCandidate, SwapPolicy
from pipeswap.schedule.policies import Selection

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import benchmark_parser, machine, one_core, publish  # noqa: E402

SECTION = "## Swap planning at scale (`benchmarks/swap_planning.py`)"
TARGETS = {"plan": 3.0, "inject": 3.0, "validate": 3.0, "simulate": 5.0, "command": 5.0}
PHASES = ("plan", "inject", "validate", "simulate")  # the doubling ratio's
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

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> Selection:
        start = time.perf_counter()
        try:
            return self.policy.select(rank, candidates, order)
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
    result = simulate(schedule, CostModel(), timeline=False)
    times["simulate"] = time.perf_counter() - start
    return {"times": times, "steps": sum(len(order) for order in schedule.orders),
            "peak": max(rank.peak_activation_bytes for rank in result.ranks),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(case: Case, microbatches: int) -> dict[str, Any]:
    """One size of ``case`` in a fresh process pinned to one core, then the whole command."""
    done = subprocess.run(one_core([sys.executable, __file__, "--one", case.kind,
                                     str(case.ranks), str(microbatches),
                                     str(case.stages_per_rank)]),
                          check=True, capture_output=True, text=True)
    found: dict[str, Any] = json.loads(done.stdout)
    command = [sys.executable, "-m", "pipeswap.schedule.cli", "simulate", "--swap",
               "--schedule", case.kind, "--ranks", str(case.ranks),
               "--microbatches", str(microbatches)]
    if case.kind == "interleaved-1f1b":
        command += ["--stages-per-rank", str(case.stages_per_rank)]
    start = time.perf_counter()
    subprocess.run(one_core(command), check=True, stdout=subprocess.DEVNULL)
    found["times"]["command"] = time.perf_counter() - start
    return found


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
            total = sum(large["times"][p] for p in PHASES) / sum(small["times"][p]
                                                                for p in PHASES)
            ratios.append(f"{case.name} to M={micro}: {total:.2f}x"
                          + ("" if total <= TARGET_RATIO else " **(over)**"))
    return "\n".join(lines) + "\n\nTime of all four phases when M doubles: " + "; ".join(
        ratios) + "."


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, "only the smallest size of each case, once, not recorded")
    parser.add_argument("--repeat", type=int, default=3, metavar="N",
                        help="measure each size N times, each in a fresh process, and keep "
                             "each phase's fastest (default 3: other load on a shared machine "
                             "only ever adds time)")
    parser.add_argument("--one", nargs=4, metavar=("KIND", "P", "M", "V"),
                        help=argparse.SUPPRESS)  # a child's own case
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
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
            runs = [measure(case, micro) for _ in range(1 if args.quick else args.repeat)]
            fastest = {phase: min(run["times"][phase] for run in runs) for phase in TARGETS}
            measured.append((micro, {**runs[0], "times": fastest,
                                     "rss": max(run["rss"] for run in runs)}))
        results.append((case, measured))
    stamp = datetime.date.today().isoformat()
    text = (f"Measured {stamp} on {machine()}; each size {args.repeat} times, each in a fresh "
            "process on one core, each phase's fastest kept; the "
            "default policy (peak, granularity auto) on the default cost model, every rank "
            "planned; `command` is the whole `pipeswap-schedule simulate --swap` of the same "
            "(start-up, generation, lowering, swap pass, simulation, table). Targets at each "
            "case's named M (the third row): plan, inject and validate at most 3 s each, "
            f"simulate and the command at most 5 s each; doubling M at most {TARGET_RATIO}x "
            "the time of the four phases.\n\n"
            "Command: `python benchmarks/swap_planning.py --write` in the default env.\n\n"
            + report(results))
    return publish(SECTION, text, args.write and not args.quick)


if __name__ == "__main__":
    sys.exit(main())
