"""Pipeline training with and without swap: step time and per-rank peak activation bytes.

    python benchmarks/train_step.py               # CPU, gloo, spawned ranks
    python benchmarks/train_step.py --write       # also record them in BENCHMARKS.md
    python benchmarks/train_step.py --device cuda # one GPU per rank, NCCL

Each case trains the bundled small GPT for ``--steps`` steps per mode from the same weights
(pipeswap.runtime.train.run_rank, the code behind ``pipeswap-train``, default swap policy,
which streams a chunk layer by layer where that lowers the peak more than swapping it whole;
two cases force whole-chunk or streaming swap on the same 1F1B run).
Two peaks per rank and mode: the swap manager's count of device bytes held by saved
activations, and the allocator's peak over a step above what it held when the step began
(``torch.cuda.max_memory_allocated`` on a GPU, torch's profiler memory events on CPU), taken
in the odd steps; step time is the median over the even steps (the profiler slows a step).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from pipeswap.runtime import spawn
from pipeswap.runtime.distributed.launch import backend_for
from pipeswap.runtime.train import TrainConfig, run_rank, summarize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, publish  # noqa: E402

SECTION = "## Training step, swap vs no swap (`benchmarks/train_step.py`)"


def cases(base: TrainConfig) -> dict[str, TrainConfig]:
    return {
        # the default policy picks each chunk's granularity; the next two force one
        "1F1B P=4 M=8": base.but(schedule="1f1b", ranks=4, microbatches=8),
        "1F1B P=4 M=8, whole chunks only": base.but(schedule="1f1b", ranks=4, microbatches=8,
                                                    granularity="chunk"),
        "1F1B P=4 M=8, every chunk streamed": base.but(schedule="1f1b", ranks=4,
                                                       microbatches=8, granularity="layer"),
        "Interleaved 1F1B P=2 V=2 M=8": base.but(schedule="interleaved-1f1b", ranks=2,
                                                 stages_per_rank=2, microbatches=8),
        "ZBV P=2 M=8": base.but(schedule="zbv", ranks=2, stages_per_rank=2, microbatches=8),
        "DualPipeV P=2 M=8": base.but(schedule="dualpipev", ranks=2, stages_per_rank=2,
                                      microbatches=8),
        # two replicas of the interleaved case, stages sharded with FSDP2: each replica has
        # half the batch, so half the activations a rank
        "Interleaved 1F1B P=2 V=2 M=8 x DP=2, FSDP": base.but(
            schedule="interleaved-1f1b", ranks=2, stages_per_rank=2, microbatches=8, dp=2,
            fsdp=True),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--steps", type=int, default=8, help="steps per mode")
    parser.add_argument("--width", type=int, default=128, help="model width")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    args = parser.parse_args(argv)
    base = TrainConfig.of(steps=args.steps, batch_size=16, seq_len=args.seq_len,
                          width=args.width, device=args.device, verbose=False, timeout_s=300)
    rows = []
    for name, config in cases(base).items():
        print(f"{name} ...", file=sys.stderr, flush=True)
        summary = summarize(config, spawn(run_rank, config.parallel.world, config,
                                          backend=backend_for(config.training.device),
                                          timeout_s=config.job.timeout_s))
        for entry in summary["per_rank"]:
            plain = entry["peak_activation_bytes_no_swap"]
            swap = entry["peak_activation_bytes_swap"]
            a_plain = entry["peak_allocated_bytes_no_swap"]
            a_swap = entry["peak_allocated_bytes_swap"]
            t_plain, t_swap = entry["step_time_s_no_swap"], entry["step_time_s_swap"]
            rank = str(entry["rank"])
            if config.parallel.dp > 1:
                rank += f" (pp {entry['pp_rank']}, dp {entry['dp_rank']})"
            rows.append(
                f"| {name} | {rank} | {entry['swapped_chunks']} "
                f"({entry['streamed_chunks']}) | "
                f"{plain / 2**20:.2f} MiB | {swap / 2**20:.2f} MiB | {1 - swap / plain:.0%} | "
                f"{a_plain / 2**20:.2f} MiB | {a_swap / 2**20:.2f} MiB | "
                f"{1 - a_swap / a_plain:.0%} | "
                f"{entry['bytes_offloaded'] / 2**20 / config.training.steps:.1f} MiB | "
                f"{t_plain * 1e3:.0f} ms | {t_swap * 1e3:.0f} ms | {t_swap / t_plain:.2f}x |")
        rows.append(f"| {name}: losses with and without swap "
                    f"{'bit-identical' if summary['losses_match'] else 'DIFFER'} | | | | | | | | "
                    f"| | | | {summary['step_time_ratio']:.2f}x (median over ranks) |")
    device = (torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)")
    report = (
        f"Measured {datetime.date.today().isoformat()} on {device}, host {machine()}; "
        f"torch {torch.__version__}; GPT width {args.width}, {args.seq_len} tokens x 16 "
        f"sequences a step, two blocks per stage, {args.steps} steps per mode (allocator "
        "measured in the odd ones, median step time of the even ones), default swap policy; "
        "one intra-op thread per rank.\n\n"
        "| case | rank | swapped chunks (streamed) | counted peak, no swap | with swap | saving | "
        "allocator peak, no swap | with swap | saving | offloaded a step | step, no swap | "
        "with swap | ratio |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    if args.device == "cpu":
        report += (
            "\nOn CPU the \"device\" is host memory and the copy streams are threads on the same "
            "two cores as the ranks' compute, so the time ratio shows swap's bookkeeping and "
            "memcpy cost, not PCIe overlap. The counted peak is the saved activations the swap "
            "manager holds; the allocator's covers everything the step allocates (parameter "
            "gradients, temporaries, received tensors), so its saving is smaller in share, and "
            "host buffers are left out of it as on a GPU. Ranks whose peak no swap can lower "
            "swap nothing under the default policy. The DP=2 case runs four processes on the "
            "two cores, each replica on half the batch, and its allocator peak includes the "
            "gradients FSDP holds gathered until REDUCE_GRAD.\n")
    return publish(SECTION, report, args.write)


if __name__ == "__main__":
    sys.exit(main())
