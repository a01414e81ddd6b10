"""The multi-process NCCL cases of ``gpu_check.py --nccl``: what each runs, and running one.

Each case is one command through a public entry point (``pipeswap-train``, torchrun, or
``benchmarks/nccl_job.py``, which uses :func:`pipeswap.runtime.distributed.launch.spawn`),
started in a session of its own. A case that outlives its timeout is stopped with its whole
process group (SIGTERM, then SIGKILL a few seconds later); a case that exits but leaves
processes of its group running fails, and they are killed. Each gives one result line:
``ok``, ``FAILED`` with the first error line of its output, ``TIMED OUT after N s``, or
``skipped: why``.

The GPU check's one-rank probes run the same way, one command each (``_probes.py NAME``, or
torchrun on one process); a probe's result is the last JSON line it prints.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JOB = "benchmarks/nccl_job.py"
MAX_RANKS = 4  # the cases use at most this many GPUs (pipeline ranks, or ranks x replicas)
TIMEOUT_S = 180.0  # a case's default limit; its ranks wait RANK_TIMEOUT_S for a peer
RANK_TIMEOUT_S = 60
GRACE_S = 5.0  # SIGTERM to SIGKILL
STRAY_WAIT_S = 3.0  # how long processes of a case that exited may take to end by themselves
LOSS_TOLERANCE = 1e-3  # swap may change a loss only by the noise of nondeterministic kernels
#: the first line of the output that says what went wrong
ERROR_LINE = re.compile(r"FAILED|error:|^\s*[\w.]*(Error|Exception)\b")
#: training job sizes: small, so a case is start-up (CUDA, NCCL) plus seconds
TRAIN_SIZES = ["--seq-len", "64", "--width", "128", "--heads", "4", "--steps", "3",
               "--timeout", str(RANK_TIMEOUT_S), "--json"]


#: a part's timeout for a command of ``name`` whose own limit is the float, or the line
#: saying why it is skipped (the GPU check's budget)
Fit = Callable[[str, float], "float | str"]
PROBE_TIMEOUT_S = 60.0  # a probe's limit: start-up, NCCL set-up, a wait of 20 s at most
PROBE_STEP = "_probes: step:"  # a probe's line before each step, so that a hang says where


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class CaseFailed(Exception):
    """The case ran to its end but what it printed shows a failure."""


@dataclass(frozen=True)
class Case:
    """One NCCL case: ``gpus`` it needs at least, the command for this machine's GPU count,
    and how to read its output when it exits 0 (a detail for the ok line, or CaseFailed)."""

    name: str
    what: str
    gpus: int
    command: Callable[[int], list[str]]
    read: Callable[[str], str]


def ranks_for(gpus: int) -> int:
    return max(2, min(gpus, MAX_RANKS))


def python() -> list[str]:
    return [sys.executable]


def read_train(output: str) -> str:
    """pipeswap-train --json: every loss finite, and with swap equal to those without."""
    lines = [line for line in output.splitlines() if line.startswith("{")]
    if not lines:
        raise CaseFailed("pipeswap-train printed no JSON summary")
    summary = json.loads(lines[-1])
    losses = [loss for mode in summary["losses"].values() for loss in mode]
    if not losses or not all(math.isfinite(loss) for loss in losses):
        raise CaseFailed(f"losses {summary['losses']}")
    diff = summary["max_abs_loss_diff"]
    if diff is not None and diff > LOSS_TOLERANCE:
        raise CaseFailed(f"losses with swap differ from those without by {diff:.2e}")
    swapped = sum(entry["swapped_chunks"] for entry in summary["per_rank"])
    same = "bit-identical" if summary["losses_match"] else f"within {diff:.1e}"
    return (f"{len(summary['per_rank'])} ranks, losses {same} with and without swap "
            f"({swapped} chunks swapped)")


def read_job(output: str) -> str:
    """nccl_job.py: its ok line (under torchrun, the one of the rank with the losses)."""
    lines = [line.split(":", 2)[2].strip() for line in output.splitlines()
             if line.startswith("nccl_job: ok:")]
    if not lines:
        raise CaseFailed("nccl_job.py printed no ok line")
    return max(lines, key=len)


def torchrun(ranks: int) -> list[str]:
    """nccl_job.py's torchrun job under torchrun, one process a GPU (the one-rank probe of
    the GPU check runs it with one)."""
    return [*python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(ranks), JOB, "torchrun"]


def _train(gpus: int, *options: str) -> list[str]:
    return [*python(), "-m", "pipeswap.runtime.train", "--device", "cuda", *options,
            *TRAIN_SIZES]


CASES = (
    Case("batch-p2p", "pipeswap-train, 1F1B with --batch-p2p (neighbouring sends and "
         "receives in one batch_isend_irecv), without and with swap", 2,
         lambda gpus: _train(gpus, "--schedule", "1f1b", "--batch-p2p", "--ranks",
                             str(ranks_for(gpus)), "--microbatches", str(2 * ranks_for(gpus)),
                             "--batch-size", str(4 * ranks_for(gpus))),
         read_train),
    Case("pytree", "stage boundaries of several tensors (a dict, then tuples: two with "
         "gradients, int64 ids, a float mask), interleaved 1F1B with swap, against the "
         "unsplit model", 2,
         lambda gpus: [*python(), JOB, "pytree", "--ranks", str(ranks_for(gpus)),
                       "--timeout", str(RANK_TIMEOUT_S)],
         read_job),
    Case("recover", "a rank raises mid-step (forward, then backward): its peers get "
         "PeerFailedError naming it, recover(), the next step matches a clean one", 2,
         lambda gpus: [*python(), JOB, "recover", "--ranks", str(ranks_for(gpus)),
                       "--timeout", str(RANK_TIMEOUT_S)],
         read_job),
    Case("fsdp-dp", "pipeswap-train --ranks 2 --dp 2 --fsdp: 2 pipelines x 2 FSDP2 shards, "
         "without and with swap", 4,
         lambda gpus: _train(gpus, "--schedule", "1f1b", "--ranks", "2", "--dp", "2",
                             "--fsdp", "--microbatches", "4", "--batch-size", "16"),
         read_train),
    Case("torchrun", "torchrun; the script calls plain init_process_group(\"nccl\") and "
         "builds the executor on that group: 1F1B with swap", 2,
         lambda gpus: torchrun(ranks_for(gpus)), read_job),
)
NAMES = tuple(case.name for case in CASES)


def describe(gpus: int) -> list[str]:
    """Each case's name, what it checks and its command on ``gpus`` GPUs (or why it would be
    skipped), for ``gpu_check.py --list``."""
    lines = []
    for case in CASES:
        lines.append(f"{case.name}: {case.what}")
        if gpus < case.gpus:
            lines.append(f"    skipped on {gpus} GPUs: needs {case.gpus}")
        else:
            lines.append(f"    $ {shown(case.command(gpus))}")
    return lines


def shown(command: list[str]) -> str:
    return " ".join(["python", *command[1:]] if command[0] == sys.executable else command)


def error_line(output: str) -> str | None:
    """The first line of ``output`` that says what failed, if one does."""
    lines = (line.strip() for line in output.splitlines())
    found = next((line for line in lines if ERROR_LINE.search(line)), None)
    return None if found is None else _short(found)


def first_error(output: str) -> str:
    """The first line of ``output`` that says what failed, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return error_line(output) or _short(lines[-1] if lines else "no output")


