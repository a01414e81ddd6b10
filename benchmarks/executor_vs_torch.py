"""pipeswap's executor next to PyTorch's pipelining schedules: same model, same schedule, same
process group, one run.

    python benchmarks/executor_vs_torch.py            # CPU, gloo, spawned ranks
    python benchmarks/executor_vs_torch.py --write    # also record it in BENCHMARKS.md
    python benchmarks/executor_vs_torch.py --quick    # a tiny model and 2 steps (CI smoke)

Each case spawns its ranks once (gloo, one intra-op thread each) and builds three contenders
from the same weights (the bundled GPT, ``build_gpt`` with one seed, cut by
``split_stages``): pipeswap's ``PipelineExecutor`` without swap, the same with swap, and
``torch.distributed.pipelining`` (its ``PipelineStage`` and the schedule class of the case:
``Schedule1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, whose compute
orders pipeswap's generators reproduce, see tests/test_pytorch_schedules.py; for 1F1B with
its sends and receives batched in pairs, as ``Schedule1F1B`` posts them). Every step runs
all three on the same batch, one after the other, each after a barrier, in orders that put
each right after each other equally often (see ``balanced_orders``), and times each on every
rank; no optimizer runs, so every step starts from the same weights. The first ``--warmup`` steps (shape exchange, buffers, the pool) are
left out; a figure is the median over steps on each rank, then the median over ranks. The
losses of all three are compared on every step, and the gradients after the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeswap.runtime import spawn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, publish  # noqa: E402

SECTION = "## pipeswap's executor vs PyTorch pipelining (`benchmarks/executor_vs_torch.py`)"
CONTENDERS = ("pipeswap", "pipeswap-swap", "torch")
TORCH_CLASSES = {"1f1b": "Schedule1F1B", "interleaved-zb": "ScheduleInterleavedZeroBubble",
                 "zbv": "ScheduleZBVZeroBubble"}
LOSS_TOLERANCE = 1e-5  # relative, per microbatch
GRAD_TOLERANCE = 1e-4  # largest |difference| over the largest |gradient|, per rank


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str  # a pipeswap ScheduleKind value, with a class in TORCH_CLASSES
    ranks: int
    stages_per_rank: int
    microbatches: int
    batch_p2p: bool = False  # post adjacent sends and receives together, as PyTorch's class does


@dataclass(frozen=True)
class Sizes:
    width: int
    seq_len: int
    batch_size: int
    blocks_per_stage: int
    steps: int
    warmup: int
    seed: int = 0


CASES = (
    # Schedule1F1B posts a forward's send with the next backward's receive in one
    # batch_isend_irecv (and a backward's send with the next forward's receive), as pipeswap
    # does with batch_p2p; PyTorch's runtime for the zero-bubble classes posts each operation
    # alone, as pipeswap does by default.
    Case("1F1B P=4 M=8", "1f1b", 4, 1, 8, batch_p2p=True),
    Case("Interleaved ZB P=2 V=2 M=8", "interleaved-zb", 2, 2, 8),
    Case("ZBV P=2 M=8", "zbv", 2, 2, 8),
)


@dataclass
class RankResult:
    """One rank's figures for one case."""

    seconds: dict[str, list[float]] = field(default_factory=dict)  # contender -> measured steps
    losses: dict[str, list[list[float]]] = field(default_factory=dict)  # per step, per micro
    grad_diff: dict[str, float] = field(default_factory=dict)  # vs pipeswap without swap
    refused: dict[str, str] = field(default_factory=dict)  # contender -> why it cannot run


def _torch_schedule(case: Case, modules: list[torch.nn.Module], mine: list[int],
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    boundary: Callable[[int], torch.Tensor]) -> Any:
    """PyTorch's schedule over this rank's stages. Their boundary shapes are given (its static
    mode): the dynamic mode exchanges them as pickled objects, which needs numpy."""
    from torch.distributed.pipelining import PipelineStage, schedules

    num_stages = case.ranks * case.stages_per_rank
    stages = [PipelineStage(modules[index], index, num_stages, torch.device("cpu"),
                            input_args=boundary(index - 1), output_args=boundary(index))
              for index in mine]
    cls = getattr(schedules, TORCH_CLASSES[case.schedule])
    if case.stages_per_rank == 1:
        return cls(stages[0], case.microbatches, loss_fn=loss_fn)
    return cls(stages, case.microbatches, loss_fn=loss_fn)


