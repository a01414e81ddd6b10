"""The multi-process jobs of ``gpu_check.py --nccl`` that ``pipeswap-train`` has no option for,
through pipeswap's public API on one GPU a rank:

    python benchmarks/nccl_job.py pytree --ranks 2     # stages passing dicts and tuples
    python benchmarks/nccl_job.py recover --ranks 2    # a rank raises mid-step; recover()
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/nccl_job.py torchrun                # plain init_process_group("nccl")

pytree    ``--ranks`` P ranks x 2 stages (interleaved 1F1B, with swap) of a toy model whose
          stage boundaries are several tensors: a dict and then tuples of two tensors that
          carry a gradient (hidden state, gate), int64 position ids and a float mask that
          cross forward only. Spawned with :func:`pipeswap.runtime.distributed.launch.spawn`.
          The loss and every gradient must match the unsplit model's on one GPU.
recover   1F1B with swap on P ranks (the bundled GPT); rank ``--failing-rank`` raises in its
          second forward of a step, later in its second backward: it must see its own
          error, every other rank a ``PeerFailedError`` naming it (promptly, not at the
          timeout), nothing left behind (swap groups, host buffers), and after
          ``recover()`` on every rank the next step must match a step that never failed.
torchrun  run under torchrun: ``torch.cuda.set_device(LOCAL_RANK)``, then plain
          ``torch.distributed.init_process_group("nccl")`` (no device_id, no gloo backend),
          then pipeswap's executor on that default group: two 1F1B steps with swap.

Each job ends with one line, ``nccl_job: ok: ...`` or ``nccl_job: FAILED: ...``, and exits 0
or 1. ``--device cpu`` runs the same on gloo, to check this script on a machine without GPUs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import torch

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from pipeswap_e2e_workers import FailAt  # noqa: E402  (the suite's failing stage wrapper)

PREFIX = "nccl_job:"
VOCAB, WIDTH, SEQ = 11, 16, 8  # the pytree job's toy model
GPT_SEQ, GPT_WIDTH = 32, 64  # the recover and torchrun jobs' GPT


class Failed(Exception):
    """A check of a job failed; the message says which."""


def device_of(kind: str) -> torch.device:
    """This rank's device: the GPU of its local rank (spawn and torchrun set LOCAL_RANK)."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, int(os.environ.get("LOCAL_RANK", "0")))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6))


# -- pytree: stages passing several tensors --------------------------------------------------


