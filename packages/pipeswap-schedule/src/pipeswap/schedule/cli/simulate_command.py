"""``pipeswap-schedule simulate``: cost options, the policy choice, and running it.

Also the argparse types of every number the command line takes: each refuses a value out of
its range with a message that names the range; and the parser whose usage errors are one
line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Literal, NoReturn, TypeVar, get_args

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
from pipeswap.schedule.plot import plot
from pipeswap.schedule.policies import (
    GRANULARITIES,
    PIPELINE_CHOICES,
    RECOMPUTE_MODES,
    CostModelPolicy,
    MemoryBudgetPolicy,
    MinGapPolicy,
    PeakPolicy,
    PipelineChoice,
    RecomputeMode,
    RecomputePolicy,
    SwapPolicy,
)
from pipeswap.schedule.policies.peak import TURNS_UP_TO
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.simulate import simulate
from pipeswap.schedule.simulate_report import render_report, report
from pipeswap.schedule.swap_plan import SwapPlan
from pipeswap.schedule.trace import write_chrome_trace
from pipeswap.schedule.units import MAX_BYTES, parse_bytes, parse_size, parse_time

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_Value = TypeVar("_Value")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at --help (argparse prints the
    whole usage first: a screenful for the commands with cost options)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _argument(parse: Callable[[str], _Value]) -> Callable[[str], _Value]:
    """``parse`` as an argparse type: its ValueError becomes the option's error message."""

    def parse_argument(text: str) -> _Value:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_argument


def in_range(parse: Callable[[str], float], low: float, high: float,
             allowed: str) -> Callable[[str], float]:
    """``parse``, refusing a value outside ``low..high`` (inf and NaN included) with a message
    naming the range: every cost stays finite, and so does every time the simulator adds up."""

    checked = _argument(parse)

    def parse_in_range(text: str) -> float:
        value = checked(text)
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


MAX_SECONDS = 1e6  # about 11.6 days: no chunk's compute or message takes longer
BYTES = _argument(parse_bytes)
BANDWIDTH = in_range(parse_size, 1, MAX_BYTES, "give 1 to 2**60 bytes per second")
FLOPS = in_range(parse_size, 1, 1e21, "give 1 to 1e21 FLOP/s")
SECONDS = in_range(parse_time, 0, MAX_SECONDS, "give 0 to 1e6 s (about 11.6 days)")
#: A compute's time: above zero, as no copy hides behind a compute that takes none.
COMPUTE_SECONDS = in_range(parse_time, 1e-9, MAX_SECONDS,
                           "give a time above 0 (1ns at least) up to 1e6 s (about 11.6 days)")
DIMENSION = count(2**24)
#: The most layers one stage's chunk may have: far beyond any model, and the peak policy
#: weighs every layer lag of every chunk, so a million layers would never finish.
MAX_LAYERS = 1024
LAYERS = count(MAX_LAYERS)


def budget_bytes(text: str) -> int:
    """``--budget``: a byte count of at least 1; a budget of 0 (or less) keeps nothing."""
    if not text.strip().startswith("-"):
        value = parse_bytes(text)
        if value > 0:
            return value
    raise ValueError(
        f"a budget of {text!r} bytes keeps nothing on the device, not even the chunk being "
        "computed: give the activation bytes one rank may hold (e.g. 40GiB), or drop "
        "--budget to swap only chunks whose copies hide")


BUDGET = _argument(budget_bytes)