def run_case(rank: int, world_size: int, case: Case, sizes: Sizes) -> RankResult:
    """Build the three contenders on this rank and run them step by step, alternating."""
    import torch.distributed as dist

    from pipeswap.runtime.models.data import Corpus, batches
    from pipeswap.runtime.errors import PipelineSetupError
    from pipeswap.runtime.executor import PipelineExecutor
    from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, lm_loss, split_stages
    from pipeswap.runtime.executor.stage import PipelineStage
    from pipeswap.schedule import ScheduleKind, ScheduleSpec, build_schedule

    torch.set_num_threads(1)  # several ranks share the cores
    corpus = Corpus.bundled()
    data = batches(corpus.encode(), sizes.batch_size, sizes.seq_len,
                   sizes.warmup + sizes.steps, sizes.seed)
    num_stages = case.ranks * case.stages_per_rank
    gpt = GPTConfig(vocab=len(corpus.vocab), seq_len=sizes.seq_len, width=sizes.width,
                    layers=sizes.blocks_per_stage * num_stages)
    spec = ScheduleSpec(ScheduleKind(case.schedule), ranks=case.ranks,
                        microbatches=case.microbatches, stages_per_rank=case.stages_per_rank,
                        batch_p2p=case.batch_p2p)
    placement = build_schedule(spec).stage_ranks
    mine = [index for index in range(num_stages) if placement[index] == rank]
    holds_first, holds_last = 0 in mine, num_stages - 1 in mine

    micro = sizes.batch_size // case.microbatches

    def boundary(index: int) -> torch.Tensor:
        """An example of what stage ``index`` outputs (-1: the model's input), per microbatch."""
        if index < 0:
            return torch.zeros(micro, sizes.seq_len, dtype=torch.int64)
        return torch.zeros(micro, sizes.seq_len, gpt.vocab if index == num_stages - 1
                           else gpt.width, requires_grad=True)  # it carries gradients back

    result = RankResult()
    runners: dict[str, Callable[[torch.Tensor, torch.Tensor], list[float]]] = {}
    params: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name in CONTENDERS:
        modules = split_stages(build_gpt(gpt, sizes.seed), num_stages)
        params[name] = [(f"{index}.{pname}", p) for index in mine
                        for pname, p in modules[index].named_parameters()]
        if name == "torch":
            try:
                schedule = _torch_schedule(case, list(modules), mine, lm_loss, boundary)
            except (ValueError, RuntimeError) as exc:  # the same on every rank
                result.refused[name] = f"{type(exc).__name__}: {exc}"
                continue

            def run_torch(inputs: torch.Tensor, targets: torch.Tensor,
                          schedule: Any = schedule) -> list[float]:
                losses: list[torch.Tensor] = []
                args = (inputs,) if holds_first else ()
                schedule.step(*args, target=targets if holds_last else None,
                              losses=losses if holds_last else None, return_outputs=False)
                return [float(loss.detach()) for loss in losses]

            runners[name] = run_torch
        else:
            stages = [PipelineStage(modules[index], index, num_stages) for index in mine]
            try:
                executor = PipelineExecutor(stages, spec, case.microbatches, lm_loss,
                                            swap=name == "pipeswap-swap")
            except PipelineSetupError as exc:  # raised on every rank alike
                result.refused[name] = f"{type(exc).__name__}: {exc}"
                continue

            def run_pipeswap(inputs: torch.Tensor, targets: torch.Tensor,
                             executor: PipelineExecutor = executor) -> list[float]:
                return list(executor.step(inputs, targets).losses)

            runners[name] = run_pipeswap
        result.seconds[name], result.losses[name] = [], []

    first_grads: dict[str, dict[str, torch.Tensor]] = {}
    orders = balanced_orders([name for name in CONTENDERS if name in runners])
    for number, (inputs, targets) in enumerate(data):
        for name in orders[number % len(orders)]:
            for _, p in params[name]:
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            losses = runners[name](inputs, targets)
            seconds = time.perf_counter() - start
            if number >= sizes.warmup:
                result.seconds[name].append(seconds)
            result.losses[name].append(losses)
            if number == 0:
                first_grads[name] = {key: p.grad.detach().clone() for key, p in params[name]
                                     if p.grad is not None}
    reference = first_grads.get("pipeswap")
    for name, grads in first_grads.items():
        if reference is None or name == "pipeswap":
            continue
        if grads.keys() != reference.keys():
            result.grad_diff[name] = float("inf")
            continue
        scale = max((float(g.abs().max()) for g in reference.values()), default=0.0) or 1.0
        result.grad_diff[name] = max(
            (float((grads[key] - reference[key]).abs().max()) for key in reference),
            default=0.0) / scale
    return result


