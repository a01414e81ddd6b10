"""Fuzzing the readers and the validator with random text and with mutated real schedules.

Whatever comes in, it is either refused with a ScheduleError, or it validates and then
simulates without any error: never an IndexError, KeyError, AssertionError, ... leaking out.
"""

from __future__ import annotations

import json
import os
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeswap.schedule import (
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    TransportModel,
    build_schedule,
    from_json,
    validate,
)
from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.formats import dumps_csv, dumps_json, dumps_lines, loads
from pipeswap.schedule.simulate import simulate
from pipeswap.schedule.text import format_step, parse_order

# CI replays a fixed set of examples (derandomized) so that a run is repeatable; elsewhere
# every run explores new ones.
PROPERTY_SETTINGS = settings(
    max_examples=250, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=os.environ.get("CI") == "true")

CODES = ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "LO", "WO", "LL", "WL",
         "UNSHARD", "RESHARD", "REDUCE_GRAD"]
COMPOSITES = ["OVERLAP_F_B", "OVERLAP_B_F", "BATCH_P2P"]
# Pieces of every form a schedule file takes, and of things that are nearly one.
FRAGMENTS = [*CODES, *(f"){c}" for c in COMPOSITES), "(", ";", "rank", " ", "  ", ":", "\n",
             "_", "#", "{", "}", "[", "]", '"orders"', '"0"', "null", ",", '"', "0", "1", "2",
             "3", "00", "9999999999", "\u0663", "\u00b2", "-1", "\t", "\r", "\x00", "\u2028"]


def check(text: str, transport: TransportModel = "ordered", microbatches: int | None = None
          ) -> None:
    """The property: refused as a ScheduleError, or valid and then simulated."""
    try:
        schedule = loads(text)
        validate(schedule, transport=transport, microbatches=microbatches)
    except ScheduleError:
        return
    simulate(schedule, CostModel())


@PROPERTY_SETTINGS
@given(st.one_of(st.text(max_size=200),
                 st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join)))
def test_random_text_is_refused_or_valid(text: str) -> None:
    check(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from([f"{s}{c}{m}" for s in "01" for c in CODES[:8] for m in "01"]),
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.text(max_size=4) | st.sampled_from(["0", "1", "orders", "01",
                                                             "\u00b2", "\u0663"]), inner,
                      max_size=4),
    max_leaves=20)


@PROPERTY_SETTINGS
@given(st.one_of(json_values, st.fixed_dictionaries({"orders": json_values})))
def test_random_json_is_refused_or_valid(data: object) -> None:
    try:
        schedule = from_json(data)
        validate(schedule)
    except ScheduleError:
        return
    simulate(schedule, CostModel())


@st.composite
def built(draw: st.DrawFn) -> tuple[ScheduleSpec, Schedule]:
    """A spec within small sizes, and what it builds (a plain 1F1B where it cannot)."""
    kind = draw(st.sampled_from(list(ScheduleKind)))
    interleaved = kind is ScheduleKind.INTERLEAVED_1F1B
    overlap = interleaved and draw(st.booleans())
    multi = kind in (ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.LOOPED_BFS,
                     ScheduleKind.INTERLEAVED_ZB)
    try:
        spec = ScheduleSpec(
            kind, ranks=draw(st.integers(1, 3)), microbatches=draw(st.integers(1, 6)),
            stages_per_rank=draw(st.integers(1, 2)) if multi else 1,
            overlap_b_f=overlap, dxdw_split=overlap and draw(st.booleans()),
            fsdp=draw(st.booleans()), batch_p2p=draw(st.booleans()), swap=draw(st.booleans()))
        return spec, build_schedule(spec)
    except ScheduleError:  # e.g. dualpipev with fewer microbatches than stages
        spec = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 2, 4, swap=True)
        return spec, build_schedule(spec)


