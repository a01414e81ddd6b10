#!/usr/bin/env python3
"""The one entry point for working on pipeswap: set up, test, demo, benchmark.

Needs only Python >= 3.10 with pip. What it sets up itself stays inside this checkout:

  .venv/                  pinned tools: hatch and uv
  .cache/wheels/          the CPU build of torch that every Hatch env takes torch from
  .cache/constraints.txt  pins torch to that wheel's exact version, so no env ever resolves
                          torch from the index (that would pull a CUDA build of several GB)

Hatch keeps its envs in its own data directory and installs with uv, which hard-links torch
from its cache, so an extra env costs seconds and little disk. The envs themselves are
defined in pyproject.toml; after `setup`, `.venv/bin/hatch ...` works directly too.

commands:
  setup              create .venv, install hatch and uv, fetch the torch wheel (idempotent)
  test               the everyday check (<= 5 min on 2 cores, set-up included), phases in
                     order, stopping at the first failure:
                       a. layout: no packages/*/src/pipeswap/__init__.py (PEP 420), py.typed
                          and __about__.py in every package, unique test file names, and in
                          packages/*/src no module over 600 lines, no function or method
                          (nested ones too) over 80 and no class over 300, save the named
                          exceptions in dev.py's LONG_UNITS, a list that may only shrink
                       b. `hatch test -m "not multiprocess or everyday"`: every test that
                          starts no process, and the few multi-process ones marked everyday
                          (1F1B with swap bit-identical, a failure and recover, FSDP x DP)
                       c. `hatch run types`: mypy --strict over all packages as one program
  test --full        everything, each test once (<= 15 min on 2 cores; what CI runs):
                       a. layout, as above
                       b. `hatch test`: the whole suite, every multi-process case included
                       c. `hatch run types`
                       d. each package alone, in a Hatch env with only the siblings it
                          declares: every module imports (pipeswap-schedule with torch
                          absent) and `mypy --strict` passes
                       e. build every package (sdist + wheel) into dist/, install the wheels
                          into a fresh venv, import them, run `pipeswap-schedule --help`,
                          `pipeswap-train --help` and a short two-rank training run
                       f. build pipeswap-schedule's optional compiled wheel (mypyc), run the
                          package's tests against it and check that it plans three cases
                          exactly as the pure wheel of e. does (the same JSON)
                     Hatch envs are deleted first on CI (CI=true) and whenever a
                     pyproject.toml or __about__.py changed since they were built.
  test -- ARGS...    only phase b, over the whole suite, with ARGS passed to pytest
                     (e.g. `python3 dev.py test -- -k hygiene -x`; add
                     `-m "not multiprocess or everyday"` for the everyday tier's tests)
  demo [ARGS...]     the main job: `pipeswap-train` in the default env (a small GPT trained
                     on 4 CPU ranks with 1F1B, without and with swap, then compared);
                     ARGS go to pipeswap-train (`python3 dev.py demo -- --help`)
  bench [ARGS...]    run benchmarks/schedule_passes.py, swap_planning.py,
                     simulate_schedules.py, keep_offload_recompute.py,
                     pytorch_lowering.py, swap_overhead.py, layer_offload.py,
                     train_step.py and executor_vs_torch.py in the
                     default env (`bench --write` records the results in BENCHMARKS.md);
                     benchmarks/gpu_check.py needs a GPU: see gpu-setup
  gpu-setup [--use-installed-torch] [--torch-index URL]
                     on a machine with an NVIDIA GPU, instead of setup: the four packages
                     (editable), pytest and hypothesis, with a CUDA build of torch and no
                     Hatch or CPU pin: in .venv-gpu/ with torch 2.13.0 from PyPI (a CUDA build
                     on Linux x86-64; --torch-index picks another index, e.g.
                     https://download.pytorch.org/whl/cu128), or with --use-installed-torch
                     into the environment of the Python running dev.py, keeping its torch
                     (a container's, a conda env's). Last, it checks that this torch sees
                     the GPUs and runs a kernel; if not, it fails with one line saying why
                     (CPU build, CUDA_VISIBLE_DEVICES, driver, torch's CUDA version) and what
                     to do. Then, with that env's python:
                       python -m pipeswap.runtime.train --device cuda --replay-rank 0
                       python benchmarks/gpu_check.py --write   (--nccl: with 2+ GPUs)
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
CACHE = ROOT / ".cache"
WHEELS = CACHE / "wheels"
CONSTRAINTS = CACHE / "constraints.txt"
WHEEL_CHECK_VENV = CACHE / "wheel-check"
COMPILED_CHECK_VENV = CACHE / "compiled-check"
ENVS_FINGERPRINT = CACHE / "envs-fingerprint"
DIST = ROOT / "dist"
SUITE_REPORT = CACHE / "suite-report.xml"
GPU_VENV = ROOT / ".venv-gpu"

HATCH = "1.18.2"
UV = "0.13.9"
TORCH = "2.13.0+cpu"  # a CPU build: its dependencies hold no nvidia-* packages
PYTEST = "pytest~=9.2"
BENCHMARKS = ["benchmarks/schedule_passes.py", "benchmarks/swap_planning.py",
              "benchmarks/simulate_schedules.py", "benchmarks/keep_offload_recompute.py",
              "benchmarks/pytorch_lowering.py", "benchmarks/swap_overhead.py",
              "benchmarks/layer_offload.py", "benchmarks/train_step.py",
              "benchmarks/executor_vs_torch.py"]
MAX_MODULE_LINES = 600  # a source module past this is doing more than one job
MAX_FUNCTION_LINES = 80  # a function (a method, a nested one) past this is doing several
MAX_CLASS_LINES = 300
# "path::qualname" -> why a unit in packages/*/src may exceed its limit for now. The check
# fails on an entry whose unit is gone or fits, so the list can only shrink.
LONG_UNITS: dict[str, str] = {}
DEMO = ["pipeswap-train"]  # 1F1B on 4 spawned CPU ranks, without and with swap, compared


class Failure(Exception):
    """A step failed; the message says which and how to retry it."""


def say(message: str) -> None:
    print(f"dev.py: {message}", flush=True)


def run(
    cmd: Sequence[str | Path],
    *,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    label: str | None = None,
) -> None:
    """Run a command in the foreground, echoing it (or its label); raise Failure when it fails."""
    args = [str(c) for c in cmd]
    where = "" if cwd == ROOT else f"(in {cwd.relative_to(ROOT)}) "
    print(f"$ {where}{label or shlex.join(args)}", flush=True)
    code = subprocess.run(args, cwd=cwd, env=env, check=False).returncode
    if code != 0:
        raise Failure(f"`{label or shlex.join(args)}` exited with {code}")


def run_quietly(cmd: Sequence[str | Path]) -> None:
    """Run a command, showing its output only if it fails."""
    args = [str(c) for c in cmd]
    print(f"$ {shlex.join(args)}", flush=True)
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        raise Failure(f"`{shlex.join(args)}` exited with {proc.returncode}")


def tools_env() -> dict[str, str]:
    """The environment for hatch and uv: the pinned tools first on PATH, torch from the cache."""
    env = dict(os.environ)
    for name in ("HATCH_BUILD_HOOKS_ENABLE", "HATCH_BUILD_HOOK_ENABLE_CUSTOM"):
        env.pop(name, None)  # every build but phase f's is the pure one
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["UV_FIND_LINKS"] = str(WHEELS)  # pyproject.toml sets the same for the Hatch envs
    env["UV_CONSTRAINT"] = str(CONSTRAINTS)
    return env


def hatch(*args: str, cwd: Path = ROOT) -> None:
    run([BIN / "hatch", *args], cwd=cwd, env=tools_env())


def venv_facts() -> tuple[str, str, str]:
    """(hatch version, uv version, CPython wheel tag) of .venv; "" for a missing tool."""
    probe = (
        "import sys\n"
        "from importlib.metadata import version, PackageNotFoundError\n"
        "def v(name):\n"
        "    try: return version(name)\n"
        "    except PackageNotFoundError: return ''\n"
        "print(v('hatch'), v('uv'), f'cp{sys.version_info[0]}{sys.version_info[1]}', sep=',')\n"
    )
    out = subprocess.run([BIN / "python", "-c", probe], capture_output=True, text=True, check=True)
    hatch_version, uv_version, tag = out.stdout.strip().split(",")
    return hatch_version, uv_version, tag


def setup() -> None:
    """Make .venv and .cache ready; does nothing that is already done."""
    if not (BIN / "python").exists():
        say(f"creating {VENV.relative_to(ROOT)} with {sys.executable}")
        run([sys.executable, "-m", "venv", VENV])
    hatch_version, uv_version, tag = venv_facts()
    if (hatch_version, uv_version) != (HATCH, UV):
        say(f"installing hatch {HATCH} and uv {UV} into .venv")
        run_quietly([BIN / "python", "-m", "pip", "install", "-q", f"hatch=={HATCH}", f"uv=={UV}"])
    if not list(WHEELS.glob(f"torch-{TORCH}-{tag}-*.whl")):
        say(f"fetching the torch {TORCH} wheel for {tag} into {WHEELS.relative_to(ROOT)}/")
        try:
            run_quietly(
                [BIN / "python", "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                 "-d", WHEELS, f"torch=={TORCH}"]
            )
        except Failure as e:
            raise Failure(
                f"{e}.\npip found no torch {TORCH} wheel for {tag}. Point pip at an index or a folder "
                f"that has one (PIP_EXTRA_INDEX_URL or PIP_FIND_LINKS), or copy the wheel into "
                f"{WHEELS}/, then run `python3 dev.py setup` again. Plain `torch` from PyPI is a "
                "CUDA build of several GB, which this project never installs."
            ) from None
    CACHE.mkdir(exist_ok=True)
    wanted = f"torch=={TORCH}\n"
    if not CONSTRAINTS.exists() or CONSTRAINTS.read_text() != wanted:
        CONSTRAINTS.write_text(wanted)
        say(f"wrote {CONSTRAINTS.relative_to(ROOT)}: {wanted.strip()}")
    say(f"ready: hatch {HATCH}, uv {UV}, torch {TORCH} ({tag})")


def package_dirs() -> list[Path]:
    return sorted(p.parent for p in ROOT.glob("packages/pipeswap-*/pyproject.toml"))


def metadata_fingerprint() -> str:
    """A hash of everything that decides what the Hatch envs install."""
    digest = hashlib.sha256()
    files = [ROOT / "pyproject.toml", *ROOT.glob("packages/*/pyproject.toml")]
    for path in sorted([*files, *ROOT.glob("packages/*/src/pipeswap/*/__about__.py")]):
        digest.update(f"{path.relative_to(ROOT)}\n".encode() + path.read_bytes())
    return digest.hexdigest()


def envs_are_stale() -> bool:
    """True on CI, or when a package's metadata changed since the envs were last rebuilt.

    Hatch does not notice a sibling's version bump: its envs would keep the old metadata.
    """
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return True
    return not ENVS_FINGERPRINT.exists() or ENVS_FINGERPRINT.read_text() != metadata_fingerprint()


def remove_envs() -> None:
    """Delete every Hatch env of the project; each is rebuilt when next used."""
    hatch("env", "prune")
    hatch("env", "remove", "hatch-test")  # prune misses internal matrix envs (hatch 1.18.2)
    ENVS_FINGERPRINT.write_text(metadata_fingerprint())


def unit_lengths(source: str) -> dict[str, tuple[str, int]]:
    """Each function and class of a module by dotted qualname (``Class.method.inner``): its
    kind ("function" or "class") and its length in lines, decorators left out."""
    found: dict[str, tuple[str, int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                # an overload or a property's setter shares its name: keep the longest
                found[name] = (kind, max(length, found.get(name, (kind, 0))[1]))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def code_shape_problems(root: Path, allowed: dict[str, str]) -> list[str]:
    """Modules, functions and classes under ``root``/packages/*/src past their limits, and
    entries of ``allowed`` ("path::qualname") that name no unit past its limit any more."""
    limits = {"function": MAX_FUNCTION_LINES, "class": MAX_CLASS_LINES}
    problems: list[str] = []
    over: set[str] = set()
    seen: set[str] = set()
    for module in sorted(root.glob("packages/*/src/pipeswap/**/*.py")):
        path = module.relative_to(root).as_posix()
        source = module.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            problems.append(f"{path} has {lines} lines; split it by job "
                            f"into modules of at most {MAX_MODULE_LINES}")
        for name, (kind, length) in unit_lengths(source).items():
            key = f"{path}::{name}"
            seen.add(key)
            if length <= limits[kind]:
                continue
            over.add(key)
            if key not in allowed:
                problems.append(f"{key}: a {kind} of {length} lines; split it into units "
                                f"of at most {limits[kind]}")
    for key in sorted(set(allowed) - over):
        why = "no longer exists" if key not in seen else "is now within its limit"
        problems.append(f"LONG_UNITS in dev.py lists {key}, which {why}: remove the entry")
    return problems


