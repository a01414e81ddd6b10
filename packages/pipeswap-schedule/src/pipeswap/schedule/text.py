"""The canonical text form of steps, orders and schedules.

A leaf is ``{stage}{CODE}{micro}`` (``0F3``, ``2LO5``, ``3SEND_F1``), or ``{stage}{CODE}`` for
FSDP control (``1UNSHARD``); a streaming offload or load may add its layer lag (``0SO3:2``,
``0SL3:2``), and a recompute names its layers (``0RC3:0-1,3``); a composite is
``(a;b;...)NAME`` (``(0B4;0F7)OVERLAP_B_F``). An
order is whitespace-separated steps with ``_`` for an idle slot; a schedule is one
``rank N: <order>`` line per rank. PyTorch pipelining's action strings for the kinds it has
parse unchanged. Numbers are ASCII digits, at most :data:`MAX_DIGITS` of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from pipeswap.schedule._numbering import gaps, listing
from pipeswap.schedule.errors import ParseError, StepError
from pipeswap.schedule.steps import COMPOSITES, Step, StepType

IDLE = "_"
_LEAF_CODES = {t.value: t for t in StepType if t not in COMPOSITES}
_COMPOSITE_CODES = {t.value: t for t in COMPOSITES}
# Longest codes first so "SEND_F" is not read as "S" + garbage.
_CODE_ALTERNATIVES = "|".join(sorted(map(re.escape, _LEAF_CODES), key=len, reverse=True))
# [0-9], not \d: int() reads any script's digits, and a step must mean one thing everywhere.
_LEAF = re.compile(rf"([0-9]+)({_CODE_ALTERNATIVES})([0-9]*)(?::([0-9][0-9,-]*))?")
_LAYER_RUN = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_COMPOSITE = re.compile(r"\((.*)\)([A-Z_0-9]+)")
_RANK_LINE = re.compile(r"\s*rank\s+([0-9]+)\s*:(.*)")
#: Stage, micro and rank numbers are indices: nine digits is far beyond any pipeline, and the
#: bound keeps int() (which refuses over 4300 digits) and every message short.
MAX_DIGITS = 9
#: The most layers one RC step may name: far beyond any chunk, and it bounds what a range
#: such as ``0-999999999`` would build.
MAX_LAYERS = 4096
_QUOTED = 60

EXPECTED_STEP = (
    "expected {stage}{CODE}{micro} with CODE one of F B I W SEND_F RECV_F SEND_B RECV_B "
    "LO WO LL WL SO SL RC (e.g. 0F3, 2LO5; SO and SL may add their layer lag: 0SO3:2; RC "
    "names the layers it recomputes: 0RC3:0-1,3), {stage}UNSHARD|RESHARD|REDUCE_GRAD (e.g. "
    "1UNSHARD), or (a;b;...)OVERLAP_F_B|OVERLAP_B_F|BATCH_P2P (e.g. (0B4;0F7)OVERLAP_B_F)"
)


def quoted(text: str) -> str:
    """``repr(text)``, cut short for a message when ``text`` is long."""
    if len(text) <= _QUOTED:
        return repr(text)
    return f"{text[:_QUOTED]!r}... ({len(text)} characters)"


def parse_number(digits: str, what: str) -> int:
    """An index written in ASCII digits; refuse more than :data:`MAX_DIGITS` of them."""
    if len(digits) > MAX_DIGITS:
        raise ParseError(f"the {what} number has {len(digits)} digits; numbers here have at "
                         f"most {MAX_DIGITS}")
    return int(digits)


def parse_step(text: str) -> Step:
    """Parse one step; raise :class:`ParseError` quoting the bad token."""
    token = text.strip()
    composite = _COMPOSITE.fullmatch(token)
    if composite:
        inner, name = composite.groups()
        kind = _COMPOSITE_CODES.get(name)
        if kind is None:
            raise ParseError(f"bad step {quoted(token)}: unknown composite {quoted(name)}; "
                             f"{EXPECTED_STEP}")
        if "(" in inner or ")" in inner:
            raise ParseError(f"bad step {quoted(token)}: composites cannot be nested; "
                             f"{EXPECTED_STEP}")
        subs = tuple(_parse_leaf(part.strip(), token) for part in inner.split(";"))
        return _build(token, kind, None, None, subs)
    return _parse_leaf(token, token)


def _parse_leaf(token: str, whole: str) -> Step:
    match = _LEAF.fullmatch(token)
    where = "" if token == whole else f" in {quoted(whole)}"
    if match is None:
        raise ParseError(f"bad step {quoted(token)}{where}: {EXPECTED_STEP}")
    stage, code, micro, suffix = match.groups()
    kind = _LEAF_CODES[code]
    try:
        stage_index = parse_number(stage, "stage")
        micro_index = parse_number(micro, "micro") if micro else None
        if kind is StepType.RECOMPUTE and not suffix:
            raise ParseError(f"RC names the layers it recomputes after a colon, such as "
                             f"{stage}RC{micro}:0-1")
        if suffix and kind is not StepType.RECOMPUTE and not suffix.isdigit():
            raise ParseError(f"only RC names layers ({stage}RC{micro}:{suffix}); after "
                             f"{code} a colon gives SO's or SL's layer lag, one number")
        layers = parse_layers(suffix) if suffix and kind is StepType.RECOMPUTE else None
        lag_value = parse_number(suffix, "layer lag") if suffix and layers is None else None
    except ParseError as exc:
        raise ParseError(f"bad step {quoted(token)}{where}: {exc}") from None
    return _build(whole, kind, stage_index, micro_index, (), lag_value, layers)


def parse_layers(text: str) -> tuple[int, ...]:
    """Layer indices written as ``0-2,5``: single layers and inclusive runs, ascending."""
    layers: list[int] = []
    for part in text.split(","):
        run = _LAYER_RUN.fullmatch(part)
        if run is None:
            raise ParseError(f"the layers {quoted(text)} are not indices and runs such as 0-2,5")
        first = parse_number(run.group(1), "layer")
        last = first if run.group(2) is None else parse_number(run.group(2), "layer")
        if last < first or (layers and first <= layers[-1]):
            raise ParseError(f"the layers {quoted(text)} must ascend without repeats "
                             "(such as 0-2,5)")
        if len(layers) + last - first >= MAX_LAYERS:
            raise ParseError(f"the layers {quoted(text)} name more than {MAX_LAYERS} layers")
        layers.extend(range(first, last + 1))
    return tuple(layers)


def _build(
    token: str, kind: StepType, stage: int | None, micro: int | None, subs: tuple[Step, ...],
    lag: int | None = None, layers: tuple[int, ...] | None = None,
) -> Step:
    try:
        return Step(kind, stage, micro, subs, lag, layers)
    except StepError as exc:
        raise ParseError(f"bad step {quoted(token)}: {exc}; {EXPECTED_STEP}") from exc


def parse_order(text: str | Iterable[str | None]) -> tuple[Step | None, ...]:
    """Parse an order: a whitespace-separated string, or a list of tokens (``None``/``_`` idle)."""
    tokens: Iterable[str | None] = text.split() if isinstance(text, str) else text
    return tuple(None if tok is None or tok == IDLE else parse_step(tok) for tok in tokens)


def format_step(step: Step | None) -> str:
    return IDLE if step is None else str(step)


def format_order(order: Iterable[Step | None]) -> str:
    return " ".join(format_step(step) for step in order)


def parse_rank_lines(text: str) -> tuple[tuple[Step | None, ...], ...]:
    """Parse ``rank N: <order>`` lines (blank lines and ``#`` comments are skipped)."""
    orders: dict[int, tuple[Step | None, ...]] = {}
    first_line: dict[int, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _RANK_LINE.fullmatch(line)
        if match is None:
            raise ParseError(f"line {number}: expected 'rank N: <steps>' with N in digits 0-9, "
                             f"got {quoted(line.strip())}")
        try:
            rank = parse_number(match.group(1), "rank")
        except ParseError as exc:
            raise ParseError(f"line {number}: {exc}") from None
        if rank in orders:
            raise ParseError(f"line {number}: rank {rank} appears twice (first on line "
                             f"{first_line[rank]}): a schedule has one order per rank; keep "
                             "one of them, or renumber the other")
        first_line[rank] = number
        try:
            orders[rank] = parse_order(match.group(2))
        except ParseError as exc:
            raise ParseError(f"line {number} (rank {rank}): {exc}") from exc
    return dense_orders(orders)


def format_rank_lines(orders: Sequence[Iterable[Step | None]]) -> str:
    return "\n".join(f"rank {rank}: {format_order(order)}" for rank, order in enumerate(orders))


def dense_orders(
    orders: dict[int, tuple[Step | None, ...]],
) -> tuple[tuple[Step | None, ...], ...]:
    """Turn ``{rank: order}`` into a tuple indexed by rank, refusing gaps in the numbering."""
    if not orders:
        raise ParseError("no ranks found: expected one order per rank")
    end = max(orders) + 1
    if end != len(orders):
        missing = listing(gaps(orders, end), end - len(orders))
        raise ParseError(f"ranks must be numbered 0..P-1; missing rank(s) {missing}")
    return tuple(orders[rank] for rank in range(end))
