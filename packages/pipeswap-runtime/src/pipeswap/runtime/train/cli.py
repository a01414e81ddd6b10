"""The ``pipeswap-train`` command line: the parser, every check of its values (each bad
value refused with one line, and a pointer to --help, before any rank starts), the config it
makes, and ``main``, which spawns the ranks or joins torchrun's and prints the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import NoReturn

from pipeswap.runtime.errors import CheckpointError
from pipeswap.runtime.distributed.launch import (
    RankFailedError,
    backend_for,
    current_step,
    init_from_env,
    launched_by_torchrun,
    spawn,
)
from pipeswap.runtime.distributed.rank_failure import describe
from pipeswap.runtime.train.config import (
    DTYPES,
    LOG_LEVELS,
    MODELS,
    MODES,
    POLICIES,
    SWAP_COSTS,
    CheckpointConfig,
    JobConfig,
    Mode,
    ModelConfig,
    ParallelConfig,
    SwapConfig,
    TrainConfig,
    TrainingConfig,
)
from pipeswap.runtime.train.metrics import ModeResult
from pipeswap.runtime.train.preflight import (
    directory_problem,
    expected_layout,
    file_problem,
    plan_resume,
)
from pipeswap.runtime.train.summary import render, summarize
from pipeswap.runtime.train.trainer import run_rank
from pipeswap.schedule import GRANULARITIES, ScheduleKind, parse_bytes
from pipeswap.schedule import RECOMPUTE_MODES
from pipeswap.schedule import V_SHAPED


#: Most ranks one job starts (under torchrun: in all). Each rank is a process with its own
#: torch, some 200 MB before any model, all started at once: a few dozen already crowd a
#: workstation, and a slip such as --ranks 512 would exhaust its memory.
_MAX_RANKS = 64
#: Most (stage, microbatch) pairs in a schedule, ranks x stages per rank x microbatches. Every
#: rank builds and walks the whole schedule, about six steps a pair: at this size that takes
#: seconds and hundreds of MB in each rank, and it is checked before anything is built.
_MAX_SCHEDULE_PAIRS = 100_000
#: Longest --timeout: a rank that waits a day for a peer is hung, not slow.
_MAX_TIMEOUT_S = 86_400.0


class _Parser(argparse.ArgumentParser):
    """Errors in two lines: argparse's default puts the whole usage, a screenful with this
    many options, above the one line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see {self.prog} --help\n")