def check_layout() -> None:
    problems: list[str] = []
    for init in ROOT.glob("packages/*/src/pipeswap/__init__.py"):
        problems.append(f"{init.relative_to(ROOT)} must not exist: pipeswap is a PEP 420 namespace")
    root_config = (ROOT / "pyproject.toml").read_text()
    for pkg in package_dirs():
        name = pkg.name.removeprefix("pipeswap-")
        namespace = pkg.relative_to(ROOT) / "src" / "pipeswap"
        for required in ("__about__.py", "py.typed"):
            if not (ROOT / namespace / name / required).is_file():
                problems.append(f"{namespace / name / required} is missing")
        strays = {p.name for p in (ROOT / namespace).iterdir()} - {name, "__init__.py", "__pycache__"}
        if strays:
            problems.append(f"{namespace} holds {sorted(strays)}; only {name}/ belongs there")
        if f"packages/{pkg.name}/src" not in root_config:
            problems.append(f"pyproject.toml: [tool.mypy] mypy_path lacks packages/{pkg.name}/src")
    test_files: dict[str, Path] = {}
    for test_file in sorted([*ROOT.glob("packages/*/tests/**/test_*.py"), *ROOT.glob("tests/**/test_*.py")]):
        first = test_files.setdefault(test_file.name, test_file)
        if first != test_file:
            problems.append(
                f"test file name {test_file.name} is used twice: {first.relative_to(ROOT)} and "
                f"{test_file.relative_to(ROOT)}; give each a name unique in the repository"
            )
    problems += code_shape_problems(ROOT, LONG_UNITS)
    if len(package_dirs()) != 4:
        problems.append(f"expected 4 packages under packages/, found {[p.name for p in package_dirs()]}")
    for problem in problems:
        print(f"  layout: {problem}", file=sys.stderr)
    if problems:
        raise Failure(f"{len(problems)} layout problem(s)")
    print(f"  layout ok: {len(package_dirs())} packages, {len(test_files)} test files")