def _short(line: str) -> str:
    return line if len(line) <= 240 else line[:237] + "..."


@contextmanager
def _own_group(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` in a new session (its own process group), output to ``log``; however the
    block ends (Ctrl-C included), nothing of that group is left running."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            yield process
        finally:
            if process.poll() is None or group_members(process.pid):
                stop_group(process)


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group ``process`` leads, SIGKILL to what is left of it after
    GRACE_S; ``process`` is reaped."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and (process.poll() is None
                                           or group_members(process.pid)):
        time.sleep(0.05)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def group_members(pgid: int) -> list[int]:
    """The live processes (not zombies) of process group ``pgid``: read from /proc on Linux;
    elsewhere [pgid] while a signal can reach the group."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended while we looked
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


@dataclass(frozen=True)
class Ran:
    """How a command run in its own process group ended: its exit status (None: stopped at
    its timeout), how many processes of its group it left running (killed), its seconds and
    its output."""

    code: int | None
    stray: int
    seconds: float
    output: str


def run_in_group(command: list[str], timeout_s: float, log: Path) -> Ran:
    """Run ``command`` in a session of its own, output to ``log``: stopped with its whole
    process group after ``timeout_s``; processes of the group still running once it exited
    are stray (given STRAY_WAIT_S to end by themselves, then killed)."""
    start = time.perf_counter()
    code: int | None = None
    stray: list[int] = []
    with _own_group(command, log) as process:
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(process)
        else:  # a process of the group that is just ending gets a moment, then it is stray
            deadline = time.monotonic() + STRAY_WAIT_S
            while (stray := group_members(process.pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
        # leaving the block stops whatever is left of the group
    return Ran(code, len(stray), time.perf_counter() - start, log.read_text(errors="replace"))


def run_case(case: Case, gpus: int, timeout_s: float, logs: Path) -> dict[str, Any]:
    """Run ``case`` on ``gpus`` GPUs: its result, with one ``line`` to print."""
    result: dict[str, Any] = {"case": case.name, "gpus": case.gpus}
    if gpus < case.gpus:
        result.update(status="skipped", line=f"skipped: needs {case.gpus} GPUs, this machine "
                      f"has {gpus}", seconds=0.0)
        return result
    command = case.command(gpus)
    log = logs / f"{case.name}.log"
    result["command"] = shown(command)
    ran = run_in_group(command, timeout_s, log)
    result["seconds"], result["log"] = ran.seconds, str(log)
    if ran.code is None:
        error = error_line(ran.output)
        result.update(status="timed out", line=f"TIMED OUT after {timeout_s:.0f} s, stopped "
                      f"with its process group{f' (first error: {error})' if error else ''}")
    elif ran.code != 0:
        result.update(status="failed",
                      line=f"FAILED (exit {ran.code}): {first_error(ran.output)}")
    elif ran.stray:
        result.update(status="failed", line=f"FAILED: it exited 0 but left {ran.stray} "
                      "process(es) of its group running (killed)")
    else:
        try:
            detail = case.read(ran.output)
        except (CaseFailed, ValueError, KeyError, TypeError) as exc:
            result.update(status="failed", line=f"FAILED: {exc}")
        else:
            result.update(status="ok", line=f"ok in {ran.seconds:.0f} s: {detail}")
    return result


def _keep(logs: Path, ok: bool) -> None:
    """The commands' outputs stay in ``logs`` when one did not pass, named; else they go."""
    if ok:
        shutil.rmtree(logs, ignore_errors=True)
    else:
        say(f"  each one's output: {logs}/")


def run_cases(names: list[str], gpus: int, timeout_s: float, fit: Fit) -> dict[str, Any]:
    """The NCCL cases ``names`` (all when empty) on ``gpus`` GPUs, each under its timeout
    from ``fit``, one line each as they end; each case's output stays in a folder, named
    when a case did not pass."""
    if gpus < 2:
        return {"ok": True, "gpus": gpus, "cases": [],
                "skipped": f"{gpus} CUDA GPU here; the NCCL cases need two or more"}
    logs = Path(tempfile.mkdtemp(prefix="pipeswap-nccl-"))
    say(f"NCCL cases on {gpus} GPUs, each stopped after {timeout_s:.0f} s ...")
    results = []
    for case in CASES:
        if names and case.name not in names:
            continue
        timeout = fit(f"nccl {case.name}", timeout_s)
        result = (run_case(case, gpus, timeout, logs) if not isinstance(timeout, str) else
                  {"case": case.name, "gpus": case.gpus, "status": "skipped", "line": timeout,
                   "seconds": 0.0})
        say(f"  {case.name}: {result['line']}")
        results.append(result)
    ok = all(result["status"] in ("ok", "skipped") for result in results)
    _keep(logs, ok)
    return {"ok": ok, "gpus": gpus, "timeout_s": timeout_s, "cases": results}


def case_lines(found: dict[str, Any]) -> list[str]:
    """The NCCL cases' part of the GPU check's report."""
    if "skipped" in found:
        return ["", f"**NCCL cases** (`--nccl`): skipped, {found['skipped']}."]
    return ["", f"**NCCL cases** on {found['gpus']} GPUs (`--nccl`; each a command in its own "
            f"process group, stopped after {found['timeout_s']:.0f} s; `--list` shows the "
            "commands):", "", "| case | result |", "|---|---|",
            *(f"| {r['case']} | {_cell(r['line'])} |" for r in found["cases"])]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# -- the one-rank probes ---------------------------------------------------------------------


def read_result(output: str) -> dict[str, Any]:
    """A probe's result: its last JSON line; without one (it crashed), FAILED with the first
    line of its output that says what went wrong."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and {"status", "line"} <= found.keys():
            return found
    return {"status": "FAILED", "line": f"FAILED: {first_error(output)}"}


def read_torchrun(output: str) -> dict[str, Any]:
    """nccl_job.py's ok line, as a probe's result."""
    try:
        detail = read_job(output)
    except CaseFailed:
        return {"status": "FAILED", "line": f"FAILED: {first_error(output)}"}
    return {"status": "ok", "line": f"ok: {detail}; one rank has no peer, so no peer watch "
            "runs (the NCCL case torchrun runs one, on two GPUs)"}


@dataclass(frozen=True)
class Probe:
    """One probe: its command (run from the repository root), what it shows, its timeout,
    how its output reads, and, where a hang is the finding it looks for (torch's own
    behaviour) rather than a failure, what a hang means."""

    name: str
    what: str
    command: tuple[str, ...]
    timeout_s: float = PROBE_TIMEOUT_S
    read: Callable[[str], dict[str, Any]] = read_result
    hang_means: str = ""


def last_step(output: str) -> str | None:
    steps = [line.split(PROBE_STEP, 1)[1].strip() for line in output.splitlines()
             if PROBE_STEP in line]
    return steps[-1] if steps else None


def run_probe(probe: Probe, timeout_s: float, logs: Path) -> dict[str, Any]:
    """Run ``probe`` in its own process group, stopped with the group after ``timeout_s``:
    its result (name, status, line, seconds, its figures; ``passed``: whether it counts as
    passed)."""
    log = logs / f"{probe.name}.log"
    ran = run_in_group(list(probe.command), timeout_s, log)
    if ran.code is None:
        where = last_step(ran.output)
        found = {"status": "TIMED OUT",
                 "line": f"TIMED OUT after {timeout_s:.0f} s, stopped with its process group"
                 + (f", at: {where}" if where else "")
                 + (f" ({probe.hang_means})" if probe.hang_means else "")}
    elif ran.stray:
        found = {"status": "FAILED", "line": f"FAILED: it exited but left {ran.stray} "
                 "process(es) of its group running (killed)"}
    else:
        found = probe.read(ran.output)
        if ran.code != 0 and found["status"] in ("ok", "skipped"):
            found = {"status": "FAILED",
                     "line": f"FAILED (exit {ran.code}; its last line: {found['line']})"}
    result = {"name": probe.name, **found, "seconds": ran.seconds, "exit": ran.code,
              "log": str(log), "command": shown(list(probe.command))}
    result["passed"] = result["status"] in ("ok", "skipped") or bool(
        probe.hang_means and result["status"] == "TIMED OUT")
    return result


def skipped(name: str, line: str) -> dict[str, Any]:
    return {"name": name, "status": "skipped", "line": line, "seconds": 0.0, "passed": True}


def run_probes(probes: Sequence[Probe], cuda: bool, fit: Fit) -> dict[str, Any]:
    """``probes`` in turn, each in its own process group under its timeout from ``fit``;
    without CUDA each says it needs CUDA, and nothing starts."""
    if not cuda:
        say("probes: skipped: needs CUDA")
        return {"ok": True, "skipped": "needs CUDA",
                "probes": [skipped(probe.name, "skipped: needs CUDA") for probe in probes]}
    logs = Path(tempfile.mkdtemp(prefix="pipeswap-probes-"))
    say("one-rank NCCL probes on cuda:0, each in its own process group ...")
    results = []
    for probe in probes:
        timeout = fit(f"probe {probe.name}", probe.timeout_s)
        result = (skipped(probe.name, timeout) if isinstance(timeout, str)
                  else run_probe(probe, timeout, logs))
        say(f"  {probe.name}: {result['line']}")
        results.append(result)
    ok = all(result["passed"] for result in results)
    _keep(logs, ok)
    return {"ok": ok, "probes": results}


def probe_lines(found: dict[str, Any]) -> list[str]:
    """The probes' part of the GPU check's report."""
    if "skipped" in found:
        return ["", f"**One-rank NCCL probes**: skipped, {found['skipped']}."]
    return ["", "**One-rank NCCL probes** on cuda:0, each a process in its own process group "
            "stopped with it at its timeout (`python benchmarks/_probes.py NAME` runs one):", "",
            "| probe | result |", "|---|---|",
            *(f"| {r['name']} | {_cell(r['line'])} |" for r in found["probes"])]
