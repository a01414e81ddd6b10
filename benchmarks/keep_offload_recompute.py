"""Keep, offload or recompute under a memory budget, on the reference case, at three host-link
speeds.

    python benchmarks/keep_offload_recompute.py            # print the table
    python benchmarks/keep_offload_recompute.py --write    # also record it in BENCHMARKS.md
    python benchmarks/keep_offload_recompute.py --quick    # one budget, one link (a smoke run)

The reference case: 1F1B, 8 ranks, 16 microbatches, h100-pcie5, a transformer of hidden 8192,
sequence 4096 and 4 layers a stage (per layer 1.06 GiB of activations, a 17.9 ms forward; a
recomputed layer keeps its 64 MiB input). Each budget is planned three ways: offload alone
(the peak policy, whole chunks or streamed, ``--recompute never``), recompute alone (the
fewest first layers per rank, ``--policy recompute``) and mixed (the peak policy choosing
per rank what to recompute and what to swap, the command line's default under a budget);
each is simulated: step time against the same schedule without either, the largest rank's
peak, whether every rank met the budget, the most compute time a rank waits for copies, and
the layers rank 0 recomputes a step. Each row also says how long the mixed plan took.

Then the set-up each rank pays at scale: 1F1B on the PCIe Gen4 link under 8.5 GiB, M = 2P,
rank 0 planning only itself (as each rank of ``pipeswap-train --budget`` does), timed at
P = 8, 16, 32 and 64. Last, the whole command's planning at 16, 32 and 64 ranks, both ways
``simulate --budget`` may choose the ranks' plans in the whole pipeline: rank by rank (every
rank planned, then each rank's plan chosen in turn; in one process and in one worker
process per core, ``--jobs``) and one plan alike on every rank, with the step each gives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pipeswap.schedule import (
    ScheduleKind,
    ScheduleSpec,
    build_schedule,
    inject_swap,
    parse_bytes,
)
from pipeswap.schedule.costs import CostModel, Link, TransformerShape, from_preset
from pipeswap.schedule.policies import PeakPolicy, PipelineChoice, RecomputePolicy
from pipeswap.schedule.policies.peak import TURNS_UP_TO
from pipeswap.schedule.simulate import SimulationResult, simulate
from pipeswap.schedule.cli.simulate_command import usable_cores

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, publish  # noqa: E402

SECTION = "## Offload or recompute under a budget (`benchmarks/keep_offload_recompute.py`)"
SPEC = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=8, microbatches=16)
SHAPE = TransformerShape(hidden=8192, seq_len=4096, layers=4)
#: name: host-link bandwidth each way (bytes/s)
LINKS = {"PCIe Gen5 (55 GB/s)": 55e9, "PCIe Gen4 (25 GB/s)": 25e9, "12 GB/s": 12e9}
BUDGETS = ["17GiB", "8.5GiB", "4.25GiB", "2.2GiB", "1.2GiB"]


@dataclass(frozen=True)
class Figures:
    """One plan, simulated."""

    step_time_s: float
    ratio: float  # against the same schedule without swap or recompute
    peak_bytes: int  # the largest rank's
    met: bool  # on every rank
    exposed_copy_s: float  # the most one rank waits for copies
    recomputed_layers_rank0: int

    @staticmethod
    def of(result: SimulationResult, plain: SimulationResult, budget: int) -> Figures:
        return Figures(result.step_time, result.step_time / plain.step_time,
                       max(rank.peak_activation_bytes for rank in result.ranks),
                       all(rank.peak_activation_bytes <= budget for rank in result.ranks),
                       max(rank.exposed_copy for rank in result.ranks),
                       result.ranks[0].recomputed_layers)

    def cell(self) -> str:
        return (f"{self.ratio:.3f}x, {self.peak_bytes / 2**30:.2f} GiB, "
                f"{'met' if self.met else 'not met'}, {self.exposed_copy_s * 1e3:.0f} ms, "
                f"{self.recomputed_layers_rank0}")


@dataclass(frozen=True)
class Row:
    link: str
    budget: str
    offload: Figures
    recompute: Figures
    mixed: Figures
    mixed_plan_s: float  # building the schedule with the mixed plan


def measure(links: dict[str, float], budgets: list[str]) -> list[Row]:
    """Every (link, budget) planned both ways and simulated."""
    rows = []
    plain_schedule = build_schedule(SPEC)
    for link_name, bandwidth in links.items():
        costs: CostModel = replace(from_preset("h100-pcie5", SHAPE),
                                   link=Link(bandwidth, bandwidth, duplex=True))
        plain = simulate(plain_schedule, costs)
        for text in budgets:
            print(f"{link_name}, {text} ...", file=sys.stderr, flush=True)
            budget = parse_bytes(text)
            offload = simulate(build_schedule(replace(SPEC, swap=True),
                                              PeakPolicy(costs, budget)), costs)
            recompute = simulate(inject_swap(plain_schedule, RecomputePolicy(costs, budget)),
                                 costs)
            started = time.perf_counter()
            mixed_schedule = build_schedule(replace(SPEC, swap=True),
                                            PeakPolicy(costs, budget, recompute="auto"))
            took = time.perf_counter() - started
            mixed = simulate(mixed_schedule, costs)
            rows.append(Row(link_name, text, Figures.of(offload, plain, budget),
                            Figures.of(recompute, plain, budget),
                            Figures.of(mixed, plain, budget), took))
    return rows


#: pipeline sizes for the set-up time of one rank's mixed plan
SCALE = (8, 16, 32, 64)


def plan_times(sizes: tuple[int, ...]) -> list[tuple[int, float]]:
    """(P, seconds) for rank 0 planning itself under 8.5 GiB on the Gen4 link, M = 2P."""
    costs: CostModel = replace(from_preset("h100-pcie5", SHAPE),
                               link=Link(25e9, 25e9, duplex=True))
    out = []
    for ranks in sizes:
        print(f"set-up at P={ranks} ...", file=sys.stderr, flush=True)
        spec = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=ranks, microbatches=2 * ranks,
                            swap=True)
        started = time.perf_counter()
        build_schedule(spec, PeakPolicy(costs, parse_bytes("8.5GiB"), recompute="auto"),
                       swap_ranks={0})
        out.append((ranks, time.perf_counter() - started))
    return out


#: (P, M) for the whole command's planning
WHOLE = ((16, 64), (32, 64), (64, 128))


def whole_times(sizes: tuple[tuple[int, int], ...]
                ) -> list[tuple[int, int, PipelineChoice, int, float, float]]:
    """(P, M, choice, jobs, seconds, step time) for every rank planned under 8.5 GiB on the
    Gen4 link: rank by rank (in one process and in one per usable core) and alike."""
    costs: CostModel = replace(from_preset("h100-pcie5", SHAPE),
                               link=Link(25e9, 25e9, duplex=True))
    out = []
    for ranks, micros in sizes:
        spec = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=ranks, microbatches=micros,
                            swap=True)
        runs: list[tuple[PipelineChoice, int]] = [
            *(("turns", jobs) for jobs in sorted({1, usable_cores()})), ("alike", 1)]
        for choice, jobs in runs:
            print(f"every rank at P={ranks} M={micros}, {choice}, {jobs} process(es) ...",
                  file=sys.stderr, flush=True)
            started = time.perf_counter()
            planned = build_schedule(spec, PeakPolicy(
                costs, parse_bytes("8.5GiB"), recompute="auto", jobs=jobs,
                pipeline_choice=choice))
            took = time.perf_counter() - started
            out.append((ranks, micros, choice, jobs, took,
                        simulate(planned, costs, timeline=False).step_time))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    parser.add_argument("--quick", action="store_true", help="one budget, one link")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    links = dict(list(LINKS.items())[:1]) if args.quick else LINKS
    rows = measure(links, BUDGETS[1:2] if args.quick else BUDGETS)
    scale = plan_times(SCALE[:1] if args.quick else SCALE)
    whole = whole_times(((8, 16),) if args.quick else WHOLE)
    if args.json:
        print(json.dumps({"rows": [asdict(row) for row in rows],
                          "setup_s": {str(ranks): took for ranks, took in scale},
                          "whole": [{"ranks": p, "microbatches": m, "choice": c, "jobs": j,
                                     "s": took, "step_time_s": step}
                                    for p, m, c, j, took, step in whole]}))
        return 0
    table = "\n".join(f"| {row.link} | {row.budget} | {row.offload.cell()} | "
                      f"{row.recompute.cell()} | {row.mixed.cell()} | {row.mixed_plan_s:.1f} s |"
                      for row in rows)
    report = (
        f"Measured {datetime.date.today().isoformat()} on {machine()} (simulated: the figures "
        "are the simulator's, not a GPU's). 1F1B, 8 ranks, 16 microbatches, h100-pcie5 "
        "compute, hidden 8192, sequence 4096, 4 layers a stage; the link's bandwidth each way "
        "as named. Each cell: step time against no swap and no recompute, the largest rank's "
        "peak, whether every rank met the budget, the most compute a rank waits for copies, "
        "the layers rank 0 recomputes a step.\n\n"
        "| link | budget | offload alone (`--recompute never`) | recompute alone "
        "(`--policy recompute`) | mixed (default) | mixed plan took |\n"
        "|---|---|---|---|---|---|\n" + table + "\n\n"
        "Offload alone stops at about one chunk a rank; recompute alone reaches lower but "
        "costs a forward per recomputed layer; the mix recomputes where the link falls short "
        "(the first forwards and the last backwards of a rank) and swaps the rest, kept "
        "inputs included, or, where that is faster in the whole pipeline, streams every chunk "
        "alike and lets the copies stall where other ranks' slack absorbs much of it. On the "
        "PCIe Gen4 link under 8.5 GiB, for example, nothing is recomputed: every chunk "
        "streams with a lag of 2 or 3 layers and loads two layers ahead (a layer's load, 46 "
        "ms, outlasts its backward, 36 ms), fitted chunk by chunk where that goes over the "
        "budget. Under 4.25 GiB on that link every chunk recomputes layers 1 and 3 of its "
        "four (a layer's recompute and backward, 54 ms, hide the load of the layer before "
        "it) and streams the rest.\n\n"
        "Set-up one rank pays at scale (1F1B, PCIe Gen4, 8.5 GiB, M = 2P, rank 0 planning "
        "only itself, as each rank of `pipeswap-train --budget` does): "
        + ", ".join(f"P={ranks} {took:.1f} s" for ranks, took in scale) + ".\n\n"
        "The whole command's planning, as `simulate --budget` does it, same link and budget: "
        "`turns` plans every rank, then chooses each rank's plan in the whole pipeline from "
        "two starts (`--pipeline-choice turns`); `alike` takes one plan alike on every rank, "
        "fitted to each rank's budget (`--pipeline-choice alike`). The default (`auto`) "
        f"takes turns up to {TURNS_UP_TO} ranks x microbatches and alike beyond.\n\n"
        "| P | M | choice | processes (`--jobs`) | planning | step of the plan |\n"
        "|---|---|---|---|---|---|\n"
        + "\n".join(f"| {p} | {m} | {c} | {j} | {took:.1f} s | {step:.4f} s |"
                    for p, m, c, j, took, step in whole))
    return publish(SECTION, report, args.write)


if __name__ == "__main__":
    sys.exit(main())
