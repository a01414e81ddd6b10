"""The ``pipeswap-schedule`` command line: build, print, check and look at schedules."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Literal, get_args

from pipeswap.schedule.__about__ import __version__
from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.build import (
    LOWERINGS,
    Lowering,
    ScheduleKind,
    ScheduleSpec,
    build_planned,
    inject_swap,
)
from pipeswap.schedule.cli.plan_command import add_plan, run_plan
from pipeswap.schedule.cli.simulate_command import (
    LAYERS,
    MAX_LAYERS,
    Parser,
    choose_policy,
    cost_arguments,
    costs_from,
    count,
    policy_arguments,
    run_simulate,
)
from pipeswap.schedule.costs import PRESETS
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.files import FileAccessError, read_text, write_text
from pipeswap.schedule.formats import (
    describe_schedule,
    dumps_csv,
    dumps_json,
    dumps_lines,
    loads,
    render_grid,
    swap_summary,
)
from pipeswap.schedule.p2p import coalesce_p2p
from pipeswap.schedule.policies import SwapPolicy
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.swap_plan import SwapPlan
from pipeswap.schedule.text import MAX_DIGITS
from pipeswap.schedule.validation import TRANSPORTS, validate

PROG = "pipeswap-schedule"
#: What ``orders --format`` prints, what ``convert --to`` writes, what ``simulate --format``
#: prints.
OrdersFormat = Literal["grid", "json"]
ConvertFormat = Literal["json", "grid", "csv", "csv-compute"]
ReportFormat = Literal["table", "json"]
DESCRIPTION = """\
Build pipeline-parallel schedules, inject activation-swap steps, check them, and look at them.
No GPU or torch needed.

A schedule is one order of steps per rank. Steps are written {stage}{CODE}{micro}:
  F  forward          B  backward            I  backward, input grads (dx)   W  weight grads (dw)
  SEND_F / RECV_F     activations to / from the next stage
  SEND_B / RECV_B     gradients to / from the previous stage
  LO / WO             launch / wait the device-to-host offload of a chunk's activations
  LL / WL             launch / wait the host-to-device reload before its backward
  SO / SL             stream a chunk layer by layer instead of LO / LL: SO (before the
                      forward) offloads each layer as it ends, freeing it a lag of layers
                      later (0SO3:2, lag 2; 0SO3 is lag 1); SL loads the last layer, and the
                      backward loads each layer while computing the one after it (0SL3:2:
                      the last two, and each layer two ahead, one more layer resident)
  RC                  recompute layers of a chunk (before its forward): 0RC3:0-1,3 keeps
                      only the input of layers 0, 1 and 3, and the backward runs each one's
                      forward again just before the layer's own backward
  {stage}UNSHARD, RESHARD, REDUCE_GRAD      FSDP parameter gather, free, grad reduction
  (a;b)OVERLAP_B_F, (a;b)OVERLAP_F_B, (a;b;...)BATCH_P2P   composite steps
  _ (null in JSON)    an idle slot
so 0F3 is stage 0's forward of microbatch 3 and 2LO5 offloads stage 2, microbatch 5.
"""
EPILOG = f"""\
examples:
  {PROG} show --schedule 1f1b --ranks 4 --microbatches 8 --swap
  {PROG} orders --schedule interleaved-1f1b --ranks 4 --stages-per-rank 2 \\
      --microbatches 8 --overlap-b-f --dxdw-split --swap --format json > plan.json
  {PROG} validate plan.json
  {PROG} simulate --schedule 1f1b --ranks 8 --microbatches 32 --preset h100-pcie5 \
      --hidden 8192 --seq-len 4096 --layers-per-stage 4 --policy budget --budget 40GiB

