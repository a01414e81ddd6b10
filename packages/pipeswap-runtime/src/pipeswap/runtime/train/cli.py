"""The ``pipeswap-train`` command: every check of its options' values (each bad value
refused with one line, and a pointer to --help, before any rank starts), the config they
make, and ``main``, which spawns the ranks or joins torchrun's and prints the report. The
options themselves are :mod:`pipeswap.runtime.train.arguments`'."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import traceback
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import NoReturn

from pipeswap.runtime.errors import CheckpointError
from pipeswap.runtime.distributed.launch import (
    RankFailedError,
    backend_for,
    current_step,
    end_stopped_sibling,
    init_from_env,
    launched_by_torchrun,
    spawn,
)
from pipeswap.runtime.distributed.rank_failure import describe
from pipeswap.runtime.checkpoint.ownership import claimed
from pipeswap.runtime.distributed.collectives import all_gather_ints, gather_object
from pipeswap.runtime.train.arguments import command_line
from pipeswap.runtime.train.config import (
    MODES,
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
    restarted,
)
from pipeswap.runtime.train.summary import render, summarize
from pipeswap.runtime.train.trainer import run_rank
from pipeswap.schedule import V_SHAPED, ScheduleError, ScheduleKind, ScheduleSpec, build_schedule


#: Most ranks one job starts (under torchrun: in all). Each rank is a process with its own
#: torch, some 200 MB before any model, all started at once: a few dozen already crowd a
#: workstation, and a slip such as --ranks 512 would exhaust its memory.
_MAX_RANKS = 64
_MAX_STEPS = 100_000_000  # optimizer steps per mode: years of training at any speed
#: Most (stage, microbatch) pairs in a schedule, ranks x stages per rank x microbatches. Every
#: rank builds and walks the whole schedule, about six steps a pair: at this size that takes
#: seconds and hundreds of MB in each rank, and it is checked before anything is built.
_MAX_SCHEDULE_PAIRS = 100_000
#: Longest --timeout: a rank that waits a day for a peer is hung, not slow.
_MAX_TIMEOUT_S = 86_400.0


def parse_args(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    """The config of ``argv`` (and the parsed arguments, for how to report); a bad value
    exits here with one line, before any rank starts."""
    parser = command_line()
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




def _check_llama_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--kv-heads and --ffn: llama's, at least 1, the key/value heads dividing the heads."""
    for option, value in (("--kv-heads", args.kv_heads), ("--ffn", args.ffn)):
        if value is None:
            continue
        if args.model != "llama":
            parser.error(f"{option} shapes the llama model: add --model llama, or drop it")
        if value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    if args.kv_heads is not None and args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}: each "
                     "key/value head serves a whole group of query heads")


def _config(args: argparse.Namespace, ranks: int, modes: tuple[Mode, ...], v_shaped: bool
            ) -> TrainConfig:
    """The job's config of the parsed arguments (their values checked apart)."""
    defaults = TrainConfig()
    return TrainConfig(
        model=ModelConfig(family=args.model, tie_embeddings=args.tie_embeddings,
                          width=args.width, layers=args.layers, heads=args.heads,
                          kv_heads=args.kv_heads, ffn=args.ffn, seq_len=args.seq_len,
                          dtype=args.dtype),
        parallel=ParallelConfig(schedule=args.schedule, ranks=ranks, dp=args.dp,
                                fsdp=args.fsdp,
                                stages_per_rank=2 if v_shaped else args.stages_per_rank,
                                microbatches=args.microbatches, overlap_b_f=args.overlap_b_f,
                                dxdw_split=args.dxdw_split, batch_p2p=args.batch_p2p),
        swap=SwapConfig(policy=args.policy, granularity=args.swap_granularity,
                        budget=args.budget, modes=modes,
                        host_pool_bytes=args.host_pool_bytes,
                        costs=args.swap_costs or defaults.swap.costs,
                        recompute=args.recompute or defaults.swap.recompute),
        training=TrainingConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                seed=args.seed, device=args.device),
        checkpoint=CheckpointConfig(save_dir=args.checkpoint_dir, every=args.checkpoint_every,
                                    asynchronous=args.checkpoint_async,
                                    resume=args.resume,
                                    resume_anyway=args.resume_anyway),
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


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace, ranks: int,
                   world: int, torchrun: bool) -> None:
    """Each number on its own: within what the model, the corpus and this machine allow."""

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
        ("--steps", args.steps, 1, _MAX_STEPS,
         "more would run for years; a larger number is a typo"),
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
    _check_llama_shape(parser, args)
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
    if checkpoint.asynchronous and checkpoint.save_dir is None:
        parser.error("--checkpoint-async needs --checkpoint-dir (where to save)")
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
    if torchrun and config.checkpoint.save_dir is not None and config.checkpoint.resume is None:
        config = _restarted(config)
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


