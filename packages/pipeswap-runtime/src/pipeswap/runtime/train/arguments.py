"""The ``pipeswap-train`` command line's options, each with the help that teaches it; the
checks of their values and the config they make are :mod:`pipeswap.runtime.train.cli`'s."""

from __future__ import annotations

import argparse
from typing import NoReturn

from pipeswap.runtime.train.config import (
    DTYPES,
    LOG_LEVELS,
    MODELS,
    TRAIN_POLICIES,
    SWAP_COSTS,
    TrainConfig,
)
from pipeswap.schedule import GRANULARITIES, RECOMPUTE_MODES, ScheduleKind, parse_bytes

__all__ = ["Parser", "command_line"]


class Parser(argparse.ArgumentParser):
    """Errors in two lines: argparse's default puts the whole usage, a screenful with this
    many options, above the one line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see {self.prog} --help\n")


def command_line() -> Parser:
    """The command line, every option with its help."""
    parser = Parser(
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
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="llama: key/value heads, dividing --heads (default: half the "
                             "heads, or as many for an odd count)")
    parser.add_argument("--ffn", type=int, default=None,
                        help="llama: the SwiGLU hidden size (default: Llama's rule, two "
                             "thirds of 4 x --width rounded up to a multiple of 16)")
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
    parser.add_argument("--policy", choices=TRAIN_POLICIES, default=defaults.swap.policy,
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
    parser.add_argument("--host-pool-bytes", type=_bytes, metavar="BYTES",
                        help="the pinned host memory each rank may hold for swapped "
                             "activations (e.g. 40GiB; default: half this host's memory, "
                             "shared among the ranks it runs). Pinned memory cannot be paged "
                             "out: lower it where the host runs other work, raise it where a "
                             "plan needs more")
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
                             "random state) into DIR/no-swap and DIR/swap at its last step. "
                             "The run claims DIR while it lives: another run given it is "
                             "refused. Under torchrun --max-restarts, a restarted job goes "
                             "on from the newest checkpoint in DIR that verifies")
    saving.add_argument("--checkpoint-every", type=int, metavar="N",
                        help="with --checkpoint-dir: also after every N steps (the two newest "
                             "are kept)")
    saving.add_argument("--checkpoint-async", action="store_true",
                        help="with --checkpoint-dir: write each checkpoint while the next "
                             "steps train (DCP's async_save: the state is copied to host "
                             "memory, then written, checksummed and committed in the "
                             "background; one save in flight at a time)")
    saving.add_argument("--resume", metavar="DIR",
                        help="go on from the newest checkpoint in DIR/<mode> whose files "
                             "verify against their checksums; --steps counts "
                             "from the run's start, so a checkpoint of step 2 and --steps 4 "
                             "run steps 3 and 4, as the uninterrupted run would. A "
                             "checkpoint saved with other training options (--lr, "
                             "--batch-size, --seed, --microbatches, the data) is refused")
    saving.add_argument("--resume-anyway", action="store_true",
                        help="with --resume: go on from a checkpoint saved with other "
                             "training options, with this run's (the model and the layout "
                             "must still match)")
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
                        help="seconds a rank may show no sign of life in a step (stopped, "
                        "hung, gone) before the job fails naming it, and the longest wait "
                        "for a peer outside a step (set-up, checkpoint saves) (default "
                        f"{defaults.job.timeout_s:.0f}); a rank that is only slow (a long "
                        "step) still beats and is waited for")


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