Run '{PROG} COMMAND --help' for the options of each command.
"""


#: A token that starts with '-' and a digit ('-1GiB', '-.5', '-1e9'): a value, never one of
#: this command line's options; and those argparse takes as values already ('-3', '-.5').
_DASHED_VALUE = re.compile(r"-\.?[0-9]")
_PLAIN_NEGATIVE = re.compile(r"-[0-9]+|-[0-9]*\.[0-9]+")


def _attach_dashed_values(argv: Sequence[str]) -> list[str]:
    """Write ``--budget -1GiB`` as ``--budget=-1GiB``, so that the option refuses the value
    for what it is instead of argparse saying the option lacks one. argparse would refuse
    such a token anyway (no option looks like it), so nothing that parsed before changes."""
    out: list[str] = []
    for token in argv:
        before = out[-1] if out else ""
        if (_DASHED_VALUE.match(token) and not _PLAIN_NEGATIVE.fullmatch(token)
                and before.startswith("-") and before != "--" and "=" not in before
                and not _DASHED_VALUE.match(before)):
            out[-1] = f"{before}={token}"
        else:
            out.append(token)
    return out


def _spec_arguments() -> Parser:
    parent = Parser(add_help=False)
    group = parent.add_argument_group("what to build")
    group.add_argument(
        "--schedule", required=True, choices=[k.value for k in ScheduleKind],
        help="gpipe: all forwards then all backwards; 1f1b: one forward one backward after a "
             "warm-up of P-r forwards; interleaved-1f1b: several stages per rank "
             "(--stages-per-rank), as in MindSpore hyper-parallel; looped-bfs, interleaved-zb "
             "(ZB1P), zbv and dualpipev: PyTorch's schedules of those names, with the same "
             "compute orders (zbv and dualpipev: two stages per rank on a V)")
    group.add_argument("--ranks", "-P", type=int, required=True, metavar="P",
                       help="pipeline ranks")
    group.add_argument("--microbatches", "-M", type=int, required=True, metavar="M",
                       help="microbatches per step")
    group.add_argument("--stages-per-rank", "-V", type=int, default=1, metavar="V",
                       help="stages per rank, interleaved-1f1b only (default 1); rank r owns "
                            "stages r, r+P, ..., r+(V-1)P")
    group.add_argument("--overlap-b-f", action="store_true",
                       help="interleaved-1f1b: pair each steady-state backward with the next "
                            "forward in one OVERLAP_B_F step")
    group.add_argument("--dxdw-split", action="store_true",
                       help="split the backward inside each overlap into dx (I) and a later dw "
                            "(W); needs --overlap-b-f")
    group.add_argument("--less-memory", action="store_true",
                       help="interleaved-1f1b: half-depth warm-up (fewer live activations)")
    group.add_argument("--lowering", choices=[k.value for k in Lowering], default=None,
                       help="how sends and receives are placed in compute orders. early (the default for "
                            "looped-bfs, interleaved-zb, zbv, dualpipev): receives posted as "
                            "soon as a run of all ranks reaches them, as PyTorch's runtime does "
                            "by default; runs on every transport, NCCL included. deferred: each "
                            "receive right before the compute that needs it (PyTorch's "
                            "deferred receives); gloo/tagged transports only. columns "
                            "(interleaved-1f1b's default): MindSpore hyper-parallel's scan of "
                            "aligned time columns")
    group.add_argument("--fsdp", action="store_true",
                       help="every stage is FSDP-managed: add UNSHARD/RESHARD/REDUCE_GRAD "
                            "(simulate then counts the gathered parameters, --param-bytes)")
    group.add_argument("--batch-p2p", action="store_true",
                       help="coalesce adjacent sends/receives into BATCH_P2P steps, both "
                            "ends of each message alike (what --transport nccl checks)")
    group.add_argument("--swap", action="store_true",
                       help="inject activation swap steps (LO, WO, LL, WL; SO, SL for chunks "
                            "streamed layer by layer) as the last pass, for the chunks --policy "
                            "picks (default peak)")
    group.add_argument("--swap-min-gap", type=int, default=None, metavar="N",
                       help="the gap policy (implies it and --swap): swap a chunk when its "
                            "backward is at least N compute slots after its forward (4 is "
                            "MindSpore hyper-parallel's rule; min 3)")
    return parent


def _build(args: argparse.Namespace, policy: SwapPolicy | None
           ) -> tuple[Schedule, SwapPlan | None]:
    spec = ScheduleSpec(
        kind=ScheduleKind(args.schedule),
        ranks=args.ranks,
        microbatches=args.microbatches,
        stages_per_rank=args.stages_per_rank,
        overlap_b_f=args.overlap_b_f,
        dxdw_split=args.dxdw_split,
        less_memory=args.less_memory,
        fsdp=args.fsdp,
        batch_p2p=args.batch_p2p,
        swap=policy is not None,
        lowering=args.lowering,
    )
    return build_planned(spec, policy)


def _parser() -> Parser:
    spec = _spec_arguments()
    costs, policies = cost_arguments(), policy_arguments()
    parser = Parser(
        prog=PROG, description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    orders = commands.add_parser(
        "orders", parents=[spec, policies, costs], help="print every rank's final order",
        description="Build a schedule and print every rank's final order.",
        epilog="The JSON form is {\"orders\": {\"0\": [\"0F0\", \"0LO0\", null, ...], ...}}: rank "
               "keys are strings, idle slots null. The grid form is one 'rank N: steps' line per "
               "rank. 'validate' reads both.")
    orders.add_argument("--format", choices=get_args(OrdersFormat), default="grid",
                        help="grid: 'rank N: <steps>' lines (default); json: machine-readable")

    _add_validate(commands)
    _add_convert(commands, policies, costs)
    show = commands.add_parser(
        "show", parents=[spec, policies, costs],
        help="render all ranks side by side with a swap summary",
        description="Build a schedule and render it: one column per rank (swap steps marked *), "
                    "then which (stage, micro) chunks each rank swaps.")
    show.add_argument("--no-grid", action="store_true", help="print only the summary")

    _add_simulate(commands, spec, policies)
    add_plan(commands)
    return parser


def _add_validate(commands: argparse._SubParsersAction[Parser]) -> None:
    check = commands.add_parser(
        "validate", help="check a schedule file; exit 0 if valid, 1 if not",
        description="Check a schedule (the JSON or grid that 'orders' prints): every stage "
                    "forwards and backwards each microbatch 0..M-1 once, in order, dx before "
                    "dw; swap steps run F < LO < WO < LL < WL < backward (streamed: SO < F < WO "
                    "< SL < WL < backward); a stage with FSDP "
                    "steps is gathered (UNSHARD) for each of its computes, freed (RESHARD) in "
                    "turn and its gradients reduced once after its last backward; and a "
                    "simulation of all ranks pairs every send with its receive without "
                    "deadlock.")
    check.add_argument("file", help="schedule file, or - for standard input")
    check.add_argument("--microbatches", "-M", type=count(10**MAX_DIGITS - 1), metavar="M",
                       help="the microbatch count the schedule must run (default: its highest "
                            "micro + 1); every stage must compute micro 0..M-1 either way")
    check.add_argument("--transport", choices=TRANSPORTS, default="ordered",
                       help="ordered (default): a send waits for its receive and messages "
                            "between two ranks pair in order, as on NCCL when every send and "
                            "receive goes through batch_isend_irecv (the pipeswap runtime "
                            "posts them so). nccl: ordered, and both ends of each message "
                            "posted alike, both in a BATCH_P2P or both alone, as an executor "
                            "that posts a lone send or receive with plain isend/irecv needs "
                            "(NCCL pairs the two kinds on different communicators). tagged: "
                            "sends never wait and messages match by tag, as on gloo (only "
                            "schedules built with --lowering deferred need it)")
    check.add_argument("--layers-per-stage", type=LAYERS, metavar="L",
                       help=f"layers in one chunk of every stage (1 to {MAX_LAYERS}): a "
                            "streamed swap's layer lag (0SO3:2 or 0SL3:2 is lag 2) must then "
                            "be 1 to L. A schedule file holds no layer counts, so without this "
                            "option a lag is only checked to be at least 1; give the model's "
                            "count to catch a schedule made for another model")


def _add_convert(commands: argparse._SubParsersAction[Parser], policies: Parser,
                 costs: Parser) -> None:
    convert = commands.add_parser(
        "convert", parents=[policies, costs],
        help="convert between JSON, grid lines and PyTorch's CSV; lower and swap",
        description="Read a schedule in any form pipeswap knows (JSON, 'rank N:' lines, "
                    "PyTorch's CSV, compute-only or with comms; detected from the content), "
                    "optionally add sends and receives (--lower, for a compute-only CSV), "
                    "batch them and inject swap steps, validate it, and write it out.",
        epilog="Example: a compute-only CSV dumped by PyTorch's schedule._dump_csv(path, "
               "'compute_only'), lowered, swapped and checked:\n"
               f"  {PROG} convert zbv.csv --lower --swap --to json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    convert.add_argument("file", help="schedule file, or - for standard input")
    convert.add_argument("--to", choices=get_args(ConvertFormat),
                         default="json", help="output form (default json); csv-compute keeps "
                         "only computes, as PyTorch's compute_only CSV")
    convert.add_argument("--lower", action="store_true",
                         help="add sends and receives to compute-only orders, as PyTorch's "
                              "runtime does (see --lowering)")
    convert.add_argument("--lowering", choices=[Lowering.EARLY.value, Lowering.DEFERRED.value],
                         default=Lowering.EARLY.value,
                         help="with --lower: early (default; equals PyTorch's lowering, runs "
                              "on NCCL) or deferred (receives right before their consumers; "
                              "needs --transport tagged)")
    convert.add_argument("--batch-p2p", action="store_true",
                         help="coalesce adjacent sends/receives into BATCH_P2P steps, both "
                              "ends of each message alike (what --transport nccl checks)")
    convert.add_argument("--swap", action="store_true",
                         help="inject swap steps for the chunks --policy picks (default peak)")
    convert.add_argument("--swap-min-gap", type=int, default=None, metavar="N",
                         help="the gap policy's threshold (implies it and --swap; 4 is "
                              "MindSpore hyper-parallel's rule)")
    convert.add_argument("--transport", choices=TRANSPORTS, default="ordered",
                         help="P2P model for the final validation: ordered (default), nccl "
                              "(also both ends of each message batched alike) or tagged (see "
                              "'validate --help')")
    convert.add_argument("--output", "-o", metavar="FILE", help="write here, not to stdout")


def _add_simulate(commands: argparse._SubParsersAction[Parser], spec: Parser,
                  policies: Parser) -> None:
    sim = commands.add_parser(
        "simulate", parents=[spec, policies, cost_arguments(param_bytes=True)],
        help="predict step time, bubbles, exposed copy time and peak memory per rank",
        description="Build a schedule and run all ranks together on a cost model: one compute "
                    "and two copy streams per rank, sends and receives as cross-rank "
                    "dependencies, swap steps as real copies and waits. Prints per rank the "
                    "step time, bubble fraction, compute time lost waiting for swap copies, and "
                    "the peak activation memory with and without swap. With --fsdp, also the "
                    "most parameter bytes gathered at once and the peak of activations and "
                    "gathered parameters together: a stage's parameters (--param-bytes) are "
                    "held from its UNSHARD to its RESHARD.",
        epilog="Sizes take a suffix (KiB, MiB, GiB, or KB, MB, GB), times one of s, ms, us; "
               "bandwidths are bytes per second (55GB = 55e9 B/s). Costs come from --preset "
               "(host link, P2P and achieved FLOP/s of a machine), then the model dimensions "
               "(--hidden --seq-len --layers-per-stage: compute times, activation bytes and, "
               "with --fsdp, parameter bytes), "
               "then the explicit options, each overriding the one before. Presets: "
               + "; ".join(f"{p.name}: {p.source}" for p in PRESETS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_argument("--trace", metavar="FILE",
                     help="write a Chrome trace (open in Perfetto or chrome://tracing)")
    sim.add_argument("--plot", metavar="FILE",
                     help="draw the timeline and memory (PNG/SVG/PDF by suffix; needs "
                          "pip install 'pipeswap-schedule[plot]')")
    sim.add_argument("--format", choices=get_args(ReportFormat), default="table",
                     help="table: ranks side by side (default); json: one object")
def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Whatever goes wrong ends in one line on stderr and a non-zero exit,
    never a traceback."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # here, where a closed pipe can still be caught
    except BrokenPipeError:
        # The reader (`| head`) left early: not an error. Point stdout at devnull so that
        # the interpreter's own flush at exit has nothing left to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl-C: the planning workers, if any, are gone already
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


@gc_paused  # the whole command: between the passes, each paused alone, the cyclic collector
# would scan the million acyclic steps a large schedule has, again and again (a tenth of the
# command at 64 stages)
def _run(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(_attach_dashed_values(sys.argv[1:] if argv is None else argv))
    try:
        if args.command == "validate":
            return _validate(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "simulate":
            return run_simulate(args, _build)
        if args.command == "plan":
            return run_plan(args)
        schedule, _ = _build(args, choose_policy(args, costs_from(args)))
        if args.command == "orders":
            print(dumps_json(schedule) if args.format == "json" else dumps_lines(schedule))
            return 0
        if not args.no_grid:
            print(render_grid(schedule))
            print("\n* = swap step\n")
        print(describe_schedule(schedule))
        print()
        print(swap_summary(schedule))
        return 0
    except (ScheduleError, FileAccessError) as exc:
        parser.exit(2, f"{PROG}: error: {exc}\n")


def _convert(args: argparse.Namespace) -> int:
    schedule = loads(read_text(args.file))
    if args.lower:
        if any(step is not None and step.p2p_leaves for order in schedule.orders
               for step in order):
            raise ScheduleError("--lower adds sends and receives to compute-only orders, but "
                                "this schedule has them already")
        schedule = LOWERINGS[Lowering(args.lowering)](schedule)
    if args.batch_p2p:
        schedule = coalesce_p2p(schedule)
    policy = choose_policy(args, costs_from(args))
    if policy is not None:
        schedule = inject_swap(schedule, policy)
    # with the model dimensions a chunk's layer count is known: check streamed lags against it
    validate(schedule, transport=args.transport, layers=args.layers_per_stage)
    text = {"json": lambda: dumps_json(schedule), "grid": lambda: dumps_lines(schedule),
            "csv": lambda: dumps_csv(schedule),
            "csv-compute": lambda: dumps_csv(schedule, compute_only=True)}[args.to]()
    text = text if text.endswith("\n") else text + "\n"
    if args.output:
        write_text(args.output, text)
    else:
        print(text, end="")
    return 0


def _validate(args: argparse.Namespace) -> int:
    """Exit 0 if the schedule is valid, 1 with the reason if not (2 if it cannot be read)."""
    text = read_text(args.file)
    try:
        schedule = loads(text)
        validate(schedule, transport=args.transport, microbatches=args.microbatches,
                 layers=args.layers_per_stage)
    except ScheduleError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    steps = sum(1 for order in schedule.orders for s in order if s is not None)
    print(f"valid: {schedule.num_ranks} ranks, {schedule.num_stages} stages, {steps} steps")
    return 0
