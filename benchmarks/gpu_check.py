"""The GPU check: is pipeswap correct on a real accelerator, and do its copies hide?

    python benchmarks/gpu_check.py                        # this machine's GPU (<= 8 min, H200)
    python benchmarks/gpu_check.py --write                # also record it in BENCHMARKS.md
    python benchmarks/gpu_check.py --device cpu --quick   # every part, tiny, on the CPU platform
    python benchmarks/gpu_check.py --nccl                 # also the NCCL cases (2+ GPUs)
    python benchmarks/gpu_check.py --only nccl            # the NCCL cases alone
    python benchmarks/gpu_check.py --list                 # the NCCL cases and their commands

Parts, in this order (``--skip PART`` leaves one out, ``--only PART`` runs only the parts
named; each prints as it goes):

tests    the platform and swap-manager test suites on the device (``PIPESWAP_TEST_DEVICE``):
         property tests, and the stress tests that reuse freed device memory right after each
         offload and during each load, with copies as they are and lagging far behind compute
         (a missing stream wait then corrupts a gradient). Needs pytest and hypothesis.
copies   device-to-host and host-to-device bandwidth between a device tensor and a pinned
         host buffer, each direction alone and both at once (PCIe Gen5 x16: about 55 GB/s
         per direction).
overlap  the share of each copy hidden behind matmuls queued beside it, raw and through
         SwapManager (launch, matmuls, wait); and the matmuls' throughput.
preset   the simulator's ``h200-pcie5`` preset (link bandwidth, duplex, bf16 matmul
         throughput) against what was measured; a difference over 10% is flagged.
replay   rank 0 of 1F1B P=8 M=16, Llama layers of hidden 4096 (32 heads, 16 key/value
         heads) on sequences of 4096 tokens in bf16 (4 layers a stage), replayed alone (``pipeswap-train --replay-rank 0``): peaks
         (counted and the allocator's) and step time without swap, swapping whole chunks, and
         streaming layer by layer. Goal: activation peak down >= 60% at <= 1.05x step time.
nccl     only with ``--nccl`` (or ``--only nccl``), on two or more CUDA GPUs (one GPU: a line
         says so and the rest runs): the multi-process cases over NCCL, one GPU a rank, each
         a command of its own in its own process group, stopped with it after
         ``--nccl-timeout`` seconds (``_nccl.py`` lists them; ``--case NAME`` picks some):
         batch-p2p (pipeswap-train, 1F1B, ``--batch-p2p``), pytree (stage boundaries of
         several tensors), recover (a rank raises mid-step, its peers get PeerFailedError
         naming it, recover(), the next step), fsdp-dp (``--ranks 2 --dp 2 --fsdp``, 4 GPUs;
         skipped with fewer) and torchrun (plain ``init_process_group("nccl")``, then the
         executor). Each prints one line: ok, FAILED with the first error line, TIMED OUT,
         or skipped and why.

The exit status is 1 when the tests fail, a replay run fails or an NCCL case fails or times
out, else 0 (a goal missed is reported, not an error); 2 for a check this machine cannot run
(no accelerator; ``--nccl`` without CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeswap.platform import Platform, Stream, available_platforms, get_platform
from pipeswap.schedule.costs import preset
from pipeswap.swap import SwapManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _nccl  # noqa: E402
from _report import machine, publish, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## GPU check (`benchmarks/gpu_check.py`)"
PARTS = ("tests", "copies", "overlap", "preset", "replay", "nccl")
PRESET = "h200-pcie5"
TOLERANCE = 0.10  # a preset figure further than this from the measured one is flagged
#: the replayed pipeline: P=8 M=16, one sequence a microbatch, Llama layers, 4 a stage
REPLAY = ["--schedule", "1f1b", "--ranks", "8", "--microbatches", "16", "--batch-size", "16",
          "--model", "llama", "--dtype", "bf16", "--replay-rank", "0"]
REPLAY_SIZES = {"full": ["--width", "4096", "--heads", "32", "--seq-len", "4096",
                         "--layers", "32", "--steps", "4"],
                "quick": ["--width", "64", "--heads", "4", "--seq-len", "64", "--layers", "16",
                          "--steps", "2"]}
QUICK_TESTS = "reused or round_trip or allocator"  # pytest -k of --quick: the stress tests
TESTS_TIMEOUT_S = 300  # the tests; each replay run gets REPLAY_TIMEOUT_S: 8 minutes in all
REPLAY_TIMEOUT_S = 150


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- tests ----------------------------------------------------------------------------------


def run_tests(device: str, quick: bool) -> dict[str, Any]:
    """The platform and swap packages' tests on ``device``; pytest's tally."""
    command = [sys.executable, "-m", "pytest", "packages/pipeswap-platform/tests",
               "packages/pipeswap-swap/tests", "-q", "-p", "no:cacheprovider",
               *(["-k", QUICK_TESTS] if quick else [])]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PIPESWAP_TEST_DEVICE": device},
                              timeout=TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "tally": f"stopped after {TESTS_TIMEOUT_S} s (hung?)",
                "seconds": float(TESTS_TIMEOUT_S), "passed": 0, "failed": 0, "skipped": 0}
    seconds = time.perf_counter() - start
    lines = (done.stdout + done.stderr).strip().splitlines()
    tally = next((line.strip("= ") for line in reversed(lines)
                  if re.search(r"\d+ (passed|failed|error)", line)), lines[-1] if lines else "")
    tally = re.sub(r" in [\d.]+s.*$", "", tally)  # the time is reported apart
    if done.returncode != 0:
        print("\n".join(lines[-60:]), file=sys.stderr)
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)",
                                                     tally)}
    return {"ok": done.returncode == 0, "tally": tally, "seconds": seconds,
            "passed": counts.get("passed", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
            "skipped": counts.get("skipped", 0)}


# -- copies and overlap ---------------------------------------------------------------------


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
    """The buffers, streams and matmul operands of one run: a device tensor and a host
    buffer for each direction, so that both directions can run at once."""

    def __init__(self, platform: Platform, nbytes: int, matmul: int, repeats: int) -> None:
        self.platform, self.repeats, self.nbytes = platform, repeats, nbytes
        self.compute = platform.current_stream()
        self.streams = {True: platform.new_stream(), False: platform.new_stream()}
        self.device_bytes = {d: torch.full((nbytes,), 1, dtype=torch.uint8,
                                           device=platform.device) for d in (True, False)}
        self.host_bytes = {d: platform.host_buffer(nbytes).fill_(2) for d in (True, False)}
        self.dtype = torch.float32 if platform.device.type == "cpu" else torch.bfloat16
        self.size = matmul
        self.a = torch.randn(matmul, matmul, device=platform.device, dtype=self.dtype)
        self.b = torch.randn(matmul, matmul, device=platform.device, dtype=self.dtype)
        self.matmuls = 1

    def copy(self, to_host: bool) -> None:
        src, dst = self.device_bytes[to_host], self.host_bytes[to_host]
        if not to_host:
            src, dst = dst, src
        with self.platform.stream(self.streams[to_host]):
            self.platform.copy_(dst, src)

    def compute_work(self) -> None:
        for _ in range(self.matmuls):
            torch.mm(self.a, self.b)

    def time(self, work: Callable[[], None]) -> float:
        return _median(work, [self.compute, *self.streams.values()], self.repeats)

    def calibrate(self, target_s: float) -> float:
        """Size the matmul loop to about ``target_s``; returns its time."""
        self.matmuls = 1
        one = self.time(self.compute_work)
        self.matmuls = max(1, math.ceil(target_s / one))
        return self.time(self.compute_work)

    def flops(self) -> float:
        """The matmuls' throughput, FLOP/s, from a loop of them alone."""
        seconds = self.calibrate(0.05)
        return 2 * self.size**3 * self.matmuls / seconds