def parse_args(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    """The config of ``argv`` (and the parsed arguments, for how to report); a bad value
    exits here with one line, before any rank starts."""
    parser = _parser()
    args = parser.parse_args(argv)
    # Every check below runs before any rank starts, and a bad value ends here with one line.
    modes = ("no-swap",) if args.no_swap else ("swap",) if args.swap_only else MODES
    torchrun = launched_by_torchrun()
    if args.dp < 1:
        parser.error(f"--dp must be at least 1, got {args.dp}")
    if args.dp > 1 and not args.fsdp:
        parser.error(f"--dp {args.dp}: the replicas share gradients through FSDP2; add --fsdp")
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.ranks * args.dp
    if torchrun and world % args.dp:
        parser.error(f"torchrun's world size {world} does not split into --dp {args.dp} "
                     f"replicas: start a multiple of {args.dp} processes")
    ranks = world // args.dp if torchrun else args.ranks
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world
    _check_numbers(parser, args, ranks, world, torchrun)
    v_shaped = ScheduleKind(args.schedule) in V_SHAPED
    if v_shaped and args.stages_per_rank not in (1, 2):
        parser.error(f"{args.schedule} runs exactly two stages per rank")
    config = _config(args, ranks, modes, v_shaped)
    _check_files(parser, config)
    _check_replay(parser, config, torchrun)
    _check_swap_options(parser, args, modes)
    stage_ranks = _check_schedule(parser, config)
    parts = args.microbatches * args.dp
    if args.batch_size % parts:
        replicas = f" in each of {args.dp} replicas" if args.dp > 1 else ""
        parser.error(f"--batch-size {args.batch_size} does not split into "
                     f"{args.microbatches} microbatches{replicas}: use a multiple of {parts}")
    if config.num_layers < config.num_stages:
        parser.error(f"--layers {config.num_layers} cannot fill {config.num_stages} stages: "
                     f"use at least {config.num_stages}, one block per stage")
    if config.job.replay_rank is not None:
        local_ranks = 1
    _check_device(parser, config.training.device, local_ranks)
    _check_memory(parser, config, local_ranks)
    return _check_resume(parser, config, stage_ranks, torchrun), args




def _parser() -> _Parser:
    """The command line, every option with its help."""
    parser = _Parser(
        prog="pipeswap-train",
        description=(
            "Train a small GPT on a bundled text across pipeline ranks, once without and once "
            "with activation swap, and compare. Each rank prints nothing but the last stage's "
            "rank, which reports loss, time and tokens/s per step; at the end a table shows "
            "per rank the peak device bytes held by saved activations without and with swap "
            "(as the swap manager counts them), the peak the device allocator saw above each "
            "step's start (measured in the odd steps, which are not timed), the savings, the "
            "step time, the bytes building the rank's stages left allocated (its "
            "parameters), and whether the losses matched bit for bit. With --dp N --fsdp, N "
            "pipeline replicas each train on their part of the batch with every stage sharded "
            "by FSDP2, and the table adds the peak of activations plus gathered parameters."),
        epilog=(
            "examples:\n"
            "  pipeswap-train                                   # 1F1B on 4 CPU ranks, both modes\n"
            "  pipeswap-train --schedule gpipe --ranks 2 --microbatches 4\n"
            "  pipeswap-train --schedule interleaved-1f1b --ranks 2 --stages-per-rank 2 \\\n"
            "      --overlap-b-f --dxdw-split --batch-p2p\n"
            "  pipeswap-train --schedule dualpipev --ranks 2 --microbatches 4\n"
            "  pipeswap-train --no-swap --json                  # one mode, JSON for tools\n"
            "  pipeswap-train --ranks 2 --dp 2 --fsdp           # 2 pipelines x 2 FSDP shards\n"
            "  pipeswap-train --device cuda --replay-rank 0 --ranks 8 --microbatches 16\n"
            "      # rank 0 of an 8-rank pipeline alone on one GPU: does it fit?\n"
            "  torchrun --nproc-per-node 4 -m pipeswap.runtime.train --device cuda\n"
            "  torchrun --nproc-per-node 4 -m pipeswap.runtime.train --dp 2 --fsdp\n"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainConfig()
    _model_options(parser, defaults)
    _swap_options(parser, defaults)
    _run_options(parser, defaults)
    return parser


def _model_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The options of the model, the pipeline and the optimisation loop."""
    model, parallel, training = defaults.model, defaults.parallel, defaults.training
    kinds = [k.value for k in ScheduleKind]
    parser.add_argument("--schedule", choices=kinds, default=parallel.schedule,
                        help=f"pipeline schedule (default {parallel.schedule})")
    parser.add_argument("--model", choices=MODELS, default=model.family,
                        help="gpt (LayerNorm, learned positions, GELU MLP) or llama (RMSNorm, "
                             "rotary embeddings, grouped-query attention through "
                             "scaled_dot_product_attention, SwiGLU); default "
                             f"{model.family}")
    parser.add_argument("--tie-embeddings", action="store_true",
                        help="llama: one weight for the input embedding and the output layer "
                             "(on the first and the last stage; their ranks sum its gradient)")
    parser.add_argument("--ranks", "-P", type=int, default=parallel.ranks,
                        help=f"pipeline ranks (default {parallel.ranks}; under torchrun, its "
                        "world size / --dp); the job spawns ranks x dp processes")
    parser.add_argument("--dp", type=int, default=parallel.dp, metavar="N",
                        help="pipeline replicas, each on its own part of the batch, laid out "
                             "on a 2-D (pp, dp) device mesh; needs --fsdp (default 1)")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard each stage's parameters with FSDP2 over its data-parallel "
                             "group; the schedule's UNSHARD, RESHARD and REDUCE_GRAD steps "
                             "gather, free and reduce them")
    parser.add_argument("--stages-per-rank", "-V", type=int, default=parallel.stages_per_rank,
                        help="stages per rank (interleaved-1f1b, looped-bfs, interleaved-zb; "
                             "zbv and dualpipev always run two)")
    parser.add_argument("--microbatches", "-M", type=int, default=parallel.microbatches,
                        help=f"microbatches per step (default {parallel.microbatches})")
    parser.add_argument("--steps", type=int, default=training.steps,
                        help=f"optimizer steps per mode (default {training.steps})")
    parser.add_argument("--batch-size", type=int, default=training.batch_size,
                        help=f"sequences per step in all (split evenly over the --dp "
                        f"replicas), a multiple of --microbatches x --dp (default "
                        f"{training.batch_size})")
    parser.add_argument("--seq-len", type=int, default=model.seq_len, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=model.width, help="model width")
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer blocks (default: two per stage)")
    parser.add_argument("--heads", type=int, default=model.heads,
                        help=f"attention heads, dividing --width (default {model.heads}; "
                             "llama: half as many key/value heads, or as many for an odd "
                             "count)")
    parser.add_argument("--lr", type=float, default=training.lr,
                        help=f"AdamW learning rate (default {training.lr:g})")
    parser.add_argument("--device", default=training.device,
                        help="cpu (gloo) or cuda (NCCL, one GPU per local rank); default cpu")
    parser.add_argument("--overlap-b-f", action="store_true",
                        help="interleaved-1f1b: overlap each backward with a forward")
    parser.add_argument("--dxdw-split", action="store_true",
                        help="with --overlap-b-f: split backwards into input and weight parts")
    parser.add_argument("--batch-p2p", action="store_true",
                        help="batch neighbouring sends and receives into one call")


def _swap_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The options of what swaps, how, and under which budget."""
    parser.add_argument("--policy", choices=POLICIES, default=defaults.swap.policy,
                        help="which chunks to swap (default peak): peak, only those that "
                             "lower the rank's peak with copies hidden on a uniform cost "
                             "model; gap, MindSpore hyper-parallel's rule; cost, every chunk "
                             "whose copies hide (see pipeswap-schedule simulate --help)")
    parser.add_argument("--swap-granularity", choices=GRANULARITIES,
                        default=defaults.swap.granularity,
                        help="with the peak policy: swap chunks whole (chunk), stream them "
                             "layer by layer (layer: each layer leaves the device as the "
                             "forward moves past it and comes back one layer ahead of the "
                             "backward), or pick per chunk what lowers the peak more (auto, "
                             "the default)")
    parser.add_argument("--budget", type=_bytes, metavar="BYTES",
                        help="with the peak policy: keep each rank's saved activations under "
                             "BYTES (e.g. 3MiB), exposing copies or recomputing layers where "
                             "needed (see --recompute), planned on the chunk and layer sizes "
                             "the run without swap measures (so not with --swap-only or "
                             "--no-swap); a budget no plan meets is reported per rank")
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES,
                        help="with --budget: auto (the default) lets the plan also recompute "
                             "layers (keep a layer's input, run its forward again just before "
                             "its backward) where that costs less than the copies it saves, "
                             "as when the budget is below what swapping alone reaches; never "
                             "only swaps")
    parser.add_argument("--swap-costs", choices=SWAP_COSTS,
                        help="what the peak policy weighs: measured (the default: the compute "
                             "times and chunk bytes the run without swap measured, and the "
                             "host link a short copy probe measures, so that it swaps only "
                             "what can hide) or layers (layer counts alone, the link taken "
                             "as infinitely fast: the same plan run after run)")


def _run_options(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The options of what the job runs and reports, checkpoints, replay and timeouts."""
    model, training = defaults.model, defaults.training
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--compare", action="store_true",
                       help="run without and then with swap and compare them (the default)")
    which.add_argument("--no-swap", action="store_true", help="run without swap only")
    which.add_argument("--swap-only", action="store_true", help="run with swap only")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object at the end (per_rank entries with rank, "
                        "pp_rank, dp_rank, peak_activation_bytes_swap, "
                        "peak_activation_bytes_no_swap, peak_memory_bytes_swap and _no_swap "
                        "(activations and gathered FSDP parameters), "
                        "peak_allocated_bytes_swap, peak_allocated_bytes_no_swap, "
                        "parameter_bytes, swapped_chunks; losses, max_abs_loss_diff, "
                        "step_time_ratio)")
    parser.add_argument("--dtype", choices=DTYPES, default=model.dtype,
                        help="fp32, or bf16: every forward under autocast to bfloat16, "
                             "parameters, gradients and optimizer state in float32 (default "
                             f"{model.dtype})")
    parser.add_argument("--metrics", metavar="FILE",
                        help="write one JSON line per step and mode to FILE as the run goes "
                             "(appended to with --resume): step, mode, loss (the mean "
                             "microbatch loss), tokens_per_s, allocator_measured (such steps "
                             "run slower), and per rank the step's peaks and bytes offloaded")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help="level of the ranks' logs, each line prefixed by its rank "
                             "(default info; warning with --json)")
    saving = parser.add_argument_group("checkpoints (torch.distributed.checkpoint)")
    saving.add_argument("--checkpoint-dir", metavar="DIR",
                        help="save each mode's run (model, optimizer, step, data position, "
                             "random state) into DIR/no-swap and DIR/swap at its last step")
    saving.add_argument("--checkpoint-every", type=int, metavar="N",
                        help="with --checkpoint-dir: also after every N steps (the two newest "
                             "are kept)")
    saving.add_argument("--resume", metavar="DIR",
                        help="go on from the newest checkpoint in DIR/<mode> whose files "
                             "verify against their checksums; --steps counts "
                             "from the run's start, so a checkpoint of step 2 and --steps 4 "
                             "run steps 3 and 4, as the uninterrupted run would")
    parser.add_argument("--replay-rank", type=int, metavar="R",
                        help="run pipeline rank R of --ranks alone, in this process, on one "
                             "device: its stages only (fresh weights), what it would receive "
                             "made here with the shapes the stage boundaries have, what it "
                             "would send dropped, everything else (compute, swap copies and "
                             "their waits) real; reports its peaks and step time without and "
                             "with swap, as in the full run. Checks on one GPU whether rank R "
                             "of a larger pipeline fits")
    parser.add_argument("--seed", type=int, default=training.seed, help="weights and data seed")
    parser.add_argument("--timeout", type=float, default=defaults.job.timeout_s,
                        help="seconds a rank waits for a peer before failing, in every "
                        "group the job makes (default "
                        f"{defaults.job.timeout_s:.0f}); a hung rank ends the job about this "
                        "long, plus 5 s, after it stops")


def _config(args: argparse.Namespace, ranks: int, modes: tuple[Mode, ...], v_shaped: bool
            ) -> TrainConfig:
    """The job's config of the parsed arguments (their values checked apart)."""
    defaults = TrainConfig()
    return TrainConfig(
        model=ModelConfig(family=args.model, tie_embeddings=args.tie_embeddings,
                          width=args.width, layers=args.layers, heads=args.heads,
                          seq_len=args.seq_len, dtype=args.dtype),
        parallel=ParallelConfig(schedule=args.schedule, ranks=ranks, dp=args.dp,
                                fsdp=args.fsdp,
                                stages_per_rank=2 if v_shaped else args.stages_per_rank,
                                microbatches=args.microbatches, overlap_b_f=args.overlap_b_f,
                                dxdw_split=args.dxdw_split, batch_p2p=args.batch_p2p),
        swap=SwapConfig(policy=args.policy, granularity=args.swap_granularity,
                        budget=args.budget, modes=modes,
                        costs=args.swap_costs or defaults.swap.costs,
                        recompute=args.recompute or defaults.swap.recompute),
        training=TrainingConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                seed=args.seed, device=args.device),
        checkpoint=CheckpointConfig(save_dir=args.checkpoint_dir, every=args.checkpoint_every,
                                    resume=args.resume),
        job=JobConfig(verbose=not args.json,
                      log_level=args.log_level or ("warning" if args.json else "info"),
                      metrics=args.metrics, timeout_s=args.timeout,
                      replay_rank=args.replay_rank))


def _check_swap_options(parser: argparse.ArgumentParser, args: argparse.Namespace,
                        modes: tuple[Mode, ...]) -> None:
    """Swap options that apply only together: refused, naming what to drop or add."""
    if args.swap_granularity != "auto" and args.policy != "peak":
        parser.error(f"--swap-granularity applies to the peak policy, not --policy "
                     f"{args.policy} (which swaps whole chunks)")
    if args.swap_costs is not None and args.policy != "peak":
        parser.error(f"--swap-costs applies to the peak policy, not --policy {args.policy}")
    if args.budget is not None and args.policy != "peak":
        parser.error(f"--budget applies to the peak policy, not --policy {args.policy}")
    if args.recompute is not None and args.budget is None:
        parser.error(f"--recompute {args.recompute} applies under a --budget (without one "
                     "nothing is recomputed): give --budget BYTES")
    if args.tie_embeddings and args.model != "llama":
        parser.error("--tie-embeddings applies to --model llama")
    if args.budget is not None and modes != MODES:
        parser.error("--budget plans on the chunk sizes the run without swap measures: drop "
                     "--swap-only / --no-swap")


def _check_replay(parser: argparse.ArgumentParser, config: TrainConfig, torchrun: bool
                  ) -> None:
    """--replay-rank runs one rank of one pipeline, by itself."""
    rank = config.job.replay_rank
    if rank is None:
        return
    if not 0 <= rank < config.parallel.ranks:
        parser.error(f"--replay-rank {rank}: the pipeline has ranks 0 to "
                     f"{config.parallel.ranks - 1}")
    if torchrun:
        parser.error("--replay-rank runs one rank in this process: start it with "
                     "pipeswap-train (or python -m pipeswap.runtime.train), not torchrun")
    if config.parallel.meshed:
        parser.error("--replay-rank replays one rank of one pipeline: drop --dp and --fsdp "
                     "(FSDP's collectives need the other ranks)")
    if config.checkpoint.save_dir is not None or config.checkpoint.resume is not None:
        parser.error("--replay-rank trains fresh weights of one rank for a few steps to "
                     "measure it: no --checkpoint-dir or --resume")


def _bytes(text: str) -> int:
    """``--budget``'s value: a byte count such as 3MiB, above 0 (no budget leaves a stage
    room for even the activations it is computing with)."""
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} leaves no room for activations: give a budget above 0 bytes (e.g. "
            "512MiB), or no --budget to keep the peak as low as hidden copies allow")
    return value


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace, ranks: int,
                   world: int, torchrun: bool) -> None:
    """Each number on its own: within what the model, the corpus and this machine allow."""
    import math

    from pipeswap.runtime.models.data import Corpus

    chars = len(Corpus.bundled().text)  # a window is seq_len tokens and the next, one a char
    heads = args.heads
    # option, value, lowest, highest (None: none of its own), why no higher
    limits: list[tuple[str, int, int, int | None, str]] = [
        ("--ranks", ranks, 1, None, ""),
        ("torchrun's world size" if torchrun else "--ranks" if args.dp == 1 else
         "--ranks x --dp", world, 1, _MAX_RANKS,
         "each rank is a process of its own with its own torch, all running at once"),
        ("--stages-per-rank", args.stages_per_rank, 1, None, ""),
        ("--microbatches", args.microbatches, 1, None, ""),
        ("--steps", args.steps, 1, None, ""),
        ("--batch-size", args.batch_size, 1, None, ""),
        ("--seq-len", args.seq_len, 1, chars - 2,
         f"the bundled corpus has {chars} characters, so use {chars - 2} or less"),
        ("--heads", args.heads, 1, None, ""),
        ("--width", args.width, heads, None, ""),
        ("--seed", args.seed, 0, 2**64 - 1, "torch's seeds are 64-bit"),
    ]
    for option, value, lowest, highest, why in limits:
        if value < lowest:
            parser.error(f"{option} must be at least {lowest}, got {value}")
        if highest is not None and value > highest:
            parser.error(f"{option} must be at most {highest}, got {value}: {why}")
    if args.width % heads:
        parser.error(f"--width {args.width} does not split into the model's {heads} attention "
                     f"heads: use a multiple of {heads}")
    if args.model == "llama" and args.width // heads % 2:
        parser.error(f"--width {args.width} gives heads of {args.width // heads} dimensions; "
                     "rotary embeddings turn pairs of them: use a multiple of "
                     f"{2 * heads}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number above 0, got {args.lr}")
    if not (math.isfinite(args.timeout) and 1 <= args.timeout <= _MAX_TIMEOUT_S):
        parser.error(f"--timeout must be a finite number of seconds from 1 to "
                     f"{_MAX_TIMEOUT_S:.0f} (how long a rank waits for a peer), got {args.timeout}")