# The siblings each package declares (pyproject.toml's pkg matrix installs the same).
DECLARED = {"schedule": [], "platform": [], "swap": ["platform"],
            "runtime": ["schedule", "platform", "swap"]}


def check_each_package() -> None:
    for name, siblings in DECLARED.items():
        hatch("run", f"+pkg={name}", "pkg:python", str(ROOT / ".ci" / "isolation_probe.py"), name,
              ",".join(siblings) or "-")
    hatch("run", "pkg:types")


def check_wheels() -> None:
    shutil.rmtree(DIST, ignore_errors=True)
    for pkg in package_dirs():
        hatch("build", str(DIST), cwd=pkg)
    wheels = sorted(DIST.glob("*.whl"))
    shutil.rmtree(WHEEL_CHECK_VENV, ignore_errors=True)
    run([BIN / "uv", "venv", "-q", "--python", BIN / "python", WHEEL_CHECK_VENV], env=tools_env())
    python = WHEEL_CHECK_VENV / "bin" / "python"
    run([BIN / "uv", "pip", "install", "-q", "--python", python, *wheels], env=tools_env())
    probe = (
        "import importlib, importlib.metadata as md, sys\n"
        "from pathlib import Path\n"
        "for name in ('schedule', 'platform', 'swap', 'runtime'):\n"
        "    module = importlib.import_module(f'pipeswap.{name}')\n"
        "    assert Path(module.__file__).is_relative_to(sys.prefix), module.__file__\n"
        "    print(f'  pipeswap.{name} {module.__version__} from {Path(module.__file__).parent}')\n"
        "cuda = [d.metadata['Name'] for d in md.distributions() if d.metadata['Name'].startswith('nvidia')]\n"
        f"assert not cuda and md.version('torch') == {TORCH!r}, (md.version('torch'), cuda)\n"
        "namespace = Path(importlib.import_module('pipeswap.schedule').__file__).parents[1]\n"
        "assert not (namespace / '__init__.py').exists(), 'a wheel ships pipeswap/__init__.py'\n"
        "for name in ('schedule', 'platform', 'swap', 'runtime'):\n"
        "    assert (namespace / name / 'py.typed').is_file(), f'pipeswap-{name} lacks py.typed'\n"
    )
    run([python, "-c", probe], label=f"{python} -c <import all four, no nvidia-*, torch {TORCH}>")
    run([WHEEL_CHECK_VENV / "bin" / "pipeswap-schedule", "--help"])
    run([WHEEL_CHECK_VENV / "bin" / "pipeswap-train", "--help"])
    # One short multi-process run from the installed wheels (the suite itself ran in phase b,
    # against the editable packages): the bundled corpus, spawn and the entry point.
    train: list[str | Path] = [
        WHEEL_CHECK_VENV / "bin" / "pipeswap-train", "--ranks", "2", "--microbatches", "2",
        "--batch-size", "4", "--seq-len", "16", "--width", "32", "--steps", "1", "--json"]
    print(f"$ {shlex.join(map(str, train))}", flush=True)
    done = subprocess.run(train, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or json.loads(lines[-1]).get("losses_match") is not True:
        print(done.stdout + done.stderr, file=sys.stderr)
        raise Failure("the wheels' pipeswap-train run failed or its losses did not match")
    print("  two ranks from the wheels: losses bit-identical with and without swap")


#: Plans the compiled build must make exactly as the pure-Python wheel does (same JSON):
#: keep, swap or recompute chosen in the whole pipeline, three schedule families.
SAME_PLANS = [
    [*family, "--preset", "h100-pcie5", "--hidden", "8192", "--seq-len", "4096",
     "--layers-per-stage", "4", "--swap", "--budget", "8.5GiB", "--d2h-bandwidth", "25GB",
     "--h2d-bandwidth", "25GB", "--jobs", "1", "--format", "json"]
    for family in (["--schedule", "1f1b", "--ranks", "8", "--microbatches", "16"],
                   ["--schedule", "zbv", "--ranks", "4", "--microbatches", "8"],
                   ["--schedule", "interleaved-zb", "--ranks", "4", "--stages-per-rank", "2",
                    "--microbatches", "8"])]


def check_compiled() -> None:
    """pipeswap-schedule's optional compiled build (mypyc): built from the same source, its
    package suite passes against it (less the tests that replace a module's function at
    run time, which compiled modules never see) and it plans as the pure wheel does."""
    package = ROOT / "packages" / "pipeswap-schedule"
    built = CACHE / "compiled"
    shutil.rmtree(built, ignore_errors=True)
    run([BIN / "hatch", "build", "-t", "wheel", built], cwd=package,
        env={**tools_env(), "HATCH_BUILD_HOOKS_ENABLE": "true"})
    shutil.rmtree(COMPILED_CHECK_VENV, ignore_errors=True)
    run([BIN / "uv", "venv", "-q", "--python", BIN / "python", COMPILED_CHECK_VENV],
        env=tools_env())
    python = COMPILED_CHECK_VENV / "bin" / "python"
    run([BIN / "uv", "pip", "install", "-q", "--python", python, *built.glob("*.whl"), PYTEST,
         "hypothesis~=6.170", "pytest-xdist~=3.8"], env=tools_env())
    probe = ("import sys, pipeswap.schedule\n"
             "found = sys.modules['pipeswap.schedule.simulate'].__file__\n"
             "assert found.endswith(sys.argv[1]), found\n")
    for venv, suffix, which in ((COMPILED_CHECK_VENV, ".so", "compiled"),
                                (WHEEL_CHECK_VENV, ".py", "pure Python")):
        run([venv / "bin" / "python", "-c", probe, suffix],
            label=f"{venv / 'bin' / 'python'} -c <the simulator is the {which} one>")
    run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "-m",
         "not source_only", "tests"], cwd=package)
    for args in SAME_PLANS:
        command = f"pipeswap-schedule simulate {shlex.join(args)}"
        outputs = []
        for venv, which in ((WHEEL_CHECK_VENV, "pure"), (COMPILED_CHECK_VENV, "compiled")):
            done = subprocess.run([venv / "bin" / "pipeswap-schedule", "simulate", *args],
                                  capture_output=True, text=True, check=False)
            if done.returncode:
                print(done.stderr, file=sys.stderr)
                raise Failure(f"`{command}` failed in the {which} build ({venv})")
            (COMPILED_CHECK_VENV / f"{which}.json").write_text(done.stdout)
            outputs.append(done.stdout)
        if outputs[0] != outputs[1]:
            raise Failure(f"the compiled build plans otherwise than the pure wheel: {command} "
                          f"(diff {COMPILED_CHECK_VENV}/pure.json and compiled.json)")
    print(f"  {len(SAME_PLANS)} plans under a budget: the same JSON from both builds")


