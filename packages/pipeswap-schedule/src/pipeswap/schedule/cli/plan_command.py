"""``pipeswap-schedule plan``: the fastest configurations that fit a model, a cluster and a
batch, ranked (see :mod:`pipeswap.schedule.jobplan`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import get_args

from pipeswap.schedule.build import ScheduleKind
from pipeswap.schedule.cli.simulate_command import Parser, count, in_range
from pipeswap.schedule.costs import Link
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.jobplan import (
    MACHINE_PRESETS,
    MODEL_PRESETS,
    Job,
    Machine,
    ModelShape,
    Outcome,
    SearchSpace,
    as_data,
    from_hf_config,
    machine_preset,
    model_preset,
    plan,
    render,
)
from pipeswap.schedule.jobplan.memory import Optimizer
from pipeswap.schedule.jobplan.search import Progress
from pipeswap.schedule.units import parse_bytes, parse_size

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
PROGRESS_S = 3.0  # a progress line on stderr at most this often, the first after it
DIMENSIONS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


def add_plan(commands: argparse._SubParsersAction[Parser]) -> None:
    found = commands.add_parser(
        "plan", help="find the fastest configuration that fits a model, GPUs and a batch",
        description="Search pipeline degrees, schedules, stages per rank, micro-batch sizes "
                    "and, per rank, what to keep, swap and recompute; simulate the "
                    "configurations that could win and rank those that fit the GPUs' memory.",
        epilog="Example: pipeswap-schedule plan --model llama3-70b --gpu h100-sxm --gpus 64 "
               "--global-batch 512 --seq-len 4096. Models: " + ", ".join(MODEL_PRESETS)
               + ". GPUs: " + "; ".join(f"{m.name}: {m.source}"
                                        for m in MACHINE_PRESETS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    model = found.add_argument_group("the model (a preset, a config.json, or dimensions)")
    model.add_argument("--model", help=f"a preset: {', '.join(MODEL_PRESETS)}")
    model.add_argument("--hf-config", metavar="FILE", help="a Hugging Face config.json")
    for name in DIMENSIONS:
        model.add_argument(f"--{name.replace('_', '-')}", type=count(10**7), metavar="N",
                           help=f"the model's {name.replace('_', ' ')} (overrides the preset's)")
    gpu = found.add_argument_group("the GPUs (a preset; any figure overridden)")
    gpu.add_argument("--gpu", default="h100-sxm", help=f"{', '.join(MACHINE_PRESETS)} "
                                                       "(default h100-sxm)")
    gpu.add_argument("--memory", type=parse_bytes, metavar="BYTES", help="device memory")
    gpu.add_argument("--flops", type=in_range(parse_size, 1e9, 1e18, "1e9 to 1e18"),
                     help="achieved 16-bit FLOP/s")
    gpu.add_argument("--d2h-bandwidth", type=in_range(parse_size, 1e6, 1e13, "1MB to 10TB"))
    gpu.add_argument("--h2d-bandwidth", type=in_range(parse_size, 1e6, 1e13, "1MB to 10TB"))
    gpu.add_argument("--p2p-bandwidth", type=in_range(parse_size, 1e6, 1e13, "1MB to 10TB"))
    gpu.add_argument("--host-memory", type=parse_bytes, metavar="BYTES",
                     help="host memory per node")
    gpu.add_argument("--gpus-per-node", type=count(1024), metavar="N")
    _job_arguments(found)
    _search_arguments(found)


def _job_arguments(found: Parser) -> None:
    job = found.add_argument_group("the job")
    job.add_argument("--gpus", type=count(10**6), required=True, metavar="N",
                     help="GPUs in all: pipeline ranks x data-parallel replicas")
    job.add_argument("--global-batch", type=count(10**7), required=True, metavar="SEQUENCES")
    job.add_argument("--seq-len", type=count(10**7), required=True, metavar="TOKENS")
    job.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    job.add_argument("--optimizer", choices=list(get_args(Optimizer)), default="adam")
    job.add_argument("--replicate", action="store_true",
                     help="data-parallel replicas each hold their stages' whole weights, "
                          "gradients and optimizer state (default: FSDP shards them)")
    job.add_argument("--reserve", type=parse_bytes, default=2 << 30, metavar="BYTES",
                     help="kept free on each GPU for the CUDA context, workspaces and the "
                          "allocator's slack (default 2GiB)")


def _search_arguments(found: Parser) -> None:
    search = found.add_argument_group("the search (each narrows it)")
    search.add_argument("--ranks", type=_counts, metavar="LIST",
                        help="pipeline degrees to try, e.g. 8,16 (default: every divisor of "
                             "--gpus)")
    search.add_argument("--schedules", type=_kinds, metavar="LIST",
                        help=f"families to try (default all: "
                             f"{', '.join(kind.value for kind in ScheduleKind)})")
    search.add_argument("--stages-per-rank", type=_counts, default=(1, 2, 3, 4), metavar="LIST")
    search.add_argument("--micro-batch-sizes", type=_counts, metavar="LIST",
                        help="sequences per microbatch to try (default: every divisor)")
    search.add_argument("--max-microbatches-per-rank", type=count(64), default=8, metavar="F",
                        help="at most F x P microbatches (default 8)")
    search.add_argument("--no-swap", action="store_true",
                        help="every rank keeps every activation (no swap, no recompute)")
    search.add_argument("--top", type=count(100), default=5, metavar="N")
    search.add_argument("--format", choices=["table", "json"], default="table")


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"give integers from 1, got {text!r}")
    return values


def _kinds(text: str) -> tuple[ScheduleKind, ...]:
    try:
        return tuple(ScheduleKind(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown schedule in {text!r}: choose from "
            f"{', '.join(kind.value for kind in ScheduleKind)}") from None


def model_of(args: argparse.Namespace) -> ModelShape:
    """The model: a preset or a config.json, dimensions given overriding it."""
    given = {name: getattr(args, name) for name in DIMENSIONS if getattr(args, name)}
    if args.model and args.hf_config:
        raise ScheduleError("give --model or --hf-config, not both")
    if args.model:
        return replace(model_preset(args.model), **given)
    if args.hf_config:
        return replace(from_hf_config(args.hf_config), **given)
    missing = [f"--{name.replace('_', '-')}" for name in DIMENSIONS
               if name not in given and name != "kv_heads"]
    if missing:
        raise ScheduleError(f"no model: give --model (one of {', '.join(MODEL_PRESETS)}), "
                            f"--hf-config, or the dimensions ({', '.join(missing)} missing)")
    ffn = given.pop("ffn")
    return ModelShape("custom", ffn=ffn, kv_heads=given.pop("kv_heads", given["heads"]),
                      **given)


def machine_of(args: argparse.Namespace) -> Machine:
    base = machine_preset(args.gpu)
    link = Link(args.d2h_bandwidth or base.link.d2h_bandwidth,
                args.h2d_bandwidth or base.link.h2d_bandwidth, duplex=base.link.duplex)
    return replace(base, memory_bytes=args.memory or base.memory_bytes,
                   flops=args.flops or base.flops, link=link,
                   p2p_bandwidth=args.p2p_bandwidth or base.p2p_bandwidth,
                   host_memory_bytes=args.host_memory or base.host_memory_bytes,
                   gpus_per_node=args.gpus_per_node or base.gpus_per_node)


def run_plan(args: argparse.Namespace) -> int:
    model, machine = model_of(args), machine_of(args)
    job = Job(args.gpus, args.global_batch, args.seq_len, DTYPES[args.dtype], args.optimizer,
              fsdp=not args.replicate, reserve_bytes=args.reserve)
    space = SearchSpace(ranks=args.ranks, schedules=args.schedules or tuple(ScheduleKind),
                  stages_per_rank=args.stages_per_rank, micro_batches=args.micro_batch_sizes,
                  max_microbatch_factor=args.max_microbatches_per_rank, swap=not args.no_swap)
    found = plan(model, job, machine, space, top=args.top, progress=_progress())
    print(json.dumps(as_data(found), indent=1) if args.format == "json" else render(found))
    return 0


def _progress() -> Progress:
    begun = time.monotonic()
    said = [begun]

    def tell(judged: int, total: int, best: Outcome | None) -> None:
        now = time.monotonic()
        if now - said[0] >= PROGRESS_S:
            said[0] = now
            leader = (f"; best so far {best.config.describe()}, {best.step_time:.2f} s a step"
                      if best is not None else "")
            print(f"plan: {judged} simulated of {total} configurations, {now - begun:.0f} s"
                  f"{leader}", file=sys.stderr, flush=True)

    return tell
