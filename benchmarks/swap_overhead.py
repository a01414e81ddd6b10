"""What swap costs on the CPU platform.

    python benchmarks/swap_overhead.py            # print the figures
    python benchmarks/swap_overhead.py --write    # also record them in BENCHMARKS.md

1. Collection overhead: forward + backward of a small transformer block with a swap group
   collecting its saved activations but nothing offloaded, against the same step without swap
   (target: at most 1.05x).
2. Offload + reload throughput of the worker-thread copy streams, with the host buffer pool
   cold (first step allocates) and warm (steady state reuses every buffer).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipeswap.platform import get_platform
from pipeswap.swap import SwapManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, publish  # noqa: E402

SECTION = "## Swap overhead on CPU (`benchmarks/swap_overhead.py`)"


class Block(torch.nn.Module):
    """Pre-norm attention + MLP, the shape of one transformer layer."""

    def __init__(self, width: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


def _median_seconds(steps: list[Callable[[], None]], repeat: int) -> list[float]:
    """Median time of each step, run alternately so that drift hits all of them alike."""
    for step in steps:
        step()  # warm-up
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeat):
        for step, samples in zip(steps, times):
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def collection_overhead(repeat: int) -> tuple[float, float]:
    torch.manual_seed(0)
    block, x = Block(), torch.randn(8, 128, 256)
    mgr = SwapManager(get_platform("cpu"))
    mgr.protect_module(block)

    def plain() -> None:
        block(x).sum().backward()

    def collecting() -> None:
        with mgr.group_context("g"):
            loss = block(x).sum()
        loss.backward()
        mgr.finish_group("g")

    plain_s, collecting_s = _median_seconds([plain, collecting], repeat)
    return plain_s, collecting_s


def throughput(steps: int) -> tuple[float, float, int]:
    """(cold GB/s, warm GB/s, bytes per step) of offload + reload."""
    mgr = SwapManager(get_platform("cpu"))
    rates = []
    moved = 0
    for step in range(steps):
        tensors = [torch.randn(1 << 20, requires_grad=True) for _ in range(16)]  # 64 MiB
        with mgr.group_context(f"s{step}"):
            loss = torch.stack([t.sin().sum() for t in tensors]).sum()
        start = time.perf_counter()
        mgr.launch_offload(f"s{step}")
        mgr.wait_offload(f"s{step}")
        mgr.launch_load(f"s{step}")
        mgr.wait_load(f"s{step}")
        elapsed = time.perf_counter() - start
        moved = mgr.stats().bytes_offloaded // (step + 1)
        rates.append(2 * moved / elapsed / 1e9)
        loss.backward()  # type: ignore[no-untyped-call]
        mgr.finish_group(f"s{step}")
    return rates[0], statistics.median(rates[1:]), moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=40, help="timed steps per variant")
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("collection overhead ...", file=sys.stderr, flush=True)
    plain, collecting = collection_overhead(args.repeat)
    print("offload + reload throughput ...", file=sys.stderr, flush=True)
    cold, warm, moved = throughput(6)
    ratio = collecting / plain
    report = (
        f"Measured {datetime.date.today().isoformat()} on {machine()}; torch {torch.__version__}, "
        "1 intra-op thread.\n\n"
        "| measure | value | target |\n|---|---|---|\n"
        f"| block step (fwd+bwd, 8x128x256), no swap | {plain * 1e3:.1f} ms | |\n"
        f"| same, swap group collecting, nothing offloaded | {collecting * 1e3:.1f} ms | |\n"
        f"| collection overhead | {ratio:.3f}x | <= 1.05x"
        f"{'' if ratio <= 1.05 else ' **(over target)**'} |\n"
        f"| offload + reload, {moved >> 20} MiB a step, pool cold | {cold:.2f} GB/s | |\n"
        f"| offload + reload, pool warm (steady state) | {warm:.2f} GB/s | |\n"
    )
    return publish(SECTION, report, args.write)


if __name__ == "__main__":
    sys.exit(main())
