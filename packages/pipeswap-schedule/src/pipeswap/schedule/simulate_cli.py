"""``pipeswap-schedule simulate``: cost options, the policy choice, and the report."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pipeswap.schedule.costs import (
    CostModel,
    Link,
    TransformerShape,
    from_preset,
    preset,
    with_transformer,
)
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.files import writing
from pipeswap.schedule.policies import (
    GRANULARITIES,
    CostModelPolicy,
    MemoryBudgetPolicy,
    PeakPolicy,
)
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.simulate import SimulationResult, simulate
from pipeswap.schedule.steps import FSDP
from pipeswap.schedule.swap import MinGapPolicy, SwapPolicy

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]?)(i?)B?\s*$")
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us)?\s*$")
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def parse_size(text: str) -> float:
    """'4GiB' -> 4 * 2**30, '55GB' -> 55e9, '1.5e9' -> 1.5e9."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (examples: 1073741824, 1GiB, 512MiB, 55GB)")
    number, prefix, binary = match.groups()
    return float(number) * float((1024 if binary else 1000) ** _POWERS[prefix])


def parse_time(text: str) -> float:
    match = _TIME.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (examples: 0.012, 12ms, 800us)")
    number, unit = match.groups()
    return float(number) * {"s": 1.0, None: 1.0, "ms": 1e-3, "us": 1e-6}[unit]


def in_range(parse: Callable[[str], float], low: float, high: float,
             allowed: str) -> Callable[[str], float]:
    """``parse``, refusing a value outside ``low..high`` (inf and NaN included) with a message
    naming the range: every cost stays finite, and so does every time the simulator adds up."""

    def parse_in_range(text: str) -> float:
        value = parse(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: {allowed}")
        return value

    return parse_in_range


def count(high: int) -> Callable[[str], int]:
    """An integer option from 1 to ``high``."""

    def parse_count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not 1 <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give 1 to {high:,}")
        return value

    return parse_count


MAX_BYTES = 2**60  # 1 EiB
MAX_SECONDS = 1e6  # about 11.6 days: no chunk's compute or message takes longer
BYTES = in_range(parse_size, 0, MAX_BYTES, "give 0 to 2**60 bytes (1 EiB)")
BANDWIDTH = in_range(parse_size, 1, MAX_BYTES, "give 1 to 2**60 bytes per second")
FLOPS = in_range(parse_size, 1, 1e21, "give 1 to 1e21 FLOP/s")
SECONDS = in_range(parse_time, 0, MAX_SECONDS, "give 0 to 1e6 s (about 11.6 days)")
DIMENSION = count(2**24)


def cost_arguments(param_bytes: bool = False) -> argparse.ArgumentParser:
    """The cost options; with ``param_bytes``, also ``--param-bytes`` (for simulate, the one
    command that counts parameters)."""
    parent = argparse.ArgumentParser(add_help=False)
    machine = parent.add_argument_group("machine")
    machine.add_argument("--preset", help="a machine's host link, P2P and FLOP/s: "
                         "h100-pcie5, h200-pcie5, gh200-nvlink-c2c")
    machine.add_argument("--d2h-bandwidth", type=BANDWIDTH, metavar="B/s",
                         help="device-to-host copy bandwidth")
    machine.add_argument("--h2d-bandwidth", type=BANDWIDTH, metavar="B/s",
                         help="host-to-device copy bandwidth")
    machine.add_argument("--no-duplex", action="store_true",
                         help="D2H and H2D share one copy stream (cannot run at once)")
    machine.add_argument("--p2p-bandwidth", type=BANDWIDTH, metavar="B/s",
                         help="stage-to-stage bandwidth")
    machine.add_argument("--p2p-latency", type=SECONDS, metavar="TIME",
                         help="stage-to-stage latency")
    machine.add_argument("--flops", type=FLOPS, metavar="FLOP/s",
                         help="achieved FLOP/s, for the model dimensions (default: the "
                              "preset's, else 400e12)")
    model = parent.add_argument_group("model (one stage's chunk)")
    model.add_argument("--hidden", type=DIMENSION, help="hidden size")
    model.add_argument("--seq-len", type=DIMENSION, help="tokens per sequence")
    model.add_argument("--layers-per-stage", type=DIMENSION, help="transformer layers per stage")
    model.add_argument("--micro-batch-size", type=DIMENSION, default=1,
                       help="sequences per microbatch (default 1)")
    model.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                       help="activation dtype, and the dtype FSDP gathers parameters in "
                            "(default bf16)")
    explicit = parent.add_argument_group("explicit costs (override the above)")
    explicit.add_argument("--forward-time", type=SECONDS, metavar="TIME",
                          help="one chunk's forward (default 1 s without a model)")
    explicit.add_argument("--backward-time", type=SECONDS, metavar="TIME",
                          help="one chunk's backward (default twice the forward)")
    explicit.add_argument("--activation-bytes", type=BYTES, metavar="BYTES",
                          help="what one chunk's forward saves (default 1GiB without a model)")
    explicit.add_argument("--pinned-bytes", type=BYTES, metavar="BYTES",
                          help="the part of a chunk that never leaves the device (default 0)")
    explicit.add_argument("--boundary-bytes", type=BYTES, metavar="BYTES",
                          help="one stage-to-stage message")
    if param_bytes:
        explicit.add_argument(
            "--param-bytes", type=BYTES, metavar="BYTES",
            help="one stage's parameters as FSDP gathers them: held on the device from the "
                 "stage's UNSHARD to its RESHARD, on top of the activations; needs --fsdp "
                 "(default with the model dimensions: 12*hidden^2 weights per layer, "
                 "--layers-per-stage layers, in --dtype; else 0)")
    return parent


