"""The ``nccl`` transport model and P2P batching that posts both ends of a message alike.

NCCL pairs an op posted inside ``batch_isend_irecv`` on the group's communicator and one
posted alone on the two ranks' own, so a message batched on one end only never arrives:
``nccl`` refuses it, and ``coalesce_p2p`` never makes one.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from pipeswap.schedule import (
    DeadlockError,
    Lowering,
    P2PError,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    Step,
    StepType,
    build_schedule,
    coalesce_p2p,
    gpipe,
    insert_send_recv_by_dependency,
    parse_order,
    validate,
)
from pipeswap.schedule.build import MULTI_STAGE, V_SHAPED
from pipeswap.schedule.pytorch_family import zbv
from pipeswap.schedule.schedule import Message
from pipeswap.schedule.steps import P2P, SWAP, Order

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py

# Rank 0 batches its two sends; rank 1 receives each alone. In order it runs; on NCCL the
# batched sends go on another communicator than the lone receives, and both ranks hang.
ONE_SIDED = ("rank 0: 0F0 0F1 (0SEND_F0;0SEND_F1)BATCH_P2P 0RECV_B0 0B0 0RECV_B1 0B1\n"
             "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1\n")
ONE_SIDED_ERROR = (
    "rank 0 sends the activation of stage 0 micro 0 inside a batch "
    "((0SEND_F0;0SEND_F1)BATCH_P2P) but rank 1 receives it alone (1RECV_F0); NCCL pairs an op "
    "in a batch only with one in a batch, so the message never arrives and both ranks hang: "
    "batch both ends (coalesce_p2p batches pairs alike) or neither")


def _schedule(*orders: str) -> Schedule:
    return Schedule.from_orders([parse_order(order) for order in orders])


def _flat(order: Order) -> list[Step | None]:
    return [leaf for step in order
            for leaf in (step.sub_steps if step is not None and step.type is
                         StepType.BATCH_SEND_RECV else (step,))]


def _flatten(schedule: Schedule) -> Schedule:
    return schedule.map_orders(lambda _rank, order: _flat(order))


def _greedy(schedule: Schedule) -> Schedule:
    """The old batching, each rank on its own: every run of two or more adjacent P2P leaves
    becomes one batch, whatever the peer does with the other end."""
    def batch(order: Order) -> list[Step | None]:
        out: list[Step | None] = []
        for is_p2p, group in itertools.groupby(
                order, key=lambda step: step is not None and step.type in P2P):
            steps = list(group)
            if is_p2p and len(steps) >= 2:
                out.append(Step(StepType.BATCH_SEND_RECV, sub_steps=tuple(
                    step for step in steps if step is not None)))
            else:
                out += steps
        return out
    return schedule.map_orders(lambda _rank, order: batch(order))


def _ends(schedule: Schedule) -> tuple[dict[Message, bool], dict[Message, bool]]:
    """Whether each message's send, and its receive, is posted inside a batch."""
    sends: dict[Message, bool] = {}
    receives: dict[Message, bool] = {}
    for order in schedule.orders:
        for step in order:
            for leaf in step.p2p_leaves if step is not None else ():
                stage, micro = leaf.key
                batched = step is not leaf
                if leaf.type is StepType.FWD_SEND or leaf.type is StepType.BWD_SEND:
                    sends[Message(leaf.type is StepType.FWD_SEND, stage, micro)] = batched
                elif leaf.type is StepType.FWD_RECV:
                    receives[Message(True, stage - 1, micro)] = batched
                else:
                    receives[Message(False, stage + 1, micro)] = batched
    assert sends.keys() == receives.keys()
    return sends, receives


def _one_sided(schedule: Schedule) -> int:
    sends, receives = _ends(schedule)
    return sum(batched != receives[message] for message, batched in sends.items())


def _specs() -> list[ScheduleSpec]:
    """Every built-in kind on 2 and 4 ranks, one and several stages per rank where it takes
    them, and interleaved 1F1B's overlap and dx/dw split, with and without FSDP."""
    specs = []
    for kind, ranks, fsdp in itertools.product(ScheduleKind, (2, 4), (False, True)):
        per_rank = (2,) if kind in V_SHAPED else (1, 2, 3) if kind in MULTI_STAGE else (1,)
        for v in per_rank:
            specs.append(ScheduleSpec(kind, ranks, 8, v, fsdp=fsdp))
            if kind is ScheduleKind.INTERLEAVED_1F1B and v > 1:
                specs.append(ScheduleSpec(kind, ranks, 8, v, overlap_b_f=True,
                                          dxdw_split=True, fsdp=fsdp))
    return specs