def _restarted(config: TrainConfig) -> TrainConfig:
    """A job torchrun restarted (``--max-restarts``) goes on from its checkpoints; rank 0
    says how. Where every mode had finished, nothing is left to run: exit 0."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if restart == 0:
        return config
    going_on, line = restarted(config, restart)
    if os.environ.get("RANK", "0") == "0":
        print(f"pipeswap-train: {line}", file=sys.stderr, flush=True)
    if going_on is None:
        raise SystemExit(0)
    return going_on


def _check_schedule(parser: argparse.ArgumentParser, config: TrainConfig) -> tuple[int, ...]:
    """Build the schedule as every rank will, so that its errors show here (refusing one too
    big to build first); each stage's rank."""

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
        with _claim(config):
            per_rank = spawn(run_rank, parallel.world, config,
                             backend=backend_for(config.training.device),
                             timeout_s=config.group_timeout_s)
    except CheckpointError as exc:  # the directory is another run's
        print(f"pipeswap-train: error: {exc}", file=sys.stderr)
        return 2
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


def _claim(config: TrainConfig) -> AbstractContextManager[object]:
    """The checkpoint directory claimed for this run while it trains (nothing to claim
    without one)."""
    save_dir = config.checkpoint.save_dir
    if save_dir is None:
        return nullcontext()
    return claimed(save_dir, f"--checkpoint-dir {save_dir}")


def _failed(config: TrainConfig, failure: RankFailedError) -> int:
    """Say in one line which rank failed, how and at which step, and where every rank's
    story went; 2 when the cause is the job's input, 1 for a failure of the run."""

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


    rank, world = init_from_env(backend_for(config.training.device), config.group_timeout_s)
    code = 0
    with ExitStack() as claim:
        try:
            _claim_on_rank0(config, rank, claim)
            gathered = gather_object(run_rank(rank, world, config))
            dist.barrier()  # nobody tears the group down while another rank still uses it
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - one line; torchrun sees the exit code
            failure = describe(exc, traceback.format_exc(), rank, current_step())
            if config.job.log_level == "debug":
                print(failure.story, file=sys.stderr)
            print(f"pipeswap-train: error: {failure.headline(config.job.timeout_s)}",
                  file=sys.stderr, flush=True)
            end_stopped_sibling(str(exc))
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


def _claim_on_rank0(config: TrainConfig, rank: int, stack: ExitStack) -> None:
    """Under torchrun, rank 0 claims the checkpoint directory for the job (held in
    ``stack``); where it cannot, every rank raises, so none starts training."""
    problem: CheckpointError | None = None
    if rank == 0:
        try:
            stack.enter_context(_claim(config))
        except CheckpointError as exc:
            problem = exc
    if any(all_gather_ints(problem is not None, None)):
        raise problem or CheckpointError(
            f"--checkpoint-dir {config.checkpoint.save_dir} is in use by another run (rank "
            "0 says which)")


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