def costs_from(args: argparse.Namespace) -> CostModel:
    model = CostModel()
    flops = 400e12
    if args.preset:
        model, flops = from_preset(args.preset), preset(args.preset).flops
    if args.flops is not None:
        flops = args.flops
    dims = (args.hidden, args.seq_len, args.layers_per_stage)
    if any(d is not None for d in dims):
        if any(d is None for d in dims):
            raise ScheduleError("the model needs all of --hidden, --seq-len and "
                                "--layers-per-stage")
        shape = TransformerShape(args.hidden, args.seq_len, args.layers_per_stage,
                                 args.micro_batch_size, DTYPE_BYTES[args.dtype])
        model = with_transformer(model, shape, flops)

    def given(value: float | None, default: float) -> float:
        return default if value is None else value

    link = Link(given(args.d2h_bandwidth, model.link.d2h_bandwidth),
                given(args.h2d_bandwidth, model.link.h2d_bandwidth),
                duplex=model.link.duplex and not args.no_duplex)
    forward = given(args.forward_time, model.forward)
    backward = (args.backward_time if args.backward_time is not None
                else 2 * forward if args.forward_time is not None else model.backward)
    return replace(
        model, link=link, forward=forward, backward=backward,
        activation_bytes=int(given(args.activation_bytes, model.activation_bytes)),
        pinned_bytes=int(given(args.pinned_bytes, 0)),
        boundary_bytes=int(given(args.boundary_bytes, model.boundary_bytes)),
        # only simulate has --param-bytes: no other command counts parameters
        param_bytes=int(given(getattr(args, "param_bytes", None), model.param_bytes)),
        p2p_bandwidth=given(args.p2p_bandwidth, model.p2p_bandwidth),
        p2p_latency=given(args.p2p_latency, model.p2p_latency))


#: The policy ``--swap``, ``--policy`` and ``--budget`` use when no other is named.
DEFAULT_POLICY = "peak"
POLICIES = ("peak", "gap", "cost", "budget")
Outcomes = MemoryBudgetPolicy | PeakPolicy


def policy_arguments() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("which chunks to swap")
    group.add_argument(
        "--policy", choices=POLICIES, default=None,
        help=f"implies --swap (default {DEFAULT_POLICY}). peak: only chunks that lower the "
             "rank's peak of saved activations, as far as copies stay hidden behind compute "
             "on the cost model, each copy given 1-3 compute slots; gap: MindSpore "
             "hyper-parallel's rule (--swap-min-gap); cost: every chunk whose copies hide; "
             "budget: the fewest exposed copies that bring each rank under --budget")
    group.add_argument(
        "--budget", type=BYTES, metavar="BYTES",
        help="per-rank activation budget (implies --swap): the peak policy then also takes "
             "chunks whose copies stall compute, least stall first, until the budget is met "
             "(simulate reports the exposed copy time); also for --policy budget")
    group.add_argument(
        "--swap-granularity", choices=GRANULARITIES, default=None,
        help="how the peak policy swaps a chunk (implies --swap; default auto). chunk: whole: "
             "LO copies all of its activations to the host after its forward, LL brings them "
             "back before its backward. layer: streamed layer by layer: SO arms the forward to "
             "copy out each layer as it ends and free it a few layers later (its layer lag, "
             "the smallest whose copy hides behind the layers computed meanwhile; written "
             "0SO3:2), SL loads the last layer and the backward loads each layer while it "
             "computes the one after it, so only a few layers of a chunk are on the device "
             "at once, even during its own forward and backward. auto: per chunk, whichever "
             "lowers the rank's peak more. Layers per chunk come from --layers-per-stage (one "
             "layer without the model dimensions: nothing to stream, so auto swaps whole "
             "chunks). Only --policy peak streams")
    return parent


