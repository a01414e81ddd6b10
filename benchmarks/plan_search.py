"""Time ``pipeswap-schedule plan``'s search at scale: Llama 3 70B on 64 H100 SXM GPUs, a
global batch of 512 sequences of 4096 tokens, the pipeline degree fixed to 8, 16, 32 and 64
in turn, each degree in a fresh process on one core.

    python benchmarks/plan_search.py            # print the table
    python benchmarks/plan_search.py --write    # also record it in BENCHMARKS.md
    python benchmarks/plan_search.py --quick    # gpt-small on 8 GPUs at degrees 2 and 4 (CI smoke)
    python benchmarks/plan_search.py --json     # one JSON object instead of the table

Each degree runs ``pipeswap.schedule.plan`` as the command does (every schedule family,
1 to 4 stages per rank, every micro-batch size, at most 8 microbatches per pipeline rank,
swap and recompute allowed, the best 5 ranked) on ``SearchSpace(ranks=(P,))``. Per degree:
the configurations in the space, how many the search simulated before it could stop, the
seconds it took, the process's peak resident memory, and the best configuration with its
step time. A degree whose search is still going after ``--limit`` seconds (default 900) is
stopped at its next configuration judged, and its row gives the best found so far.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeswap.schedule import Job, NoFit, SearchSpace, plan
from pipeswap.schedule.jobplan import Outcome, machine_preset, model_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import benchmark_parser, machine, one_core, publish, write_section  # noqa: E402

SECTION = "## Plan search at scale (`benchmarks/plan_search.py`)"
TOP = 5  # the command's default
LIMIT_S = 900.0


@dataclass(frozen=True)
class Case:
    model: str
    gpu: str
    gpus: int
    global_batch: int
    seq_len: int
    degrees: tuple[int, ...]

    def describe(self) -> str:
        return (f"{self.model} on {self.gpus} x {self.gpu}, global batch {self.global_batch} "
                f"x {self.seq_len} tokens")


FULL = Case("llama3-70b", "h100-sxm", 64, 512, 4096, (8, 16, 32, 64))
QUICK = Case("gpt-small", "h100-sxm", 8, 32, 1024, (2, 4))


class _Stopped(Exception):
    """The search ran past its limit."""


def run_one(case: Case, ranks: int, limit: float) -> dict[str, Any]:
    """One degree of ``case``, in this process: the search's figures and the peak RSS."""
    job = Job(case.gpus, case.global_batch, case.seq_len)
    start = time.perf_counter()
    seen: dict[str, Any] = {"simulated": 0, "considered": None, "best": None}

    def progress(simulated: int, considered: int, best: Outcome | None) -> None:
        seen.update(simulated=simulated, considered=considered, best=best)
        if time.perf_counter() - start > limit:
            raise _Stopped

    row: dict[str, Any] = {"ranks": ranks, "no_fit": None, "stopped": False}
    try:
        found = plan(model_preset(case.model), job, machine_preset(case.gpu),
                     SearchSpace(ranks=(ranks,)), top=TOP, progress=progress)
    except NoFit as exc:
        row.update(no_fit=str(exc), considered=seen["considered"],
                   simulated=seen["simulated"], best=None, step_time_s=None,
                   tokens_per_s=None)
    except _Stopped:
        best = seen["best"]
        row.update(stopped=True, considered=seen["considered"], simulated=seen["simulated"])
        if best is None:
            row.update(no_fit=f"stopped after {limit:.0f} s before any configuration fit",
                       best=None, step_time_s=None, tokens_per_s=None)
        else:
            row.update(best=f"{best.config.describe()} (best so far: stopped past "
                            f"{limit:.0f} s)",
                       step_time_s=best.step_time, tokens_per_s=best.tokens_per_s)
    else:
        row.update(considered=found.considered, simulated=found.judged,
                   best=found.best.config.describe(), step_time_s=found.best.step_time,
                   tokens_per_s=found.best.tokens_per_s)
    row.update(seconds=time.perf_counter() - start,
               rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return row


def measure(case: Case, ranks: int, limit: float) -> dict[str, Any]:
    """One degree of ``case`` in a fresh process pinned to one core."""
    argv = [sys.executable, __file__, "--one", json.dumps(case.__dict__), str(ranks),
            "--limit", str(limit)]
    done = subprocess.run(one_core(argv), check=True, capture_output=True, text=True)
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def report(case: Case, rows: list[dict[str, Any]]) -> str:
    lines = ["| P | configurations | simulated | search | memory | best | step | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        head = (f"| {row['ranks']} | {row['considered'] or ''} | {row['simulated'] or ''} | "
                f"{row['seconds']:.1f} s | {row['rss'] / 2**20:.0f} MiB |")
        if row["no_fit"] is not None:
            lines.append(f"{head} {row['no_fit']} | | |")
        else:
            lines.append(f"{head} {row['best']} | {row['step_time_s']:.2f} s | "
                         f"{row['tokens_per_s']:,.0f} |")
    total = sum(row["seconds"] for row in rows)
    return "\n".join(lines) + f"\n\nThe searches in all: {total:.1f} s."


def _degrees(text: str) -> tuple[int, ...]:
    try:
        found = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if min(found) < 1:
        raise argparse.ArgumentTypeError(f"give degrees from 1, got {text!r}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(
        __doc__, "gpt-small on 8 GPUs at degrees 2 and 4, not recorded (seconds)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--limit", type=float, default=LIMIT_S, metavar="S",
                        help="stop a degree's search at its first configuration judged past S "
                             f"seconds and report its best so far (default {LIMIT_S:.0f})")
    parser.add_argument("--degrees", type=_degrees, metavar="LIST",
                        help="pipeline degrees to time, e.g. 8,16 (default 8,16,32,64; "
                             "with --quick 2,4)")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "P"),
                        help=argparse.SUPPRESS)  # a child's own degree
    args = parser.parse_args(argv)
    if args.limit <= 0:
        parser.error("--limit must be positive")
    if args.one:
        fields = json.loads(args.one[0])
        case = Case(**{**fields, "degrees": tuple(fields["degrees"])})
        print(json.dumps(run_one(case, int(args.one[1]), args.limit)))
        return 0
    case = QUICK if args.quick else FULL
    if args.degrees:
        case = replace(case, degrees=args.degrees)
    rows: list[dict[str, Any]] = []
    for ranks in case.degrees:
        print(f"{case.model}, P={ranks} ...", file=sys.stderr, flush=True)
        rows.append(measure(case, ranks, args.limit))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.write and not args.quick and not args.json and len(rows) < len(case.degrees):
            write_section(SECTION, text(case, rows, args.limit))  # kept if a later one fails
    if args.json:
        print(json.dumps({"case": case.describe(), "rows": rows}))
        return 0
    return publish(SECTION, text(case, rows, args.limit), args.write and not args.quick)


def text(case: Case, rows: list[dict[str, Any]], limit: float) -> str:
    """The section: how it was measured, and the table of the degrees measured so far."""
    left = [str(ranks) for ranks in case.degrees[len(rows):]]
    return (f"Measured {datetime.date.today().isoformat()} on {machine()}; each degree once, "
            f"in a fresh process on one core, stopped past {limit:.0f} s. "
            f"{case.describe()}; the pipeline degree P fixed (`SearchSpace(ranks=(P,))`, so "
            f"DP = {case.gpus}/P), everything else as `pipeswap-schedule plan` searches it by "
            "default (every family, 1 to 4 stages per rank, every micro-batch size, at most 8P "
            f"microbatches, swap and recompute allowed, the best {TOP} ranked). "
            "`configurations`: in the space; `simulated`: judged before the search could stop; "
            "`search`: the seconds `plan()` took; `memory`: the process's peak resident "
            "memory. The target for the whole search as the command runs it (every degree at "
            "once) is under a minute.\n\n"
            "Command: `python benchmarks/plan_search.py --write` in the default env.\n\n"
            + report(case, rows)
            + (f" Not measured yet: P={', '.join(left)}." if left else ""))


if __name__ == "__main__":
    sys.exit(main())
