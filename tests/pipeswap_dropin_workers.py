"""Rank functions that run PyTorch's pipelining schedule classes and pipeswap's drop-ins
(``pipeswap.runtime.pipelining``) side by side, on the same PyTorch ``PipelineStage``
objects' modules and weights."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as torch_pipelining

import pipeswap.runtime.pipelining as pipeswap_pipelining

WIDTH, BATCH, MICRO = 8, 16, 8
SINGLE = {"ScheduleGPipe", "Schedule1F1B"}
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
ZERO_BUBBLE = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
CLASSES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]


def stage_indices(name: str, rank: int, world: int) -> list[int]:
    """Where PyTorch's class places stages: one a rank, looped, or in a V."""
    if name in SINGLE:
        return [rank]
    if name in V_SHAPED:
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]


def model(stages: int, inner: int = WIDTH) -> list[torch.nn.Sequential]:
    """The same weights on every rank: a stage of Linear, tanh, Linear (``inner`` wide
    between them: what the stage saves for its backward)."""
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, inner), torch.nn.Tanh(),
                                torch.nn.Linear(inner, WIDTH)) for _ in range(stages)]


def _stages(modules: list[Any], indices: list[int], count: int) -> list[Any]:
    """PyTorch stages of fresh copies of the ``modules`` this rank runs."""
    return [torch_pipelining.PipelineStage(copy.deepcopy(modules[index]), index, count,
                                           torch.device("cpu")) for index in indices]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, WIDTH, generator=generator),
            torch.randn(BATCH, WIDTH, generator=generator))


def loss_fn(output: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target) * scale


def _run(schedule_of: Any, name: str, rank: int, world: int,
         loss_kwargs: dict[str, float] | None = None, **options: Any) -> dict[str, Any]:
    """One step of ``name`` from ``schedule_of`` (a module of schedule classes) on fresh
    copies of the model: this rank's losses, output, gradients (and pipeswap's report)."""
    count = world if name in SINGLE else 2 * world
    modules = model(count)
    indices = stage_indices(name, rank, world)
    stages = _stages(modules, indices, count)
    schedule = getattr(schedule_of, name)(stages[0] if name in SINGLE else stages,
                                          n_microbatches=MICRO, loss_fn=loss_fn, **options)
    x, y = batch()
    losses: list[torch.Tensor] = []
    output = schedule.step(x if 0 in indices else None, target=y if count - 1 in indices
                           else None, losses=losses, loss_kwargs=loss_kwargs)
    grads = {f"{stage.stage_index}.{n}": p.grad.clone()
             for stage in stages for n, p in stage.submod.named_parameters()
             if p.grad is not None}
    report = getattr(schedule, "report", None)
    # then forward only, on the same weights (nothing stepped them): eval's contract (which
    # PyTorch's zero-bubble classes break on this torch: they split a backward eval has not)
    evaluated: list[torch.Tensor] = []
    out = None
    if schedule_of is not torch_pipelining or name not in ZERO_BUBBLE:
        with torch.no_grad():
            out = schedule.eval(x if 0 in indices else None,
                                target=y if count - 1 in indices else None, losses=evaluated)
    return {"losses": [loss.detach().clone() for loss in losses], "output": output,
            "grads": grads, "swapped": 0 if report is None else report.swapped_chunks,
            "eval_losses": [loss.detach().clone() for loss in evaluated], "eval_output": out}


def side_by_side(rank: int, world: int, name: str,
                 loss_kwargs: dict[str, float] | None = None) -> dict[str, Any]:
    """PyTorch's class, pipeswap's without swap and pipeswap's with swap, one after the
    other on the same ranks (``loss_kwargs`` passed to each step)."""
    return {"torch": _run(torch_pipelining, name, rank, world, loss_kwargs),
            "pipeswap": _run(pipeswap_pipelining, name, rank, world, loss_kwargs),
            "swap": _run(pipeswap_pipelining, name, rank, world, loss_kwargs, swap=True)}


