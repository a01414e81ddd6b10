"""What the GPU check measures in its own process (the machine's facts, the host link as
pipeswap probes it, copies and their overlap with compute, the simulator's preset against
them), and its one-rank NCCL probes, each a process of its own:

    python benchmarks/_probes.py NAME    # one probe: a line per step, then one JSON line

A probe runs on ``cuda:0`` as a world of one NCCL rank (``init_process_group("nccl",
device_id=...)`` over a TCP store on 127.0.0.1 at a free port). It looks at what can hang,
so the check runs it in a session of its own and stops its whole process group at its
timeout. It prints ``_probes: step:`` before each step, so that a hang says where, and ends
with one JSON line: ``status`` (ok, FAILED, skipped), ``line`` and its figures.
batch-raise-torch reports what torch does (its batch_isend_irecv opens an NCCL group call
before the operations and closes it with no ``finally``); batch-raise-pipeswap checks
pipeswap's drop-in, which closes that call where an operation raises.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform as host
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeswap.platform import Platform, Stream
from pipeswap.schedule.costs import preset
from pipeswap.swap import SwapManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _nccl  # noqa: E402
from _nccl import Probe, say  # noqa: E402

PRESET = "h200-pcie5"  # the simulator's preset the measured figures are held against
TOLERANCE = 0.10  # a preset figure further than this from the measured one is flagged
WAIT_S = 20.0  # how long a probe waits for a batch on a fresh group
STOP_AFTER_S = 1.0  # abort-releases: how long the host is blocked before the stop
RELEASE_LIMIT_S = 10.0  # abort-releases: a release slower than this fails
QUEUE_S = 0.25  # link: the compute queued before the second probe (0.02 with --quick)
HANG = "a hang here is torch's batch leaving the NCCL group call open, not a pipeswap failure"


def _own(name: str) -> tuple[str, ...]:
    return (sys.executable, "benchmarks/_probes.py", name)


PROBES = (
    Probe("eager-init", "init_process_group and new_group with device_id; an all_reduce on "
          "each", _own("eager-init")),
    Probe("batch-raise-torch", "torch's batch_isend_irecv raising on an aborted group, then "
          "a batch on a fresh group", _own("batch-raise-torch"), hang_means=HANG),
    Probe("batch-raise-pipeswap", "the same through pipeswap's batch_isend_irecv",
          _own("batch-raise-pipeswap")),
    Probe("abort-releases", "a host blocked on a receive that never completes, released by "
          "stop_groups from another thread", _own("abort-releases")),
    Probe("torchrun-watch", "nccl_job.py torchrun on one process: plain "
          "init_process_group(\"nccl\") under torchrun, then the executor",
          tuple(_nccl.torchrun(1)), timeout_s=120.0, read=_nccl.read_torchrun),
)


# -- the machine's facts --------------------------------------------------------------------


def facts(platform: Platform) -> dict[str, Any]:
    """What the figures were measured on: the GPU (from torch.cuda and nvidia-smi where
    present), the software, the host's CPUs and memory."""
    found: dict[str, Any] = {
        "platform": str(platform.device), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "python": host.python_version(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "host_ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    if platform.device.type == "cuda":
        props = torch.cuda.get_device_properties(platform.device)
        found |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory,
                  "gpus": torch.cuda.device_count(), "capability": f"{props.major}.{props.minor}",
                  "nccl": nccl_version()}
    else:
        found |= {"gpu": None, "note": "the CPU platform: no GPU is used"}
    return found | nvidia_smi()


def nccl_version() -> str:
    """The NCCL torch was built with, as 2.27.5."""
    version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def nvidia_smi() -> dict[str, Any]:
    """The driver and the CUDA version it supports, from nvidia-smi's header; nothing
    without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"nvidia_smi": f"failed: {exc}"}
    driver = re.search(r"Driver Version:\s*(\S+)", out.stdout)
    cuda = re.search(r"CUDA Version:\s*(\S+)", out.stdout)
    if out.returncode != 0 or driver is None:
        return {"nvidia_smi": f"failed: {_nccl.first_error(out.stdout + out.stderr)}"}
    return {"driver": driver.group(1), "driver_cuda": cuda.group(1) if cuda else None}


# -- the host link as pipeswap measures it -------------------------------------------------


def link(platform: Platform, matmul: int, queue_s: float) -> dict[str, Any]:
    """pipeswap's link probe (``probe_link``, what a measured plan weighs) on an idle device,
    then again right after about ``queue_s`` of matmuls were queued on the compute stream:
    its copies must start after that compute (they use memory it may still use)."""
    from pipeswap.runtime.executor.measurements import PROBE_BYTES, PROBE_REPEATS, probe_link

    def probe() -> dict[str, Any]:
        start = time.perf_counter()
        found = probe_link(platform)
        return {"d2h_gb_s": found.d2h_bandwidth / 1e9, "h2d_gb_s": found.h2d_bandwidth / 1e9,
                "duplex": found.duplex, "probe_s": time.perf_counter() - start}

    idle = probe()
    dtype = torch.float32 if platform.device.type == "cpu" else torch.bfloat16
    a = torch.randn(matmul, matmul, device=platform.device, dtype=dtype)
    b = torch.randn(matmul, matmul, device=platform.device, dtype=dtype)
    compute = platform.current_stream()
    torch.mm(a, b)  # warm-up: kernel selection
    compute.synchronize()
    start = time.perf_counter()
    torch.mm(a, b)
    compute.synchronize()
    # about queue_s of them, no more than a CUDA launch queue holds without blocking the host
    count = min(1000, max(1, math.ceil(queue_s / max(time.perf_counter() - start, 1e-6))))
    done = platform.new_event()
    for _ in range(count):
        torch.mm(a, b)
    done.record(compute)
    queued = not done.query()
    behind = probe() | {"matmuls": count, "matmul_size": matmul, "compute_queued": queued}
    behind["after_compute"] = done.query()  # the probe returned once the compute had ended
    return idle | {"queued": behind, "ok": behind["after_compute"] or not queued,
                   "probe_bytes": PROBE_BYTES, "probe_repeats": PROBE_REPEATS}


# -- copies and overlap, raw and through SwapManager; the preset --------------------------


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


def measure(args: argparse.Namespace, platform: Platform) -> dict[str, Any]:
    """Copies, overlap and the preset, as far as asked (the preset needs the other two)."""
    say(f"copies of {args.mib} MiB and {args.matmul}^2 matmuls on {platform!r} ...")
    check = Check(platform, args.mib << 20, args.matmul, args.repeats)
    found: dict[str, Any] = {}
    if "copies" not in args.skip or "preset" not in args.skip:
        found["copies"] = copies(check)
    if "overlap" not in args.skip or "preset" not in args.skip:
        found["overlap"] = overlap(check, args.mib << 20)
    if "preset" not in args.skip:
        found["preset"] = preset_check(found["copies"] | found["overlap"])
    del check
    if platform.device.type == "cuda":  # the replay runs in processes of its own
        torch.cuda.empty_cache()
    return found


# -- the probes themselves (in their own process) -------------------------------------------


def step(text: str) -> None:
    print(f"{_nccl.PROBE_STEP} {text}", flush=True)


def _first_line(exc: BaseException) -> str:
    line = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    return line if len(line) <= 240 else line[:237] + "..."


def _init(device: torch.device) -> float:
    """This process as a world of one NCCL rank bound to ``device`` (eager set-up), over a
    TCP store on 127.0.0.1 at a free port; the seconds init_process_group took."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, unstubbed

    torch.cuda.set_device(device)
    store = TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    step(f"init_process_group(\"nccl\", device_id={device}) over a TCP store, port "
         f"{store.port}")
    start = time.perf_counter()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    return time.perf_counter() - start


def eager_init(device: torch.device) -> dict[str, Any]:
    init_s = _init(device)
    step(f"new_group([0], device_id={device})")
    start = time.perf_counter()
    group = dist.new_group([0], device_id=device)
    group_s = time.perf_counter() - start
    step("an all_reduce of one element on each group")
    start = time.perf_counter()
    values = []
    for each in (None, group):
        tensor = torch.full((1,), 3.0, device=device)
        dist.all_reduce(tensor, group=each)
        values.append(tensor.item())
    reduce_s = time.perf_counter() - start
    version = nccl_version()
    ok = values == [3.0, 3.0]
    line = (f"init_process_group {init_s:.2f} s, new_group {group_s:.2f} s (both with "
            f"device_id), an all_reduce on each {'gave' if ok else 'did NOT give'} the right "
            f"value ({reduce_s:.2f} s); NCCL {version}")
    return {"status": "ok" if ok else "FAILED", "line": f"{'ok' if ok else 'FAILED'}: {line}",
            "init_s": init_s, "group_s": group_s, "all_reduce_s": reduce_s, "nccl": version}


def _self_batch(group: dist.ProcessGroup, device: torch.device, value: float
                ) -> tuple[list[dist.P2POp], torch.Tensor]:
    """A send of ``value`` to this rank and its receive, and the tensor that receives."""
    send = torch.full((1,), value, device=device)
    received = torch.zeros(1, device=device)
    return ([dist.P2POp(dist.isend, send, 0, group), dist.P2POp(dist.irecv, received, 0, group)],
            received)


def _outcome(works: list[dist.Work], received: torch.Tensor, value: float) -> str:
    """How a posted self batch ended, waited for up to WAIT_S on this thread."""
    deadline = time.monotonic() + WAIT_S
    while not all(work.is_completed() for work in works):
        if time.monotonic() > deadline:
            return f"did not complete in {WAIT_S:.0f} s"
        time.sleep(0.01)
    for work in works:
        work.wait()
    got = received.item()
    return "completed" if got == value else (
        f"completed without its data (the receive holds {got:g}, not {value:g}: its "
        "operations never ran)")


def batch_raise(device: torch.device, pipeswap: bool) -> dict[str, Any]:
    """A batch raising on an aborted group, then a batch on a fresh group."""
    from pipeswap.runtime.distributed import transport

    post: Callable[[list[dist.P2POp]], list[dist.Work]] = (
        transport.batch_isend_irecv if pipeswap else dist.batch_isend_irecv)
    whose = "pipeswap's" if pipeswap else "torch's"
    _init(device)
    step(f"new_group([0], device_id={device}), then its abort()")
    doomed = dist.new_group([0], device_id=device)
    doomed.abort()
    step(f"a self send and receive through {whose} batch_isend_irecv on the aborted group")
    raised = None
    try:
        post(_self_batch(doomed, device, 1.0)[0])
    except Exception as exc:  # noqa: BLE001 - what it raised is the figure
        raised = _first_line(exc)
    step(f"a fresh group: new_group([0], device_id={device})")
    fresh = dist.new_group([0], device_id=device)
    step(f"a self batch on the fresh group, waited for up to {WAIT_S:.0f} s")
    ops, received = _self_batch(fresh, device, 2.0)
    start = time.perf_counter()
    outcome = _outcome(post(ops), received, 2.0)
    seconds = time.perf_counter() - start
    completed = outcome == "completed"
    status = "ok" if completed or not pipeswap else "FAILED"
    line = (f"{status}: {whose} batch_isend_irecv on an aborted group "
            + (f"raised ({raised})" if raised else "did not raise")
            + f"; a self batch on a fresh group then {outcome}"
            + (f" in {seconds:.2f} s" if completed else "")
            + (f": {whose} batch left the NCCL group call open" if raised and not completed
               else ""))
    return {"status": status, "line": line, "raised": raised, "fresh_batch": outcome,
            "fresh_s": seconds}


def abort_releases(device: torch.device) -> dict[str, Any]:
    """A receive from self with no send, the host blocked on it, stop_groups from another
    thread after STOP_AFTER_S: whether and when the host was released."""
    from pipeswap.runtime.distributed.peer_watch import stop_groups

    _init(device)
    group = dist.new_group([0], device_id=device)
    step("a receive from self with no send")
    try:
        work = dist.irecv(torch.zeros(1, device=device), src=0, group=group)
        if work is None:
            raise RuntimeError("irecv returned no work: this rank is not in the group")
    except Exception as exc:  # noqa: BLE001 - NCCL may refuse it: the figure
        start = time.perf_counter()
        stop_groups([group])
        stop_s = time.perf_counter() - start
        return {"status": "skipped", "posted": False, "refused": _first_line(exc),
                "stop_s": stop_s,
                "line": f"skipped: NCCL refused a receive from self with no send "
                        f"({_first_line(exc)}), so one GPU holds no receive that waits; "
                        f"stop_groups on the group returned in {stop_s:.2f} s"}
    stopped: list[float] = []

    def stop() -> None:
        stopped.append(time.perf_counter())
        stop_groups([group])

    timer = threading.Timer(STOP_AFTER_S, stop)
    timer.daemon = True
    timer.start()
    step(f"the host waits on the receive; stop_groups([group]) after {STOP_AFTER_S:.0f} s "
         "from another thread")
    start, error = time.perf_counter(), None
    try:
        work.wait()
        torch.cuda.current_stream().synchronize()
    except Exception as exc:  # noqa: BLE001 - how the wait ended is the figure
        error = _first_line(exc)
    end = time.perf_counter()
    timer.cancel()
    ended = f"the wait ended {'with ' + error if error else 'without an error'}"
    if not stopped:
        return {"status": "skipped", "posted": True, "blocked_s": end - start, "error": error,
                "line": f"skipped: the receive did not hold the host ({ended} after "
                        f"{end - start:.2f} s, before stop_groups)"}
    release_s = end - stopped[0]
    status = "ok" if release_s <= RELEASE_LIMIT_S else "FAILED"
    return {"status": status, "posted": True, "release_s": release_s, "error": error,
            "line": f"{status}: the host, blocked on a receive that never completes, was "
                    f"released {release_s:.2f} s after stop_groups ({ended})"}


BODIES: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "eager-init": eager_init,
    "batch-raise-torch": lambda device: batch_raise(device, pipeswap=False),
    "batch-raise-pipeswap": lambda device: batch_raise(device, pipeswap=True),
    "abort-releases": abort_releases,
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="_probes.py", description=__doc__,
        epilog="\n".join(f"{probe.name}: {probe.what}" for probe in PROBES
                         if probe.name in BODIES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=sorted(BODIES))
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own reason, in the probe's log
    try:
        if not torch.cuda.is_available():
            result = {"status": "skipped", "line": "skipped: needs CUDA"}
        else:
            result = BODIES[args.probe](torch.device("cuda", 0))
    except Exception as exc:  # noqa: BLE001 - one line; the traceback goes to the log
        traceback.print_exc()
        result = {"status": "FAILED", "line": f"FAILED: {_first_line(exc)}"}
    print(json.dumps(result), flush=True)
    return 0 if result["status"] in ("ok", "skipped") else 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: a probe may leave an aborted or hung communicator behind,
    # whose destruction could block the exit.
    os._exit(code)
