"""Streaming activation offload in one process, next to plain autograd and torch's save_on_cpu.

    python benchmarks/layer_offload.py                 # CPU
    python benchmarks/layer_offload.py --write         # also record it in BENCHMARKS.md
    python benchmarks/layer_offload.py --device cuda   # an accelerator
    python benchmarks/layer_offload.py --quick         # tiny sizes, 2 steps (CI smoke)

One stack of transformer blocks (``swap_overhead.Block``: pre-norm attention and MLP), one
batch, three ways to run a training step (forward, loss, backward; no optimizer, so every step
starts from the same weights):

- plain autograd;
- ``torch.autograd.graph.save_on_cpu``: every saved activation copied to host as the forward
  saves it and back when the backward reads it (pinned host memory on accelerators only);
- pipeswap's ``LayerOffload(layers, lag=1)``: a layer's saved activations leave the device
  when the forward ends the layer after it, and come back one layer ahead of the backward.

For each: the allocator's peak over one step, above what it held before the step
(``Platform.measure_allocations``: ``torch.cuda.max_memory_allocated`` on a GPU, torch's
profiler memory events on CPU, host buffers left out), taken in a step of its own after a
warm-up (the profiler slows CPU steps); the median step time over ``--steps`` steps, the
contenders alternating step by step in a rotating order; and whether the loss and every
gradient are bit-identical to plain autograd's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeswap.platform import Platform, get_platform
from pipeswap.swap import LayerOffload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, publish, write_section  # noqa: E402
from swap_overhead import Block  # noqa: E402

SECTION = "## Streaming offload in one process (`benchmarks/layer_offload.py`)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Sizes:
    layers: int
    width: int
    heads: int
    seq: int
    batch: int
    steps: int
    dtype: str


@dataclass
class Result:
    """One contender's figures."""

    name: str
    peak_bytes: int | None  # allocator, above the step's start
    step_s: float  # median
    bit_identical: bool