def _name(spec: ScheduleSpec) -> str:
    extra = "-overlap-dxdw" if spec.overlap_b_f else ""
    return (f"{spec.kind.value}-P{spec.ranks}-V{spec.stages_per_rank}{extra}"
            f"{'-fsdp' if spec.fsdp else ''}")


@pytest.mark.parametrize("spec", _specs(), ids=_name)
def test_every_built_schedule_batched_runs_on_nccl_with_the_same_orders(
        spec: ScheduleSpec) -> None:
    plain = build_schedule(spec)
    batched = build_schedule(replace(spec, batch_p2p=True))
    validate(batched, transport="nccl", microbatches=8)
    validate(batched, transport="ordered", microbatches=8)
    assert _flatten(batched) == plain  # the same steps in the same order
    assert coalesce_p2p(batched) == batched  # a second pass finds nothing more to batch
    assert _one_sided(batched) == 0
    swapped = build_schedule(replace(spec, batch_p2p=True, swap=True))
    validate(swapped, transport="nccl", microbatches=8)
    assert _flatten(swapped).map_orders(lambda _rank, order: [
        step for step in order if step is None or step.type not in SWAP]) == plain


def test_batching_both_ends_alike_still_batches_most_of_1f1b() -> None:
    batched = coalesce_p2p(build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, 4, 8)))
    sends, receives = _ends(batched)
    assert sends == receives and len(sends) == 48 and sum(sends.values()) == 36


def test_per_rank_batching_is_refused_by_nccl_and_batching_alike_is_not() -> None:
    plain = gpipe(4, 5)
    greedy = _greedy(plain)
    validate(greedy, transport="ordered")  # the old batching runs in order...
    assert _one_sided(greedy) == 18  # ...but 18 of the 30 messages are batched on one end
    with pytest.raises(P2PError, match=r"^rank 0 sends the activation of stage 0 micro 1 alone "
                       r"\(0SEND_F1\) but rank 1 receives it inside a batch "
                       r"\(\(1SEND_F0;1RECV_F1\)BATCH_P2P\); .* batch both ends "
                       r"\(coalesce_p2p batches pairs alike\) or neither$"):
        validate(greedy, transport="nccl")
    alike = coalesce_p2p(plain)
    validate(alike, transport="nccl")
    # On GPipe every run meets a lone end somewhere: taking those out unbatches the rest.
    assert alike == plain


def test_a_message_batched_on_one_end_only_is_refused_naming_it_and_both_ranks() -> None:
    schedule = _schedule(*(line.split(": ", 1)[1] for line in ONE_SIDED.splitlines()))
    validate(schedule, transport="ordered")
    validate(schedule, transport="tagged")
    with pytest.raises(P2PError) as info:
        validate(schedule, transport="nccl")
    assert str(info.value) == ONE_SIDED_ERROR and info.value.rank == 1
    validate(coalesce_p2p(_flatten(schedule)), transport="nccl")


def test_a_receive_batched_against_a_lone_send_is_refused_too() -> None:
    schedule = _schedule(
        "0F0 0SEND_F0 0F1 0SEND_F1 (0RECV_B0;0RECV_B1)BATCH_P2P 0B0 0B1",
        "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1")
    validate(schedule, transport="ordered")
    with pytest.raises(P2PError) as info:
        validate(schedule, transport="nccl")
    assert str(info.value).startswith(
        "rank 1 sends the gradient of stage 1 micro 0 alone (1SEND_B0) but rank 0 receives it "
        "inside a batch ((0RECV_B0;0RECV_B1)BATCH_P2P); ")
    assert info.value.rank == 0


def test_nccl_reports_what_ordered_reports_when_only_tagged_runs() -> None:
    deferred = insert_send_recv_by_dependency(zbv(2, 4))
    validate(deferred, transport="tagged")
    errors = []
    for transport in ("ordered", "nccl"):
        with pytest.raises((DeadlockError, P2PError)) as info:
            validate(deferred, transport=transport)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "--transport tagged on the command line" in errors[1]


