"""``pipeswap-train``: train a small GPT across pipeline ranks, with and without swap, and
compare peak activation memory (as the swap manager counts it and as the allocator saw it),
step time and losses.

With ``--dp N --fsdp`` it runs N pipeline replicas on a 2-D device mesh (``pp`` x ``dp``),
each stage sharded with FSDP2 over its data-parallel group, every replica on its own part of
the batch. Run as is, it spawns the ranks itself; under ``torchrun`` it joins the process
group torchrun set up (``torchrun --nproc-per-node 4 -m pipeswap.runtime.train``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from pipeswap.runtime.launch import (
    DEFAULT_TIMEOUT_S,
    RankFailedError,
    backend_for,
    init_from_env,
    launched_by_torchrun,
    spawn,
)
from pipeswap.schedule import ScheduleKind, SwapPolicy
from pipeswap.schedule.build import V_SHAPED

if TYPE_CHECKING:
    from pipeswap.platform import AllocationPeak
    from pipeswap.runtime.replay import Replay

MODES = ("no-swap", "swap")
MODELS = ("gpt", "llama")
DTYPES = ("fp32", "bf16")
LOG_LEVELS = ("debug", "info", "warning", "error")
log = logging.getLogger("pipeswap.runtime.train")  # also when run as __main__


@dataclass(frozen=True)
class TrainConfig:
    """Everything a rank needs to run the job; the same object on every rank."""

    schedule: str = "1f1b"
    model: str = "gpt"  # or llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU
    tie_embeddings: bool = False  # llama: one weight for the embedding and the output
    ranks: int = 4  # pipeline ranks: the world has ranks x dp
    dp: int = 1  # pipeline replicas (data parallel)
    fsdp: bool = False  # shard each stage with FSDP2 over its data-parallel group
    stages_per_rank: int = 1
    microbatches: int = 8
    steps: int = 10
    batch_size: int = 16
    seq_len: int = 64
    width: int = 64
    layers: int | None = None  # default: two blocks per stage
    heads: int = 4  # attention heads (llama: half as many key/value heads)
    lr: float = 3e-3
    seed: int = 0
    device: str = "cpu"
    overlap_b_f: bool = False
    dxdw_split: bool = False
    batch_p2p: bool = False
    policy: str = "peak"  # which chunks swap: see swap_policy()
    swap_granularity: str = "auto"  # the peak policy's: auto, chunk or layer (streaming)
    # per-rank bytes of saved activations the peak policy keeps each rank under, planned on
    # the chunk sizes the run without swap measured (compare mode only)
    budget: int | None = None
    modes: tuple[str, ...] = MODES
    dtype: str = "fp32"  # bf16: forwards under autocast to bfloat16, fp32 master weights
    verbose: bool = True  # log each step's progress (at info level)
    log_level: str = "info"  # of the pipeswap loggers in every rank
    keep_grads: bool = False  # return the first step's gradients (for tests)
    # measure the allocator's peak in the odd steps (1, 3, ...) and time only the even ones,
    # as measuring slows a step (the one step of a one-step run is measured and timed)
    measure_allocator: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    # save each mode's run into checkpoint_dir/<mode> after every checkpoint_every steps and
    # at its end; resume each from resume/<mode> (steps counted from the run's start)
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: str | None = None
    metrics: str | None = None  # a file rank 0 appends one JSON line to per step and mode
    # run this pipeline rank alone, in this process: receives made here, sends dropped
    replay_rank: int | None = None

    @property
    def num_stages(self) -> int:
        return self.ranks * self.stages_per_rank

    @property
    def world(self) -> int:
        return self.ranks * self.dp

    @property
    def meshed(self) -> bool:
        """Whether the run lays its ranks out on a 2-D (pp, dp) device mesh."""
        return self.dp > 1 or self.fsdp

    @property
    def num_layers(self) -> int:
        return self.layers if self.layers is not None else 2 * self.num_stages


@dataclass
class ModeResult:
    """One rank's figures for one mode."""

    first_step: int = 1  # the number of the first step this run took (later when resumed)
    losses: list[list[float]] = field(default_factory=list)  # per step, per microbatch
    step_seconds: list[float] = field(default_factory=list)  # of the steps timed
    peak_activation_bytes: int = 0
    peak_memory_bytes: int = 0  # activations and gathered FSDP parameters, counted
    peak_allocated_bytes: int | None = None  # the most of the measured steps
    # what building this rank's stages left allocated (the allocator's word): their
    # parameters, sharded with FSDP; None where not measured
    parameter_bytes: int | None = None
    bytes_offloaded: int = 0
    swapped_chunks: int = 0
    streamed_chunks: int = 0  # of the swapped ones, those streamed layer by layer
    groups_alive_after_step: list[int] = field(default_factory=list)
    host_bytes_in_use_after_step: list[int] = field(default_factory=list)
    grads: dict[str, Any] | None = None  # name -> tensor, first step (keep_grads)
    chunk_bytes: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    chunk_bytes_after_input: dict[tuple[int, int], int] = field(default_factory=dict)
    # per streamed chunk, per layer: (held, movable) when the layer closed, and held after I
    layer_bytes: dict[tuple[int, int], tuple[tuple[int, int], ...]] = field(default_factory=dict)
    layer_bytes_after_input: dict[tuple[int, int], tuple[int, ...]] = field(
        default_factory=dict)
    gathered_bytes: dict[int, int] = field(default_factory=dict)  # per sharded stage
    # per step: seconds, the step's peaks (allocator's where measured) and bytes offloaded
    per_step: list[dict[str, Any]] = field(default_factory=list)


