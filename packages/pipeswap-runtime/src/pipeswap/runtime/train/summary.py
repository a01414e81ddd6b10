"""The end of a run: every rank's figures summed up as the ``--json`` object, and the table
printed instead of it: per rank the peaks without and with swap, then the verdict on losses.
"""

from __future__ import annotations

import statistics
from typing import Any

from pipeswap.runtime.train.config import MODES, Mode, TrainConfig
from pipeswap.runtime.train.metrics import ModeResult

#: The ``--json`` object: JSON values of several kinds, read by other tools.
Summary = dict[str, Any]  # Any: JSON values of several kinds, read back by key


def summarize(config: TrainConfig, per_rank: list[dict[str, ModeResult]]) -> Summary:
    """The JSON object of ``--json``: per-rank memory and time, and whether losses matched."""
    def mode(rank: int, name: str) -> ModeResult | None:
        return per_rank[rank].get(name)

    ranks = []
    for index in range(len(per_rank)):
        swap, plain = mode(index, "swap"), mode(index, "no-swap")
        either = swap or plain
        rank = index if config.job.replay_rank is None else config.job.replay_rank
        pp_rank, dp_rank = divmod(rank, config.parallel.dp)
        ranks.append({
            "rank": rank,
            "pp_rank": pp_rank,
            "dp_rank": dp_rank,
            "peak_activation_bytes_swap": swap.peak_activation_bytes if swap else None,
            "peak_activation_bytes_no_swap": plain.peak_activation_bytes if plain else None,
            "peak_memory_bytes_swap": swap.peak_memory_bytes if swap else None,
            "peak_memory_bytes_no_swap": plain.peak_memory_bytes if plain else None,
            "peak_allocated_bytes_swap": swap.peak_allocated_bytes if swap else None,
            "peak_allocated_bytes_no_swap": plain.peak_allocated_bytes if plain else None,
            "parameter_bytes": either.parameter_bytes if either else None,
            "swapped_chunks": either.swapped_chunks if either else 0,
            "streamed_chunks": swap.streamed_chunks if swap else 0,
            "recomputed_layers": swap.recomputed_layers if swap else 0,
            # under a budget: the plan's predicted peak, and how far over the budget (0: met)
            "planned_peak_bytes_swap": swap.planned_peak_bytes if swap else None,
            "budget_shortfall_bytes": swap.budget_shortfall_bytes if swap else None,
            # whether the plan was weighed in the whole pipeline (every rank's measured
            # costs) or on the rank's own timeline (a replay)
            "planned_in_pipeline": swap.planned_in_pipeline if swap else None,
            "bytes_offloaded": swap.bytes_offloaded if swap else 0,
            "step_time_s_swap": statistics.median(swap.step_seconds) if swap else None,
            "step_time_s_no_swap": statistics.median(plain.step_seconds) if plain else None,
            # what the swap plan expected, on the costs the run without swap measured (null
            # where it did not run first), next to what the step timing its computes saw:
            # the seconds compute waited for copies
            "step_time_s_swap_predicted": swap.predicted_step_seconds if swap else None,
            "exposed_copy_s_swap_predicted": swap.predicted_exposed_copy if swap else None,
            "exposed_copy_s_swap": swap.copy_wait_seconds if swap else None,
            "setup_s_swap": swap.setup_seconds if swap else None,
            "setup_s_no_swap": plain.setup_seconds if plain else None,
        })
    # per step run, every replica's microbatch losses (replicas split the batch evenly)
    losses = {name: [[loss for result in per_rank if name in result
                      for loss in result[name].losses[step]]
                     for step in range(_steps_run(per_rank, name))]
              for name in config.swap.modes}
    both = all(name in losses for name in MODES)
    diff = None
    if both:
        pairs = [(a, b) for sa, sb in zip(losses["swap"], losses["no-swap"])
                 for a, b in zip(sa, sb)]
        # None where no rank computed a loss: a replay of a rank without the last stage
        diff = max((abs(a - b) for a, b in pairs), default=None)
    times = {name: statistics.median(t for r in ranks if (t := r[f"step_time_s_{key}"]))
             for name, key in (("swap", "swap"), ("no-swap", "no_swap")) if name in losses}
    return {
        "first_step": min((r[m].first_step for r in per_rank for m in r), default=1),
        "schedule": config.parallel.schedule,
        "ranks": config.parallel.ranks,
        "dp": config.parallel.dp,
        "fsdp": config.parallel.fsdp,
        "stages_per_rank": config.parallel.stages_per_rank,
        "microbatches": config.parallel.microbatches,
        "steps": config.training.steps,
        "budget_bytes": config.swap.budget,
        "recompute": config.swap.recompute if config.swap.budget is not None else None,
        "per_rank": ranks,
        "losses": {name: [sum(s) / len(s) for s in steps if s] for name, steps in losses.items()},
        "max_abs_loss_diff": diff,
        "losses_match": None if diff is None else diff == 0.0,
        # the rank replayed alone (its losses are of inputs made up for it), or null
        "replay_rank": config.job.replay_rank,
        "step_time_ratio": times["swap"] / times["no-swap"] if both else None,
    }