def _check_files(parser: argparse.ArgumentParser, config: TrainConfig) -> None:
    """Options that fit together, and the files the run writes, writable before it starts."""
    checkpoint = config.checkpoint
    if checkpoint.every is not None:
        if checkpoint.save_dir is None:
            parser.error("--checkpoint-every needs --checkpoint-dir (where to save)")
        if checkpoint.every < 1:
            parser.error(f"--checkpoint-every must be at least 1, got {checkpoint.every}")
    if checkpoint.save_dir is not None:
        problem = directory_problem(checkpoint.save_dir)
        if problem is not None:
            parser.error(f"--checkpoint-dir {checkpoint.save_dir!r} {problem}")
    if config.job.metrics is not None:
        problem = file_problem(config.job.metrics)
        if problem is not None:
            parser.error(f"--metrics {config.job.metrics!r} {problem}")


def _check_resume(parser: argparse.ArgumentParser, config: TrainConfig,
                  stage_ranks: tuple[int, ...], torchrun: bool) -> TrainConfig:
    """The checkpoint each mode resumes from: the newest that verifies and fits this job
    (under torchrun every process checks the manifests, and the ranks the files as they
    load them); a warning line names the newer ones skipped."""
    if config.checkpoint.resume is None:
        return config
    try:
        plan = plan_resume(config, expected_layout(config, stage_ranks), verify=not torchrun)
    except CheckpointError as exc:
        parser.error(" ".join(str(exc).split()))
    if os.environ.get("RANK", "0") == "0":
        for warning in plan.warnings:
            print(f"pipeswap-train: warning: {warning}", file=sys.stderr, flush=True)
    return config.but(resume_from=plan.paths if not torchrun else ())