def copies(check: Check) -> dict[str, float]:
    """Bandwidth of each direction alone and of both at once (each direction's bytes over
    the time both took)."""
    figures = {}
    for direction, to_host in (("d2h", True), ("h2d", False)):
        seconds = check.time(lambda: check.copy(to_host))
        figures[f"{direction}_copy_ms"] = seconds * 1e3
        figures[f"{direction}_gb_s"] = check.nbytes / seconds / 1e9

    def both() -> None:
        check.copy(True)
        check.copy(False)

    seconds = check.time(both)
    figures["both_ms"] = seconds * 1e3
    figures["both_gb_s_per_direction"] = check.nbytes / seconds / 1e9
    return figures


def overlap(check: Check, nbytes: int) -> dict[str, float]:
    """The share of each copy hidden behind matmuls, raw and through SwapManager, and the
    matmuls' throughput."""
    figures: dict[str, float] = {"matmul_tflop_s": check.flops() / 1e12}
    for direction, to_host in (("d2h", True), ("h2d", False)):
        copy_s = check.time(lambda: check.copy(to_host))
        compute_s = check.calibrate(copy_s)

        def both() -> None:
            check.copy(to_host)
            check.compute_work()

        figures[f"{direction}_hidden"] = _hidden(copy_s, compute_s, check.time(both))
    figures |= manager_overlap(check, nbytes)
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
            with mgr.group_context(name):  # sin saves its input, leaf * 2: that moves
                loss = torch.stack([(leaf * 2).sin().sum() for leaf in leaves]).sum()
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
    # what one group moves (each timed transfer above moved as much)
    figures["manager_group_bytes"] = mgr.stats().bytes_offloaded / (4 * (check.repeats + 1))
    return figures