class Embed(torch.nn.Module):
    """Token ids to a dict: two tensors with gradients, int64 positions, a float mask."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.gate = torch.nn.Linear(WIDTH, 1)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return {"hidden": hidden, "gate": self.gate(hidden).squeeze(-1),
                "positions": positions, "mask": (ids % 3 != 0).float()}


class Middle(torch.nn.Module):
    """Takes the four tensors (as keywords after Embed, positionally after a Middle) and
    returns them as a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.gate = torch.nn.Linear(WIDTH, 1)
        self.positions = torch.nn.Embedding(SEQ, WIDTH)

    def forward(self, hidden: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mixed = torch.tanh(self.lin(hidden)) * torch.sigmoid(gate).unsqueeze(-1)
        hidden = hidden + mixed * mask.unsqueeze(-1) + self.positions(positions)
        return hidden, gate + self.gate(hidden).squeeze(-1), positions, mask


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, hidden: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (self.out(hidden) + 0.1 * gate.unsqueeze(-1)
                             + 0.01 * positions.unsqueeze(-1).float())
        return out


def pytree_modules(stages: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [Embed(), *(Middle() for _ in range(stages - 2)), Head()]


def pytree_data(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    return ids.to(device), targets.to(device)


def pytree_rank(rank: int, world: int, kind: str) -> dict[str, Any]:
    """One rank of the pytree job: 2 stages of 2 x ``world``; its gradients against the
    unsplit model's, computed here on this rank's device."""
    from pipeswap.platform import get_platform
    from pipeswap.runtime import PipelineExecutor, PipelineStage, SwapOptions
    from pipeswap.runtime.models.gpt import lm_loss
    from pipeswap.schedule import MinGapPolicy, ScheduleKind, ScheduleSpec, build_schedule

    device = device_of(kind)
    stages, microbatches = 2 * world, 2 * world
    ids, targets = pytree_data(2 * microbatches, device)
    whole = [module.to(device) for module in pytree_modules(stages)]
    value: Any = whole[0](ids)
    value = whole[1](**value)
    for module in whole[2:-1]:
        value = module(*value)
    want_loss = lm_loss(whole[-1](*value), targets)
    want_loss.backward()  # type: ignore[no-untyped-call]

    spec = ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, ranks=world, microbatches=microbatches,
                        stages_per_rank=2)
    placement = build_schedule(spec).stage_ranks
    modules = [module.to(device) for module in pytree_modules(stages)]
    mine = [PipelineStage(module, index, stages) for index, module in enumerate(modules)
            if placement[index] == rank]
    executor = PipelineExecutor(mine, spec, microbatches, lm_loss,
                                swap=SwapOptions(MinGapPolicy(3)),
                                platform=get_platform(str(device)))
    executor.step(ids, targets)  # the first step also exchanges the boundaries' shapes
    for stage in mine:
        stage.module.zero_grad(set_to_none=True)
    report = executor.step(ids, targets)
    bad = []
    for stage in mine:
        for (name, got), want in zip(stage.module.named_parameters(),
                                     whole[stage.stage_index].parameters()):
            if got.grad is None or want.grad is None:
                bad.append(f"{stage.stage_index}.{name} (no gradient)")
            elif not close(got.grad, want.grad):
                off = float((got.grad - want.grad).abs().max())
                bad.append(f"{stage.stage_index}.{name} (off by {off:.2e})")
    return {"rank": rank, "losses": list(report.losses), "want_loss": float(want_loss.detach()),
            "bad_grads": bad, "swapped": report.swapped_chunks,
            "groups_alive": executor.manager.active_group_count()}


def pytree(ranks: int, kind: str, timeout_s: float) -> str:
    from pipeswap.runtime.distributed.launch import backend_for, spawn

    results = spawn(pytree_rank, ranks, kind, backend=backend_for(kind), timeout_s=timeout_s)
    losses = [loss for result in results for loss in result["losses"]]
    want = results[0]["want_loss"]
    if len(losses) != 2 * ranks:
        raise Failed(f"{len(losses)} microbatch losses came back, not {2 * ranks}")
    if not math.isclose(sum(losses) / len(losses), want, rel_tol=1e-4):
        raise Failed(f"mean loss {sum(losses) / len(losses):.6f}, the unsplit model's {want:.6f}")
    for result in results:
        if result["bad_grads"]:
            raise Failed(f"rank {result['rank']}: gradients differ from the unsplit model's: "
                         f"{', '.join(result['bad_grads'][:3])}")
        if result["groups_alive"]:
            raise Failed(f"rank {result['rank']}: {result['groups_alive']} swap groups left")
    swapped = sum(result["swapped"] for result in results)
    return (f"{ranks} ranks x 2 stages, interleaved 1F1B with swap ({swapped} chunks "
            "swapped), boundaries of a dict and tuples of 4 tensors (2 with gradients, int64, "
            "float): loss and gradients match the unsplit model")


# -- recover: a rank raises mid-step ---------------------------------------------------------


def gpt_parts(world: int, device: torch.device
              ) -> tuple[list[torch.nn.Sequential], torch.Tensor, torch.Tensor, int]:
    """The bundled GPT split into ``world`` stages on ``device``, one batch of 2 x ``world``
    sequences, and the microbatch count (one sequence each)."""
    from pipeswap.runtime.models.data import Corpus, batches
    from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, split_stages

    corpus = Corpus.bundled()
    config = GPTConfig(vocab=len(corpus.vocab), seq_len=GPT_SEQ, width=GPT_WIDTH, layers=world)
    microbatches = 2 * world
    ((inputs, targets),) = batches(corpus.encode(), microbatches, GPT_SEQ, 1, 0)
    return (split_stages(build_gpt(config, 0), world), inputs.to(device), targets.to(device),
            microbatches)


def recover_rank(rank: int, world: int, kind: str, failing: int, timeout_s: float
                 ) -> dict[str, Any]:
    from pipeswap.platform import get_platform
    from pipeswap.runtime import PeerFailedError, PipelineExecutor, PipelineStage, SwapOptions
    from pipeswap.runtime.models.gpt import lm_loss
    from pipeswap.schedule import MinGapPolicy

    device = device_of(kind)
    modules, inputs, targets, microbatches = gpt_parts(world, device)
    module = FailAt(modules[rank]).to(device)
    executor = PipelineExecutor([PipelineStage(module, rank, world)], "1f1b", microbatches,
                                lm_loss, swap=SwapOptions(MinGapPolicy()),
                                platform=get_platform(str(device)))

    def clean_step() -> tuple[list[float], list[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        report = executor.step(inputs, targets)
        return list(report.losses), [p.grad.clone() for p in module.parameters()
                                     if p.grad is not None]

    reference = clean_step()
    cases = []
    for phase in ("forward", "backward"):
        if rank == failing:
            module.arm(phase, 2)
        start = time.perf_counter()
        try:
            executor.step(inputs, targets)
            outcome = "finished"
        except PeerFailedError as exc:
            outcome = f"peer {exc.failed_rank}: {exc}"
        except Exception as exc:  # noqa: BLE001 - the failing rank's own error
            outcome = f"own: {type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        module.arm("", 0)
        leftovers = (executor.manager.active_group_count(),
                     executor.manager.stats().host_bytes_in_use)
        executor.recover()
        losses, grads = clean_step()
        cases.append({
            "phase": phase, "outcome": outcome.splitlines()[0] if outcome else "",
            "seconds": seconds, "leftovers": leftovers,
            "recovered": len(losses) == len(reference[0]) and all(
                math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, reference[0]))
            and len(grads) == len(reference[1]) and all(
                close(a, b) for a, b in zip(grads, reference[1])),
            "exact": losses == reference[0] and all(
                torch.equal(a, b) for a, b in zip(grads, reference[1]))})
    return {"rank": rank, "cases": cases, "swapped": len(executor.swapped)}


def recover(ranks: int, kind: str, timeout_s: float, failing: int) -> str:
    from pipeswap.runtime.distributed.launch import backend_for, spawn

    if not 0 <= failing < ranks:
        raise Failed(f"--failing-rank {failing}: the job has ranks 0 to {ranks - 1}")
    results = spawn(recover_rank, ranks, kind, failing, timeout_s, backend=backend_for(kind),
                    timeout_s=timeout_s)
    slowest, exact = 0.0, True
    for result in results:
        rank = result["rank"]
        for case in result["cases"]:
            where = f"rank {rank}, failure in {case['phase']}"
            outcome = case["outcome"]
            if rank == failing and not (outcome.startswith("own:")
                                        and "injected failure" in outcome):
                raise Failed(f"{where}: the failing rank's step ended with {outcome!r}")
            if rank != failing and not outcome.startswith(f"peer {failing}:"):
                raise Failed(f"{where}: expected PeerFailedError naming rank {failing}, got "
                             f"{outcome!r}")
            if case["seconds"] > timeout_s / 4:
                raise Failed(f"{where}: the step took {case['seconds']:.1f} s to fail (told "
                             f"at the timeout of {timeout_s:.0f} s, not at once?)")
            if tuple(case["leftovers"]) != (0, 0):
                raise Failed(f"{where}: left {case['leftovers'][0]} swap groups and "
                             f"{case['leftovers'][1]} host bytes behind")
            if not case["recovered"]:
                raise Failed(f"{where}: after recover() the step differs from one that never "
                             "failed")
            slowest, exact = max(slowest, case["seconds"]), exact and case["exact"]
    return (f"{ranks} ranks, 1F1B with swap: rank {failing} raised in its 2nd forward, then "
            f"its 2nd backward; every peer stopped with PeerFailedError naming it within "
            f"{slowest:.1f} s; after recover() the next step matched the clean one"
            f"{' bit for bit' if exact else ' (within 1e-4, not bit for bit)'}")


# -- torchrun: plain init_process_group ------------------------------------------------------


def torchrun(kind: str) -> str:
    """One rank under torchrun: plain init_process_group, then the executor on that group."""
    import torch.distributed as dist

    from pipeswap.runtime import PipelineExecutor, PipelineStage
    from pipeswap.runtime.models.gpt import lm_loss

    device = device_of(kind)
    if kind == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if kind == "cuda" else "gloo"
    dist.init_process_group(backend)  # as a user's torchrun script does: no device_id, no gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    modules, inputs, targets, microbatches = gpt_parts(world, device)
    module = modules[rank].to(device)
    executor = PipelineExecutor([PipelineStage(module, rank, world)], "1f1b", microbatches,
                                lm_loss, swap=True)  # the platform: the current device
    if executor.platform.device != device:
        raise Failed(f"the executor runs on {executor.platform.device}, not on this rank's "
                     f"{device}")
    first = executor.step(inputs, targets)
    module.zero_grad(set_to_none=True)
    second = executor.step(inputs, targets)
    losses = list(second.losses)
    if not all(math.isfinite(loss) for loss in losses):
        raise Failed(f"losses {losses}")
    if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(first.losses, losses)):
        raise Failed(f"the same batch gave losses {list(first.losses)}, then {losses}")
    default_backend = dist.get_backend()
    dist.barrier()  # nobody tears the group down while another rank still uses it
    dist.destroy_process_group()  # only here: after a failure the process just exits
    # every rank prints a line; rank 0 holds no losses (the last stage does)
    return (f"torchrun, {world} ranks: init_process_group({backend!r}) (default group "
            f"backend {default_backend}), 1F1B with swap, 2 steps"
            + (f", mean loss {sum(losses) / len(losses):.4f}" if losses else ""))


def headline(exc: Exception, rank: str | None, timeout_s: float) -> str:
    """One line: for a spawned job that failed, the rank that explains it (launch's own
    headline); else the error's type and first line."""
    from pipeswap.runtime import RankFailedError

    if isinstance(exc, RankFailedError) and exc.cause is not None:
        return exc.cause.headline(timeout_s)
    first = (str(exc).strip().splitlines() or [""])[0]
    where = f"rank {rank}: " if rank is not None else ""
    kind = "" if isinstance(exc, Failed) else f"{type(exc).__name__}: "
    return f"{where}{kind}{first}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nccl_job.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", choices=["pytree", "recover", "torchrun"])
    parser.add_argument("--ranks", type=int, default=2,
                        help="ranks to spawn (pytree, recover; under torchrun its world size)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (NCCL, one GPU a rank; the default) or cpu (gloo)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a rank waits for a peer (default 60)")
    parser.add_argument("--failing-rank", type=int, default=1,
                        help="recover: the rank that raises (default 1)")
    args = parser.parse_args(argv)
    if args.job != "torchrun" and args.ranks < 2:
        parser.error(f"--ranks must be at least 2, got {args.ranks}")
    if args.device == "cuda" and torch.cuda.device_count() < (
            int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if args.job == "torchrun"
            else args.ranks):
        print(f"{PREFIX} FAILED: {torch.cuda.device_count()} CUDA device(s) here, one a rank "
              "is needed", flush=True)
        return 1
    torchrun_rank = os.environ.get("RANK") if args.job == "torchrun" else None
    try:
        if args.job == "pytree":
            line = pytree(args.ranks, args.device, args.timeout)
        elif args.job == "recover":
            line = recover(args.ranks, args.device, args.timeout, args.failing_rank)
        else:
            line = torchrun(args.device)
    except Exception as exc:  # noqa: BLE001 - one line; the caller reads the exit status
        print(f"{PREFIX} FAILED: {headline(exc, torchrun_rank, args.timeout)}", flush=True)
        code = 1
    else:
        where = f"rank {torchrun_rank}: " if torchrun_rank is not None else ""
        print(f"{PREFIX} ok: {where}{line}", flush=True)
        code = 0
    if args.job == "torchrun":
        # Leave without the interpreter's teardown, as pipeswap-train does under torchrun
        # (torch 2.13 aborted there now and then once all work was done).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    # Run as this module's own name, so that spawn's children find the rank functions by it.
    import nccl_job

    sys.exit(nccl_job.main())