def suite_tally() -> str:
    """'N passed, N failed, N skipped' for the whole-suite run, read from its JUnit report."""
    suite = ElementTree.parse(SUITE_REPORT).getroot()
    totals = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert totals is not None
    count = {k: int(totals.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    failed = count["failures"] + count["errors"]
    passed = count["tests"] - failed - count["skipped"]
    return f"{passed} passed, {failed} failed, {count['skipped']} skipped"


EVERYDAY = "not multiprocess or everyday"  # pytest -m: what `dev.py test` runs of the suite


def test(options: list[str]) -> None:
    full = bool(options) and options[0] == "--full"
    pytest_args = options[1:] if full else options
    if pytest_args and pytest_args[0] == "--":
        pytest_args = pytest_args[1:]
    setup()
    SUITE_REPORT.unlink(missing_ok=True)
    # ARGS given: pytest over the whole suite with them (a -m of their own picks a tier)
    selection = [] if full or pytest_args else ["-m", EVERYDAY]
    test_args = ["--", f"--junit-xml={SUITE_REPORT}", *selection, *pytest_args]
    tier = "full" if full else "everyday"
    phases: list[tuple[str, Callable[[], None]]] = [
        ("a. layout", check_layout),
        (f"b. hatch test ({'whole suite' if full else EVERYDAY})",
         lambda: hatch("test", *test_args)),
        ("c. hatch run types", lambda: hatch("run", "types")),
    ]
    if full:
        phases += [("d. each package alone", check_each_package),
                   ("e. built wheels", check_wheels),
                   ("f. compiled pipeswap-schedule", check_compiled)]
    if pytest_args:
        say(f"pytest arguments given: running phase b only, with {shlex.join(pytest_args)}")
        phases = [phases[1]]
    if envs_are_stale():
        phases.insert(0, ("fresh Hatch envs", remove_envs))
    timings: list[tuple[str, float, str]] = []
    try:
        for name, phase in phases:
            print(f"\n===== {name} =====", flush=True)
            start = time.monotonic()
            try:
                phase()
            except Failure:
                timings.append((name, time.monotonic() - start, "FAILED"))
                raise
            timings.append((name, time.monotonic() - start, "ok"))
    finally:
        print(f"\n===== summary ({tier} tier) =====")
        for name, seconds, status in timings:
            print(f"  {status:6} {seconds:7.1f}s  {name}")
        print(f"  total  {sum(s for _, s, _ in timings):7.1f}s")
        if SUITE_REPORT.exists():  # the suite's count, as the last line
            print(f"tests: {suite_tally()}")


def gpu_setup(options: list[str]) -> None:
    """The four packages with a CUDA build of torch: in .venv-gpu/, or with
    --use-installed-torch in this Python's own environment, beside the torch it has."""
    parser = argparse.ArgumentParser(prog="dev.py gpu-setup", allow_abbrev=False)
    parser.add_argument("--use-installed-torch", action="store_true")
    parser.add_argument("--torch-index", metavar="URL")
    args = parser.parse_args(options)
    if args.use_installed_torch and args.torch_index:
        parser.error("--use-installed-torch keeps the torch installed; --torch-index installs one")
    if args.use_installed_torch:
        python = Path(sys.executable)
        found = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                               capture_output=True, text=True, check=False)
        if found.returncode != 0:
            raise Failure(f"--use-installed-torch: {python} has no torch to use; run dev.py "
                          "with the Python that has it, or leave the option out to install one "
                          f"into {GPU_VENV.relative_to(ROOT)}/")
        pin = f"torch=={found.stdout.strip()}"  # the packages' range must keep this one
        where = f"{python}'s environment"
    else:
        python = GPU_VENV / "bin" / "python"
        if not python.exists():
            say(f"creating {GPU_VENV.relative_to(ROOT)} with {sys.executable}")
            run([sys.executable, "-m", "venv", GPU_VENV])
        pin = f"torch=={TORCH.split('+')[0]}"
        index = ["--index-url", args.torch_index] if args.torch_index else []
        say(f"installing {pin} into {GPU_VENV.relative_to(ROOT)} (a CUDA build from "
            f"{args.torch_index or 'PyPI'}: a few GB)")
        run([python, "-m", "pip", "install", "-q", *index, pin])
        where = str(GPU_VENV.relative_to(ROOT))
    CACHE.mkdir(exist_ok=True)
    constraints = CACHE / "gpu-constraints.txt"
    constraints.write_text(pin + "\n")
    say(f"installing the four packages (editable), pytest and hypothesis into {where}")
    run([python, "-m", "pip", "install", "-q", "-c", constraints,
         *(f"--editable={directory}" for directory in package_dirs()),
         PYTEST, "hypothesis~=6.170"])
    facts = cuda_facts(python)
    shown = python if args.use_installed_torch else python.relative_to(ROOT)
    problem = cuda_problem(facts, driver_facts(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                           f"torch {facts.torch} in {where}")
    if problem is not None:
        raise Failure(problem)
    say(f"ready: torch {facts.torch}, CUDA {facts.cuda}, {facts.count} GPU(s): {facts.device}")
    say(f"next: {shown} -m pipeswap.runtime.train --device cuda --replay-rank 0   and   "
        f"{shown} benchmarks/gpu_check.py --write"
        + (f"   (with --nccl for the multi-process cases on the {facts.count} GPUs)"
           if facts.count > 1 else ""))


@dataclass(frozen=True)
class CudaFacts:
    """What torch in the set-up environment says about CUDA."""

    torch: str
    cuda: str | None  # the CUDA version torch was built for; None: a CPU build
    available: bool
    count: int
    device: str  # the first GPU's name, "" when none
    problem: str  # no GPU: torch's warning on initializing CUDA; else a first kernel's error


@dataclass(frozen=True)
class DriverFacts:
    """What nvidia-smi says: the driver, and the highest CUDA version it supports."""

    found: bool  # nvidia-smi is on PATH
    error: str  # its first line of output when it failed, "" when it ran
    gpus: int
    driver: str  # "" when unknown
    cuda: str  # "" when unknown


# Run by the set-up env's python: torch's CUDA facts as JSON, one kernel run on the first GPU
# (a build without kernels for this GPU fails only then), and torch's warnings on the way.
CUDA_PROBE = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    device, problem = "", ""
    if available:
        try:
            device = torch.cuda.get_device_name(0)
            (torch.ones(2, device="cuda") * 2).sum().item()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
if not available:  # why not, in torch's words (a warning, when it gave one)
    problem = next((str(w.message).strip().splitlines()[0] for w in caught
                    if "cuda" in str(w.message).lower()), "")
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "available": available, "count": count, "device": device,
                  "problem": problem}))