def cost_arguments(param_bytes: bool = False) -> Parser:
    """The cost options; with ``param_bytes``, also ``--param-bytes`` (for simulate, the one
    command that counts parameters)."""
    parent = Parser(add_help=False)
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
    model.add_argument("--layers-per-stage", type=LAYERS,
                       help=f"transformer layers per stage (1 to {MAX_LAYERS})")
    model.add_argument("--micro-batch-size", type=DIMENSION, default=1,
                       help="sequences per microbatch (default 1)")
    model.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                       help="activation dtype, and the dtype FSDP gathers parameters in "
                            "(default bf16)")
    explicit = parent.add_argument_group("explicit costs (override the above)")
    explicit.add_argument("--forward-time", type=COMPUTE_SECONDS, metavar="TIME",
                          help="one chunk's forward (default 1 s without a model)")
    explicit.add_argument("--backward-time", type=COMPUTE_SECONDS, metavar="TIME",
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
PolicyName = Literal["peak", "gap", "cost", "budget", "recompute"]
DEFAULT_POLICY: PolicyName = "peak"
POLICIES: tuple[PolicyName, ...] = get_args(PolicyName)


def policy_arguments() -> Parser:
    parent = Parser(add_help=False)
    group = parent.add_argument_group("which chunks to swap")
    group.add_argument(
        "--policy", choices=POLICIES, default=None,
        help=f"implies --swap, but for recompute (default {DEFAULT_POLICY}). peak: only "
             "chunks that lower the rank's peak of saved activations, as far as copies stay "
             "hidden behind compute on the cost model, each copy given 1-3 compute slots; "
             "gap: MindSpore "
             "hyper-parallel's rule (--swap-min-gap); cost: every chunk whose copies hide; "
             "budget: the fewest exposed copies that bring each rank under --budget; "
             "recompute: swap nothing, recompute (activation checkpointing) the first layers "
             "of every chunk, on each rank as few as bring it under --budget (written "
             "0RC3:0-1 before the chunk's forward)")
    group.add_argument(
        "--budget", type=BUDGET, metavar="BYTES",
        help="per-rank activation budget, 1 byte or more (implies --swap, but with --policy "
             "recompute): the peak policy then also takes chunks whose copies stall compute, "
             "least stall first, until the budget is met (simulate reports the exposed copy "
             "time); also for --policy budget and --policy recompute")
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
    group.add_argument(
        "--recompute", choices=RECOMPUTE_MODES, default=None,
        help="whether the peak policy may also recompute layers (activation checkpointing) "
             "to meet --budget; default auto with a budget. auto: per rank, the fastest on "
             "the cost model of swapping alone, recomputing alone, and mixes: the first layers "
             "of chunks recomputed (0RC3:0-1 before the chunk's forward: only their input is "
             "kept, and their forward runs again in the backward), the rest and the kept "
             "inputs swapped where the link hides the copies. never: swap only, stalling "
             "compute for copies where the budget needs it")
    group.add_argument(
        "--pipeline-choice", choices=PIPELINE_CHOICES, default=None,
        help="how the peak policy chooses the ranks' plans under --budget in the whole "
             "pipeline, where a copy's stall that another rank's slack absorbs costs "
             "nothing (default auto). turns: rank by rank, each among its own plans, from "
             "two starts: each rank may get a plan of its own, but the time grows as ranks "
             "squared x microbatches (minutes at 64 stages). alike: one plan alike on every "
             "chunk of every rank (the same layers recomputed, the same lag and load "
             "depth), fitted to each rank's budget where it goes over: seconds at 64 "
             f"stages. auto: turns up to {TURNS_UP_TO} ranks x microbatches, alike beyond")
    group.add_argument(
        "--jobs", type=count(MAX_JOBS), default=None, metavar="N",
        help="processes that make the ranks' plans under --budget at once for the turns "
             "choice (default: one per CPU core this process may use). Each rank's plans "
             "depend on its own order alone, so any N gives the same plans; a pipeline of "
             "64 stages makes them in minutes on one core")
    return parent


#: The most processes --jobs starts.
MAX_JOBS = 256


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system tells it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def choose_policy(args: argparse.Namespace, costs: CostModel) -> SwapPolicy | None:
    """The policy the arguments ask for (None: no swap, and nothing recomputed)."""
    gap = getattr(args, "swap_min_gap", None)
    granularity = getattr(args, "swap_granularity", None)
    mode = getattr(args, "recompute", None)
    choice: PipelineChoice | None = getattr(args, "pipeline_choice", None)
    _refuse_what_cannot_apply(args, gap, mode)
    if args.policy == "recompute":
        if args.budget is None:
            raise ScheduleError("--policy recompute needs --budget BYTES: it recomputes as "
                                "few layers as bring each rank under it")
        if args.swap or gap is not None or granularity is not None:
            raise ScheduleError("--policy recompute swaps nothing: drop --swap, "
                                "--swap-min-gap and --swap-granularity")
        return RecomputePolicy(costs, args.budget)
    if not (args.swap or args.policy is not None or args.budget is not None
            or gap is not None or granularity is not None):
        return None
    name: PolicyName = args.policy or ("gap" if gap is not None else DEFAULT_POLICY)
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
        return MemoryBudgetPolicy(costs, args.budget)
    if name == "peak":
        told = None if args.budget is None else _Progress()
        return PeakPolicy(costs, args.budget, granularity=granularity or "auto",
                          recompute="never" if args.budget is None else mode or "auto",
                          pipeline_choice=choice or "auto",
                          progress=told, choosing=None if told is None else told.choosing,
                          jobs=getattr(args, "jobs", None) or usable_cores())
    if name == "cost":
        return CostModelPolicy(costs)
    return MinGapPolicy(4 if gap is None else gap)


def _refuse_what_cannot_apply(args: argparse.Namespace, gap: int | None,
                              mode: RecomputeMode | None) -> None:
    """Refuse the gap threshold with another policy, and a recompute mode or ``--jobs``
    that the arguments give nothing to apply to."""
    if gap is not None:
        MinGapPolicy(gap)  # its own check: >= 3
        if args.policy not in (None, "gap"):
            raise ScheduleError(f"--swap-min-gap sets the gap policy's threshold; drop it or "
                                f"--policy {args.policy}")
    if mode is not None and args.budget is None and args.policy != "recompute":
        raise ScheduleError(f"--recompute {mode} says how to meet --budget, and there is none: "
                            "give --budget BYTES, or drop --recompute (without a budget "
                            "nothing is recomputed)")
    if mode == "never" and args.policy == "recompute":
        raise ScheduleError("--policy recompute recomputes: drop --recompute never")
    if mode == "auto" and args.policy not in (None, "peak", "recompute"):
        raise ScheduleError(f"--recompute auto applies to the peak policy; the {args.policy} "
                            "policy plans on whole chunks: drop --recompute, or use --policy "
                            "peak")
    jobs = getattr(args, "jobs", None)
    if jobs is not None and (args.budget is None or mode == "never"
                             or args.policy not in (None, "peak")):
        raise ScheduleError(f"--jobs {jobs} makes the peak policy's plans under --budget, "
                            "where it may recompute: give --budget BYTES (with --policy peak, "
                            "the default, and --recompute auto), or drop --jobs")
    choice = getattr(args, "pipeline_choice", None)
    if choice is not None and (args.budget is None or mode == "never"
                               or args.policy not in (None, "peak")):
        raise ScheduleError(f"--pipeline-choice {choice} says how the peak policy chooses "
                            "the ranks' plans under --budget, where it may recompute: give "
                            "--budget BYTES (with --policy peak, the default, and --recompute "
                            "auto), or drop --pipeline-choice")
    if choice == "alike" and jobs is not None and jobs > 1:
        raise ScheduleError(f"--jobs {jobs} makes each rank's plans for the turns choice; "
                            "--pipeline-choice alike makes none: drop --jobs, or use "
                            "--pipeline-choice turns")


#: After how many seconds a plan under a budget starts saying how far it is.
PROGRESS_AFTER_S = 5.0


class _Progress:
    """Lines on stderr as the ranks' plans under a budget are made, once the search has
    taken :data:`PROGRESS_AFTER_S` (a few ranks stay quiet; 16 and more take minutes)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, rank: int, done: int, total: int) -> None:
        self._say(f"planning under the budget: rank {rank} done, {done} of {total} ranks")

    def choosing(self, done: int, total: int) -> None:
        """Each rank's plan chosen in the whole pipeline (each rank once a start)."""
        self._say(f"choosing the plans in the whole pipeline: {done} of {total} choices")

    def _say(self, what: str) -> None:
        spent = time.perf_counter() - self.start
        if spent >= PROGRESS_AFTER_S:
            print(f"{what}, {spent:.0f} s", file=sys.stderr, flush=True)


def run_simulate(args: argparse.Namespace,
                 build: Callable[[argparse.Namespace, SwapPolicy | None],
                                 tuple[Schedule, SwapPlan | None]]) -> int:
    if args.param_bytes is not None and not args.fsdp:
        raise ScheduleError("--param-bytes sizes the parameters FSDP gathers, but without "
                            "--fsdp the schedule gathers none, so it would change nothing: "
                            "add --fsdp, or drop --param-bytes")
    costs = costs_from(args)
    schedule, plan = build(args, choose_policy(args, costs))
    result = simulate(schedule, costs, timeline=bool(args.trace or args.plot))
    if args.trace:
        with writing(args.trace):
            write_chrome_trace(result, args.trace)
    if args.plot:
        with writing(args.plot):
            plot(result, args.plot)
    summary = report(result, plan, fsdp=args.fsdp)  # the FSDP pass adds steps to every rank
    print(json.dumps(summary) if args.format == "json" else render_report(summary))
    return 0