def test_a_batch_in_the_input_is_kept() -> None:
    # coalesce_p2p only adds batches: unbatching one could deadlock what ran in order.
    schedule = _schedule(*(line.split(": ", 1)[1] for line in ONE_SIDED.splitlines()))
    assert coalesce_p2p(schedule) == schedule


def test_validate_nccl_on_the_command_line(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "one_sided.txt"
    path.write_text(ONE_SIDED)
    assert cli("validate", str(path)) == (0, "valid: 2 ranks, 2 stages, 15 steps\n", "")
    assert cli("validate", str(path), "--transport", "nccl") == (
        1, "", f"invalid: {ONE_SIDED_ERROR}\n")
    code, out, err = cli("convert", str(path), "--transport", "nccl")
    assert (code, out, err) == (2, "", f"pipeswap-schedule: error: {ONE_SIDED_ERROR}\n")
    flat = tmp_path / "flat.txt"
    flat.write_text(ONE_SIDED.replace("(0SEND_F0;0SEND_F1)BATCH_P2P", "0SEND_F0 0SEND_F1"))
    code, out, err = cli("convert", str(flat), "--batch-p2p", "--transport", "nccl",
                         "--to", "grid")
    assert (code, err) == (0, "") and "BATCH_P2P" not in out  # rank 1 posts each alone


def test_validate_help_says_what_each_transport_checks(cli: Cli) -> None:
    code, out, _ = cli("validate", "--help")
    text = " ".join(out.split())
    assert code == 0
    assert "ordered (default): a send waits for its receive" in text
    assert "nccl: ordered, and both ends of each message posted alike" in text
    assert "tagged: sends never wait and messages match by tag" in text


def test_build_with_batched_p2p_on_the_command_line_runs_on_nccl(
        cli: Cli, tmp_path: Path) -> None:
    _, out, _ = cli("orders", "--schedule", "dualpipev", "-P", "4", "-M", "8", "--batch-p2p",
                    "--swap")
    path = tmp_path / "plan.txt"
    path.write_text(out)
    code, out, err = cli("validate", str(path), "--transport", "nccl")
    assert (code, err) == (0, "") and out.startswith("valid: 4 ranks, 8 stages")


# CI replays a fixed set of examples (derandomized), as in test_schedule_fuzz.py.
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=os.environ.get("CI") == "true")


@st.composite
def runs_in_order(draw: st.DrawFn) -> Schedule:
    """A built schedule without batches, some of its P2P leaves moved a few places, which
    still runs in order: new runs of adjacent P2P leaves, and new lone ends."""
    kind = draw(st.sampled_from(list(ScheduleKind)))
    multi = kind in MULTI_STAGE and kind not in V_SHAPED
    lowering = (draw(st.sampled_from([None, Lowering.DEFERRED]))
                if kind in MULTI_STAGE and kind is not ScheduleKind.INTERLEAVED_1F1B else None)
    try:
        schedule = build_schedule(ScheduleSpec(
            kind, draw(st.integers(1, 4)), draw(st.integers(1, 6)),
            draw(st.integers(1, 3)) if multi else 1, fsdp=draw(st.booleans()),
            swap=draw(st.booleans()), lowering=lowering))
    except ScheduleError:  # e.g. dualpipev with fewer microbatches than stages
        reject()
    orders = [list(order) for order in schedule.orders]
    for _ in range(draw(st.integers(0, 4))):
        order = orders[draw(st.integers(0, len(orders) - 1))]
        p2p = [i for i, step in enumerate(order) if step is not None and step.type in P2P]
        if not p2p:
            continue
        at = draw(st.sampled_from(p2p))
        to = min(max(at + draw(st.integers(-3, 3)), 0), len(order) - 1)
        order.insert(to, order.pop(at))
    moved = Schedule(tuple(map(tuple, orders)), schedule.stage_ranks)
    try:
        validate(moved, transport="ordered")
    except ScheduleError:
        reject()
    return moved


@PROPERTY_SETTINGS
@given(runs_in_order())
def test_what_runs_in_order_runs_on_nccl_once_batched(schedule: Schedule) -> None:
    batched = coalesce_p2p(schedule)
    validate(batched, transport="nccl")
    assert _flatten(batched) == schedule
    assert coalesce_p2p(batched) == batched
    for order in batched.orders:  # a batch holds adjacent P2P leaves only, two or more
        for step in order:
            if step is not None and step.type is StepType.BATCH_SEND_RECV:
                assert len(step.sub_steps) >= 2