"""


def cuda_facts(python: Path) -> CudaFacts:
    """Ask ``python`` (the set-up environment's) what torch sees of CUDA."""
    try:
        done = subprocess.run([python, "-c", CUDA_PROBE], capture_output=True, text=True,
                              check=False, timeout=300)
    except subprocess.TimeoutExpired:
        raise Failure(f"{python} took over 300 s to import torch and look for GPUs; check "
                      "`nvidia-smi` (a hung driver?) and run `python3 dev.py gpu-setup` "
                      "again") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        errors = done.stderr.strip().splitlines()
        raise Failure(f"torch does not import in {python}: "
                      f"{errors[-1] if errors else f'exit {done.returncode}'}; run "
                      "`python3 dev.py gpu-setup` again to reinstall it")
    return CudaFacts(**json.loads(lines[-1]))


def driver_facts() -> DriverFacts:
    """nvidia-smi's GPU count, driver version and highest CUDA version."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return DriverFacts(False, "", 0, "", "")
    try:
        done = subprocess.run([smi], capture_output=True, text=True, check=False, timeout=60)
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False,
                                timeout=60)
    except subprocess.TimeoutExpired:
        return DriverFacts(True, "it did not answer within 60 s", 0, "", "")
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        return DriverFacts(True, lines[0] if lines else f"exit {done.returncode}", 0, "", "")
    driver = re.search(r"Driver Version:\s*([\d.]+)", done.stdout)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", done.stdout)
    gpus = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    return DriverFacts(True, "", gpus, driver.group(1) if driver else "",
                       cuda.group(1) if cuda else "")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def cuda_problem(facts: CudaFacts, driver: DriverFacts, visible: str | None,
                 what: str) -> str | None:
    """None when torch sees a GPU and runs a kernel on it; else one line: what is wrong and
    what to do. ``visible``: CUDA_VISIBLE_DEVICES (None: unset); ``what``: which torch."""
    again = "then run `python3 dev.py gpu-setup` again"
    if facts.cuda is None:
        return (f"{what} is a CPU-only build (torch.version.cuda is None): install a CUDA "
                "build, e.g. `python3 dev.py gpu-setup --torch-index "
                "https://download.pytorch.org/whl/cu128` (without --use-installed-torch)")
    if facts.available and facts.count > 0:
        if facts.problem:
            return (f"{what} (CUDA {facts.cuda}) sees {facts.device} but cannot run on it "
                    f"({facts.problem}): install a torch build for this GPU, e.g. with "
                    "--torch-index https://download.pytorch.org/whl/cu128")
        return None
    said = f" (torch says: {facts.problem})" if facts.problem else ""
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return (f"{what} sees no GPU: CUDA_VISIBLE_DEVICES={visible!r} hides them all; unset "
                f"it or list the GPUs to use, {again}")
    if not driver.found:
        return (f"{what} (CUDA {facts.cuda}) sees no GPU and nvidia-smi is not on PATH: no "
                "NVIDIA driver here; install it (in a container: start it with the GPUs, e.g. "
                f"`docker run --gpus all`), {again}{said}")
    if driver.error:
        return (f"{what} (CUDA {facts.cuda}) sees no GPU and nvidia-smi fails ({driver.error}): "
                f"fix the NVIDIA driver (after a driver update: reboot), {again}")
    if driver.gpus == 0:
        return (f"{what} (CUDA {facts.cuda}) sees no GPU and nvidia-smi lists none: check the "
                f"machine has an NVIDIA GPU and its driver sees it, {again}")
    if driver.cuda and _version(driver.cuda) < _version(facts.cuda):
        return (f"{what} is built for CUDA {facts.cuda}, but the NVIDIA driver "
                f"{driver.driver or '(version unknown)'} supports CUDA up to {driver.cuda}: "
                f"update the driver, or install a torch built for CUDA {driver.cuda} or older "
                "from PyTorch's index for it (--torch-index "
                f"https://download.pytorch.org/whl/cuNNN){said}")
    if visible is not None:
        return (f"{what} (CUDA {facts.cuda}) sees none of the {driver.gpus} GPU(s) nvidia-smi "
                f"lists: CUDA_VISIBLE_DEVICES={visible!r} matches none (it takes indices from "
                f"0 to {driver.gpus - 1} or GPU UUIDs); fix or unset it, {again}{said}")
    return (f"{what} (CUDA {facts.cuda}) sees none of the {driver.gpus} GPU(s) nvidia-smi "
            f"lists{said}: check this process may open /dev/nvidia* (in a container: the GPUs "
            f"passed in) and that the driver {driver.driver} matches its kernel module, "
            f"{again}")


def main(argv: list[str] | None = None) -> int:
    if sys.version_info < (3, 10):
        print("dev.py needs Python >= 3.10", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(
        prog="dev.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("command", choices=["setup", "test", "demo", "bench", "gpu-setup"])
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if extra and args.command not in ("test", "bench", "demo", "gpu-setup"):
        parser.error(f"`{args.command}` takes no arguments: {shlex.join(extra)}")
    try:
        if args.command == "setup":
            setup()
        elif args.command == "gpu-setup":
            gpu_setup(extra)
        elif args.command == "test":
            test(extra)
        else:
            setup()
            if envs_are_stale():
                remove_envs()
            if args.command == "demo":
                hatch("run", *DEMO, *extra)
            else:
                for script in BENCHMARKS:
                    hatch("run", "python", script, *extra)
    except Failure as e:
        print(f"\ndev.py {args.command}: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
