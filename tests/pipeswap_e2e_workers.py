"""Rank functions for the end-to-end tests that need more than the training job's run_rank:
each runs in a spawned process with the process group initialized."""

from __future__ import annotations

import os
import threading
import warnings
from types import SimpleNamespace

import torch

from pipeswap.runtime import FailureHandling, SwapOptions
from pipeswap.runtime import PipelineExecutor, PipelineStage
from pipeswap.runtime.distributed.launch import mark_step
from pipeswap.runtime.models.gpt import lm_loss
from pipeswap.runtime.train import ModeResult, TrainConfig, run_rank
from pipeswap.schedule import MinGapPolicy


class Boom(torch.nn.Module):
    """A stage that fails on the given call: ``raise`` or ``die`` (exit without a word)."""

    def __init__(self, how: str, at_call: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.how, self.at_call, self.calls = how, at_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call:
            if self.how == "die":
                os._exit(3)
            raise ValueError("boom: a stage failed on purpose")
        out: torch.Tensor = self.linear(x)
        return out


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def fail_mid_step(rank: int, world_size: int, how: str) -> str:
    """Rank 0's stage fails in its second forward (the shape dry run is the first call)."""
    torch.manual_seed(0)
    module = Boom(how, at_call=3) if rank == 0 else torch.nn.Linear(8, 8)
    stage = PipelineStage(module, rank, world_size)
    executor = PipelineExecutor([stage], "gpipe", 4, _mse, swap=True)
    mark_step(1)  # what the launcher's report names
    executor.step(torch.randn(8, 8), torch.randn(8, 8))
    return "finished"


def agree_then_fail(rank: int, world_size: int) -> dict[str, object]:
    """The end-of-step agreement twice. Over ranks 1-3 (group rank 0 is global rank 1), the
    last rank to arrive comes after the others have arrived: each rank then says whether
    every one had arrived when its agreement returned. Over all four, rank 2 fails instead
    (it breaks its links, as a failing rank does); every other rank breaks its own when its
    agreement raises, as the executor's failure protocol does, and says what it raised."""
    import time

    import torch.distributed as dist

    from pipeswap.runtime.distributed.collectives import agree, members
    from pipeswap.runtime.distributed.failure_board import break_links

    store = dist.distributed_c10d._get_default_store()
    ours = dist.new_group([1, 2, 3])
    everyone = dist.new_group(list(range(world_size)))
    seen: bool | None = None
    if rank > 0:
        if rank == 3:  # the last: after the others, root included, have arrived
            store.wait(["arrived/1", "arrived/2"])
        store.set(f"arrived/{rank}", "yes")
        agree(ours, members(ours))
        seen = store.check([f"arrived/{r}" for r in (1, 2, 3)])
    dist.barrier()
    begun, raised = time.perf_counter(), ""
    if rank == 2:
        break_links(everyone)
    else:
        try:
            agree(everyone, members(everyone))
        except RuntimeError as exc:
            raised = type(exc).__name__
            break_links(everyone)
    return {"seen": seen, "raised": raised, "seconds": time.perf_counter() - begun}


def mismatched(rank: int, world_size: int, what: str) -> str:
    """Rank 1 disagrees with rank 0: another microbatch count, or the wrong stage."""
    module = torch.nn.Linear(8, 8)
    if what == "schedule":
        stage = PipelineStage(module, rank, world_size)
        PipelineExecutor([stage], "gpipe", 4 if rank == 0 else 8, _mse)
    else:
        stage = PipelineStage(module, 0, world_size)  # both ranks claim stage 0
        PipelineExecutor([stage], "gpipe", 4, lm_loss)
    return "built"


def bad_batch_then_recover(rank: int, world_size: int) -> tuple[list[str], int, int]:
    """Rank 0 gets a batch that does not split; every rank recovers, then runs a good step."""
    from pipeswap.runtime import PipelineError

    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(8, 8), rank, world_size)
    executor = PipelineExecutor([stage], "gpipe", 4, _mse, swap=True)
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)
    errors = []
    try:
        executor.step(inputs[:6] if rank == 0 else inputs, targets)
    except PipelineError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    executor.recover()
    report = executor.step(inputs, targets)
    return errors, len(report.losses), executor.manager.active_group_count()