def _check_schedule(parser: argparse.ArgumentParser, config: TrainConfig) -> tuple[int, ...]:
    """Build the schedule as every rank will, so that its errors show here (refusing one too
    big to build first); each stage's rank."""
    from pipeswap.schedule import ScheduleError, ScheduleSpec, build_schedule

    try:
        parallel = config.parallel
        spec = ScheduleSpec(ScheduleKind(parallel.schedule), ranks=parallel.ranks,
                            microbatches=parallel.microbatches,
                            stages_per_rank=parallel.stages_per_rank,
                            overlap_b_f=parallel.overlap_b_f, dxdw_split=parallel.dxdw_split,
                            batch_p2p=parallel.batch_p2p)
        pairs = spec.ranks * spec.stages_per_rank * spec.microbatches
        if pairs > _MAX_SCHEDULE_PAIRS:
            parser.error(
                f"{spec.ranks} ranks x {spec.stages_per_rank} stage(s) per rank x "
                f"{spec.microbatches} microbatches make a schedule of {pairs} (stage, "
                f"microbatch) pairs; at most {_MAX_SCHEDULE_PAIRS}, as every rank builds and "
                "runs all of it: use fewer --microbatches, --ranks or --stages-per-rank")
        # the generator's own checks, e.g. dualpipev's microbatches
        return build_schedule(spec).stage_ranks
    except ScheduleError as exc:
        parser.error(" ".join(str(exc).split()))