def choose_policy(args: argparse.Namespace, costs: CostModel
                  ) -> tuple[SwapPolicy | None, Outcomes | None]:
    """The policy the arguments ask for (None: no swap, or the gap rule's
    ``--swap-min-gap``), and the object whose ``outcomes`` report per rank."""
    gap = getattr(args, "swap_min_gap", None)
    if gap is not None:
        MinGapPolicy(gap)  # its own check: >= 3
        if args.policy not in (None, "gap"):
            raise ScheduleError(f"--swap-min-gap sets the gap policy's threshold; drop it or "
                                f"--policy {args.policy}")
    granularity = getattr(args, "swap_granularity", None)
    if not (args.swap or args.policy is not None or args.budget is not None
            or gap is not None or granularity is not None):
        return None, None
    args.swap = True
    name = args.policy or ("gap" if gap is not None else DEFAULT_POLICY)
    if granularity not in (None, "auto") and name != "peak":
        raise ScheduleError(f"--swap-granularity {granularity} applies to the peak policy; "
                            f"the {name} policy swaps whole chunks: drop --swap-granularity, "
                            "or use --policy peak")
    if args.budget is not None and name not in ("peak", "budget"):
        raise ScheduleError(f"--budget applies to --policy peak and --policy budget, not "
                            f"{name}")
    if name == "budget":
        if args.budget is None:
            raise ScheduleError("--policy budget needs --budget BYTES")
        budget = MemoryBudgetPolicy(costs, int(args.budget))
        return budget, budget
    if name == "peak":
        peak = PeakPolicy(costs, None if args.budget is None else int(args.budget),
                          granularity=granularity or "auto")
        return peak, peak
    if name == "cost":
        return CostModelPolicy(costs), None
    return None, None  # gap: the builder applies --swap-min-gap


def run_simulate(args: argparse.Namespace,
                 build: Callable[[argparse.Namespace, SwapPolicy | None], Schedule]) -> int:
    if args.param_bytes is not None and not args.fsdp:
        raise ScheduleError("--param-bytes sizes the parameters FSDP gathers, but without "
                            "--fsdp the schedule gathers none, so it would change nothing: "
                            "add --fsdp, or drop --param-bytes")
    costs = costs_from(args)
    policy, budget = choose_policy(args, costs)
    schedule = build(args, policy)
    result = simulate(schedule, costs)
    if args.trace:
        from pipeswap.schedule.trace import write_chrome_trace

        with writing(args.trace):
            write_chrome_trace(result, args.trace)
    if args.plot:
        from pipeswap.schedule.plot import plot

        with writing(args.plot):
            plot(result, args.plot)
    summary = report(result, budget, fsdp=_has_fsdp_steps(schedule))
    print(json.dumps(summary) if args.format == "json" else render(summary))
    return 0


def _has_fsdp_steps(schedule: Schedule) -> bool:
    return any(step is not None and step.type in FSDP
               for order in schedule.orders for step in order)


def report(result: SimulationResult, budget: Outcomes | None, *, fsdp: bool
           ) -> dict[str, Any]:
    """The JSON object of ``--format json``; ``fsdp`` says whether the schedule gathers
    parameters (its ``peak_memory_bytes`` then count them)."""
    per_rank = []
    for rank in result.ranks:
        entry: dict[str, Any] = {
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
            "chunks": [{"stage": c.stage, "micro": c.micro, "hidden": c.hidden,
                        "lifespan_s": c.lifespan, "off_device_s": c.off_device,
                        "layer_lag": c.layer_lag}
                       for c in rank.swapped],
        }
        outcome = budget.outcomes.get(rank.rank) if budget is not None else None
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


def render(summary: dict[str, Any]) -> str:
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


def _parameter_rows(ranks: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The rows of a schedule with FSDP steps: parameter memory, alone and with activations."""
    return [("params gathered", [_bytes(r["peak_parameter_bytes"]) for r in ranks]),
            ("peak with params, no swap", [_bytes(r["peak_memory_bytes_no_swap"])
                                           for r in ranks]),
            ("peak with params, swap", [_bytes(r["peak_memory_bytes"]) for r in ranks])]
