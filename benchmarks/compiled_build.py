"""pipeswap-schedule's optional compiled build (mypyc) against the pure-Python one, side by
side: the keep, offload or recompute choice across the whole pipeline (``simulate
--budget``: 1F1B, 4 layers a stage of hidden 8192 and 4096 tokens, a 25 GB/s duplex link,
8.5 GiB a rank) at 16, 32 and 64 ranks, and ``plan`` for Llama 3 70B on 64 H100 SXM. Each
case runs in a fresh process on one core, once per build; the figures each build gives
(the step, the plan's table) must be the same.

    python benchmarks/compiled_build.py            # print the table
    python benchmarks/compiled_build.py --write    # also record it in BENCHMARKS.md
    python benchmarks/compiled_build.py --quick    # 4 ranks, and the 8B plan (CI smoke)

The pure build is this interpreter's; the compiled one is ``--compiled PYTHON``'s (default:
the venv ``python3 dev.py test --full`` builds it into, ``.cache/compiled-check``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import benchmark_parser, child_line, machine, publish  # noqa: E402

SECTION = "## The compiled build (`benchmarks/compiled_build.py`)"
ROOT = Path(__file__).resolve().parent.parent
COMPILED = ROOT / ".cache" / "compiled-check" / "bin" / "python"

#: A case: its name, and the code a child process runs (it prints one JSON line: seconds,
#: whether its simulator is compiled, and figures).
WHICH = """
import sys, pipeswap.schedule
COMPILED = sys.modules["pipeswap.schedule.simulate"].__file__.endswith(".so")
"""
CHOICE = WHICH + """
import json, sys, time
from dataclasses import replace
from pipeswap.schedule import ScheduleKind, ScheduleSpec, build_schedule, parse_bytes
from pipeswap.schedule.costs import Link, TransformerShape, from_preset
from pipeswap.schedule.policies import PeakPolicy
from pipeswap.schedule.simulate import simulate
ranks, micros = {ranks}, {micros}
costs = replace(from_preset("h100-pcie5", TransformerShape(hidden=8192, seq_len=4096, layers=4)),
                link=Link(25e9, 25e9, duplex=True))
spec = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=ranks, microbatches=micros, swap=True)
start = time.perf_counter()
schedule = build_schedule(spec, PeakPolicy(costs, parse_bytes("8.5GiB"), recompute="auto",
                                           pipeline_choice="{choice}"))
seconds = time.perf_counter() - start
run = simulate(schedule, costs, timeline=False)
print(json.dumps({{"seconds": seconds, "compiled": COMPILED, "figures": [run.step_time] + [
    (r.peak_activation_bytes, r.exposed_copy, r.recompute_s) for r in run.ranks]}}))
"""
PLAN = WHICH + """
import json, time
from pipeswap.schedule import Job, plan
from pipeswap.schedule.jobplan import machine_preset, model_preset
start = time.perf_counter()
found = plan(model_preset("{model}"), Job({gpus}, {batch}, {seq}), machine_preset("h100-sxm"))
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "compiled": COMPILED, "figures": [
    (o.config.describe(), o.step_time) for o in found.ranked]}}))
"""
FULL = [("simulate --budget, 16 ranks, 64 microbatches (turns)",
         CHOICE.format(ranks=16, micros=64, choice="turns")),
        ("simulate --budget, 32 ranks, 64 microbatches (turns)",
         CHOICE.format(ranks=32, micros=64, choice="turns")),
        ("simulate --budget, 32 ranks, 64 microbatches (alike)",
         CHOICE.format(ranks=32, micros=64, choice="alike")),
        ("simulate --budget, 64 ranks, 128 microbatches (alike)",
         CHOICE.format(ranks=64, micros=128, choice="alike")),
        ("plan, llama3-70b on 64 x h100-sxm",
         PLAN.format(model="llama3-70b", gpus=64, batch=512, seq=4096))]
QUICK = [("simulate --budget, 4 ranks, 8 microbatches",
          CHOICE.format(ranks=4, micros=8, choice="auto")),
         ("plan, llama3-8b on 16 x h100-sxm",
          PLAN.format(model="llama3-8b", gpus=16, batch=64, seq=4096))]


class Run(NamedTuple):
    """One case run by one interpreter."""

    seconds: float
    compiled: bool  # whether its simulator is the compiled one
    figures: object


class Row(NamedTuple):
    """One case run by both builds."""

    case: str
    pure_s: float
    compiled_s: float
    same_figures: bool
    builds: tuple[bool, bool]  # whether each interpreter ran the compiled build


def timed(python: str, code: str) -> Run:
    """The case run by ``python`` in a fresh process on one core."""
    found = json.loads(child_line(python, code, f"compiled_build.py: {python}"))
    return Run(float(found["seconds"]), bool(found["compiled"]), found["figures"])


def main() -> int:
    parser = benchmark_parser(__doc__, "4 ranks, and the 8B plan (CI smoke)")
    parser.add_argument("--compiled", default=str(COMPILED), metavar="PYTHON",
                        help="the interpreter with the compiled build (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON object, not the table")
    args = parser.parse_args()
    if not Path(args.compiled).exists():
        parser.error(f"no interpreter at {args.compiled}: build the compiled wheel with "
                     "`python3 dev.py test --full` (phase f), or pass --compiled PYTHON")
    rows = []
    for name, code in QUICK if args.quick else FULL:
        pure, compiled = timed(sys.executable, code), timed(args.compiled, code)
        rows.append(Row(name, pure.seconds, compiled.seconds, pure.figures == compiled.figures,
                        (pure.compiled, compiled.compiled)))
    if args.json:
        print(json.dumps({"rows": [row._asdict() for row in rows]}))
        return 0
    if any(row.builds != (False, True) for row in rows):
        print(f"compiled_build.py: {sys.executable} must run the pure build and "
              f"{args.compiled} the compiled one; nothing recorded", file=sys.stderr)
        return 2
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {machine()}, one core per case "
             "(`python benchmarks/compiled_build.py`).", "",
             "| case | pure Python | compiled | speed-up | same figures |",
             "| --- | ---: | ---: | ---: | --- |"]
    for row in rows:
        lines.append(f"| {row.case} | {row.pure_s:.1f} s | {row.compiled_s:.1f} s | "
                     f"{row.pure_s / row.compiled_s:.2f}x | "
                     f"{'yes' if row.same_figures else 'NO'} |")
    return publish(SECTION, "\n".join(lines), args.write)


if __name__ == "__main__":
    sys.exit(main())
