"""Lowering (adding sends and receives) and checking PyTorch-family schedules: pipeswap next
to PyTorch's own passes, on the same compute orders, in one run.

    python benchmarks/pytorch_lowering.py            # print the figures
    python benchmarks/pytorch_lowering.py --write    # also record them in BENCHMARKS.md

pipeswap: ``insert_send_recv_early`` (the default lowering, whose orders equal PyTorch's) then
``validate`` on the in-order transport (every rank's order, swap lifecycle and a run of all
ranks' sends and receives as rendezvous). PyTorch:
``_add_send_recv`` then ``_simulate_comms_compute`` (its deadlock check), both from
``torch.distributed.pipelining.schedules``. Both start from the compute orders pipeswap's
generators produce, which are PyTorch's own (tests/test_pytorch_schedules.py). Best of
``--repeat`` runs each.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeswap.schedule import Schedule, validate
from pipeswap.schedule.p2p import insert_send_recv_early
from pipeswap.schedule.pytorch_family import (
    dualpipev,
    interleaved_zero_bubble,
    looped_bfs,
    zbv,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import best_of, machine, publish  # noqa: E402

SECTION = "## PyTorch-family lowering and checks (`benchmarks/pytorch_lowering.py`)"
CASES: dict[str, Callable[[], Schedule]] = {
    "LoopedBFS P=16 V=2 M=128": lambda: looped_bfs(16, 128, 2),
    "Interleaved ZB P=16 V=2 M=128": lambda: interleaved_zero_bubble(16, 128, 2),
    "ZBV P=16 M=256": lambda: zbv(16, 256),
    "DualPipeV P=16 M=256": lambda: dualpipev(16, 256),
}



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (best kept)")
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    args = parser.parse_args(argv)
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_send_recv,
        _simulate_comms_compute,
    )

    rows = []
    for name, build in CASES.items():
        print(f"{name} ...", file=sys.stderr, flush=True)
        compute = build()
        ranks = compute.stage_ranks
        actions: dict[int, list[Any]] = {
            rank: [None if s is None else _Action.from_str(str(s)) for s in order]
            for rank, order in enumerate(compute.orders)}
        computes = sum(1 for order in compute.orders for s in order if s is not None)

        lowered = insert_send_recv_early(compute)
        our_lower = best_of(lambda: insert_send_recv_early(compute), args.repeat)
        our_check = best_of(lambda: validate(lowered), args.repeat)
        def plain() -> dict[int, list[Any]]:  # a fresh copy: _add_send_recv consumes its input
            return {r: [a for a in o if a is not None] for r, o in actions.items()}

        their_lowered = _add_send_recv(plain(), lambda stage: ranks[stage], compute.num_stages)
        their_lower = best_of(lambda: _add_send_recv(plain(), lambda stage: ranks[stage],
                                                   compute.num_stages), args.repeat)
        try:
            their_check: float | None = best_of(lambda: _simulate_comms_compute(
                their_lowered, lambda stage: ranks[stage], compute.num_stages), args.repeat)
        except ValueError:  # "Unsupported action type": it cannot run OVERLAP_F_B
            their_check = None
        ours_total = our_lower + our_check
        theirs_total = their_lower + (their_check or 0.0)
        rows.append(
            f"| {name} | {computes:,} | {our_lower:.3f} s | {our_check:.3f} s | "
            f"{their_lower:.3f} s | "
            + ("cannot (OVERLAP_F_B) |" if their_check is None else f"{their_check:.3f} s |")
            + (" - |" if their_check is None else f" {theirs_total / ours_total:.1f}x |"))
    report = (
        f"Measured {datetime.date.today().isoformat()} on {machine()}; best of {args.repeat}."
        "\n\n| compute orders | compute steps | pipeswap lower | pipeswap validate | PyTorch "
        "_add_send_recv | PyTorch _simulate_comms_compute | PyTorch / pipeswap (total) |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "pipeswap's validation checks each rank's order (chunk lifecycle, swap steps, P2P "
        "placement) and runs all ranks' sends and receives as rendezvous paired in order "
        "(NCCL's model); PyTorch's simulator only orders ranks' actions and refuses "
        "OVERLAP_F_B. PyTorch's lowering here is given no FSDP actions, so its orders can "
        "differ from its runtime's.\n")
    return publish(SECTION, report, args.write)


if __name__ == "__main__":
    sys.exit(main())