def run_rank(rank: int, world_size: int, config: TrainConfig) -> dict[str, ModeResult]:
    """Train ``config.steps`` steps in each mode on this rank; this rank's figures."""
    import torch

    from pipeswap.platform import get_platform
    from pipeswap.runtime.data import Corpus, batches
    from pipeswap.runtime.executor import PipelineExecutor
    from pipeswap.runtime.model import lm_loss
    from pipeswap.runtime.checkpoint import load_checkpoint, save_checkpoint
    from pipeswap.runtime.tied import TiedGradients
    from pipeswap.schedule import ScheduleSpec, build_schedule

    replaying = config.replay_rank is not None
    if replaying:
        if rank != config.replay_rank or config.meshed:
            raise ValueError(f"a replay of rank {config.replay_rank} runs as that rank alone, "
                             "without data parallel")
    elif world_size != config.world:
        raise ValueError(f"config needs {config.world} ranks ({config.ranks} pipeline ranks x "
                         f"{config.dp} replicas) but {world_size} were started")
    else:
        torch.set_num_threads(1)  # several ranks share the cores
    _setup_logging(rank, config.log_level)
    # torchrun and spawn both set LOCAL_RANK; a replay takes the first device
    local_rank = 0 if replaying else int(os.environ.get("LOCAL_RANK", rank))
    platform = get_platform(config.device if config.device == "cpu"
                            else f"{config.device}:{local_rank % max(1, _device_count(config))}")
    mesh = None
    if config.meshed:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(platform.device.type, (config.ranks, config.dp),
                                mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = divmod(rank, config.dp)  # the mesh's layout: pp outer, dp inner
    corpus = Corpus.bundled()
    ids = corpus.encode()
    rows = slice(dp_rank * config.batch_size // config.dp,
                 (dp_rank + 1) * config.batch_size // config.dp)  # this replica's part
    data = [(x[rows].to(platform.device), y[rows].to(platform.device)) for x, y in
            batches(ids, config.batch_size, config.seq_len, config.steps, config.seed)]
    spec = ScheduleSpec(ScheduleKind(config.schedule), ranks=config.ranks,
                        microbatches=config.microbatches, stages_per_rank=config.stages_per_rank,
                        overlap_b_f=config.overlap_b_f, dxdw_split=config.dxdw_split,
                        batch_p2p=config.batch_p2p, fsdp=config.fsdp)
    placement = build_schedule(spec).stage_ranks  # loop, or V for zbv and dualpipev
    if config.metrics is not None and (rank == 0 or replaying) and config.resume is None:
        open(config.metrics, "w", encoding="utf-8").close()  # filled step by step below
    replay = None
    if replaying:
        replay = replay_of(config, len(corpus.vocab), placement, data[0][0], platform.device)
    results: dict[str, ModeResult] = {}
    for mode in config.modes:
        measuring: AbstractContextManager[AllocationPeak | None] = (
            platform.measure_allocations() if config.measure_allocator else nullcontext())
        with measuring as built:
            stages = (replay_stages(config, len(corpus.vocab), placement, platform.device)
                      if replaying else build_stages(config, len(corpus.vocab), placement,
                                                     pp_rank, mesh, platform.device))
        # one entry per parameter, also where two stages of this rank share one
        params = list({id(p): p for stage in stages for p in stage.module.parameters()}.values())
        optimizer = torch.optim.AdamW(params, lr=config.lr)
        # a replay drops the sum of a tied embedding's gradients, as it drops sends
        tied = None if replaying else TiedGradients(
            stages, placement, tied_parameters(config, len(corpus.vocab)),
            None if mesh is None else mesh.get_group("pp"))
        done = 0  # steps taken before this run: a resumed one goes on after them
        if config.resume is not None:
            done = load_checkpoint(os.path.join(config.resume, mode), stages=stages,
                                   optimizer=optimizer).data_position
        # Both modes account every chunk's saved activations, to compare their peaks.
        policy = swap_policy(config.policy, stage_layer_counts(config, len(corpus.vocab)),
                             config.swap_granularity)
        if mode == "swap" and config.budget is not None:
            policy = _budget_policy(config, results["no-swap"].chunk_bytes,
                                    stage_layer_counts(config, len(corpus.vocab)))
        executor = PipelineExecutor(
            stages, spec, config.microbatches, lm_loss, swap=mode == "swap", platform=platform,
            swap_policy=policy, account_activations=True, mesh=mesh,
            autocast_dtype=torch.bfloat16 if config.dtype == "bf16" else None, replay=replay)
        result = results[mode] = ModeResult(
            first_step=done + 1, swapped_chunks=len(executor.swapped),
            streamed_chunks=len(executor.streamed),
            parameter_bytes=None if built is None else built.held_bytes,
            gathered_bytes=executor.gathered_bytes)
        for number, (inputs, targets) in enumerate(data[done:], done + 1):
            measured = config.measure_allocator and number % 2 == 1
            executor.measure_allocator = measured
            optimizer.zero_grad(set_to_none=True)
            report = executor.step(inputs, targets)
            if tied is not None:
                tied.sum_gradients()
            if config.keep_grads and number == 1:
                result.grads = {f"{stage.stage_index}.{name}": _local(p.grad).detach().clone()
                                for stage in stages
                                for name, p in stage.module.named_parameters()
                                if p.grad is not None}
            optimizer.step()
            every = config.checkpoint_every
            if config.checkpoint_dir is not None and (
                    number == config.steps or (every is not None and number % every == 0)):
                save_checkpoint(os.path.join(config.checkpoint_dir, mode), step=number,
                                stages=stages, optimizer=optimizer, data_position=number)
            stats = executor.manager.stats()
            result.losses.append(list(report.losses))
            result.chunk_bytes = {key: (b.held, b.movable)
                                  for key, b in report.chunk_bytes.items()}
            result.chunk_bytes_after_input = dict(report.chunk_bytes_after_input)
            result.layer_bytes = {key: tuple((b.held, b.movable) for b in layers)
                                  for key, layers in report.layer_bytes.items()}
            result.layer_bytes_after_input = dict(report.layer_bytes_after_input)
            if not measured or config.steps == 1:
                result.step_seconds.append(report.seconds)
            assert report.peak_activation_bytes is not None  # accounted above
            assert report.peak_memory_bytes is not None
            result.peak_activation_bytes = max(result.peak_activation_bytes,
                                               report.peak_activation_bytes)
            result.peak_memory_bytes = max(result.peak_memory_bytes, report.peak_memory_bytes)
            if report.peak_allocated_bytes is not None:
                result.peak_allocated_bytes = max(result.peak_allocated_bytes or 0,
                                                  report.peak_allocated_bytes)
            result.bytes_offloaded += report.bytes_offloaded
            result.per_step.append({
                "seconds": report.seconds,
                "allocator_measured": measured,
                "peak_activation_bytes": report.peak_activation_bytes,
                "peak_memory_bytes": report.peak_memory_bytes,
                "peak_allocated_bytes": report.peak_allocated_bytes,
                "bytes_offloaded": report.bytes_offloaded})
            if config.metrics is not None:
                _write_metrics(config, mode, number,
                               {**result.per_step[-1], "losses": list(report.losses)}, rank)
            result.groups_alive_after_step.append(executor.manager.active_group_count())
            result.host_bytes_in_use_after_step.append(stats.host_bytes_in_use)
            if config.verbose and replaying:
                log.info("[%7s] step %d/%d  %.2f s  peak activations %s%s", mode, number,
                         config.steps, report.seconds, _mib(report.peak_activation_bytes),
                         "" if report.peak_allocated_bytes is None else
                         f", allocated {_mib(report.peak_allocated_bytes)}")
            elif config.verbose and report.losses:
                loss = sum(report.losses) / len(report.losses)
                tokens = config.batch_size // config.dp * config.seq_len
                replica = f" replica {dp_rank}" if config.dp > 1 else ""
                log.info("[%7s%s] step %d/%d  loss %.4f  %.2f s  %s tokens/s%s", mode, replica,
                         number, config.steps, loss, report.seconds,
                         f"{tokens / report.seconds:,.0f}",
                         "  (allocator measured)" if measured else "")
    return results


def build_stages(config: TrainConfig, vocab: int, placement: tuple[int, ...], pp_rank: int,
                 mesh: Any, device: Any) -> list[Any]:
    """This rank's pipeline stages of a freshly built ``config.model`` (the others are freed
    on return), each sharded with FSDP2 over the mesh's data-parallel dimension with --fsdp:
    every transformer block apart, the embedding and head with the stage's root."""
    from pipeswap.runtime.fsdp import shard_stage
    from pipeswap.runtime.stage import PipelineStage

    modules = build_stage_modules(config, vocab, device)
    group = None if mesh is None else mesh.get_group("pp")
    stages = []
    for index, module in enumerate(modules):
        if placement[index] != pp_rank:
            continue
        if config.fsdp:
            shard_stage(module, mesh["dp"], _blocks(module))
        stages.append(PipelineStage(module, index, config.num_stages, group))
    return stages


def replay_of(config: TrainConfig, vocab: int, placement: tuple[int, ...], inputs: Any,
              device: Any) -> Replay:
    """What the executor needs to replay ``config.replay_rank``: every stage's layer count and
    what crosses into its stages from other ranks, found by dry runs of the stages before
    them on one microbatch of ``inputs``, each stage built on ``device`` alone and dropped
    after."""
    import torch

    from pipeswap.runtime.microbatch import split_tree
    from pipeswap.runtime.replay import Replay, input_boundaries, materialize
    from pipeswap.runtime.stage import PipelineStage

    assert config.replay_rank is not None
    with torch.device("meta"):
        pending = dict(enumerate(build_stage_modules(config, vocab)))

    def build(index: int) -> PipelineStage:
        return PipelineStage(materialize(pending.pop(index), device), index, config.num_stages)

    def autocast() -> AbstractContextManager[object]:
        if config.dtype != "bf16":
            return nullcontext()
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)

    example = split_tree(inputs, config.microbatches, "inputs")[0]
    boundaries = input_boundaries(placement, config.replay_rank, example, build,
                                  torch.device(device), autocast)
    return Replay(config.replay_rank, config.ranks, stage_layer_counts(config, vocab),
                  boundaries, seed=config.seed)


def replay_stages(config: TrainConfig, vocab: int, placement: tuple[int, ...],
                  device: Any) -> list[Any]:
    """The replayed rank's stages alone, built on the meta device and given memory on
    ``device`` (fresh weights, the same for one seed: a replay measures memory and time, not
    a run's losses)."""
    import torch

    from pipeswap.runtime.replay import materialize
    from pipeswap.runtime.stage import PipelineStage

    with torch.device("meta"):
        mine = {index: module for index, module in enumerate(build_stage_modules(config, vocab))
                if placement[index] == config.replay_rank}
    where = torch.device(device)
    with torch.random.fork_rng(devices=[] if where.type == "cpu" else [where.index or 0],
                               device_type="cuda" if where.type == "cpu" else where.type):
        torch.default_generator.manual_seed(config.seed)
        if where.type != "cpu":
            torch.get_device_module(where.type).manual_seed(config.seed)  # its current device
        # together, so that a weight two of them share (a tied embedding) stays one
        materialize(torch.nn.ModuleList(mine.values()), device)
    return [PipelineStage(module, index, config.num_stages) for index, module in mine.items()]


def build_stage_modules(config: TrainConfig, vocab: int, device: Any = None) -> list[Any]:
    """Every stage's module of a freshly built ``config.model``, on ``device``."""
    import torch

    if config.model == "llama":
        from pipeswap.runtime.llama import build_llama, split_layers

        llama = build_llama(_llama_config(config, vocab), config.seed)
        return list(split_layers(llama.to(device), config.num_stages))
    from pipeswap.runtime.model import GPTConfig, build_gpt, split_stages

    gpt = GPTConfig(vocab=vocab, seq_len=config.seq_len, width=config.width,
                    heads=config.heads, layers=config.num_layers)
    model: torch.nn.Sequential = build_gpt(gpt, config.seed).to(device)
    return list(split_stages(model, config.num_stages))


def _llama_config(config: TrainConfig, vocab: int) -> Any:
    from pipeswap.runtime.llama import LlamaConfig

    return LlamaConfig(vocab=vocab, seq_len=config.seq_len, dim=config.width,
                       layers=config.num_layers, heads=config.heads,
                       kv_heads=config.heads // 2 if config.heads % 2 == 0 else config.heads,
                       tie_embeddings=config.tie_embeddings)


def tied_parameters(config: TrainConfig, vocab: int) -> list[Any]:
    """The parameters the whole model's stages share (a tied embedding), found on a copy
    built on the meta device (no memory)."""
    import torch

    from pipeswap.runtime.llama import build_llama, split_layers, tied_parameter_names

    if not config.tie_embeddings:
        return []
    with torch.device("meta"):
        model = build_llama(_llama_config(config, vocab), config.seed)
    return tied_parameter_names(split_layers(model, config.num_stages))


def _blocks(stage: Any) -> list[Any]:
    """A stage's transformer blocks, or the GPT's sublayers (each gets FSDP's all-gathers of its
    own)."""
    from pipeswap.runtime.llama import Block as LlamaBlock
    from pipeswap.runtime.model import SUBLAYERS

    return [m for m in stage.modules() if isinstance(m, (*SUBLAYERS, LlamaBlock))]


def _setup_logging(rank: int, level: str) -> None:
    """The job's ranks log through ``logging``: the ``pipeswap`` loggers to standard output,
    each line prefixed with the rank that wrote it (a user's own configuration of the
    ``pipeswap`` logger, made before, is kept)."""
    root = logging.getLogger("pipeswap")
    root.setLevel(level.upper())
    if not root.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
        root.addHandler(handler)
        root.propagate = False


def _local(tensor: Any) -> Any:
    """A gradient as this rank holds it (its shard, under FSDP)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _device_count(config: TrainConfig) -> int:
    import torch

    return torch.accelerator.device_count() if config.device != "cpu" else 1


# -- the summary ---------------------------------------------------------------------------


def summarize(config: TrainConfig, per_rank: list[dict[str, ModeResult]]) -> dict[str, Any]:
    """The JSON object of ``--json``: per-rank memory and time, and whether losses matched."""
    def mode(rank: int, name: str) -> ModeResult | None:
        return per_rank[rank].get(name)

    ranks = []
    for index in range(len(per_rank)):
        swap, plain = mode(index, "swap"), mode(index, "no-swap")
        either = swap or plain
        rank = index if config.replay_rank is None else config.replay_rank
        pp_rank, dp_rank = divmod(rank, config.dp)
        ranks.append({
            "rank": rank,
            "pp_rank": pp_rank,
            "dp_rank": dp_rank,
            "peak_activation_bytes_swap": swap.peak_activation_bytes if swap else None,
            "peak_activation_bytes_no_swap": plain.peak_activation_bytes if plain else None,
            "peak_memory_bytes_swap": swap.peak_memory_bytes if swap else None,
            "peak_memory_bytes_no_swap": plain.peak_memory_bytes if plain else None,
            "peak_allocated_bytes_swap": swap.peak_allocated_bytes if swap else None,
            "peak_allocated_bytes_no_swap": plain.peak_allocated_bytes if plain else None,
            "parameter_bytes": either.parameter_bytes if either else None,
            "swapped_chunks": either.swapped_chunks if either else 0,
            "streamed_chunks": swap.streamed_chunks if swap else 0,
            "bytes_offloaded": swap.bytes_offloaded if swap else 0,
            "step_time_s_swap": statistics.median(swap.step_seconds) if swap else None,
            "step_time_s_no_swap": statistics.median(plain.step_seconds) if plain else None,
        })
    # per step run, every replica's microbatch losses (replicas split the batch evenly)
    losses = {name: [[loss for result in per_rank if name in result
                      for loss in result[name].losses[step]]
                     for step in range(_steps_run(per_rank, name))]
              for name in config.modes}
    both = all(name in losses for name in MODES)
    diff = None
    if both:
        pairs = [(a, b) for sa, sb in zip(losses["swap"], losses["no-swap"])
                 for a, b in zip(sa, sb)]
        # None where no rank computed a loss: a replay of a rank without the last stage
        diff = max((abs(a - b) for a, b in pairs), default=None)
    times = {name: statistics.median(t for r in ranks if (t := r[f"step_time_s_{key}"]))
             for name, key in (("swap", "swap"), ("no-swap", "no_swap")) if name in losses}
    return {
        "first_step": min((r[m].first_step for r in per_rank for m in r), default=1),
        "schedule": config.schedule,
        "ranks": config.ranks,
        "dp": config.dp,
        "fsdp": config.fsdp,
        "stages_per_rank": config.stages_per_rank,
        "microbatches": config.microbatches,
        "steps": config.steps,
        "per_rank": ranks,
        "losses": {name: [sum(s) / len(s) for s in steps if s] for name, steps in losses.items()},
        "max_abs_loss_diff": diff,
        "losses_match": None if diff is None else diff == 0.0,
        # the rank replayed alone (its losses are of inputs made up for it), or null
        "replay_rank": config.replay_rank,
        "step_time_ratio": times["swap"] / times["no-swap"] if both else None,
    }


def _steps_run(per_rank: list[dict[str, ModeResult]], mode: str) -> int:
    return max((len(result[mode].losses) for result in per_rank if mode in result), default=0)


def _write_metrics(config: TrainConfig, mode: str, step: int, mine: dict[str, Any],
                   rank: int) -> None:
    """After each step, on every rank: rank 0 gathers the ranks' figures and appends the
    step's line to ``config.metrics``: the step's loss (the mean microbatch loss over every
    replica), tokens per second (the whole batch over the slowest rank's step) and each
    rank's peaks and bytes offloaded. A replayed rank writes its own (loss null unless it
    runs the last stage)."""
    from pipeswap.runtime.comm import gather_object

    everyone = [mine] if config.replay_rank is not None else gather_object(mine)
    if everyone is None:
        return
    figures: list[dict[str, Any]] = everyone  # type: ignore[assignment]
    losses = [loss for entry in figures for loss in entry["losses"]]
    first = 0 if config.replay_rank is None else rank
    record = {
        "step": step,
        "mode": mode,
        "loss": sum(losses) / len(losses) if losses else None,
        "tokens_per_s": config.batch_size * config.seq_len / max(e["seconds"] for e in figures),
        # a step that measured the allocator ran slower (torch's profiler on CPU)
        "allocator_measured": figures[0]["allocator_measured"],
        "per_rank": [{"rank": rank, **{k: v for k, v in entry.items()
                                       if k not in ("seconds", "losses", "allocator_measured")}}
                     for rank, entry in enumerate(figures, first)],
    }
    with open(str(config.metrics), "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f} MiB"


def _saving(plain: int | None, swap: int | None) -> str:
    return f"{1 - swap / plain:.0%}" if plain and swap is not None else "-"


def render(summary: dict[str, Any]) -> str:
    """The table: per rank, the peaks without and with swap, then the verdict on losses."""
    fsdp = summary["fsdp"]
    # column groups: a title over its column names (first the rank's own)
    groups: list[tuple[str, tuple[str, ...]]] = [
        ("", ("rank", "swapped (streamed)")),
        ("peak activations (counted)", ("no swap", "with swap", "saving"))]
    if fsdp:
        groups.append(("+ gathered parameters (counted)", ("no swap", "with swap", "saving")))
    groups += [("peak allocated (allocator)", ("no swap", "with swap", "saving")),
               ("step time", ("no swap", "with swap")),
               ("", ("parameters",))]
    rows = [tuple(name for _, names in groups for name in names)]
    for entry in summary["per_rank"]:
        def pair(key: str) -> tuple[int | None, int | None]:
            return entry[f"{key}_no_swap"], entry[f"{key}_swap"]

        rank = str(entry["rank"])
        if summary["dp"] > 1:
            rank += f" (pp {entry['pp_rank']}, dp {entry['dp_rank']})"
        row = [rank, f"{entry['swapped_chunks']} ({entry['streamed_chunks']})"]
        for key in ("peak_activation_bytes", *(("peak_memory_bytes",) if fsdp else ()),
                    "peak_allocated_bytes"):
            plain, swap = pair(key)
            row += [_mib(plain), _mib(swap), _saving(plain, swap)]
        row += ["-" if t is None else f"{t:.2f} s" for t in pair("step_time_s")]
        row.append(_mib(entry["parameter_bytes"]))
        rows.append(tuple(row))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    titles, first = [], 0
    for title, names in groups:  # each title centred over its columns, widened to fit it
        span = len(names)
        room = sum(widths[first:first + span]) + 2 * (span - 1)
        widths[first + span - 1] += max(0, len(title) - room)
        titles.append(title.center(max(room, len(title))))
        first += span
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(0, "  ".join(titles).rstrip())
    lines.insert(2, "  ".join("-" * w for w in widths))
    if summary["replay_rank"] is not None:
        lines.append(f"\nrank {summary['replay_rank']} of {summary['ranks']} replayed alone: "
                     "what it receives made here, what it sends dropped, so its step time "
                     "leaves out every wait for a peer"
                     + ("; losses are of those made-up inputs"
                        if summary["losses_match"] is not None else ""))
    if summary["losses_match"] is not None:
        verdict = ("bit-identical" if summary["losses_match"]
                   else f"DIFFER (max |diff| {summary['max_abs_loss_diff']:.3g})")
        lines.append(f"\nlosses with and without swap: {verdict}; step time with swap: "
                     f"{summary['step_time_ratio']:.2f}x")
    return "\n".join(lines)


# -- the command line ----------------------------------------------------------------------

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


def parse_args(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(
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
    kinds = [k.value for k in ScheduleKind]
    parser.add_argument("--schedule", choices=kinds, default=defaults.schedule,
                        help=f"pipeline schedule (default {defaults.schedule})")
    parser.add_argument("--model", choices=MODELS, default=defaults.model,
                        help="gpt (LayerNorm, learned positions, GELU MLP) or llama (RMSNorm, "
                             "rotary embeddings, grouped-query attention through "
                             "scaled_dot_product_attention, SwiGLU); default "
                             f"{defaults.model}")
    parser.add_argument("--tie-embeddings", action="store_true",
                        help="llama: one weight for the input embedding and the output layer "
                             "(on the first and the last stage; their ranks sum its gradient)")
    parser.add_argument("--ranks", "-P", type=int, default=defaults.ranks,
                        help=f"pipeline ranks (default {defaults.ranks}; under torchrun, its "
                        "world size / --dp); the job spawns ranks x dp processes")
    parser.add_argument("--dp", type=int, default=defaults.dp, metavar="N",
                        help="pipeline replicas, each on its own part of the batch, laid out "
                             "on a 2-D (pp, dp) device mesh; needs --fsdp (default 1)")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard each stage's parameters with FSDP2 over its data-parallel "
                             "group; the schedule's UNSHARD, RESHARD and REDUCE_GRAD steps "
                             "gather, free and reduce them")
    parser.add_argument("--stages-per-rank", "-V", type=int, default=defaults.stages_per_rank,
                        help="stages per rank (interleaved-1f1b, looped-bfs, interleaved-zb; "
                             "zbv and dualpipev always run two)")
    parser.add_argument("--microbatches", "-M", type=int, default=defaults.microbatches,
                        help=f"microbatches per step (default {defaults.microbatches})")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help=f"optimizer steps per mode (default {defaults.steps})")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help=f"sequences per step in all (split evenly over the --dp "
                        f"replicas), a multiple of --microbatches x --dp (default "
                        f"{defaults.batch_size})")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=defaults.width, help="model width")
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer blocks (default: two per stage)")
    parser.add_argument("--heads", type=int, default=defaults.heads,
                        help=f"attention heads, dividing --width (default {defaults.heads}; "
                             "llama: half as many key/value heads, or as many for an odd "
                             "count)")
    parser.add_argument("--lr", type=float, default=defaults.lr,
                        help=f"AdamW learning rate (default {defaults.lr:g})")
    parser.add_argument("--device", default=defaults.device,
                        help="cpu (gloo) or cuda (NCCL, one GPU per local rank); default cpu")
    parser.add_argument("--overlap-b-f", action="store_true",
                        help="interleaved-1f1b: overlap each backward with a forward")
    parser.add_argument("--dxdw-split", action="store_true",
                        help="with --overlap-b-f: split backwards into input and weight parts")
    parser.add_argument("--batch-p2p", action="store_true",
                        help="batch neighbouring sends and receives into one call")
    parser.add_argument("--policy", choices=sorted(POLICIES), default=defaults.policy,
                        help="which chunks to swap (default peak): peak, only those that "
                             "lower the rank's peak with copies hidden on a uniform cost "
                             "model; gap, MindSpore hyper-parallel's rule; cost, every chunk "
                             "whose copies hide (see pipeswap-schedule simulate --help)")
    parser.add_argument("--swap-granularity", choices=GRANULARITY_CHOICES,
                        default=defaults.swap_granularity,
                        help="with the peak policy: swap chunks whole (chunk), stream them "
                             "layer by layer (layer: each layer leaves the device as the "
                             "forward moves past it and comes back one layer ahead of the "
                             "backward), or pick per chunk what lowers the peak more (auto, "
                             "the default)")
    parser.add_argument("--budget", type=_budget_bytes, metavar="BYTES",
                        help="with the peak policy: keep each rank's saved activations under "
                             "BYTES (e.g. 3MiB), exposing copies where needed, planned on the "
                             "chunk sizes the run without swap measures (so not with "
                             "--swap-only or --no-swap)")
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
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype,
                        help="fp32, or bf16: every forward under autocast to bfloat16, "
                             "parameters, gradients and optimizer state in float32 (default "
                             f"{defaults.dtype})")
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
                        help="go on from the newest checkpoint in DIR/<mode>; --steps counts "
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
    parser.add_argument("--seed", type=int, default=defaults.seed, help="weights and data seed")
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s,
                        help="seconds a rank waits for a peer before failing (default "
                        f"{defaults.timeout_s:.0f})")
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
    config = TrainConfig(
        schedule=args.schedule, model=args.model, tie_embeddings=args.tie_embeddings,
        ranks=ranks, dp=args.dp, fsdp=args.fsdp,
        stages_per_rank=2 if v_shaped else args.stages_per_rank,
        microbatches=args.microbatches, steps=args.steps, batch_size=args.batch_size,
        seq_len=args.seq_len, width=args.width, layers=args.layers, lr=args.lr, seed=args.seed,
        device=args.device, overlap_b_f=args.overlap_b_f, dxdw_split=args.dxdw_split,
        batch_p2p=args.batch_p2p, policy=args.policy, budget=args.budget, modes=modes,
        swap_granularity=args.swap_granularity,
        dtype=args.dtype, verbose=not args.json,
        log_level=args.log_level or ("warning" if args.json else "info"),
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        resume=args.resume, metrics=args.metrics, timeout_s=args.timeout, heads=args.heads,
        replay_rank=args.replay_rank)
    _check_checkpoints(parser, config)
    _check_replay(parser, config, torchrun)
    if args.swap_granularity != "auto" and args.policy != "peak":
        parser.error(f"--swap-granularity applies to the peak policy, not --policy "
                     f"{args.policy} (which swaps whole chunks)")
    if args.budget is not None and args.policy != "peak":
        parser.error(f"--budget applies to the peak policy, not --policy {args.policy}")
    if args.tie_embeddings and args.model != "llama":
        parser.error("--tie-embeddings applies to --model llama")
    if args.budget is not None and modes != MODES:
        parser.error("--budget plans on the chunk sizes the run without swap measures: drop "
                     "--swap-only / --no-swap")
    _check_schedule(parser, config)
    parts = args.microbatches * args.dp
    if args.batch_size % parts:
        replicas = f" in each of {args.dp} replicas" if args.dp > 1 else ""
        parser.error(f"--batch-size {args.batch_size} does not split into "
                     f"{args.microbatches} microbatches{replicas}: use a multiple of {parts}")
    if config.num_layers < config.num_stages:
        parser.error(f"--layers {config.num_layers} cannot fill {config.num_stages} stages: "
                     f"use at least {config.num_stages}, one block per stage")
    if config.replay_rank is not None:
        local_ranks = 1
    _check_device(parser, config.device, local_ranks)
    _check_memory(parser, config, local_ranks)
    return config, args


def _check_replay(parser: argparse.ArgumentParser, config: TrainConfig, torchrun: bool
                  ) -> None:
    """--replay-rank runs one rank of one pipeline, by itself."""
    rank = config.replay_rank
    if rank is None:
        return
    if not 0 <= rank < config.ranks:
        parser.error(f"--replay-rank {rank}: the pipeline has ranks 0 to {config.ranks - 1}")
    if torchrun:
        parser.error("--replay-rank runs one rank in this process: start it with "
                     "pipeswap-train (or python -m pipeswap.runtime.train), not torchrun")
    if config.meshed:
        parser.error("--replay-rank replays one rank of one pipeline: drop --dp and --fsdp "
                     "(FSDP's collectives need the other ranks)")
    if config.budget is not None:
        parser.error("--budget plans on every rank's measured chunk sizes, which a replay "
                     "of one rank does not have: give --replay-rank without --budget")
    if config.checkpoint_dir is not None or config.resume is not None:
        parser.error("--replay-rank trains fresh weights of one rank for a few steps to "
                     "measure it: no --checkpoint-dir or --resume")


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace, ranks: int,
                   world: int, torchrun: bool) -> None:
    """Each number on its own: within what the model, the corpus and this machine allow."""
    import math

    from pipeswap.runtime.data import Corpus

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


POLICIES = {"peak", "gap", "cost"}
GRANULARITY_CHOICES = ("auto", "chunk", "layer")


def _budget_bytes(text: str) -> int:
    from pipeswap.schedule.simulate_cli import BYTES

    return int(BYTES(text))


def swap_policy(name: str, layer_counts: Mapping[int, int] | None = None,
                granularity: str = "auto") -> SwapPolicy | None:
    """The swap policy of ``--policy``. The runtime knows no chunk's bytes before it runs,
    so the cost model is uniform: layers alike, a backward twice a forward. The peak policy
    needs each stage's layer count (``layer_counts``; None leaves the executor's default,
    which asks the stages)."""
    from pipeswap.runtime.executor import default_swap_policy
    from pipeswap.schedule import MinGapPolicy
    from pipeswap.schedule.costs import CostModel
    from pipeswap.schedule.policies import CostModelPolicy

    if name == "gap":
        return MinGapPolicy()
    if name == "cost":
        return CostModelPolicy(CostModel())
    return None if layer_counts is None else default_swap_policy(layer_counts, granularity)


def stage_layer_counts(config: TrainConfig, vocab: int) -> dict[int, int]:
    """Each stage's layer count as the stages built for ``config`` have them (see
    :attr:`PipelineStage.layers`), without building them."""
    import torch

    from pipeswap.swap.layers import find_layers

    with torch.device("meta"):
        stages = build_stage_modules(config, vocab)
    return {index: len(find_layers(module)) for index, module in enumerate(stages)}


def _budget_policy(config: TrainConfig, mine: dict[tuple[int, int], tuple[int, int]],
                   layer_counts: Mapping[int, int]) -> SwapPolicy:
    """The peak policy under ``config.budget``, on the chunk sizes every rank measured
    without swap (shared by an all-reduce, so that every rank builds the same schedule)."""
    import torch
    import torch.distributed as dist

    from pipeswap.runtime.executor import uniform_layers
    from pipeswap.schedule.costs import ChunkBytes, CostModel
    from pipeswap.schedule.policies import PeakPolicy

    assert config.budget is not None
    sizes = torch.full((config.num_stages, config.microbatches, 2), -1, dtype=torch.int64)
    for (stage, micro), (held, movable) in mine.items():
        sizes[stage, micro] = torch.tensor([held, movable])
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)  # each chunk is measured on one rank
    chunks = {(stage, micro): ChunkBytes(int(held), pinned=int(held - movable))
              for stage in range(config.num_stages) for micro in range(config.microbatches)
              for held, movable in [sizes[stage, micro].tolist()] if held >= 0}
    return PeakPolicy(CostModel(chunks=chunks, stages=uniform_layers(layer_counts)),
                      config.budget, granularity=config.swap_granularity)


def _check_checkpoints(parser: argparse.ArgumentParser, config: TrainConfig) -> None:
    """Checkpoint options that fit together, and a checkpoint to resume each mode from that
    leaves steps to run."""
    from pipeswap.runtime.checkpoint import saved_step

    if config.checkpoint_every is not None:
        if config.checkpoint_dir is None:
            parser.error("--checkpoint-every needs --checkpoint-dir (where to save)")
        if config.checkpoint_every < 1:
            parser.error(f"--checkpoint-every must be at least 1, got {config.checkpoint_every}")
    if config.resume is None:
        return
    for mode in config.modes:
        where = os.path.join(config.resume, mode)
        step = saved_step(where)
        if step is None:
            parser.error(f"--resume {config.resume}: no checkpoint of the {mode} run in {where}; "
                         "resume from a directory that --checkpoint-dir filled, with the same "
                         "choice of --no-swap / --swap-only")
        if step >= config.steps:
            parser.error(f"--resume {config.resume}: the {mode} run's checkpoint is of step "
                         f"{step}, and --steps {config.steps} counts from the run's start: "
                         f"give more than {step} steps")


def _check_schedule(parser: argparse.ArgumentParser, config: TrainConfig) -> None:
    """Build the schedule as every rank will, so that its errors show here; refuse one too big
    to build first."""
    from pipeswap.schedule import ScheduleError, ScheduleSpec, build_schedule

    try:
        spec = ScheduleSpec(ScheduleKind(config.schedule), ranks=config.ranks,
                            microbatches=config.microbatches,
                            stages_per_rank=config.stages_per_rank,
                            overlap_b_f=config.overlap_b_f, dxdw_split=config.dxdw_split,
                            batch_p2p=config.batch_p2p)
        pairs = spec.ranks * spec.stages_per_rank * spec.microbatches
        if pairs > _MAX_SCHEDULE_PAIRS:
            parser.error(
                f"{spec.ranks} ranks x {spec.stages_per_rank} stage(s) per rank x "
                f"{spec.microbatches} microbatches make a schedule of {pairs} (stage, "
                f"microbatch) pairs; at most {_MAX_SCHEDULE_PAIRS}, as every rank builds and "
                "runs all of it: use fewer --microbatches, --ranks or --stages-per-rank")
        build_schedule(spec)  # the generator's own checks, e.g. dualpipev's microbatches
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
    # block; a replayed rank only its own stages) and every step's batches up front (int64
    # inputs and targets).
    weights = 4 * 12 * config.width**2 * config.num_layers
    if config.replay_rank is not None:
        weights = weights * config.stages_per_rank // config.num_stages
    batches = 2 * 8 * config.steps * config.batch_size * config.seq_len
    need = local_ranks * (weights + batches)
    if need > total:
        who = ("the replayed rank needs" if config.replay_rank is not None
               else f"{local_ranks} ranks need")
        holds = ("its stages' weights" if config.replay_rank is not None
                 else "each holds the whole model")
        parser.error(f"{who} at least {need // 2**30:,} GiB, more than this machine's "
                     f"{total / 2**30:.1f} GiB: {holds} and all {config.steps} steps' batches; "
                     "lower --width, --layers, --steps, --batch-size or --ranks")


def main(argv: list[str] | None = None) -> int:
    config, args = parse_args(argv)
    if launched_by_torchrun():
        return _main_torchrun(config, args)
    if config.replay_rank is not None:
        if config.verbose:
            print(f"pipeswap-train: replaying rank {config.replay_rank} of {config.schedule} on "
                  f"{config.ranks} ranks x {config.stages_per_rank} stage(s), "
                  f"{config.microbatches} microbatches, {config.steps} steps per mode "
                  f"({', '.join(config.modes)}) on {config.device}, in this process ...",
                  flush=True)
        _report(config, args, [run_rank(config.replay_rank, 1, config)])
        return 0
    if config.verbose:
        replicas = (f" x {config.dp} replicas{' (FSDP)' if config.fsdp else ''}"
                    if config.meshed else "")
        print(f"pipeswap-train: {config.schedule}, {config.ranks} ranks x "
              f"{config.stages_per_rank} stage(s){replicas}, {config.microbatches} microbatches, "
              f"{config.steps} steps per mode ({', '.join(config.modes)}) on {config.device}; "
              "spawning the ranks ...", flush=True)
    try:
        per_rank = spawn(run_rank, config.world, config, backend=backend_for(config.device),
                         timeout_s=config.timeout_s)
    except RankFailedError as exc:
        print(f"pipeswap-train: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pipeswap-train: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    except SystemExit as exc:  # SIGTERM: spawn stopped every rank first
        print("pipeswap-train: terminated; every rank was stopped", file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else 1
    _report(config, args, per_rank)
    return 0


def _main_torchrun(config: TrainConfig, args: argparse.Namespace) -> NoReturn:
    import torch.distributed as dist

    from pipeswap.runtime.comm import gather_object

    rank, world = init_from_env(backend_for(config.device), config.timeout_s)
    try:
        gathered = gather_object(run_rank(rank, world, config))
        dist.barrier()  # nobody tears the group down while another rank still uses it
    finally:
        dist.destroy_process_group()
    if gathered is not None:
        _report(config, args, gathered)  # type: ignore[arg-type]
    # Leave without the interpreter's teardown, as the spawned ranks do (multiprocessing ends
    # its children with os._exit): after this job under torchrun, torch 2.13 aborted there
    # now and then ("terminate called without an active exception", exit -6) once all work
    # was done and printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report(config: TrainConfig, args: argparse.Namespace,
            per_rank: list[dict[str, ModeResult]]) -> None:
    summary = summarize(config, per_rank)
    if args.json:
        print(json.dumps(summary))
    else:
        print()
        print(render(summary))


if __name__ == "__main__":
    sys.exit(main())