class FailAt(torch.nn.Module):
    """Wraps a stage: once armed, raises in its ``at``-th forward or backward call."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.phase, self.at, self.calls = "", 0, {"forward": 0, "backward": 0}

    def arm(self, phase: str, at: int) -> None:
        self.phase, self.at, self.calls = phase, at, {"forward": 0, "backward": 0}

    def _count(self, phase: str) -> None:
        self.calls[phase] += 1
        if self.phase == phase and self.calls[phase] == self.at:
            raise RuntimeError(f"injected failure in {phase} call {self.at}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._count("forward")
        out: torch.Tensor = self.inner(x)
        if out.requires_grad:
            out.register_hook(lambda grad: self._count("backward"))  # type: ignore[no-untyped-call]
        return out


def fault_injection(rank: int, world_size: int, failing_rank: int, microbatches: int
                    ) -> dict[str, object]:
    """1F1B with swap; ``failing_rank``'s stage fails at each forward and each backward in
    turn. Each failed step must fail on every rank, quickly, and leave nothing behind; after
    ``recover()`` a clean step must equal the reference step bit for bit."""
    import time

    from pipeswap.runtime import PeerFailedError
    from pipeswap.runtime.models.data import Corpus, batches
    from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, split_stages

    torch.set_num_threads(1)
    corpus = Corpus.bundled()
    config = GPTConfig(vocab=len(corpus.vocab), seq_len=16, width=32, layers=world_size)
    modules = split_stages(build_gpt(config, 0), world_size)
    module = FailAt(modules[rank])
    # The gap rule swaps on ranks 0-2, so failures meet copies in flight on several ranks.
    executor = PipelineExecutor([PipelineStage(module, rank, world_size)], "1f1b", microbatches,
                                lm_loss, swap=SwapOptions(MinGapPolicy()))
    ((inputs, targets),) = batches(corpus.encode(), microbatches, 16, 1, 0)

    def clean_step() -> tuple[tuple[float, ...], list[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        report = executor.step(inputs, targets)
        return report.losses, [p.grad.clone() for p in module.parameters() if p.grad is not None]

    reference = clean_step()
    cases = []
    for phase in ("forward", "backward"):
        for at in range(1, microbatches + 1):
            if rank == failing_rank:
                module.arm(phase, at)
            start = time.perf_counter()
            try:
                executor.step(inputs, targets)
                outcome = "finished"
            except PeerFailedError as exc:
                outcome = f"peer {exc.failed_rank}: {exc}"
            except RuntimeError as exc:
                outcome = f"own: {exc}"
            seconds = time.perf_counter() - start
            module.arm("", 0)
            stats = executor.manager.stats()
            leftovers = (executor.manager.active_group_count(), stats.host_bytes_in_use)
            executor.recover()
            losses, grads = clean_step()
            cases.append({
                "case": f"{phase} {at}", "outcome": outcome, "seconds": seconds,
                "leftovers": leftovers, "losses_equal": losses == reference[0],
                "grads_equal": len(grads) == len(reference[1]) and all(
                    torch.equal(a, b) for a, b in zip(grads, reference[1])),
            })
    return {"cases": cases, "swapped": len(executor.swapped)}


def replay_each(rank: int, world_size: int, configs: list[TrainConfig]
                ) -> list[dict[str, ModeResult]]:
    """Each config's ``replay_rank`` replayed alone, in this one process, one after another
    (``pipeswap-train --replay-rank``: no process group is used)."""
    return [run_rank(config.job.replay_rank, 1, config) for config in configs
            if config.job.replay_rank is not None]


def run_rank_recording_warnings(rank: int, world_size: int, config: TrainConfig
                                ) -> tuple[dict[str, ModeResult], list[str]]:
    """``run_rank``, and every warning the rank raised while it ran."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_rank(rank, world_size, config)
    return result, [f"{w.category.__name__}: {w.message}" for w in caught]


def without_cpu_backend(rank: int, world_size: int) -> dict[str, object]:
    """In a world whose group has no CPU backend (``cuda:gloo``, standing in for plain
    ``init_process_group("nccl")``): the groups pipeswap makes, and one step of a
    two-stage pipeline with and without swap."""
    import torch.distributed as dist

    from pipeswap.runtime.distributed.process_groups import has_cpu_backend, with_cpu_backend

    losses, groups = [], []
    for swap in (False, True):
        torch.manual_seed(0)
        stage = PipelineStage(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()),
                              rank, world_size)
        before = len(dist.distributed_c10d._world.pg_map)
        executor = PipelineExecutor([stage], "1f1b", 4, _mse, swap=swap)
        generator = torch.Generator().manual_seed(1)
        report = executor.step(torch.randn(8, 8, generator=generator),
                               torch.randn(8, 8, generator=generator))
        losses.append(report.losses)
        made = {"transport": dist.get_backend_config(executor.transport.group),
                "control": dist.get_backend_config(executor._control)}
        during = len(dist.distributed_c10d._world.pg_map)
        executor.close()
        groups.append((before, during, len(dist.distributed_c10d._world.pg_map)))
    return {"world_has_cpu": has_cpu_backend(None), "asked": with_cpu_backend(None),
            **made, "losses": losses, "groups": groups}