def balanced_orders(names: list[str]) -> list[list[str]]:
    """Orders to run ``names`` in, step after step, such that each runs right after each
    other equally often, across steps too: a contender may leave work behind (the swap
    executor's copy threads, freed memory), and a plain rotation of three would put the
    same one after it two times in three. For two or three: a b c, a c b, a b c, ..."""
    if len(names) > 3:
        raise ValueError("balanced_orders knows sequences for up to three contenders")
    return [names, names[:1] + names[:0:-1]] if names else [[]]


def run_cases(rank: int, world_size: int, cases: list[Case], sizes: Sizes) -> list[RankResult]:
    """:func:`run_case` for each case, one after the other, in the same ranks."""
    return [run_case(rank, world_size, case, sizes) for case in cases]


def _loss_diff(per_rank: list[RankResult], name: str) -> float | None:
    """The largest relative difference between ``name``'s microbatch losses and pipeswap's
    without swap, over all steps (None: one of them did not run)."""
    worst: float | None = None
    for result in per_rank:
        if name not in result.losses or "pipeswap" not in result.losses:
            return None
        for ours, theirs in zip(result.losses["pipeswap"], result.losses[name]):
            if len(ours) != len(theirs):
                return float("inf")
            for a, b in zip(ours, theirs):
                diff = abs(a - b) / max(abs(a), 1e-12)
                worst = diff if worst is None else max(worst, diff)
    return worst


def summarize(case: Case, per_rank: list[RankResult]) -> dict[str, Any]:
    """The case's figures: per contender the median step time of each rank, and the slowest
    rank's, which is the pipeline's step time (every contender starts after a barrier)."""
    medians: dict[str, list[float]] = {}
    refused: dict[str, str] = {}
    for result in per_rank:
        refused.update(result.refused)
        for name, seconds in result.seconds.items():
            if seconds:
                medians.setdefault(name, []).append(statistics.median(seconds))
    loss_diff = {name: _loss_diff(per_rank, name) for name in CONTENDERS if name != "pipeswap"}
    grad_diff = {name: max((r.grad_diff[name] for r in per_rank if name in r.grad_diff),
                           default=None) for name in CONTENDERS if name != "pipeswap"}
    ran = [name for name in loss_diff if name not in refused]
    agree = "pipeswap" not in refused and all(
        (loss := loss_diff[name]) is not None and loss <= LOSS_TOLERANCE
        and (grad := grad_diff[name]) is not None and grad <= GRAD_TOLERANCE for name in ran)
    return {
        "case": case.name,
        "per_rank_median_s": medians,
        "step_s": {name: max(values) for name, values in medians.items()},
        "refused": refused,
        "max_rel_loss_diff": loss_diff,
        "max_rel_grad_diff": grad_diff,
        "agree": agree,
    }


def _ms(summary: dict[str, Any], name: str) -> str:
    if name in summary["refused"]:
        return "refused"
    value = summary["step_s"].get(name)
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def _ratio(summary: dict[str, Any], name: str) -> str:
    times = summary["step_s"]
    return f"{times[name] / times['torch']:.2f}x" if name in times and "torch" in times else "-"