def _check_device(parser: argparse.ArgumentParser, device: str, local_ranks: int) -> None:
    """cpu, or cuda with a GPU for each rank on this machine (NCCL puts no two on one GPU)."""
    if device == "cpu":
        return
    if device != "cuda":
        parser.error(f"--device must be cpu or cuda, got {device!r} (cuda takes no index: "
                     "each rank picks a GPU of its own)")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        parser.error("--device cuda: no CUDA device is available here; use --device cpu")
    if local_ranks > count:
        parser.error(f"--device cuda runs one rank per GPU and this machine has {count}, not "
                     f"{local_ranks}: run at most {count} ranks here, or use --device cpu")


def _check_memory(parser: argparse.ArgumentParser, config: TrainConfig,
                  local_ranks: int) -> None:
    """Refuse a job whose weights and batches alone exceed this machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no such figures here: nothing to compare
        return
    # A lower bound: each rank builds the whole model in float32 (about 12 width^2 weights a
    # block; a replayed rank only its own stages) and one step's batch (int64 inputs and
    # targets; batches are made a step at a time).
    weights = 4 * 12 * config.model.width**2 * config.num_layers
    if config.job.replay_rank is not None:
        weights = weights * config.parallel.stages_per_rank // config.num_stages
    batch = 2 * 8 * config.training.batch_size * config.model.seq_len
    need = local_ranks * (weights + batch)
    if need > total:
        who = ("the replayed rank needs" if config.job.replay_rank is not None
               else f"{local_ranks} ranks need")
        holds = ("its stages' weights" if config.job.replay_rank is not None
                 else "each holds the whole model")
        parser.error(f"{who} at least {need // 2**30:,} GiB, more than this machine's "
                     f"{total / 2**30:.1f} GiB: {holds} and a step's batch; lower --width, "
                     "--layers, --batch-size, --seq-len or --ranks")


def main(argv: list[str] | None = None) -> int:
    config, args = parse_args(argv)
    if launched_by_torchrun():
        return _main_torchrun(config, args)
    parallel, where = config.parallel, f"on {config.training.device}"
    shape = f"{parallel.ranks} ranks x {parallel.stages_per_rank} stage(s)"
    plan = (f"{parallel.microbatches} microbatches, {config.training.steps} steps per mode "
            f"({', '.join(config.swap.modes)})")
    if config.job.replay_rank is not None:
        if config.job.verbose:
            print(f"pipeswap-train: replaying rank {config.job.replay_rank} of "
                  f"{parallel.schedule} on {shape}, {plan} {where}, in this process ...",
                  flush=True)
        _report(config, args, [run_rank(config.job.replay_rank, 1, config)])
        return 0
    if config.job.verbose:
        replicas = (f" x {parallel.dp} replicas{' (FSDP)' if parallel.fsdp else ''}"
                    if parallel.meshed else "")
        print(f"pipeswap-train: {parallel.schedule}, {shape}{replicas}, {plan} {where}; "
              "spawning the ranks ...", flush=True)
    try:
        per_rank = spawn(run_rank, parallel.world, config,
                         backend=backend_for(config.training.device),
                         timeout_s=config.group_timeout_s)
    except RankFailedError as exc:
        return _failed(config, exc)
    except KeyboardInterrupt:
        print("pipeswap-train: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    except SystemExit as exc:  # SIGTERM: spawn stopped every rank first
        print("pipeswap-train: terminated; every rank was stopped", file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else 1
    _report(config, args, per_rank)
    return 0


def _failed(config: TrainConfig, failure: RankFailedError) -> int:
    """Say in one line which rank failed, how and at which step, and where every rank's
    story went; 2 when the cause is the job's input, 1 for a failure of the run."""
    import tempfile

    cause = failure.cause
    descriptor, log = tempfile.mkstemp(prefix="pipeswap-train-", suffix=".log", text=True)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(f"{failure}\n")
    if config.job.log_level == "debug":
        print(failure, file=sys.stderr)
    headline = (cause.headline(config.job.timeout_s) if cause is not None
                else str(failure).splitlines()[0])
    print(f"pipeswap-train: error: {headline}", file=sys.stderr)
    print(f"pipeswap-train: every rank's traceback is in {log}", file=sys.stderr)
    return 2 if cause is not None and cause.user_error else 1