# -- the preset -----------------------------------------------------------------------------


def preset_check(figures: dict[str, float]) -> list[dict[str, Any]]:
    """Each figure of the h200-pcie5 preset next to the measured one: ratio and verdict."""
    chosen = preset(PRESET)
    rows = []
    duplex_share = figures["both_gb_s_per_direction"] / min(figures["d2h_gb_s"],
                                                            figures["h2d_gb_s"])
    for name, assumed, measured, unit in (
            ("D2H bandwidth", chosen.link.d2h_bandwidth / 1e9, figures["d2h_gb_s"], "GB/s"),
            ("H2D bandwidth", chosen.link.h2d_bandwidth / 1e9, figures["h2d_gb_s"], "GB/s"),
            ("both at once, per direction",
             (1.0 if chosen.link.duplex else 0.5) * min(chosen.link.d2h_bandwidth,
                                                        chosen.link.h2d_bandwidth) / 1e9,
             figures["both_gb_s_per_direction"], "GB/s"),
            ("matmul throughput", chosen.flops / 1e12, figures["matmul_tflop_s"],
             "TFLOP/s")):
        off = measured / assumed - 1
        rows.append({"figure": name, "preset": assumed, "measured": measured, "unit": unit,
                     "off": off, "within": abs(off) <= TOLERANCE})
    # duplex: both directions at once each keep at least 90% of their bandwidth alone
    rows.append({"figure": "duplex (both at once, per direction / alone)",
                 "preset": 1.0 if chosen.link.duplex else 0.5, "measured": duplex_share,
                 "unit": "x", "off": duplex_share / (1.0 if chosen.link.duplex else 0.5) - 1,
                 "within": (duplex_share >= 0.9) == chosen.link.duplex})
    return rows


# -- the replay -----------------------------------------------------------------------------


def replay(device: str, quick: bool) -> dict[str, Any]:
    """pipeswap-train --replay-rank 0 twice: without swap and swapping whole chunks, then
    streaming only; each run's per-rank entry."""
    base = [sys.executable, "-m", "pipeswap.runtime.train", *REPLAY, "--device", device,
            *REPLAY_SIZES["quick" if quick else "full"], "--json"]
    results: dict[str, Any] = {}
    for name, extra in (("chunk", ["--swap-granularity", "chunk"]),
                        ("layer", ["--swap-granularity", "layer", "--swap-only"])):
        say(f"  replay, {'no swap and whole chunks' if name == 'chunk' else 'streaming'} ...")
        start = time.perf_counter()
        try:
            done = subprocess.run([*base, *extra], cwd=ROOT, capture_output=True, text=True,
                                  timeout=REPLAY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"{' '.join(base[2:])} {' '.join(extra)} stopped "
                                          f"after {REPLAY_TIMEOUT_S} s"}
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return {"ok": False, "error": f"{' '.join(base[2:])} {' '.join(extra)} exited "
                                          f"with {done.returncode}"}
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        results[name] = summary["per_rank"][0]
        results[f"{name}_seconds"] = time.perf_counter() - start
    chunk, layer = results["chunk"], results["layer"]
    rows = {}
    for label, entry, key in (("no swap", chunk, "no_swap"), ("swap, whole chunks", chunk, "swap"),
                              ("swap, streamed", layer, "swap")):
        rows[label] = {"counted": entry[f"peak_activation_bytes_{key}"],
                       "allocated": entry[f"peak_allocated_bytes_{key}"],
                       "step_s": entry[f"step_time_s_{key}"],
                       "swapped": entry["swapped_chunks"] if key == "swap" else 0,
                       "streamed": entry["streamed_chunks"] if key == "swap" else 0}
    plain = rows["no swap"]
    for row in rows.values():
        row["counted_saving"] = 1 - row["counted"] / plain["counted"]
        row["allocated_saving"] = (1 - row["allocated"] / plain["allocated"]
                                   if row["allocated"] and plain["allocated"] else None)
        row["time_ratio"] = row["step_s"] / plain["step_s"]
        row["goal_met"] = row["counted_saving"] >= 0.6 and row["time_ratio"] <= 1.05
    return {"ok": True, "rows": rows, "seconds": results["chunk_seconds"]
            + results["layer_seconds"]}