def render_row(summary: dict[str, Any]) -> str:
    per_rank = summary["per_rank_median_s"]
    ranks = " / ".join(f"{a * 1e3:.0f}, {b * 1e3:.0f}" for a, b in zip(
        per_rank.get("pipeswap", []), per_rank.get("torch", [])))
    loss, grad = summary["max_rel_loss_diff"]["torch"], summary["max_rel_grad_diff"]["torch"]
    agreement = ("same" if summary["agree"] else "DIFFER") + (
        "" if loss is None or grad is None else f" ({loss:.0e}, {grad:.0e})")
    return (f"| {summary['case']} | {_ms(summary, 'pipeswap')} | "
            f"{_ms(summary, 'pipeswap-swap')} | {_ms(summary, 'torch')} | "
            f"{_ratio(summary, 'pipeswap')} | {_ratio(summary, 'pipeswap-swap')} | {ranks or '-'} "
            f"| {agreement} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="measured steps per contender")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out first")
    parser.add_argument("--width", type=int, default=128, help="model width")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, 1 warm-up and 2 measured steps: a smoke run")
    parser.add_argument("--cases", default=None,
                        help="comma-separated schedules to run (1f1b, interleaved-zb, zbv)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if args.cases is None or c.schedule in args.cases.split(",")]
    if not chosen:
        parser.error(f"--cases {args.cases!r} names none of {', '.join(TORCH_CLASSES)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    sizes = Sizes(width=args.width, seq_len=args.seq_len, batch_size=args.batch_size,
                  blocks_per_stage=2, steps=args.steps, warmup=args.warmup)
    if args.quick:
        sizes = dataclasses.replace(sizes, width=32, seq_len=16, batch_size=8,
                                    blocks_per_stage=1, steps=2, warmup=1)
    if any(sizes.batch_size % case.microbatches for case in chosen):
        parser.error(f"--batch-size {sizes.batch_size} does not split into "
                     f"{max(case.microbatches for case in chosen)} microbatches")
    summaries = []
    for ranks in sorted({case.ranks for case in chosen}, reverse=True):
        group = [case for case in chosen if case.ranks == ranks]  # one spawn for them all
        print(f"{', '.join(case.name for case in group)} ...", file=sys.stderr, flush=True)
        per_rank: list[list[RankResult]] = spawn(run_cases, ranks, group, sizes, timeout_s=300)
        summaries += [summarize(case, [results[i] for results in per_rank])
                      for i, case in enumerate(group)]
    status = 0 if all(s["agree"] for s in summaries) else 1
    if args.json:
        print(json.dumps({"sizes": dataclasses.asdict(sizes), "cases": summaries}))
        return status
    refusals = "".join(f"\n{s['case']}: {name} refused: {' '.join(why.split())}\n"
                       for s in summaries for name, why in s["refused"].items())
    report = (
        f"Measured {datetime.date.today().isoformat()} on CPU (gloo), host {machine()}; "
        f"torch {torch.__version__}; GPT width {sizes.width}, {sizes.seq_len} tokens x "
        f"{sizes.batch_size} sequences a step, {sizes.blocks_per_stage} block(s) per stage; "
        "one intra-op thread per rank. The three contenders share the spawned ranks and run "
        "alternately, step by step, each after a barrier and right after each other equally "
        "often, from the same weights on the same batches, with the same P2P (pipeswap's "
        "1F1B batches each send with the next receive, as Schedule1F1B does), no optimizer; "
        f"{sizes.steps} measured steps each after {sizes.warmup} warm-up step(s). A step time is the median over steps on each rank; "
        "the columns give the slowest rank's (the pipeline's step time), the per-rank column "
        "all of them.\n\n"
        "| case | pipeswap, no swap | pipeswap, swap | PyTorch | pipeswap / PyTorch | "
        "swap / PyTorch | per rank: pipeswap, PyTorch (ms) | losses, gradients |\n"
        "|---|---|---|---|---|---|---|---|\n"
        + "\n".join(render_row(s) for s in summaries) + "\n" + refusals
        + "\n\"same\": every microbatch loss of every step within a relative "
        f"{LOSS_TOLERANCE:g} of pipeswap's without swap, and the first step's gradients within "
        f"{GRAD_TOLERANCE:g} of the largest gradient, for pipeswap with swap and for PyTorch "
        "(in brackets: PyTorch's largest relative loss and gradient differences). PyTorch "
        "scales gradients by 1/M after the backward and pipeswap each loss before it, so "
        "their gradients may differ by rounding. pipeswap's ranks end a step together (its "
        "end-of-step agreement); PyTorch's return when their own work is done, so their "
        "per-rank times fall towards the last rank. With more ranks than cores, other load "
        "on the machine moves the absolute times a lot between runs; the ratios of one run, "
        "whose contenders alternate, are what compares.\n")
    publish(SECTION, report, args.write)
    return status


if __name__ == "__main__":
    sys.exit(main())
