"""The two ways the peak policy chooses the ranks' plans under a budget in the whole pipeline,
side by side: rank by rank (``--pipeline-choice turns``) and one plan alike on every rank,
fitted to each rank's budget (``--pipeline-choice alike``). Each case is planned both ways,
on one core, and simulated: the step each gives, whether every rank met its budget, and how
long each took.

    python benchmarks/pipeline_choice.py            # print the table
    python benchmarks/pipeline_choice.py --write    # also record it in BENCHMARKS.md
    python benchmarks/pipeline_choice.py --quick    # two small cases (a smoke run)

The cases: 1F1B on 8 ranks with 32 microbatches at three host-link speeds and three
budgets; interleaved 1F1B and interleaved zero bubble (2 stages a rank), ZBV, DualPipeV and
GPipe on 4 ranks with 16 at two speeds and two budgets; then two at scale (1F1B on 32 ranks,
interleaved 1F1B on 16 ranks with 128 microbatches), where choosing rank by rank takes
about a minute. Every case: h100-pcie5 compute, hidden 8192, sequence 4096, 4 layers a
stage, a duplex link.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import benchmark_parser, child_line, machine, publish  # noqa: E402

SECTION = "## Choosing in the whole pipeline: rank by rank or alike (`benchmarks/pipeline_choice.py`)"


class Case(NamedTuple):
    """A schedule, its size, the link's bandwidth each way (bytes/s) and the budget."""

    kind: str
    ranks: int
    microbatches: int
    stages_per_rank: int
    bandwidth: float
    budget: str

    def label(self) -> str:
        stages = f", V={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return (f"{self.kind}, P={self.ranks}{stages}, M={self.microbatches}, "
                f"{self.bandwidth / 1e9:g} GB/s, {self.budget}")


SMALL = [Case("1f1b", 8, 32, 1, bandwidth, budget)
         for bandwidth in (55e9, 25e9, 12e9) for budget in ("8.5GiB", "4.25GiB", "2.2GiB")] + [
    Case(kind, 4, 16, stages, bandwidth, budget)
    for bandwidth in (55e9, 25e9) for budget in ("8.5GiB", "4.25GiB")
    for kind, stages in (("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 1),
                         ("dualpipev", 1), ("gpipe", 1))]
AT_SCALE = [Case("1f1b", 32, 64, 1, 55e9, "4.25GiB"),
            Case("interleaved-1f1b", 16, 128, 2, 25e9, "8.5GiB")]
QUICK = [Case("1f1b", 4, 8, 1, 25e9, "2.2GiB"), Case("zbv", 2, 8, 1, 55e9, "4.25GiB")]

#: What a child process runs for one case and one choice: it prints seconds, the step and
#: whether every rank met the budget.
CHILD = """
import json, time
from dataclasses import replace
from pipeswap.schedule import ScheduleKind, ScheduleSpec, build_schedule, parse_bytes
from pipeswap.schedule.costs import Link, TransformerShape, from_preset
from pipeswap.schedule.policies import PeakPolicy
from pipeswap.schedule.simulate import simulate
costs = replace(from_preset("h100-pcie5", TransformerShape(hidden=8192, seq_len=4096, layers=4)),
                link=Link({bandwidth}, {bandwidth}, duplex=True))
budget = parse_bytes("{budget}")
spec = ScheduleSpec(ScheduleKind("{kind}"), ranks={ranks}, microbatches={microbatches},
                    stages_per_rank={stages_per_rank}, swap=True)
start = time.perf_counter()
schedule = build_schedule(spec, PeakPolicy(costs, budget, recompute="auto",
                                           pipeline_choice="{choice}"))
seconds = time.perf_counter() - start
run = simulate(schedule, costs, timeline=False)
print(json.dumps({{"seconds": seconds, "step": run.step_time,
                  "met": all(r.peak_activation_bytes <= budget for r in run.ranks)}}))
"""


class Planned(NamedTuple):
    """One case planned one way."""

    seconds: float
    step: float
    met: bool


def planned(case: Case, choice: str) -> Planned:
    """``case`` planned with ``choice`` in a fresh process on one core."""
    code = CHILD.format(choice=choice, **case._asdict())
    found = json.loads(child_line(sys.executable, code,
                                  f"pipeline_choice.py: {case.label()} ({choice})"))
    return Planned(float(found["seconds"]), float(found["step"]), bool(found["met"]))


def main() -> int:
    parser = benchmark_parser(__doc__, "two small cases (a smoke run)")
    parser.add_argument("--json", action="store_true", help="one JSON object, not the table")
    args = parser.parse_args()
    rows = []
    for case in QUICK if args.quick else SMALL + AT_SCALE:
        print(f"{case.label()} ...", file=sys.stderr, flush=True)
        rows.append((case, planned(case, "turns"), planned(case, "alike")))
    if args.json:
        print(json.dumps({"rows": [{"case": case.label(), "turns": turns._asdict(),
                                    "alike": alike._asdict()} for case, turns, alike in rows]}))
        return 0
    ratios = [alike.step / turns.step for _, turns, alike in rows]
    same = sum(1 for ratio in ratios if abs(ratio - 1) < 1e-9)
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {machine()}, one core per case "
             "(`python benchmarks/pipeline_choice.py`; simulated steps). h100-pcie5 compute, "
             "hidden 8192, sequence 4096, 4 layers a stage, a duplex link. `alike / turns`: "
             f"the alike choice's step against the rank by rank one; the same in {same} of "
             f"{len(rows)} cases.", "",
             "| case | turns: step | took | alike: step | took | alike / turns | budgets met |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for (case, turns, alike), ratio in zip(rows, ratios):
        lines.append(f"| {case.label()} | {turns.step:.4f} s | {turns.seconds:.1f} s | "
                     f"{alike.step:.4f} s | {alike.seconds:.1f} s | {ratio:.4f} | "
                     f"{'yes' if turns.met and alike.met else 'NO'} |")
    return publish(SECTION, "\n".join(lines), args.write)


if __name__ == "__main__":
    sys.exit(main())
