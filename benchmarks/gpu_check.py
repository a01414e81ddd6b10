"""The GPU check: is pipeswap correct on a real accelerator, and do its copies hide? One
command, on one GPU, within 9 minutes in all:

    python benchmarks/gpu_check.py                        # this machine's GPU (<= 9 min)
    python benchmarks/gpu_check.py --write                # also record it (below)
    python benchmarks/gpu_check.py --json                 # one JSON object, every part's results
    python benchmarks/gpu_check.py --device cpu --quick   # every part, tiny, on the CPU platform
    python benchmarks/gpu_check.py --nccl                 # also the NCCL cases (2+ GPUs)
    python benchmarks/gpu_check.py --only nccl            # the NCCL cases alone
    python benchmarks/gpu_check.py --list                 # the NCCL cases and their commands

The run has a budget, ``--budget-s`` (default 540 s; with ``--nccl``, ``--nccl-timeout`` more
for each NCCL case). Each part runs under its own timeout, cut to what is left of the budget;
a part (a probe, a replay run, an NCCL case) that would start with less left than it needs
is skipped with a line saying so. A part run in this process that outlives its timeout stops
the check, which then reports what it has. Parts, in this order (``--skip PART`` leaves one
out, ``--only PART`` runs only the parts named; each prints as it goes):

facts    the machine: the GPU, its memory, the driver and the CUDA version it supports
         (torch.cuda, nvidia-smi), torch, CUDA and NCCL versions, CPUs, host memory.
probes   one-rank NCCL probes on cuda:0, each a process of its own (``_probes.py NAME``),
         stopped with its whole process group at its timeout: eager-init
         (init_process_group and new_group with device_id; an all_reduce on each),
         batch-raise-torch and batch-raise-pipeswap (torch's batch_isend_irecv, then
         pipeswap's, raising on an aborted group; does a batch on a fresh group then
         complete? torch's leaving the NCCL group call open is reported, not failed),
         abort-releases (a host blocked on a receive, released by peer_watch.stop_groups
         from another thread) and torchrun-watch (nccl_job.py torchrun on one process).
         Each prints one line: ok, FAILED with the first error line, TIMED OUT and at
         which step, or skipped and why. On the CPU platform: skipped, needs CUDA.
link     pipeswap's own link probe (``probe_link``, what a measured swap plan weighs):
         D2H and H2D bandwidth and duplex on an idle device, then behind matmuls queued on
         the compute stream, whose end its copies must wait for.
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
         heads) on sequences of 4096 tokens in bf16 (4 layers a stage), replayed alone
         (``pipeswap-train --replay-rank 0``): peaks (counted and the allocator's) and step
         time without swap, swapping whole chunks, and streaming layer by layer. Goal:
         activation peak down >= 60% at <= 1.05x step time.
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

``--json`` prints one JSON object with every part's results. ``--write`` puts the report's
tables in BENCHMARKS.md and the JSON in benchmarks/results/gpu_check.json.

The exit status is 1 when the tests fail, a probe fails or times out (save torch's own batch
hanging, which is what that probe looks for), the link probe's copies do not wait for queued
compute, a replay run fails, a part outlives its timeout or an NCCL case fails or times out,
else 0 (a goal missed, or a part skipped for the budget, is reported, not an error); 2 for a
check this machine cannot run (no accelerator; ``--nccl`` without CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from pipeswap.platform import Platform, available_platforms, get_platform

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _nccl  # noqa: E402
import _probes  # noqa: E402
from _nccl import say  # noqa: E402
from _probes import PRESET, TOLERANCE  # noqa: E402
from _report import machine, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## GPU check (`benchmarks/gpu_check.py`)"
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
PARTS = ("facts", "probes", "link", "tests", "copies", "overlap", "preset", "replay", "nccl")
#: the replayed pipeline: P=8 M=16, one sequence a microbatch, Llama layers, 4 a stage
REPLAY = ["--schedule", "1f1b", "--ranks", "8", "--microbatches", "16", "--batch-size", "16",
          "--model", "llama", "--dtype", "bf16", "--replay-rank", "0"]
REPLAY_SIZES = {"full": ["--width", "4096", "--heads", "32", "--seq-len", "4096",
                         "--layers", "32", "--steps", "4"],
                "quick": ["--width", "64", "--heads", "4", "--seq-len", "64", "--layers", "16",
                          "--steps", "2"]}
QUICK_TESTS = "reused or round_trip or allocator"  # pytest -k of --quick: the stress tests
BUDGET_S = 540.0  # the whole run on one GPU: 9 minutes
#: seconds of the budget each part needs left to start, and its timeout (a probe's and an
#: NCCL case's are their own); "copies" covers copies, overlap and preset, "replay" is a run
NEEDS_S = {"facts": 5.0, "probe": 20.0, "link": 10.0, "tests": 60.0, "copies": 20.0,
           "replay": 30.0, "nccl": 30.0}
TIMEOUT_S = {"facts": 30.0, "link": 60.0, "tests": 300.0, "copies": 150.0, "replay": 150.0}
T = TypeVar("T")


# -- the budget -----------------------------------------------------------------------------


class Budget:
    """The run's seconds. A part starts only while at least what it needs is left, and
    runs under its own timeout cut to what is left, so that the whole check ends in time;
    a part that does not fit is skipped with a line (in ``skipped``)."""

    def __init__(self, total_s: float, overrun: Callable[[str, float], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_s, self.overrun, self.clock = total_s, overrun, clock
        self.start = clock()
        self.skipped: dict[str, str] = {}

    def left(self) -> float:
        return self.total_s - (self.clock() - self.start)

    def timeout(self, name: str, needs_s: float, limit_s: float) -> float | str:
        """``name``'s timeout: ``limit_s``, or what is left if less; when less than
        ``needs_s`` is left, the line saying it is skipped (kept in ``skipped``)."""
        left = self.left()
        if left >= needs_s:
            return min(limit_s, left)
        line = (f"skipped: {max(left, 0.0):.0f} s of the {self.total_s:.0f} s budget left, it "
                f"needs {needs_s:.0f}")
        self.skipped[name] = line
        say(f"{name}: {line}")
        return line

    def fit(self, kind: str) -> _nccl.Fit:
        """The timeouts of the commands of ``kind`` (probe, nccl), each needing
        ``NEEDS_S[kind]`` to start."""
        return lambda name, limit_s: self.timeout(name, NEEDS_S[kind], limit_s)

    @contextmanager
    def guard(self, name: str, timeout_s: float) -> Iterator[None]:
        """Call ``overrun(name, timeout_s)`` from another thread if the block outlives
        ``timeout_s``: a part run in this process cannot be stopped, only reported."""
        timer = threading.Timer(timeout_s, self.overrun, (name, timeout_s))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def run(self, part: str, work: Callable[[], T]) -> T | None:
        """``work()`` as part ``part`` of this process, guarded by its timeout; None when it
        does not fit the budget."""
        timeout = self.timeout(part, NEEDS_S[part], TIMEOUT_S[part])
        if isinstance(timeout, str):
            return None
        with self.guard(part, timeout):
            return work()


# -- tests ----------------------------------------------------------------------------------


def run_tests(device: str, quick: bool, timeout_s: float) -> dict[str, Any]:
    """The platform and swap packages' tests on ``device``; pytest's tally."""
    command = [sys.executable, "-m", "pytest", "packages/pipeswap-platform/tests",
               "packages/pipeswap-swap/tests", "-q", "-p", "no:cacheprovider",
               *(["-k", QUICK_TESTS] if quick else [])]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PIPESWAP_TEST_DEVICE": device},
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "tally": f"stopped after {timeout_s:.0f} s (hung?)",
                "seconds": timeout_s, "passed": 0, "failed": 0, "skipped": 0}
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


# -- the replay -----------------------------------------------------------------------------


def replay(device: str, quick: bool, budget: Budget) -> dict[str, Any]:
    """pipeswap-train --replay-rank 0 twice: without swap and swapping whole chunks, then
    streaming only, each run under its own timeout; each run's per-rank entry."""
    base = [sys.executable, "-m", "pipeswap.runtime.train", *REPLAY, "--device", device,
            *REPLAY_SIZES["quick" if quick else "full"], "--json"]
    results: dict[str, Any] = {}
    for name, extra in (("chunk", ["--swap-granularity", "chunk"]),
                        ("layer", ["--swap-granularity", "layer", "--swap-only"])):
        run = f"replay, {'no swap and whole chunks' if name == 'chunk' else 'streaming'}"
        timeout = budget.timeout(run, NEEDS_S["replay"], TIMEOUT_S["replay"])
        if isinstance(timeout, str):
            return {"ok": True, "skipped": f"{run}: {timeout}"}
        say(f"  {run} ...")
        start = time.perf_counter()
        try:
            done = subprocess.run([*base, *extra], cwd=ROOT, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"{' '.join(base[2:])} {' '.join(extra)} stopped "
                                          f"after {timeout:.0f} s"}
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