class Contender:
    """A way to run a step of ``model`` on ``x``: ``around`` wraps the forward, ``after``
    runs after the backward."""

    def __init__(self, name: str, around: Callable[[], AbstractContextManager[Any]],
                 after: Callable[[], None] = lambda: None) -> None:
        self.name, self.around, self.after = name, around, after
        self.times: list[float] = []

    def step(self, model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        """The loss and the gradients of the input and of every parameter."""
        model.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_(True)
        with self.around():
            loss: torch.Tensor = model(leaf).float().pow(2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        self.after()
        assert leaf.grad is not None
        return [loss.detach(), leaf.grad, *(p.grad for p in model.parameters()
                                            if p.grad is not None)]


def _synchronize(platform: Platform) -> None:
    if platform.device.type != "cpu":
        torch.accelerator.synchronize(platform.device)


def _same(want: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    return len(want) == len(got) and all(
        a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got))


@contextmanager
def _entered(offload: LayerOffload) -> Iterator[None]:
    with offload:
        yield


def run(sizes: Sizes, device: str) -> tuple[list[Result], dict[str, int]]:
    """The three contenders' figures, and LayerOffload's own count of a step's bytes."""
    platform = get_platform(device)
    torch.manual_seed(0)
    dtype = DTYPES[sizes.dtype]
    model = torch.nn.Sequential(*(Block(sizes.width, sizes.heads) for _ in range(sizes.layers)))
    model = model.to(device=platform.device, dtype=dtype)
    x = torch.randn(sizes.batch, sizes.seq, sizes.width, device=platform.device, dtype=dtype)
    pin = platform.pins_host_memory
    offload = LayerOffload(list(model), lag=1, platform=platform)
    saved: list[int] = []  # what each LayerOffload forward saved, in bytes

    def finish() -> None:
        if offload.chain is not None:
            saved.append(sum(b.held for b in offload.chain.layer_bytes))
        offload.finish()

    contenders = [
        Contender("plain autograd", nullcontext),
        Contender(f"save_on_cpu(pin_memory={pin})",
                  lambda: torch.autograd.graph.save_on_cpu(
                      pin_memory=pin, device_type=platform.device.type)),
        Contender("LayerOffload(lag=1)", lambda: _entered(offload), finish),
    ]
    reference = [t.clone() for t in contenders[0].step(model, x)]
    identical: dict[str, bool] = {}
    for contender in contenders:  # warm-up: first allocations, the host buffer pool
        got = contender.step(model, x)
        identical[contender.name] = _same(reference, got)
    peaks: dict[str, int | None] = {}
    for contender in contenders:
        del got
        model.zero_grad(set_to_none=True)  # the step starts from no gradients
        _synchronize(platform)
        with platform.measure_allocations() as measured:
            got = contender.step(model, x)
            _synchronize(platform)
        peaks[contender.name] = measured.peak_bytes
        identical[contender.name] &= _same(reference, got)
    offload.manager.reset_peak()
    before = offload.manager.stats()
    for index in range(sizes.steps):
        order = contenders[index % len(contenders):] + contenders[:index % len(contenders)]
        for contender in order:
            _synchronize(platform)
            start = time.perf_counter()
            got = contender.step(model, x)
            _synchronize(platform)
            contender.times.append(time.perf_counter() - start)
            identical[contender.name] &= _same(reference, got)
    stats = offload.manager.stats()
    offload.close()
    counted = {
        "saved_bytes": saved[-1],
        "peak_held_bytes": stats.peak_device_bytes_held,
        "offloaded_bytes_per_step": (stats.bytes_offloaded - before.bytes_offloaded)
        // max(1, sizes.steps),
        "reloaded_bytes_per_step": (stats.bytes_reloaded - before.bytes_reloaded)
        // max(1, sizes.steps),
    }
    results = [Result(c.name, peaks[c.name], statistics.median(c.times), identical[c.name])
               for c in contenders]
    return results, counted


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def _ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}x"


def render(sizes: Sizes, device_name: str, results: list[Result], counted: dict[str, int],
           threads: str) -> str:
    plain = results[0]
    rows = "".join(
        f"| {r.name} | {_mib(r.peak_bytes)} | {_ratio(r.peak_bytes, plain.peak_bytes)} | "
        f"{r.step_s * 1e3:.1f} ms | {_ratio(r.step_s, plain.step_s)} | "
        f"{'reference' if r is plain else 'bit-identical' if r.bit_identical else 'DIFFER'} |\n"
        for r in results)
    report = (
        f"Measured {datetime.date.today().isoformat()} on {device_name} (host: {machine()}); "
        f"torch {torch.__version__}; {threads}. {sizes.layers} transformer blocks of width "
        f"{sizes.width} ({sizes.heads} heads), {sizes.batch} x {sizes.seq} tokens, "
        f"{sizes.dtype}; forward, loss and backward, no optimizer. Allocator peak: one step "
        "after a warm-up, above what the allocator held before it (parameter gradients "
        "included, host buffers not); step time: median of "
        f"{sizes.steps} steps, the contenders alternating.\n\n"
        "| contender | allocator peak | vs plain | step time | vs plain | loss, gradients |\n"
        "|---|---|---|---|---|---|\n" + rows
        + f"\nLayerOffload's own count: a forward saves {_mib(counted['saved_bytes'])}, of "
        f"which it held at most {_mib(counted['peak_held_bytes'])} on the device at once; "
        f"{_mib(counted['offloaded_bytes_per_step'])} went to host and back each step "
        f"({_mib(counted['reloaded_bytes_per_step'])} reloaded).\n")
    if device_name == "cpu":
        report += (
            "\nOn CPU the \"device\" is host memory: `save_on_cpu` keeps every saved tensor "
            "where it is (`.cpu()` of a CPU tensor is the tensor), so it saves nothing here, "
            "and LayerOffload's copies run on worker threads that share the cores with "
            "compute, so its time shows the copy and bookkeeping cost, not PCIe overlap.\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--width", type=int, default=256, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per contender")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, ...")
    parser.add_argument("--quick", action="store_true",
                        help="4 tiny blocks and 2 timed steps: a smoke run")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    args = parser.parse_args(argv)
    sizes = Sizes(layers=args.layers, width=args.width, heads=args.heads, seq=args.seq,
                  batch=args.batch, steps=args.steps, dtype=args.dtype)
    if args.quick:
        sizes = Sizes(layers=4, width=32, heads=2, seq=16, batch=2, steps=2, dtype=args.dtype)
    if sizes.layers < 2 or sizes.steps < 1 or sizes.width % sizes.heads:
        parser.error("need --layers >= 2, --steps >= 1 and --width a multiple of --heads")
    platform = get_platform(args.device)
    threads = "default intra-op threads"
    if platform.device.type == "cpu":
        torch.set_num_threads(1)  # the other cores are the copy streams' (a GPU's copy engines)
        threads = "1 intra-op thread"
    print(f"{sizes.layers} blocks, width {sizes.width}, {sizes.batch}x{sizes.seq} tokens on "
          f"{platform!r} ...", file=sys.stderr, flush=True)
    results, counted = run(sizes, args.device)
    name = (torch.cuda.get_device_name(platform.device) if platform.device.type == "cuda"
            else platform.device.type)
    status = 0 if all(r.bit_identical for r in results) else 1
    report = render(sizes, name, results, counted, threads)
    if args.json:
        print(json.dumps({"device": name, "sizes": asdict(sizes),
                          "contenders": [asdict(r) for r in results], "layer_offload": counted}))
        if args.write:
            write_section(SECTION, report)
        return status
    publish(SECTION, report, args.write)
    return status


if __name__ == "__main__":
    sys.exit(main())