def refused(rank: int, world: int, case: str) -> str:
    """The error a bad construction or step raises on this rank (every rank raises)."""
    name = "ScheduleZBVZeroBubble" if case == "layout" else "Schedule1F1B"
    count = 2 * world if case in ("layout", "single") else world
    modules = model(count)
    indices = ([rank, rank + world] if case in ("layout", "single")
               else stage_indices(name, rank, world))
    stages: list[Any] = [torch_pipelining.PipelineStage(modules[index], index, count,
                                                        torch.device("cpu"))
                         for index in indices]
    if case == "device" and rank == 0:  # a stage built for another device
        stages = [SimpleNamespace(submod=modules[0], stage_index=0, num_stages=count,
                                  device=torch.device("cuda", 1), group=None)]
    last = count - 1 in indices
    try:
        along_1 = torch_pipelining.microbatch.TensorChunkSpec(1)  # type: ignore[no-untyped-call]
        spec = (along_1,) if case == "spec" and rank == 0 else None  # one rank's, not all
        schedule = getattr(pipeswap_pipelining, name)(
            stages[0] if name in SINGLE and case != "single" else stages, n_microbatches=MICRO,
            loss_fn=None if case == "loss" and last else loss_fn, args_chunk_spec=spec,
            budget=10**6 if case == "budget" and rank == 0 else None)
        x, y = batch()
        if case == "batch":
            x = x[:BATCH - 1]  # 15 rows do not split into 8 microbatches
        schedule.step(x if 0 in indices else None, target=y if last else None)
    except Exception as exc:  # noqa: BLE001 - what the test reads
        dist.barrier()  # every rank got here: none hangs
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def budgeted(rank: int, world: int) -> dict[str, Any]:
    """Two steps of Schedule1F1B with no budget to speak of, then two under 60% of what
    the first step held on this rank: each step's losses, gradients and counted peak, what
    the plan under the budget expected, and what it warned."""
    import warnings

    x, y = batch()
    runs = {}
    budget = 10**15
    for run in ("roomy", "tight"):
        modules = model(world, inner=256)  # saved activations that move, not boundaries
        stage = torch_pipelining.PipelineStage(modules[rank], rank, world, torch.device("cpu"))
        steps: list[dict[str, Any]] = []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            schedule = pipeswap_pipelining.Schedule1F1B(stage, n_microbatches=MICRO,
                                                        loss_fn=loss_fn, budget=budget)
            for _ in range(2):
                losses: list[torch.Tensor] = []
                output = schedule.step(x if rank == 0 else None,
                                       target=y if rank == world - 1 else None, losses=losses)
                report = schedule.report
                assert report is not None and report.peak_activation_bytes is not None
                peak: int = report.peak_activation_bytes
                steps.append({"losses": losses, "peak": peak, "output": output,
                              "swapped": report.swapped_chunks,
                              "grads": {n: p.grad.clone()
                                        for n, p in modules[rank].named_parameters()
                                        if p.grad is not None}})
                modules[rank].zero_grad()
        runs[run] = {"steps": steps, "budget": budget,
                     "planned": None if schedule.planned is None else schedule.planned.peak,
                     "warned": [str(w.message) for w in said]}
        budget = int(steps[0]["peak"]) * 6 // 10
    return runs


class _Routed(torch.nn.Module):
    """A stage whose saved activations depend on the data, as a mixture-of-experts layer
    that drops tokens makes them: only the rows whose first feature is positive go through
    the wide expert (what it saves grows with them); the rest pass unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 256), torch.nn.Linear(256, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x[:, 0] > 0).nonzero().squeeze(1)
        routed = self.down(torch.tanh(self.up(x.index_select(0, rows))))
        return x.index_add(0, rows, routed)


def routed_budget(rank: int, world: int) -> dict[str, Any]:
    """Schedule1F1B on stages of data-dependent size, two steps without a budget and two
    under one below the first step's peak: each step's losses, gradients and counted peak,
    the plan's peak, the stages it found of varying size and what it said of them."""
    import warnings

    x, y = batch()
    runs: dict[str, Any] = {}
    for run, budget in (("plain", None), ("budget", 1)):
        torch.manual_seed(0)
        module = [_Routed() for _ in range(world)][rank]
        stage = torch_pipelining.PipelineStage(module, rank, world, torch.device("cpu"))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            schedule = pipeswap_pipelining.Schedule1F1B(stage, n_microbatches=MICRO,
                                                        loss_fn=loss_fn, budget=budget)
            steps = []
            for _ in range(2):
                losses: list[torch.Tensor] = []
                schedule.step(x if rank == 0 else None,
                              target=y if rank == world - 1 else None, losses=losses)
                report = schedule.report
                assert report is not None
                steps.append({"losses": losses, "peak": report.peak_activation_bytes,
                              "moved": report.swapped_chunks + report.recomputed_layers,
                              "grads": {n: p.grad.clone() for n, p in module.named_parameters()
                                        if p.grad is not None}})
                module.zero_grad()
        runs[run] = {"steps": steps, "varying": schedule.varying,
                     "planned": None if schedule.planned is None else schedule.planned,
                     "said": [str(w.message) for w in said]}
        schedule.executor.close()
    return runs