# -- the NCCL cases -------------------------------------------------------------------------


def cuda_gpus() -> int:
    """CUDA devices torch sees here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl(names: list[str], gpus: int, timeout_s: float) -> dict[str, Any]:
    """The NCCL cases ``names`` (all when empty) on ``gpus`` GPUs, one line each as they end;
    each case's output stays in a folder, named when a case did not pass."""
    if gpus < 2:
        return {"ok": True, "gpus": gpus, "cases": [],
                "skipped": f"{gpus} CUDA GPU here; the NCCL cases need two or more"}
    logs = Path(tempfile.mkdtemp(prefix="pipeswap-nccl-"))
    say(f"NCCL cases on {gpus} GPUs, each stopped after {timeout_s:.0f} s ...")
    results = []
    for case in _nccl.CASES:
        if names and case.name not in names:
            continue
        result = _nccl.run_case(case, gpus, timeout_s, logs)
        say(f"  {case.name}: {result['line']}")
        results.append(result)
    ok = all(result["status"] in ("ok", "skipped") for result in results)
    if ok:
        shutil.rmtree(logs, ignore_errors=True)
    else:
        say(f"  each case's output: {logs}/")
    return {"ok": ok, "gpus": gpus, "timeout_s": timeout_s, "cases": results}


# -- the report -----------------------------------------------------------------------------


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.2f} MiB"