def _renumber(token: str, number: int, which: int) -> str:
    """``token`` with its ``which``-th number (modulo how many it has) set to ``number``."""
    spans = [m.span() for m in re.finditer(r"[0-9]+", token)]
    start, end = spans[which % len(spans)]
    return f"{token[:start]}{number}{token[end:]}"


@st.composite
def mutated(draw: st.DrawFn) -> tuple[list[list[str]], Schedule]:
    """A built schedule's orders as tokens, after a few random edits."""
    _, schedule = draw(built())
    orders = [[format_step(s) for s in order] for order in schedule.orders]
    tokens = sorted({t for order in orders for t in order})
    for _ in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(0, len(orders) - 1))
        order = orders[rank]
        edit = draw(st.sampled_from(["delete", "duplicate", "swap", "move", "renumber",
                                     "recode", "insert", "idle", "drop rank", "add rank"]))
        at = draw(st.integers(0, max(0, len(order) - 1)))
        if edit == "delete" and order:
            del order[at]
        elif edit == "duplicate" and order:
            order.insert(draw(st.integers(0, len(order))), order[at])
        elif edit == "swap" and order:
            other = draw(st.integers(0, len(order) - 1))
            order[at], order[other] = order[other], order[at]
        elif edit == "move" and order:
            target = orders[draw(st.integers(0, len(orders) - 1))]
            target.insert(draw(st.integers(0, len(target))), order.pop(at))
        elif edit == "renumber" and order and order[at] != "_":
            order[at] = _renumber(order[at], draw(st.integers(0, 8)), draw(st.integers(0, 5)))
        elif edit == "recode" and order and order[at] != "_":
            order[at] = re.sub("|".join(sorted(CODES, key=len, reverse=True)),
                               draw(st.sampled_from(CODES)), order[at], count=1)
        elif edit == "insert":
            order.insert(draw(st.integers(0, len(order))), draw(st.sampled_from(tokens)))
        elif edit == "idle":
            order.insert(draw(st.integers(0, len(order))), "_")
        elif edit == "drop rank" and len(orders) > 1:
            del orders[rank]
        elif edit == "add rank":
            orders.append([])
    return orders, schedule


@PROPERTY_SETTINGS
@given(mutated(), st.sampled_from(["lines", "json", "csv"]),
       st.sampled_from(["ordered", "nccl", "tagged"]),
       st.none() | st.integers(1, 7))
def test_mutated_schedules_are_refused_or_valid(
        case: tuple[list[list[str]], Schedule], form: str, transport: TransportModel,
        microbatches: int | None) -> None:
    orders, _ = case
    if form == "lines":
        text = "\n".join(f"rank {r}: {' '.join(order)}" for r, order in enumerate(orders))
    elif form == "json":
        text = json.dumps({"orders": {str(r): [None if t == "_" else t for t in order]
                                      for r, order in enumerate(orders)}})
    else:
        text = "\n".join(",".join("" if t == "_" else t for t in order) for order in orders)
    check(text, transport, microbatches)


@PROPERTY_SETTINGS
@given(mutated())
def test_mutated_orders_on_the_built_placement_are_refused_or_valid(
        case: tuple[list[list[str]], Schedule]) -> None:
    # The placement stays the generator's while the steps move: a step may now name a stage
    # its rank does not run, or a rank may run nothing.
    orders, built = case
    try:
        schedule = Schedule(tuple(map(parse_order, orders)), built.stage_ranks)
        validate(schedule, transport="tagged")
    except ScheduleError:
        return
    simulate(schedule, CostModel())


@PROPERTY_SETTINGS
@given(built())
def test_every_built_schedule_round_trips_validates_and_simulates(
        case: tuple[ScheduleSpec, Schedule]) -> None:
    spec, schedule = case
    for text in (dumps_lines(schedule), dumps_json(schedule), dumps_csv(schedule)):
        assert loads(text) == schedule
    validate(schedule, microbatches=spec.microbatches)  # every built schedule runs in order
    assert schedule.num_microbatches == spec.microbatches
    simulate(schedule, CostModel())
