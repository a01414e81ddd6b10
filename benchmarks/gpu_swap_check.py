"""Can swap copies hide behind compute on this device? Copy bandwidth and overlap, measured.

    python benchmarks/gpu_swap_check.py                  # the machine's accelerator
    python benchmarks/gpu_swap_check.py --write          # also record it in BENCHMARKS.md
    python benchmarks/gpu_swap_check.py --device cpu --mib 8   # the CPU platform's threads

1. Bandwidth: device->host and host->device copies of ``--mib`` MiB between a device tensor
   and a host buffer from the platform (pinned on accelerators), on a side stream.
2. Overlap: matmuls on the compute stream sized to last about as long as one copy; the copy
   alone, the matmuls alone, and both at once. The hidden fraction of the copy is
   (copy + compute - both) / copy, clipped to [0, 1]: 1 means the copy cost nothing.
3. The same overlap through the swap manager: ``launch_offload`` of a group of activations,
   matmuls, ``wait_offload``; and ``launch_load``, matmuls, ``wait_load``.

Times are host wall clock around work queued and then synchronized; each is the median of
``--repeats`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipeswap.platform import Platform, Stream, available_platforms, get_platform
from pipeswap.swap import SwapManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, publish, write_section  # noqa: E402

SECTION = "## GPU swap check (`benchmarks/gpu_swap_check.py`)"


def _median(work: Callable[[], None], streams: list[Stream], repeats: int) -> float:
    def once() -> float:
        start = time.perf_counter()
        work()
        for stream in streams:
            stream.synchronize()
        return time.perf_counter() - start

    once()  # warm-up: allocations, kernel selection, thread start
    return statistics.median(once() for _ in range(repeats))


def _hidden(copy_s: float, compute_s: float, both_s: float) -> float:
    return min(1.0, max(0.0, (copy_s + compute_s - both_s) / copy_s))


class Check:
    """The buffers, streams and matmul operands of one run."""

    def __init__(self, platform: Platform, nbytes: int, matmul: int, repeats: int) -> None:
        self.platform, self.repeats = platform, repeats
        self.compute = platform.current_stream()
        self.side = platform.new_stream()
        self.device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=platform.device)
        self.host_bytes = platform.host_buffer(nbytes)
        self.device_bytes.fill_(1)
        self.host_bytes.fill_(2)
        dtype = torch.float32 if platform.device.type == "cpu" else torch.bfloat16
        self.a = torch.randn(matmul, matmul, device=platform.device, dtype=dtype)
        self.b = torch.randn(matmul, matmul, device=platform.device, dtype=dtype)
        self.matmuls = 1

    def copy(self, to_host: bool) -> None:
        src, dst = ((self.device_bytes, self.host_bytes) if to_host
                    else (self.host_bytes, self.device_bytes))
        with self.platform.stream(self.side):
            self.platform.copy_(dst, src)

    def compute_work(self) -> None:
        for _ in range(self.matmuls):
            torch.mm(self.a, self.b)

    def time(self, work: Callable[[], None]) -> float:
        return _median(work, [self.compute, self.side], self.repeats)

    def calibrate(self, target_s: float) -> float:
        """Size the matmul loop to about ``target_s``; returns its time."""
        self.matmuls = 1
        one = self.time(self.compute_work)
        self.matmuls = max(1, math.ceil(target_s / one))
        return self.time(self.compute_work)


def raw_copies(check: Check) -> dict[str, float]:
    nbytes = check.device_bytes.numel()
    figures: dict[str, float] = {}
    for direction, to_host in (("d2h", True), ("h2d", False)):
        copy_s = check.time(lambda: check.copy(to_host))
        compute_s = check.calibrate(copy_s)

        def both() -> None:
            check.copy(to_host)
            check.compute_work()

        both_s = check.time(both)
        figures |= {f"{direction}_gb_s": nbytes / copy_s / 1e9,
                    f"{direction}_copy_ms": copy_s * 1e3,
                    f"{direction}_compute_ms": compute_s * 1e3,
                    f"{direction}_both_ms": both_s * 1e3,
                    f"{direction}_hidden": _hidden(copy_s, compute_s, both_s)}
    return figures


def manager_overlap(check: Check, nbytes: int) -> dict[str, float]:
    """Offload and load groups through SwapManager, alone and under matmuls."""
    platform = check.platform
    mgr = SwapManager(platform)
    count = 8
    leaves = [torch.randn(nbytes // 4 // count, device=platform.device, requires_grad=True)
              for _ in range(count)]

    def timed(direction: str, compute: bool) -> float:
        """Median time of one transfer of a fresh group (with matmuls queued beside it)."""
        samples = []
        for step in range(check.repeats + 1):
            name = f"{direction}{step}"
            with mgr.group_context(name):
                loss = torch.stack([leaf.sin().sum() for leaf in leaves]).sum()
            if direction == "load":
                mgr.launch_offload(name)
                mgr.wait_offload(name)
            check.compute.synchronize()
            start = time.perf_counter()
            getattr(mgr, f"launch_{direction}")(name)
            if compute:
                check.compute_work()
            getattr(mgr, f"wait_{direction}")(name)
            check.compute.synchronize()
            samples.append(time.perf_counter() - start)
            if direction == "offload":
                mgr.launch_load(name)
                mgr.wait_load(name)
            loss.backward()  # type: ignore[no-untyped-call]
            mgr.finish_group(name)
        return statistics.median(samples[1:])  # the first is the warm-up

    figures: dict[str, float] = {}
    for direction in ("offload", "load"):
        alone_s = timed(direction, False)
        compute_s = check.calibrate(alone_s)
        both_s = timed(direction, True)
        figures[f"manager_{direction}_ms"] = alone_s * 1e3
        figures[f"manager_{direction}_hidden"] = _hidden(alone_s, compute_s, both_s)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None,
                        help="platform to measure (default: this machine's accelerator)")
    parser.add_argument("--mib", type=int, default=256, help="bytes per copy, in MiB")
    parser.add_argument("--matmul", type=int, default=None,
                        help="matmul size (default 4096 on accelerators, 256 on CPU)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per figure")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    args = parser.parse_args(argv)
    device = args.device or available_platforms()[0]
    if device == "cpu" and args.device is None:
        parser.error("no accelerator on this machine; pass --device cpu to measure the CPU "
                     "platform's worker-thread streams instead")
    platform = get_platform(device)
    nbytes = args.mib << 20
    matmul = args.matmul or (256 if platform.device.type == "cpu" else 4096)
    print(f"measuring {platform!r}: {args.mib} MiB copies, {matmul}^2 matmuls ...",
          file=sys.stderr, flush=True)
    check = Check(platform, nbytes, matmul, args.repeats)
    figures = raw_copies(check)
    print("through the swap manager ...", file=sys.stderr, flush=True)
    figures |= manager_overlap(check, nbytes)
    name = (torch.cuda.get_device_name(platform.device) if platform.device.type == "cuda"
            else platform.device.type)
    if args.json:
        print(json.dumps({"device": name, "mib": args.mib, "matmul": matmul, **figures}))
    report = (
        f"Measured {datetime.date.today().isoformat()} on {name} (host: {machine()}); "
        f"torch {torch.__version__}; {args.mib} MiB per copy, {'pinned' if platform.pins_host_memory else 'pageable'} "
        f"host buffers, {matmul}x{matmul} matmuls sized to the copy; median of {args.repeats}.\n\n"
        "| direction | bandwidth | copy alone | matmuls alone | both | copy hidden |\n"
        "|---|---|---|---|---|---|\n"
        + "".join(
            f"| {label} | {figures[f'{d}_gb_s']:.1f} GB/s | {figures[f'{d}_copy_ms']:.2f} ms | "
            f"{figures[f'{d}_compute_ms']:.2f} ms | {figures[f'{d}_both_ms']:.2f} ms | "
            f"{figures[f'{d}_hidden']:.0%} |\n"
            for d, label in (("d2h", "device to host"), ("h2d", "host to device")))
        + f"\nThrough `SwapManager` (launch, matmuls, wait) with {args.mib} MiB of activations "
        f"in 8 storages: offload {figures['manager_offload_ms']:.2f} ms alone, "
        f"{figures['manager_offload_hidden']:.0%} hidden; load "
        f"{figures['manager_load_ms']:.2f} ms alone, {figures['manager_load_hidden']:.0%} "
        "hidden.\n")
    if platform.device.type == "cpu":
        report += ("\nThis is the CPU platform (worker-thread streams, matmuls on the same two "
                   "cores), not a GPU: run `python benchmarks/gpu_swap_check.py --write` on a "
                   "CUDA machine for the figures this check is for.\n")
    if args.json:  # the JSON object above is the whole output
        if args.write:
            write_section(SECTION, report)
        return 0
    return publish(SECTION, report, args.write)


if __name__ == "__main__":
    sys.exit(main())