# -- the report -----------------------------------------------------------------------------


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.2f} MiB"


def report(figures: dict[str, Any], args: argparse.Namespace, platform: Platform) -> str:
    lines = [f"Measured {datetime.date.today().isoformat()} on {figures['device']} (host: "
             f"{machine()}); torch {torch.__version__}{'; --quick sizes' if args.quick else ''};"
             f" {figures['seconds']:.0f} s of a {figures['budget']['total_s']:.0f} s budget."]
    if "stopped" in figures:
        lines += ["", f"**Stopped early**: {figures['stopped']}; the parts after it did not run."]
    if "facts" in figures:
        lines += ["", _facts_line(figures["facts"])]
    if "probes" in figures:
        lines += _nccl.probe_lines(figures["probes"])
    if "link" in figures:
        lines += ["", _link_line(figures["link"])]
    tests = figures.get("tests")
    if tests:
        lines += ["", f"**Tests on {args.device}** (platform and swap packages"
                  f"{', stress tests only' if args.quick else ''}): {tests['tally']} in "
                  f"{tests['seconds']:.0f} s."]
    lines += _measured_lines(figures, args, platform)
    if "replay" in figures:
        lines += _replay_lines(figures["replay"], args.quick)
    if "nccl" in figures:
        lines += _nccl.case_lines(figures["nccl"])
    if figures["budget"]["skipped"]:
        lines += ["", "**Skipped for the budget**: " + "; ".join(
            f"{name}, {line}" for name, line in figures["budget"]["skipped"].items()) + "."]
    if platform.device.type == "cpu":
        lines += ["", "This is the CPU platform (worker-thread streams on the same cores as "
                  "the matmuls), not a GPU: `python benchmarks/gpu_check.py --write` on a CUDA "
                  "machine gives the figures this check is for."]
    return "\n".join(lines) + "\n"