class _Shifted(torch.nn.Module):
    """A stage that every step calls with keyword arguments too: a tensor split with the
    batch (``shift``) and a plain number copied to every microbatch (``factor``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor, factor: float) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(self.linear(x)) * factor + shift
        return out


def keyword_arguments(rank: int, world: int, name: str) -> dict[str, Any]:
    """PyTorch's class and pipeswap's (with swap) on stages that take keyword arguments,
    given to ``step`` and ``eval`` on every rank: each rank's losses, output and
    gradients."""
    count = world if name in SINGLE else 2 * world
    torch.manual_seed(0)
    modules = [_Shifted() for _ in range(count)]
    x, y = batch()
    shift = torch.linspace(-1, 1, BATCH).unsqueeze(1).expand(BATCH, WIDTH).contiguous()
    found: dict[str, Any] = {}
    for mode, schedule_of, options in (("torch", torch_pipelining, {}),
                                       ("pipeswap", pipeswap_pipelining, {"swap": True})):
        indices = stage_indices(name, rank, world)
        stages = _stages(modules, indices, count)
        schedule = getattr(schedule_of, name)(stages[0] if name in SINGLE else stages,
                                              n_microbatches=MICRO, loss_fn=loss_fn, **options)
        losses: list[torch.Tensor] = []
        first, last = 0 in indices, count - 1 in indices
        output = schedule.step(*((x,) if first else ()), target=y if last else None,
                               losses=losses, shift=shift, factor=2.0)
        grads = {f"{stage.stage_index}.{n}": p.grad.clone()
                 for stage in stages for n, p in stage.submod.named_parameters()
                 if p.grad is not None}
        evaluated: list[torch.Tensor] = []
        out = None
        if schedule_of is not torch_pipelining or name not in ZERO_BUBBLE:
            with torch.no_grad():
                out = schedule.eval(*((x,) if first else ()), target=y if last else None,
                                    losses=evaluated, shift=shift, factor=2.0)
        found[mode] = {"losses": [loss.detach() for loss in losses], "output": output,
                       "eval_losses": evaluated, "eval_output": out, "grads": grads,
                       "grads_after_eval": {
                           f"{stage.stage_index}.{n}": p.grad.clone() for stage in stages
                           for n, p in stage.submod.named_parameters() if p.grad is not None}}
    return found


def presplit(rank: int, world: int, name: str) -> dict[str, Any]:
    """pipeswap's class given microbatches already split (``_step_microbatches``), and
    PyTorch's given the whole batch to split (its ``_step_microbatches`` runs no backward
    unless its ``step`` set it up): each rank's losses and gradients."""
    count = world if name in SINGLE else 2 * world
    modules = model(count)
    x, y = batch()
    arg_mbs = [(chunk,) for chunk in x.chunk(MICRO)]
    target_mbs = list(y.chunk(MICRO))
    found: dict[str, Any] = {}
    for mode, schedule_of in (("torch", torch_pipelining), ("pipeswap", pipeswap_pipelining)):
        indices = stage_indices(name, rank, world)
        stages = _stages(modules, indices, count)
        schedule = getattr(schedule_of, name)(stages[0] if name in SINGLE else stages,
                                              n_microbatches=MICRO, loss_fn=loss_fn)
        losses: list[torch.Tensor] = []
        first, last = 0 in indices, count - 1 in indices
        if schedule_of is torch_pipelining:  # the reference: its step on the whole batch
            schedule.step(x if first else None, target=y if last else None, losses=losses)
        else:
            schedule._step_microbatches(arg_mbs if first else None, None,
                                        target_mbs if last else None, losses)
        found[mode] = {"losses": [loss.detach() for loss in losses],
                       "grads": {f"{stage.stage_index}.{n}": p.grad.clone()
                                 for stage in stages for n, p in stage.submod.named_parameters()
                                 if p.grad is not None}}
    return found


