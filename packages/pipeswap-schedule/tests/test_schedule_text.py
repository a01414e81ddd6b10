"""The step IR and its text form: canonical, round-tripping, PyTorch-compatible, strict."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from pipeswap.schedule import ParseError, Step, StepError, StepType, from_json, parse_step, to_json
from pipeswap.schedule.formats import loads
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import COMPUTE, P2P, STREAMING, SWAP, chunk_leaf
from pipeswap.schedule.text import format_order, parse_order, parse_rank_lines

EVERY_KIND = [
    "0F3", "1B0", "2I4", "3W12", "0SEND_F1", "1RECV_F1", "1SEND_B2", "0RECV_B2",
    "4UNSHARD", "4RESHARD", "4REDUCE_GRAD", "2LO5", "2WO5", "2LL5", "2WL5",
    "(0B4;0F7)OVERLAP_B_F", "(0F3;1B2)OVERLAP_F_B", "(2I0;0F3)OVERLAP_B_F",
    "(0SEND_F1;0RECV_B0)BATCH_P2P", "(1RECV_F2;1SEND_B0;1RECV_B1)BATCH_P2P",
]


@pytest.mark.parametrize("text", EVERY_KIND)
def test_every_kind_round_trips(text: str) -> None:
    step = parse_step(text)
    assert str(step) == text
    assert parse_step(str(step)) == step


def test_pytorch_action_strings_mean_what_pytorch_means() -> None:
    assert parse_step("0F1") == Step(StepType.FWD, 0, 1)
    assert parse_step("2I0") == Step(StepType.BWD_INPUT, 2, 0)
    assert parse_step("1W3") == Step(StepType.BWD_WEIGHT, 1, 3)
    assert parse_step("3SEND_F1") == Step(StepType.FWD_SEND, 3, 1)
    assert parse_step("(0F3;1B2)OVERLAP_F_B") == Step(
        StepType.OVERLAP_F_B, sub_steps=(Step(StepType.FWD, 0, 3), Step(StepType.BWD, 1, 2)))


def test_parsed_fields() -> None:
    assert parse_step("3SEND_F12") == Step(StepType.FWD_SEND, 3, 12)
    assert parse_step("2LO5") == Step(StepType.SWAP_LAUNCH_OFFLOAD, 2, 5)
    assert parse_step("1REDUCE_GRAD") == Step(StepType.FSDP_REDUCE_GRAD, 1)
    overlap = parse_step("(0B4;0F7)OVERLAP_B_F")
    assert overlap.type is StepType.OVERLAP_B_F
    assert overlap.sub_steps == (Step(StepType.BWD, 0, 4), Step(StepType.FWD, 0, 7))
    assert overlap.stage is None and overlap.micro is None


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("0X3", "'0X3'"),
        ("F3", "'F3'"),
        ("0F", "'0F'"),
        ("0UNSHARD3", "'0UNSHARD3'"),
        ("(0F1;0B0)FOO", "unknown composite 'FOO'"),
        ("((0F1;0B0)OVERLAP_F_B)BATCH_P2P", "nested"),
        ("(0LO0;0F1)OVERLAP_B_F", "'(0LO0;0F1)OVERLAP_B_F'"),
        ("(0F1;0SEND_F1)BATCH_P2P", "P2P leaves"),
        ("(0F1;0F2)OVERLAP_F_B", "one F leaf and one B or I leaf"),
        ("(0F1;0B1;0B2)OVERLAP_F_B", "exactly two"),
    ],
)
def test_malformed_text_names_the_token_and_what_was_expected(text: str, quoted: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_step(text)
    assert quoted in str(info.value)
    assert "expected" in str(info.value) or "holds" in str(info.value)


def test_a_bad_token_inside_a_composite_is_quoted_with_its_composite() -> None:
    with pytest.raises(ParseError, match=r"bad step '0Q1' in '\(0Q1;0F2\)OVERLAP_B_F'"):
        parse_step("(0Q1;0F2)OVERLAP_B_F")


def test_steps_are_immutable_hashable_values() -> None:
    a, b = parse_step("(0B4;0F7)OVERLAP_B_F"), parse_step("(0B4;0F7)OVERLAP_B_F")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert parse_step("0F1") != parse_step("0F2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.micro = 3  # type: ignore[misc]


@pytest.mark.parametrize("kind", sorted(
    (COMPUTE | P2P | SWAP) - STREAMING, key=lambda kind: str(kind)))
def test_a_leaf_built_without_checks_is_the_checked_step(kind: StepType) -> None:
    fast, checked = chunk_leaf(kind, 3, 5), Step(kind, 3, 5)
    assert fast == checked and hash(fast) == hash(checked) and str(fast) == str(checked)
    assert (fast.sub_steps, fast.lag, fast.key) == ((), None, (3, 5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.micro = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Step(StepType.FWD, 0), "microbatch"),
        (lambda: Step(StepType.FWD, -1, 0), "stage"),
        (lambda: Step(StepType.FSDP_UNSHARD, 0, 1), "takes no microbatch"),
        (lambda: Step(StepType.OVERLAP_B_F, 0, 0), "composite"),
        (lambda: Step(StepType.FWD, 0, 0, (Step(StepType.FWD, 0, 1),)), "leaf"),
        (lambda: Step(StepType.BATCH_SEND_RECV, sub_steps=()), "P2P leaves"),
        (lambda: Step(StepType.FWD, True, 0), "stage index"),
        (lambda: Step("F", 0, 0), "StepType"),  # type: ignore[arg-type]
        (lambda: Step(StepType.BATCH_SEND_RECV, sub_steps=[Step(StepType.FWD_SEND, 0, 0)]),  # type: ignore[arg-type]
         "must be a tuple"),
    ],
)
def test_impossible_steps_cannot_be_built(make: object, message: str) -> None:
    with pytest.raises(StepError, match=message):
        make()  # type: ignore[operator]


def test_orders_keep_idle_slots() -> None:
    order = parse_order("0F0 _ 0SEND_F0 _")
    assert order == (Step(StepType.FWD, 0, 0), None, Step(StepType.FWD_SEND, 0, 0), None)
    assert format_order(order) == "0F0 _ 0SEND_F0 _"
    assert parse_order(["0F0", None, "_"]) == (Step(StepType.FWD, 0, 0), None, None)


def test_rank_lines_report_the_line_and_rank() -> None:
    with pytest.raises(ParseError, match=r"line 2 \(rank 1\): bad step '1Z0'"):
        parse_rank_lines("rank 0: 0F0 0B0\nrank 1: 1Z0\n")
    with pytest.raises(ParseError, match=r"missing rank\(s\) \[1\]"):
        parse_rank_lines("rank 0: 0F0 0B0\nrank 2: 2F0 2B0\n")
    with pytest.raises(ParseError, match="rank 0 appears twice"):
        parse_rank_lines("rank 0: 0F0 0B0\nrank 0: 0F1 0B1\n")
    with pytest.raises(ParseError, match="expected 'rank N: <steps>'"):
        parse_rank_lines("0F0 0B0\n")


def test_json_form_is_exactly_rank_keyed_strings_with_null_idle_slots() -> None:
    schedule = Schedule.from_orders([parse_order("0F0 _ 0SEND_F0 0RECV_B0 0B0"),
                                     parse_order("_ 1RECV_F0 1F0 1B0 1SEND_B0")])
    data = to_json(schedule)
    assert data == {"orders": {
        "0": ["0F0", None, "0SEND_F0", "0RECV_B0", "0B0"],
        "1": [None, "1RECV_F0", "1F0", "1B0", "1SEND_B0"],
    }}
    text = json.dumps(data)
    assert '"0": ["0F0", null' in text
    assert from_json(json.loads(text)) == schedule
    assert loads(text) == schedule
    assert loads("rank 0: 0F0 _ 0SEND_F0 0RECV_B0 0B0\nrank 1: _ 1RECV_F0 1F0 1B0 1SEND_B0") == schedule


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "expected a JSON object"),
        ({"orders": {"x": []}}, "rank keys"),
        ({"orders": {"0": ["0F0"], "00": ["0F0"]}}, "rank keys are ranks written as"),
        ({"orders": {"0": "0F0"}}, "list of step strings"),
        ({"orders": {"0": ["0F0", "oops"]}}, "rank 0: bad step 'oops'"),
        ({"orders": {"0": ["1F0"]}}, "no rank runs stage"),
        ({"orders": {"0": ["0F0"], "1": ["0B0"]}}, "stage 0 appears on rank 0 and on rank 1"),
    ],
)
def test_bad_json_schedules_are_refused_clearly(data: object, message: str) -> None:
    with pytest.raises(ParseError, match=message):
        from_json(data)


@pytest.mark.parametrize(("text", "message"), [
    ('{"orders": {"0": ["0F0", "0B0"], "1": ["1F0", "1B0"], "0": ["0F0", "0B0"]}}',
     "rank 0 appears twice in the JSON: a schedule has one order per rank"),
    ('{"orders": {"0": ["0F0", "0B0"]}, "orders": {"0": ["0F0", "0B0"]}}',
     "the JSON names 'orders' twice in one object"),
    ("rank 0: 0F0 0B0\n# again\nrank 0: 0F1 0B1\n",
     r"line 3: rank 0 appears twice \(first on line 1\): a schedule has one order per rank"),
])
def test_a_rank_given_twice_is_refused_in_both_forms(text: str, message: str) -> None:
    # json.loads alone would keep the last order of a repeated key and drop the first unseen.
    with pytest.raises(ParseError, match=message):
        loads(text)


def test_a_byte_order_mark_and_a_json_array_are_read_as_json() -> None:
    plain = '{"orders": {"0": ["0F0", "0B0"]}}'
    assert loads("\ufeff" + plain) == loads(plain)
    with pytest.raises(ParseError, match="expected a JSON object"):
        loads('[["0F0", "0B0"]]')


@pytest.mark.parametrize("text", ["", "  \n\n", "# only a comment\n"])
def test_an_empty_text_says_it_is_empty(text: str) -> None:
    with pytest.raises(ParseError, match="no schedule: the text is empty or only comments"):
        loads(text)


def test_absurdly_nested_json_is_a_parse_error() -> None:
    with pytest.raises(ParseError, match="nested too deeply"):
        loads('{"orders": ' + "[" * 100_000 + "]" * 100_000 + "}")


@pytest.mark.parametrize(("read", "message"), [
    (lambda: parse_step("\u0660F\u0660"), "bad step"),  # Arabic-Indic zeros
    (lambda: parse_rank_lines("rank \u0663: 0F0 0B0\n"),
     "line 1: expected 'rank N: <steps>' with N in digits 0-9, got 'rank \u0663: 0F0 0B0'"),
    (lambda: from_json({"orders": {"\u0663": ["0F0"]}}), "rank keys are ranks written as"),
    (lambda: from_json({"orders": {"\u00b2": ["0F0"]}}), "rank keys are ranks written as"),
])
def test_numbers_are_ascii_digits_only(read: object, message: str) -> None:
    # int() reads any script's digits (and str.isdigit() accepts '²', which int() refuses).
    with pytest.raises(ParseError, match=re.escape(message)):
        read()  # type: ignore[operator]


@pytest.mark.parametrize(("text", "message"), [
    ("rank 0: 1234567890F0", "the stage number has 10 digits; numbers here have at most 9"),
    ("rank 0: 0F0000000000001", "the micro number has 13 digits"),
    ("rank 0: " + "1" * 200_000 + "F0", "the stage number has 200000 digits"),
    ("rank 1234567890: 0F0", "line 1: the rank number has 10 digits"),
    ('{"orders": {"1234567890": ["0F0"]}}', "the rank number has 10 digits"),
])
def test_long_numbers_are_refused_with_the_limit(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=message) as info:
        loads(text)
    assert len(str(info.value)) < 1000  # a huge token is quoted cut short


def test_a_huge_number_in_json_is_a_parse_error() -> None:
    with pytest.raises(ParseError, match="a number thousands of digits long"):
        loads('{"orders": {"0": [' + "1" * 5000 + "]}}")


def test_gaps_in_the_numbering_are_counted_without_building_them() -> None:
    # One stray big number must cost neither memory nor a page of output.
    with pytest.raises(ParseError, match=re.escape(
            "missing rank(s) [0, 1, 2, 3, 4] and 999999994 more")):
        loads("rank 999999999: 0F0")
    with pytest.raises(ParseError, match=re.escape(
            "no rank runs stage(s) [1, 2, 3, 4, 5] and 999999993 more")):
        loads("rank 0: 0F0 999999999F0")


def test_a_schedule_file_may_start_with_a_comment() -> None:
    assert loads("# the plan\n\nrank 0: 0F0 0B0\n") == loads("rank 0: 0F0 0B0")


@pytest.mark.parametrize(("text", "message"), [
    ("0F0," + "x" * 140_000, "field larger than field limit (131072)"),
    ("\r0", "new-line character seen in unquoted field"),
])
def test_what_the_csv_module_refuses_is_a_parse_error(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=re.escape(message)) as info:
        loads(text)
    assert str(info.value).startswith("not a schedule in PyTorch's CSV form: line 1: ")


def test_a_bad_batch_names_the_leaf_that_does_not_belong() -> None:
    leaves = ";".join(f"0SEND_F{m}" for m in range(10_000))
    with pytest.raises(ParseError, match="P2P leaves .*, got 0F1;") as info:
        parse_step(f"({leaves};0F1)BATCH_P2P")
    assert len(str(info.value)) < 1000
