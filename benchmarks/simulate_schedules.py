"""How fast the simulator runs big schedules, next to PyTorch's own pipeline simulator.

    python benchmarks/simulate_schedules.py            # print the figures
    python benchmarks/simulate_schedules.py --write    # also record them in BENCHMARKS.md

pipeswap: ``simulate`` on the finished schedule (swap steps included; it validates first,
then runs every rank with compute and copy streams, P2P timing and memory). PyTorch:
``torch.distributed.pipelining.schedules._simulate_comms_compute`` on the same orders without
the swap steps, which it does not know (it models neither time, streams nor memory), where
torch is installed. Best of ``--repeat`` runs each.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeswap.schedule import Schedule, ScheduleKind, ScheduleSpec, build_schedule
from pipeswap.schedule.costs import TransformerShape, from_preset
from pipeswap.schedule.simulate import simulate
from pipeswap.schedule.steps import SWAP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import best_of, machine, publish  # noqa: E402

SECTION = "## Simulator (`benchmarks/simulate_schedules.py`)"
CASES = {
    "1F1B P=64 M=1024": ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=64, microbatches=1024,
                                     swap=True),
    "1F1B P=8 M=64": ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=8, microbatches=64, swap=True),
    "Interleaved 1F1B P=8 V=2 M=64": ScheduleSpec(
        ScheduleKind.INTERLEAVED_1F1B, ranks=8, microbatches=64, stages_per_rank=2, swap=True),
}



def _torch_simulator(schedule: Schedule) -> Callable[[], object] | None:
    """PyTorch's simulator on the same orders (no swap steps), or None without torch."""
    try:
        from torch.distributed.pipelining.schedules import _Action, _simulate_comms_compute
    except ImportError:
        return None
    orders: dict[int, list[Any]] = {
        rank: [None if step is None else _Action.from_str(str(step))
               for step in order if step is None or step.type not in SWAP]
        for rank, order in enumerate(schedule.orders)}
    ranks = schedule.stage_ranks

    def run() -> object:
        return _simulate_comms_compute(orders, lambda stage: ranks[stage], schedule.num_stages)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (best kept)")
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    args = parser.parse_args(argv)
    costs = from_preset("h100-pcie5", TransformerShape(hidden=8192, seq_len=4096, layers=2))
    rows = []
    for name, spec in CASES.items():
        print(f"{name} ...", file=sys.stderr, flush=True)
        schedule = build_schedule(spec)
        steps = sum(1 for order in schedule.orders for step in order if step is not None)
        ours = best_of(lambda: simulate(schedule, costs), args.repeat)
        theirs_run = _torch_simulator(schedule)
        theirs = None if theirs_run is None else best_of(theirs_run, 1 if steps > 100_000
                                                       else args.repeat)
        rows.append(f"| {name} | {steps:,} | {ours:.2f} s | "
                    + ("not installed | |" if theirs is None else
                       f"{theirs:.2f} s | {theirs / ours:.1f}x |"))
    report = (
        f"Measured {datetime.date.today().isoformat()} on {machine()}; best of {args.repeat} "
        "(PyTorch's once on the largest case). Target: 1F1B P=64 M=1024 with swap under 3 s.\n\n"
        "| case (with swap) | steps | pipeswap simulate | PyTorch _simulate_comms_compute | "
        "PyTorch / pipeswap |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "pipeswap's figure includes validating the schedule first and models time, copy "
        "streams and memory; PyTorch's orders rank steps only (no time, no streams, no memory) "
        "and gets the orders without swap steps.\n")
    return publish(SECTION, report, args.write)


if __name__ == "__main__":
    sys.exit(main())