class Stops(torch.nn.Module):
    """A stage whose forward stops its own process (SIGSTOP) once ``stop`` is set, until a
    peer sends SIGCONT."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.stop = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import signal

        if self.stop:
            self.stop = False
            os.kill(os.getpid(), signal.SIGSTOP)
        out: torch.Tensor = self.linear(x)
        return out


def watched_stop(rank: int, world_size: int, timeout_s: float) -> dict[str, object]:
    """Two ranks watched with ``FailureHandling(timeout_s)``: a step, then one in which
    rank 1 stops. Rank 0 sends it SIGCONT once its own step failed."""
    import signal
    import time

    import torch.distributed as dist

    from pipeswap.runtime import PeerFailedError, PipelineCommError

    pids: list[int | None] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    torch.manual_seed(0)
    module = Stops() if rank == 1 else torch.nn.Linear(8, 8)
    executor = PipelineExecutor([PipelineStage(module, rank, world_size)], "gpipe", 2, _mse,
                                failure=FailureHandling(timeout_s))
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    result: dict[str, object] = {"operation_timeout": executor._operation_timeout}
    executor.step(*batch)
    if isinstance(module, Stops):
        module.stop = True
    start = time.monotonic()
    try:
        executor.step(*batch)
    except PeerFailedError as exc:
        result.update(error=str(exc), failed_rank=exc.failed_rank,
                      seconds=time.monotonic() - start)
    except PipelineCommError as exc:
        result.update(error=str(exc), failed_rank=None)
    finally:
        if rank == 0:
            pid = pids[1]
            assert pid is not None
            os.kill(pid, signal.SIGCONT)
    executor.close()
    return result


class _HeldStream:
    """The compute stream of a rank whose last kernel waits for a message that never comes:
    its synchronize returns only once the executor's groups are stopped (NCCL's abort is
    what releases a receive's kernel), or after ``limit_s``."""

    def __init__(self, released: threading.Event, limit_s: float) -> None:
        self.released, self.limit_s = released, limit_s

    def synchronize(self) -> None:
        self.released.wait(self.limit_s)


def watched_last_device_work(rank: int, world_size: int, timeout_s: float
                             ) -> dict[str, object]:
    """Two watched ranks: a step, then one after whose end-of-step agreement rank 1 stops
    (SIGSTOP) while rank 0's last kernel still waits for it. Rank 0's watch must still be
    armed to find the silence and release the kernel; it then sends rank 1 SIGCONT."""
    import signal
    import time

    import torch.distributed as dist

    from pipeswap.runtime import PeerFailedError

    pids: list[int | None] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    torch.manual_seed(0)
    executor = PipelineExecutor([PipelineStage(torch.nn.Linear(8, 8), rank, world_size)],
                                "gpipe", 2, _mse, failure=FailureHandling(timeout_s))
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    executor.step(*batch)
    result: dict[str, object] = {"error": None}
    start = time.monotonic()
    if rank == 0:
        held = _HeldStream(executor._stopper._stopped, 20 * timeout_s)
        real = executor.platform
        executor.platform = SimpleNamespace(
            current_stream=lambda: held, device=real.device,
            measure_allocations=real.measure_allocations)
        try:
            executor.step(*batch)
        except PeerFailedError as exc:
            result.update(error=str(exc), failed_rank=exc.failed_rank)
        finally:
            pid = pids[1]
            assert pid is not None
            os.kill(pid, signal.SIGCONT)
    else:
        executor.step(*batch)
        os.kill(os.getpid(), signal.SIGSTOP)
    result["seconds"] = time.monotonic() - start
    executor.close()
    return result


def watched_slow(rank: int, world_size: int, timeout_s: float) -> dict[str, object]:
    """Two watched ranks, rank 1's forward taking twice ``timeout_s``: slow, alive, beating.
    The step must finish on both."""
    import time

    torch.manual_seed(0)
    module = _Slow(2 * timeout_s if rank == 1 else 0.0)
    executor = PipelineExecutor([PipelineStage(module, rank, world_size)], "gpipe", 1, _mse,
                                failure=FailureHandling(timeout_s))
    start = time.monotonic()
    report = executor.step(torch.randn(4, 8), torch.randn(4, 8))
    seconds = time.monotonic() - start
    executor.close()
    return {"losses": report.losses, "seconds": seconds,
            "operation_timeout_s": executor._operation_timeout.total_seconds()
            if executor._operation_timeout else None}


class _Slow(torch.nn.Module):
    """A stage whose forward takes ``delay_s`` more than its compute (a slow rank)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            threading.Event().wait(self.delay_s)  # the slow rank's own time
        out: torch.Tensor = self.linear(x)
        return out


def timed_behind_a_slow_rank(rank: int, world: int, delay_s: float) -> dict[str, float]:
    """1F1B over ``world`` ranks, the last one slow: this rank's measured forward and
    backward means (a measured step times each compute)."""
    from pipeswap.runtime import Measure
    from pipeswap.schedule import StepType

    torch.manual_seed(0)
    stage = PipelineStage(_Slow(delay_s if rank == world - 1 else 0.0), rank, world)
    executor = PipelineExecutor([stage], "1f1b", 4, torch.nn.functional.mse_loss)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    report = executor.step(x, y, measure=Measure(compute=True))
    executor.close()
    return {"forward": report.compute_seconds[StepType.FWD, rank],
            "backward": report.compute_seconds[StepType.BWD, rank]}