def _main_torchrun(config: TrainConfig, args: argparse.Namespace) -> NoReturn:
    import torch.distributed as dist

    from pipeswap.runtime.distributed.transport import gather_object

    rank, world = init_from_env(backend_for(config.training.device), config.group_timeout_s)
    code = 0
    try:
        gathered = gather_object(run_rank(rank, world, config))
        dist.barrier()  # nobody tears the group down while another rank still uses it
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - one line; torchrun sees the exit code
        failure = describe(exc, traceback.format_exc(), rank, current_step())
        if config.job.log_level == "debug":
            print(failure.story, file=sys.stderr)
        print(f"pipeswap-train: error: {failure.headline(config.job.timeout_s)}",
              file=sys.stderr, flush=True)
        gathered, code = None, 2 if failure.user_error else 1
    if gathered is not None:
        _report(config, args, [_results(entry) for entry in gathered])
    # Leave without the interpreter's teardown, as the spawned ranks do (multiprocessing ends
    # its children with os._exit): after this job under torchrun, torch 2.13 aborted there
    # now and then ("terminate called without an active exception", exit -6) once all work
    # was done and printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _results(entry: object) -> dict[str, ModeResult]:
    assert isinstance(entry, dict)  # each rank sent what run_rank returned
    return entry


def _report(config: TrainConfig, args: argparse.Namespace,
            per_rank: list[dict[str, ModeResult]]) -> None:
    summary = summarize(config, per_rank)
    if args.json:
        print(json.dumps(summary))
    else:
        print()
        print(render(summary))