def _facts_line(found: dict[str, Any]) -> str:
    gib = 2**30
    software = f"torch {found['torch']}, Python {found['python']}"
    where = (f"{found['cpus']} CPUs ({found['cpus_usable']} usable), "
             f"{found['host_ram_bytes'] / gib:.0f} GiB host memory")
    if found["gpu"] is None:
        return f"**Machine**: the CPU platform, no GPU used; {software}; {where}."
    driver = (f"driver {found['driver']} (CUDA {found['driver_cuda']}), " if "driver" in found
              else f"nvidia-smi {found['nvidia_smi']}, " if "nvidia_smi" in found
              else "no nvidia-smi, ")
    return (f"**Machine**: {found['gpus']} x {found['gpu']} ({found['gpu_memory_bytes'] / gib:.1f}"
            f" GiB, compute capability {found['capability']}); {driver}{software} built for "
            f"CUDA {found['torch_cuda']}, NCCL {found['nccl']}; {where}.")


def _link_line(found: dict[str, Any]) -> str:
    def figures(entry: dict[str, Any]) -> str:
        return (f"D2H {entry['d2h_gb_s']:.1f} GB/s, H2D {entry['h2d_gb_s']:.1f} GB/s, "
                f"{'duplex' if entry['duplex'] else 'not duplex'}")

    queued = found["queued"]
    if not queued["compute_queued"]:
        order = "the matmuls ran before the probe (nothing was queued)"
    elif queued["after_compute"]:
        order = "its copies started after the queued compute"
    else:
        order = "**its copies did not wait for the queued compute**"
    return (f"**Host link** as pipeswap measures it (`probe_link`, "
            f"{found['probe_bytes'] >> 20} MiB each way, best of {found['probe_repeats']}): "
            f"idle, {figures(found)}; behind {queued['matmuls']} queued "
            f"{queued['matmul_size']}^2 matmuls, {figures(queued)} ({queued['probe_s']:.2f} s "
            f"with the wait): {order}.")


def _measured_lines(figures: dict[str, Any], args: argparse.Namespace, platform: Platform
                    ) -> list[str]:
    lines: list[str] = []
    pinned = "pinned" if platform.pins_host_memory else "pageable"
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
    return lines


def _replay_lines(r: dict[str, Any], quick: bool) -> list[str]:
    if "skipped" in r:
        return ["", f"**Replay**: {r['skipped']}."]
    if not r["ok"]:
        return ["", f"**Replay failed**: {r['error']}"]
    sizes = " ".join(REPLAY_SIZES["quick" if quick else "full"])
    lines = ["", f"**Replay of rank 0**, 1F1B P=8 M=16, Llama bf16 ({sizes}), "
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
    return lines


# -- the command ----------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--budget-s", type=float, default=None, metavar="S",
                        help=f"seconds the whole run may take (default {BUDGET_S:.0f}; with "
                             "--nccl, --nccl-timeout more for each NCCL case): each part runs "
                             "under its own timeout, cut to what is left, and a part that "
                             "does not fit is skipped with a line")
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
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with every part's results")
    parser.add_argument("--write", action="store_true",
                        help="record the report in BENCHMARKS.md and the JSON in "
                             "benchmarks/results/gpu_check.json")
    return parser


