"""What ``pipeswap-schedule simulate`` prints: one JSON object (``--format json``), or the
same figures as a table, one column per rank.

The JSON object's shape is :class:`Report`, so that scripts reading it and the table drawn
from it agree on every key.
"""

from __future__ import annotations

from typing import TypedDict

from pipeswap.schedule.simulate import SimulationResult
from pipeswap.schedule.swap_plan import SwapPlan


class ChunkReport(TypedDict):
    """One swapped chunk of a rank."""

    stage: int
    micro: int
    hidden: bool
    lifespan_s: float
    off_device_s: float
    layer_lag: int
    load_depth: int


class BudgetReport(TypedDict):
    """Whether a rank's peak met the memory budget, and by how much it did not."""

    bytes: int
    met: bool
    shortfall_bytes: int


class _RankFigures(TypedDict):
    rank: int
    step_time_s: float
    bubble_fraction: float
    exposed_copy_s: float
    peak_activation_bytes: int
    peak_activation_bytes_no_swap: int
    peak_parameter_bytes: int
    peak_memory_bytes: int
    peak_memory_bytes_no_swap: int
    swapped_chunks: int
    hidden_chunks: int
    streamed_chunks: int
    recomputed_layers: int
    recompute_s: float
    chunks: list[ChunkReport]


class RankReport(_RankFigures, total=False):
    """One rank's figures; ``budget`` only where the policy planned for one."""

    budget: BudgetReport


class Report(TypedDict):
    """The whole step: its time, whether it gathers parameters, and every rank."""

    step_time_s: float
    fsdp: bool
    per_rank: list[RankReport]


def report(result: SimulationResult, plan: SwapPlan | None, *, fsdp: bool) -> Report:
    """The JSON object of ``--format json``, a rank's budget as its ``plan`` says (where the
    schedule was planned); ``fsdp`` says whether the schedule gathers parameters (its
    ``peak_memory_bytes`` then count them)."""
    per_rank: list[RankReport] = []
    for rank in result.ranks:
        entry: RankReport = {
            "rank": rank.rank,
            "step_time_s": rank.step_time,
            "bubble_fraction": rank.bubble_fraction,
            "exposed_copy_s": rank.exposed_copy,
            "peak_activation_bytes": rank.peak_activation_bytes,
            "peak_activation_bytes_no_swap": rank.peak_activation_bytes_no_swap,
            "peak_parameter_bytes": rank.peak_parameter_bytes,
            "peak_memory_bytes": rank.peak_memory_bytes,
            "peak_memory_bytes_no_swap": rank.peak_memory_bytes_no_swap,
            "swapped_chunks": len(rank.swapped),
            "hidden_chunks": sum(c.hidden for c in rank.swapped),
            "streamed_chunks": sum(c.streamed for c in rank.swapped),
            "recomputed_layers": rank.recomputed_layers,
            "recompute_s": rank.recompute_s,
            "chunks": [{"stage": c.stage, "micro": c.micro, "hidden": c.hidden,
                        "lifespan_s": c.lifespan, "off_device_s": c.off_device,
                        "layer_lag": c.layer_lag, "load_depth": c.load_depth}
                       for c in rank.swapped],
        }
        outcome = None if plan is None else plan.outcome(rank.rank)
        if outcome is not None and outcome.budget is not None:
            entry["budget"] = {"bytes": outcome.budget, "met": outcome.met,
                               "shortfall_bytes": outcome.shortfall}
        per_rank.append(entry)
    return {"step_time_s": result.step_time, "fsdp": fsdp, "per_rank": per_rank}


def _bytes(value: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value} B"


def render_report(summary: Report) -> str:
    """The table of ``summary``, one column per rank, and the step time."""
    ranks = summary["per_rank"]
    rows: list[tuple[str, list[str]]] = [
        ("rank", [str(r["rank"]) for r in ranks]),
        ("step time", [f"{r['step_time_s']:.4g} s" for r in ranks]),
        ("bubble", [f"{r['bubble_fraction']:.1%}" for r in ranks]),
        ("exposed copy", [f"{r['exposed_copy_s']:.4g} s" for r in ranks]),
        ("peak, no swap", [_bytes(r["peak_activation_bytes_no_swap"]) for r in ranks]),
        ("peak, swap", [_bytes(r["peak_activation_bytes"]) for r in ranks]),
        *(_parameter_rows(ranks) if summary["fsdp"] else ()),
        ("swapped (hidden)", [f"{r['swapped_chunks']} ({r['hidden_chunks']})" for r in ranks]),
    ]
    if any(r["streamed_chunks"] for r in ranks):  # a row only where streaming happened
        rows.append(("streamed", [str(r["streamed_chunks"]) for r in ranks]))
    if any(r["recomputed_layers"] for r in ranks):
        rows.append(("recomputed layers", [f"{r['recomputed_layers']} ({r['recompute_s']:.4g} s)"
                                           for r in ranks]))
    if any("budget" in r for r in ranks):
        rows.append(("budget", [("met" if r["budget"]["met"] else
                                 f"short {_bytes(r['budget']['shortfall_bytes'])}")
                                if "budget" in r else "-" for r in ranks]))
    width = max(len(name) for name, _ in rows)
    cells = [max(len(row[1][i]) for row in rows) for i in range(len(ranks))]
    lines = [f"{name:<{width}}  " + "  ".join(v.rjust(w) for v, w in zip(values, cells))
             for name, values in rows]
    if summary["fsdp"]:
        lines.append(f"\n{_PARAMETER_LEGEND}")
    lines.append(f"\nsimulated step time: {summary['step_time_s']:.4g} s")
    return "\n".join(lines)


_PARAMETER_LEGEND = ("params gathered: the most parameter bytes FSDP holds gathered at once; "
                     "peak with params: the most\nsaved activations and gathered parameters "
                     "held at once (at most the sum of the two peaks)")


def _parameter_rows(ranks: list[RankReport]) -> list[tuple[str, list[str]]]:
    """The rows of a schedule with FSDP steps: parameter memory, alone and with activations."""
    return [("params gathered", [_bytes(r["peak_parameter_bytes"]) for r in ranks]),
            ("peak with params, no swap", [_bytes(r["peak_memory_bytes_no_swap"])
                                           for r in ranks]),
            ("peak with params, swap", [_bytes(r["peak_memory_bytes"]) for r in ranks])]