def _steps_run(per_rank: list[dict[str, ModeResult]], mode: Mode) -> int:
    return max((len(result[mode].losses) for result in per_rank if mode in result), default=0)


def mib(value: int | None) -> str:
    """Bytes as MiB for the table and the progress lines; "-" for none."""
    return "-" if value is None else f"{value / 2**20:.2f} MiB"


def _saving(plain: int | None, swap: int | None) -> str:
    return f"{1 - swap / plain:.0%}" if plain and swap is not None else "-"


def render(summary: Summary) -> str:
    """The table: per rank, the peaks without and with swap, then the verdict on losses."""
    fsdp = summary["fsdp"]
    # column groups: a title over its column names (first the rank's own)
    groups: list[tuple[str, tuple[str, ...]]] = [
        ("", ("rank", "swapped (streamed)", "recomputed")),
        ("peak activations (counted)", ("no swap", "with swap", "saving"))]
    if fsdp:
        groups.append(("+ gathered parameters (counted)", ("no swap", "with swap", "saving")))
    groups += [("peak allocated (allocator)", ("no swap", "with swap", "saving")),
               ("step time", ("no swap", "with swap")),
               ("", ("parameters",))]
    rows = [tuple(name for _, names in groups for name in names)]
    for entry in summary["per_rank"]:
        def pair(key: str) -> tuple[int | None, int | None]:
            return entry[f"{key}_no_swap"], entry[f"{key}_swap"]

        rank = str(entry["rank"])
        if summary["dp"] > 1:
            rank += f" (pp {entry['pp_rank']}, dp {entry['dp_rank']})"
        row = [rank, f"{entry['swapped_chunks']} ({entry['streamed_chunks']})",
               str(entry["recomputed_layers"])]
        for key in ("peak_activation_bytes", *(("peak_memory_bytes",) if fsdp else ()),
                    "peak_allocated_bytes"):
            plain, swap = pair(key)
            row += [mib(plain), mib(swap), _saving(plain, swap)]
        row += ["-" if t is None else f"{t:.2f} s" for t in pair("step_time_s")]
        row.append(mib(entry["parameter_bytes"]))
        rows.append(tuple(row))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    titles, first = [], 0
    for title, names in groups:  # each title centred over its columns, widened to fit it
        span = len(names)
        room = sum(widths[first:first + span]) + 2 * (span - 1)
        widths[first + span - 1] += max(0, len(title) - room)
        titles.append(title.center(max(room, len(title))))
        first += span
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(0, "  ".join(titles).rstrip())
    lines.insert(2, "  ".join("-" * w for w in widths))
    if summary["replay_rank"] is not None:
        lines.append(f"\nrank {summary['replay_rank']} of {summary['ranks']} replayed alone: "
                     "what it receives made here, what it sends dropped, so its step time "
                     "leaves out every wait for a peer"
                     + ("; losses are of those made-up inputs"
                        if summary["losses_match"] is not None else ""))
    short = [entry for entry in summary["per_rank"] if entry["budget_shortfall_bytes"]]
    if short:
        lines.append(f"\nbudget of {summary['budget_bytes']:,} bytes not met on rank(s) "
                     + ", ".join(f"{e['rank']} (planned {mib(e['planned_peak_bytes_swap'])})"
                                 for e in short)
                     + (": no plan of swaps and recomputes fits; raise --budget or add ranks"
                        if summary["recompute"] == "auto" else
                        ": no swap plan fits; let it recompute layers too (--recompute auto), "
                        "raise --budget or add ranks"))
    if summary["losses_match"] is not None:
        verdict = ("bit-identical" if summary["losses_match"]
                   else f"DIFFER (max |diff| {summary['max_abs_loss_diff']:.3g})")
        lines.append(f"\nlosses with and without swap: {verdict}; step time with swap: "
                     f"{summary['step_time_ratio']:.2f}x")
    return "\n".join(lines)