def run_parts(args: argparse.Namespace, platform: Platform, gpus: int, budget: Budget,
              figures: dict[str, Any]) -> int:
    """Each part not skipped, in order, its results put in ``figures``; the exit status."""
    skip, device, status = set(args.skip), args.device, 0
    if "facts" not in skip and (found := budget.run("facts", lambda: _probes.facts(platform))):
        figures["facts"] = found
        say(_facts_line(found).replace("**", ""))
    if "probes" not in skip:
        figures["probes"] = _nccl.run_probes(_probes.PROBES, platform.device.type == "cuda",
                                             budget.fit("probe"))
        status |= not figures["probes"]["ok"]
    if "link" not in skip:
        say("link: pipeswap's probe_link, idle, then behind queued matmuls ...")
        queue_s = 0.02 if args.quick else _probes.QUEUE_S
        if found := budget.run("link", lambda: _probes.link(platform, args.matmul, queue_s)):
            figures["link"] = found
            say(f"  {_link_line(found).replace('**', '')}")
            status |= not found["ok"]
    if "tests" not in skip and not isinstance(
            timeout := budget.timeout("tests", NEEDS_S["tests"], TIMEOUT_S["tests"]), str):
        say(f"tests on {device} ...")
        figures["tests"] = run_tests(device, args.quick, timeout)
        say(f"  {figures['tests']['tally']}")
        status |= not figures["tests"]["ok"]
    if {"copies", "overlap", "preset"} - skip:
        figures |= budget.run("copies", lambda: _probes.measure(args, platform)) or {}
    if "replay" not in skip:
        say("replay of rank 0 (pipeswap-train --replay-rank 0) ...")
        figures["replay"] = replay(device, args.quick, budget)
        status |= not figures["replay"]["ok"]
    if "nccl" not in skip:
        figures["nccl"] = _nccl.run_cases(args.cases, gpus, args.nccl_timeout,
                                          budget.fit("nccl"))
        status |= not figures["nccl"]["ok"]
    return status


def finish(figures: dict[str, Any], args: argparse.Namespace, platform: Platform,
           budget: Budget, done: threading.Lock) -> None:
    """Print the results (the report, or one JSON object with --json); with --write, put
    the report in BENCHMARKS.md and the JSON in benchmarks/results/. Once a run: ``done``
    is held from here on, so a part outliving its timeout cannot print a second time."""
    done.acquire()
    figures["seconds"] = budget.total_s - budget.left()
    figures["budget"] = {"total_s": budget.total_s, "skipped": dict(budget.skipped)}
    say(f"done in {figures['seconds']:.0f} s of a {budget.total_s:.0f} s budget")
    text = report(figures, args, platform)
    print(json.dumps(figures) if args.json else text, flush=True)
    if args.write:
        write_section(SECTION, text)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(figures, indent=1) + "\n")
        say(f"recorded in BENCHMARKS.md and {RESULTS}")


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.list:
        shown = gpus if gpus >= 2 else _nccl.MAX_RANKS
        print(f"the NCCL cases of --nccl, as they run on {shown} GPUs"
              f"{'' if shown == gpus else f' (this machine has {gpus})'}:")
        print("\n".join(_nccl.describe(shown)))
        return 0
    if args.nccl_timeout <= 0:
        cli.error(f"--nccl-timeout must be above 0 seconds, got {args.nccl_timeout}")
    if args.budget_s is not None and args.budget_s <= 0:
        cli.error(f"--budget-s must be above 0 seconds, got {args.budget_s}")
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
        cli.error("no accelerator on this machine; pass --device cpu to run the check on "
                  "the CPU platform's worker-thread streams instead")
    if "nccl" not in skip and gpus < 2:
        say("nccl: one CUDA GPU here; the NCCL cases need two or more (one rank a GPU): "
            "skipped, the rest of the check runs")
    if args.budget_s is None:
        cases = len(set(args.cases or _nccl.NAMES)) if "nccl" not in skip and gpus >= 2 else 0
        args.budget_s = BUDGET_S + cases * args.nccl_timeout
    args.device = device
    platform = get_platform(device)
    on_cpu = platform.device.type == "cpu"
    args.mib = args.mib or (1 if args.quick else 1024)
    args.matmul = args.matmul or (32 if args.quick else 256 if on_cpu else 8192)
    args.repeats = args.repeats or (1 if args.quick else 10)
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(platform.device)
                               if platform.device.type == "cuda" else platform.device.type}
    done = threading.Lock()

    def overrun(part: str, timeout_s: float) -> None:
        say(f"{part}: still running after its {timeout_s:.0f} s timeout: the check stops "
            "here and reports what it has")
        figures["stopped"] = f"{part} outlived its {timeout_s:.0f} s timeout"
        try:
            finish(figures, args, platform, budget, done)
        finally:
            os._exit(1)

    budget = Budget(args.budget_s, overrun)
    status = run_parts(args, platform, gpus, budget, figures)
    finish(figures, args, platform, budget, done)
    return status


if __name__ == "__main__":
    sys.exit(main())