def report(figures: dict[str, Any], args: argparse.Namespace, platform: Platform,
           name: str) -> str:
    pinned = "pinned" if platform.pins_host_memory else "pageable"
    lines = [f"Measured {datetime.date.today().isoformat()} on {name} (host: {machine()}); "
             f"torch {torch.__version__}{'; --quick sizes' if args.quick else ''}."]
    tests = figures.get("tests")
    if tests:
        lines += ["", f"**Tests on {args.device}** (platform and swap packages"
                  f"{', stress tests only' if args.quick else ''}): {tests['tally']} in "
                  f"{tests['seconds']:.0f} s."]
    if "copies" in figures:
        c = figures["copies"]
        lines += ["", f"**Copies** of {args.mib} MiB, {pinned} host buffers, median of "
                  f"{args.repeats}:", "",
                  "| direction | time | bandwidth |", "|---|---|---|",
                  f"| device to host | {c['d2h_copy_ms']:.2f} ms | {c['d2h_gb_s']:.1f} GB/s |",
                  f"| host to device | {c['h2d_copy_ms']:.2f} ms | {c['h2d_gb_s']:.1f} GB/s |",
                  f"| both at once | {c['both_ms']:.2f} ms | "
                  f"{c['both_gb_s_per_direction']:.1f} GB/s per direction |"]
    if "overlap" in figures:
        o = figures["overlap"]
        dtype = "fp32" if platform.device.type == "cpu" else "bf16"
        lines += ["", f"**Overlap** with {args.matmul}x{args.matmul} {dtype} matmuls "
                  f"({o['matmul_tflop_s']:.1f} TFLOP/s alone) sized to each copy: "
                  f"D2H {o['d2h_hidden']:.0%} hidden, H2D {o['h2d_hidden']:.0%}; through "
                  f"SwapManager ({o['manager_group_bytes'] / 2**20:.0f} MiB in 8 storages): "
                  f"offload {o['manager_offload_ms']:.2f} ms, "
                  f"{o['manager_offload_hidden']:.0%} hidden; load "
                  f"{o['manager_load_ms']:.2f} ms, {o['manager_load_hidden']:.0%} hidden."]
    if "preset" in figures:
        lines += ["", f"**The `{PRESET}` preset** against this machine (flagged beyond "
                  f"{TOLERANCE:.0%}):", "", "| figure | preset | measured | off |",
                  "|---|---|---|---|"]
        for row in figures["preset"]:
            mark = "" if row["within"] else " **(differs)**"
            lines.append(f"| {row['figure']} | {row['preset']:.2f} {row['unit']} | "
                         f"{row['measured']:.2f} {row['unit']} | {row['off']:+.0%}{mark} |")
    if "replay" in figures:
        r = figures["replay"]
        if not r["ok"]:
            lines += ["", f"**Replay failed**: {r['error']}"]
        else:
            sizes = " ".join(REPLAY_SIZES["quick" if args.quick else "full"])
            lines += ["", f"**Replay of rank 0**, 1F1B P=8 M=16, Llama bf16 ({sizes}), "
                      "`pipeswap-train --replay-rank 0`; goal: activation peak down >= 60% at "
                      "<= 1.05x step time:", "",
                      "| run | chunks swapped (streamed) | peak activations (counted) | "
                      "peak allocated | step time | goal |", "|---|---|---|---|---|---|"]
            for label, row in r["rows"].items():
                plain = label == "no swap"
                counted, allocated = _bytes(row["counted"]), _bytes(row["allocated"])
                if not plain:
                    counted += f" (-{row['counted_saving']:.0%})"
                    if row["allocated_saving"] is not None:
                        allocated += f" (-{row['allocated_saving']:.0%})"
                step = f"{row['step_s'] * 1e3:.0f} ms"
                if not plain:
                    step += f" ({row['time_ratio']:.2f}x)"
                goal = "-" if plain else ("met" if row["goal_met"] else "not met")
                lines.append(f"| {label} | {row['swapped']} ({row['streamed']}) | {counted} | "
                             f"{allocated} | {step} | {goal} |")
    if "nccl" in figures:
        n = figures["nccl"]
        if "skipped" in n:
            lines += ["", f"**NCCL cases** (`--nccl`): skipped, {n['skipped']}."]
        else:
            lines += ["", f"**NCCL cases** on {n['gpus']} GPUs (`--nccl`; each a command in "
                      f"its own process group, stopped after {n['timeout_s']:.0f} s; "
                      "`--list` shows the commands):", "", "| case | result |", "|---|---|"]
            lines += ["| {} | {} |".format(r["case"], r["line"].replace("|", "\\|"))
                      for r in n["cases"]]
    if platform.device.type == "cpu":
        lines += ["", "This is the CPU platform (worker-thread streams on the same cores as "
                  "the matmuls), not a GPU: `python benchmarks/gpu_check.py --write` on a CUDA "
                  "machine gives the figures this check is for."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None,
                        help="platform to check (default: this machine's accelerator)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and the stress tests only (a smoke run, as CI does "
                             "with --device cpu)")
    parser.add_argument("--skip", action="append", choices=PARTS, default=[],
                        help="leave a part out (repeatable)")
    parser.add_argument("--only", action="append", choices=PARTS, default=[], metavar="PART",
                        help="run only this part (repeatable; --only nccl implies --nccl)")
    parser.add_argument("--nccl", action="store_true",
                        help="also run the multi-process cases over NCCL, one GPU a rank "
                             "(two or more CUDA GPUs; --list shows them)")
    parser.add_argument("--case", dest="cases", action="append", choices=_nccl.NAMES,
                        default=[], metavar="NAME",
                        help=f"with --nccl: only this case (repeatable): "
                             f"{', '.join(_nccl.NAMES)}")
    parser.add_argument("--nccl-timeout", type=float, default=_nccl.TIMEOUT_S, metavar="S",
                        help="seconds an NCCL case may run before it is stopped with its "
                             f"process group (default {_nccl.TIMEOUT_S:.0f})")
    parser.add_argument("--list", action="store_true",
                        help="print the NCCL cases and their commands for this machine, "
                             "and exit")
    parser.add_argument("--mib", type=int, default=None,
                        help="bytes per copy, in MiB (default 1024; 1 with --quick)")
    parser.add_argument("--matmul", type=int, default=None,
                        help="matmul size (default 8192 on accelerators, 256 on CPU; 32 with "
                             "--quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per figure (default 10; 1 with --quick)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--write", action="store_true", help="record results in BENCHMARKS.md")
    args = parser.parse_args(argv)
    gpus = cuda_gpus()
    if args.list:
        shown = gpus if gpus >= 2 else _nccl.MAX_RANKS
        print(f"the NCCL cases of --nccl, as they run on {shown} GPUs"
              f"{'' if shown == gpus else f' (this machine has {gpus})'}:")
        print("\n".join(_nccl.describe(shown)))
        return 0
    if args.nccl_timeout <= 0:
        parser.error(f"--nccl-timeout must be above 0 seconds, got {args.nccl_timeout}")
    args.nccl = args.nccl or "nccl" in args.only or bool(args.cases)
    skip = set(args.skip) | (set(PARTS) - set(args.only) if args.only else set())
    if not args.nccl:
        skip.add("nccl")
    args.skip = sorted(skip)
    device = args.device or available_platforms()[0]
    if "nccl" not in skip and (gpus == 0 or not device.startswith("cuda")):
        where = ("this machine has no CUDA GPU" if gpus == 0 else
                 f"--device {device} is not a CUDA device")
        say(f"gpu_check.py: error: --nccl runs its cases over NCCL on two or more CUDA GPUs, "
            f"one rank a GPU; {where}")
        return 2
    if device == "cpu" and args.device is None:
        parser.error("no accelerator on this machine; pass --device cpu to run the check on "
                     "the CPU platform's worker-thread streams instead")
    if "nccl" not in skip and gpus < 2:
        say("nccl: one CUDA GPU here; the NCCL cases need two or more (one rank a GPU): "
            "skipped, the rest of the check runs")
    args.device = device
    platform = get_platform(device)
    on_cpu = platform.device.type == "cpu"
    args.mib = args.mib or (1 if args.quick else 1024)
    args.matmul = args.matmul or (32 if args.quick else 256 if on_cpu else 8192)
    args.repeats = args.repeats or (1 if args.quick else 10)
    name = (torch.cuda.get_device_name(platform.device) if platform.device.type == "cuda"
            else platform.device.type)
    figures: dict[str, Any] = {"device": name}
    status = 0
    started = time.perf_counter()
    if "tests" not in args.skip:
        say(f"tests on {device} ...")
        figures["tests"] = run_tests(device, args.quick)
        say(f"  {figures['tests']['tally']}")
        status |= not figures["tests"]["ok"]
    if {"copies", "overlap", "preset"} - set(args.skip):
        say(f"copies of {args.mib} MiB and {args.matmul}^2 matmuls on {platform!r} ...")
        check = Check(platform, args.mib << 20, args.matmul, args.repeats)
        if "copies" not in args.skip or "preset" not in args.skip:
            figures["copies"] = copies(check)
        if "overlap" not in args.skip or "preset" not in args.skip:
            figures["overlap"] = overlap(check, args.mib << 20)
        if "preset" not in args.skip:
            figures["preset"] = preset_check(figures["copies"] | figures["overlap"])
        del check
        if platform.device.type == "cuda":  # the replay runs in processes of its own
            torch.cuda.empty_cache()
    if "replay" not in args.skip:
        say("replay of rank 0 (pipeswap-train --replay-rank 0) ...")
        figures["replay"] = replay(device, args.quick)
        status |= not figures["replay"]["ok"]
    if "nccl" not in args.skip:
        figures["nccl"] = nccl(args.cases, gpus, args.nccl_timeout)
        status |= not figures["nccl"]["ok"]
    figures["seconds"] = time.perf_counter() - started
    say(f"done in {figures['seconds']:.0f} s")
    text = report(figures, args, platform, name)
    if args.json:
        print(json.dumps(figures))
        if args.write:
            write_section(SECTION, text)
    else:
        publish(SECTION, text, args.write)
    return status


if __name__ == "__main__":
    sys.exit(main())
