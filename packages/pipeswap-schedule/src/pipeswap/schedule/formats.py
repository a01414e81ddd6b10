"""Reading and writing whole schedules: JSON, ``rank N:`` lines, and the side-by-side view."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Mapping

from pipeswap.schedule.errors import ParseError, ScheduleError
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import COMPUTE, OVERLAPS, SWAP, Step, StepType, format_layers
from pipeswap.schedule.swap_order import swapped_chunks
from pipeswap.schedule.text import (
    IDLE,
    dense_orders,
    format_rank_lines,
    format_step,
    parse_number,
    parse_order,
    parse_rank_lines,
    parse_step,
    quoted,
)

JsonOrders = dict[str, dict[str, list[str | None]]]
_RANK_KEY = re.compile(r"0|[1-9][0-9]*")


def to_json(schedule: Schedule) -> JsonOrders:
    """``{"orders": {"0": ["0F0", null, ...], ...}}``: rank keys as strings, idle slots null."""
    return {
        "orders": {
            str(rank): [None if s is None else str(s) for s in order]
            for rank, order in enumerate(schedule.orders)
        }
    }


def dumps_json(schedule: Schedule) -> str:
    return json.dumps(to_json(schedule))


def from_json(data: object) -> Schedule:
    """The inverse of :func:`to_json`; stage placement is read off the steps."""
    if not isinstance(data, Mapping) or not isinstance(data.get("orders"), Mapping):
        raise ParseError('expected a JSON object {"orders": {"0": [steps...], "1": [...]}}')
    orders = {}
    for key, steps in data["orders"].items():
        if not (isinstance(key, str) and _RANK_KEY.fullmatch(key)):
            shown = quoted(key) if isinstance(key, str) else repr(key)
            raise ParseError(f"rank keys are ranks written as \"0\", \"1\", ..., got {shown}")
        rank = parse_number(key, "rank")
        if rank in orders:
            raise ParseError(f"rank {rank} appears twice")
        if not isinstance(steps, list) or any(
            s is not None and not isinstance(s, str) for s in steps
        ):
            raise ParseError(f"rank {key}: expected a list of step strings and nulls")
        try:
            orders[rank] = parse_order(steps)
        except ParseError as exc:
            raise ParseError(f"rank {key}: {exc}") from exc
    return _schedule(dense_orders(orders))


def dumps_csv(schedule: Schedule, *, compute_only: bool = False) -> str:
    """PyTorch's CSV schedule format: one row per rank, one step per cell, an empty cell for
    an idle slot. ``compute_only`` keeps only computes (F, B, I, W and their overlaps), the
    form PyTorch's ``_load_csv(format="compute_only")`` reads; otherwise every step is
    written (pipeswap's swap steps and P2P batches are extensions PyTorch does not read)."""
    out = io.StringIO()
    writer = csv.writer(out)
    for order in schedule.orders:
        writer.writerow("" if step is None else str(step) for step in order
                        if step is None or not compute_only or step.compute_leaves)
    return out.getvalue()


def loads_csv(text: str) -> Schedule:
    """Read PyTorch's CSV schedule format (either form); stages are placed where they run."""
    orders = []
    rows = csv.reader(io.StringIO(text))
    try:
        for rank, row in enumerate(rows):
            try:
                orders.append(tuple(None if not cell.strip() else parse_step(cell.strip())
                                    for cell in row))
            except ParseError as exc:
                raise ParseError(f"row {rank + 1} (rank {rank}): {exc}") from exc
    except csv.Error as exc:  # e.g. a cell over the csv module's limit of 128 KiB
        raise ParseError(f"not a schedule in PyTorch's CSV form: line {rows.line_num}: {exc}; "
                         "a cell holds one step, and a schedule file is JSON, "
                         "'rank N: <steps>' lines or CSV") from None
    return _schedule(tuple(orders))


def loads(text: str) -> Schedule:
    """Read a schedule from JSON, from ``rank N: <steps>`` lines or from PyTorch's CSV,
    whichever ``text`` is (judged by its first line that is neither blank nor a comment)."""
    text = text.removeprefix("\ufeff")  # the byte order mark some editors put first
    first = next((stripped for line in text.splitlines()
                  if (stripped := line.strip()) and not stripped.startswith("#")), "")
    if not first:
        raise ParseError("no schedule: the text is empty or only comments; expected JSON "
                         "{\"orders\": ...}, 'rank N: <steps>' lines or PyTorch's CSV")
    if first.startswith(("{", "[")):
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise ParseError(f"not valid JSON: {exc}") from None
        except ParseError:
            raise
        except ValueError:  # int() refuses numbers of over 4300 digits
            raise ParseError('not a schedule: the JSON holds a number thousands of digits '
                             'long; steps are strings such as "0F3"') from None
        except RecursionError:
            raise ParseError("not a schedule: the JSON is nested too deeply") from None
        return from_json(data)
    if not first.startswith("rank"):
        return loads_csv(text)
    return _schedule(parse_rank_lines(text))


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object as a dict, refusing a repeated key, which ``json`` would silently let
    the last one win: a rank given twice would lose one of its orders unseen."""
    found: dict[str, object] = {}
    for key, value in pairs:
        if key in found:
            if _RANK_KEY.fullmatch(key):
                raise ParseError(f"rank {key} appears twice in the JSON: a schedule has one "
                                 "order per rank; keep one of them, or renumber the other")
            raise ParseError(f"the JSON names {quoted(key)} twice in one object; keep one")
        found[key] = value
    return found


def _schedule(orders: tuple[tuple[Step | None, ...], ...]) -> Schedule:
    try:
        return Schedule.from_orders(orders)
    except ScheduleError as exc:
        raise ParseError(str(exc)) from exc


def dumps_lines(schedule: Schedule) -> str:
    return format_rank_lines(schedule.orders)


def swap_summary(schedule: Schedule) -> str:
    """One line per rank: which (stage, micro) chunks are swapped, grouped by stage, how
    many of them are streamed (and load more than one layer ahead), and how many chunks
    recompute layers (RC)."""
    lines = []
    for rank, chunks in enumerate(swapped_chunks(schedule)):
        by_stage: dict[int, list[int]] = {}
        for stage, micro in chunks:
            by_stage.setdefault(stage, []).append(micro)
        forwards = sum(
            1 for s in schedule.orders[rank] if s is not None
            for leaf in s.compute_leaves if leaf.type is StepType.FWD
        )
        listing = "; ".join(f"stage {s} micro {format_layers(tuple(sorted(m)))}"
                            for s, m in sorted(by_stage.items()))
        streamed = sum(1 for s in schedule.orders[rank]
                       if s is not None and s.type is StepType.SWAP_STREAM_OFFLOAD)
        ahead = sum(1 for s in schedule.orders[rank] if s is not None
                    and s.type is StepType.SWAP_STREAM_LOAD and (s.lag or 1) > 1)
        recomputes = [s.layers for s in schedule.orders[rank]
                      if s is not None and s.layers is not None]
        lines.append(
            f"rank {rank}: {len(chunks)} of {forwards} chunks swapped"
            + (f" ({listing})" if listing else "")
            + (f", {streamed} of them streamed layer by layer" if streamed else "")
            + (f" ({ahead} loading more than one layer ahead)" if ahead else "")
            + (f"; {len(recomputes)} chunks recompute {sum(map(len, recomputes))} layers"
               if recomputes else "")
        )
    return "\n".join(lines)


def render_grid(schedule: Schedule) -> str:
    """All ranks side by side, one column per rank, swap steps marked with ``*``."""
    cells = [[_cell(step) for step in order] for order in schedule.orders]
    width = max([len(c) for col in cells for c in col] + [len(f"rank {len(cells) - 1}")])
    index_width = len(str(max(len(col) for col in cells)))
    header = (" " * index_width + " | " + " | ".join(
        f"rank {r}".ljust(width) for r in range(len(cells)))).rstrip()
    rows = [header, "-" * len(header)]
    for i in range(max(len(col) for col in cells)):
        row = [(col[i] if i < len(col) else "").ljust(width) for col in cells]
        rows.append(f"{i:>{index_width}} | " + " | ".join(row).rstrip())
    return "\n".join(rows)


def _cell(step: Step | None) -> str:
    if step is None:
        return IDLE
    text = format_step(step)
    return f"{text}*" if step.type in SWAP else text


def describe_schedule(schedule: Schedule) -> str:
    """Counts per rank: compute slots, overlaps, P2P, swap, recompute (where any), idle."""
    lines = []
    for rank, order in enumerate(schedule.orders):
        steps = [s for s in order if s is not None]
        compute = sum(1 for s in steps if s.type in COMPUTE or s.type in OVERLAPS)
        swap = sum(1 for s in steps if s.type in SWAP)
        recompute = sum(1 for s in steps if s.type is StepType.RECOMPUTE)
        p2p = sum(len(s.p2p_leaves) for s in steps)
        idle = len(order) - len(steps)
        lines.append(
            f"rank {rank}: {len(order)} steps: {compute} compute slots, {p2p} P2P, "
            f"{swap} swap, " + (f"{recompute} recompute, " if recompute else "") + f"{idle} idle"
        )
    return "\n".join(lines)