def by_name(rank: int, world: int, name: str, swap: bool) -> dict[str, Any]:
    """A trainer that picks its schedule by name and builds it from PyTorch's arguments, as
    torchtitan's ``build_pipeline_schedule`` does (its calls, made here): with PyTorch's
    ``get_schedule_class`` and pipeswap's (``swap`` bound to the class): each rank's
    losses and gradients."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti
    from torch.distributed.pipelining.schedules import get_schedule_class as pytorchs

    from pipeswap.runtime.pipelining import get_schedule_class as pipeswaps

    found: dict[str, Any] = {}
    for mode in ("torch", "pipeswap"):
        schedule_class: Any = (pytorchs(name) if mode == "torch"
                               else pipeswaps(name, swap=True) if swap else pipeswaps(name))
        looped = issubclass(schedule_class, PipelineScheduleMulti)
        count = 2 * world if looped else world
        modules = model(count)
        indices = stage_indices("ScheduleZBVZeroBubble" if name == "ZBVZeroBubble"
                                else "ScheduleInterleaved1F1B" if looped else "Schedule1F1B",
                                rank, world)
        stages = _stages(modules, indices, count)
        schedule = schedule_class(stages if looped else stages[0], n_microbatches=MICRO,
                                  loss_fn=loss_fn, scale_grads=False)
        x, y = batch()
        losses: list[torch.Tensor] = []
        schedule.step(x if 0 in indices else None, target=y if count - 1 in indices else None,
                      losses=losses)
        found[mode] = {"losses": [loss.detach() for loss in losses], "looped": looped,
                       "swapped": mode == "pipeswap" and schedule.report.swapped_chunks > 0,
                       "grads": {f"{stage.stage_index}.{n}": p.grad.clone()
                                 for stage in stages for n, p in stage.submod.named_parameters()
                                 if p.grad is not None}}
    return found


def normed_model(stages: int) -> list[torch.nn.Sequential]:
    """:func:`model` with a final norm on the last stage (a gradient PyTorch's zero-bubble
    classes have lost under FSDP)."""
    modules = model(stages)
    modules[-1].append(torch.nn.LayerNorm(WIDTH))
    return modules


def replica_batch(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel replica ``replica``'s batch (replica 0's is :func:`batch`)."""
    if replica == 0:
        return batch()
    generator = torch.Generator().manual_seed(1 + replica)
    return (torch.randn(BATCH, WIDTH, generator=generator),
            torch.randn(BATCH, WIDTH, generator=generator))


def fsdp_wrapped(rank: int, world: int, names: list[str], dp: int = 1) -> dict[str, Any]:
    """Stages whose blocks and modules are ``fully_shard``ed over a data-parallel dimension
    of ``dp`` (torchtitan shards each block, then every stage's root, at degree 1 too; each
    replica has its own batch), run by PyTorch's class and by pipeswap's without and with
    swap: for each class of ``names``, this rank's gradients (full tensors)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
    return {name: _fsdp_steps(mesh, name) for name in names}


def _fsdp_steps(mesh: Any, name: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    pp = mesh["pp"].size()
    count = pp if name in SINGLE else 2 * pp
    modules = normed_model(count)
    indices = stage_indices(name, mesh["pp"].get_local_rank(), pp)
    found: dict[str, Any] = {}
    for mode, schedule_of, options in (("torch", torch_pipelining, {}),
                                       ("pipeswap", pipeswap_pipelining, {}),
                                       ("swap", pipeswap_pipelining, {"swap": True})):
        stages = []
        for index in indices:
            module = copy.deepcopy(modules[index])
            for child in module:  # each block, then the root (the norm's), as torchtitan
                if isinstance(child, torch.nn.Linear):
                    fully_shard(child, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
            stages.append(torch_pipelining.PipelineStage(
                module, index, count, torch.device("cpu"), group=mesh.get_group("pp")))
        schedule = getattr(schedule_of, name)(stages[0] if name in SINGLE else stages,
                                              n_microbatches=MICRO, loss_fn=loss_fn, **options)
        x, y = replica_batch(mesh["dp"].get_local_rank())
        schedule.step(x if 0 in indices else None, target=y if count - 1 in indices else None)
        found[mode] = {
            f"{stage.stage_index}.{n}": (p.grad.full_tensor() if isinstance(p.grad, DTensor)
                                         else p.grad).clone()
            for stage in stages for n, p in stage.submod.named_parameters()
            if p.grad is not None}
    return found


def unpipelined(count: int, normed: bool = False, replica: int = 0
                ) -> dict[str, torch.Tensor]:
    """The gradients of the mean microbatch loss of ``count`` stages (of
    :func:`normed_model` where ``normed``) run in one process on ``replica``'s batch, keyed
    as the workers key theirs."""
    modules = normed_model(count) if normed else model(count)
    x, y = replica_batch(replica)
    whole = torch.nn.Sequential(*modules)
    total = torch.stack([loss_fn(whole(xs), ys)
                         for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO))]).sum()
    (total / MICRO).backward()  # type: ignore[no-untyped-call]
    return {f"{index}.{n}": p.grad.clone() for index, module in enumerate(modules)
            for n, p in module.named_parameters() if p.grad is not None}
