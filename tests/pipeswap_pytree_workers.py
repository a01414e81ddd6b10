"""A four-stage toy model whose stages pass dicts and tuples: a hidden state that carries a
gradient, a second one next to it, integer position ids and a floating mask that cross
forward only; and the rank function that trains it across two ranks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipeswap.runtime import SwapOptions
from pipeswap.runtime import PipelineExecutor, PipelineStage
from pipeswap.runtime.distributed.collectives import AGREE_TAG
from pipeswap.runtime.models.gpt import lm_loss
from pipeswap.schedule import MinGapPolicy, ScheduleKind, ScheduleSpec, StepType, build_schedule

VOCAB, WIDTH, SEQ, BATCH, MICRO = 11, 8, 6, 8, 4


class Embed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        positions = torch.arange(ids.shape[1]).expand_as(ids)  # int64, no gradient
        mask = (ids % 3 != 0).float()  # floating, no gradient
        return {"hidden": self.tokens(ids), "positions": positions, "mask": mask}


class Mixer(torch.nn.Module):
    """Returns a tuple: two tensors that carry gradients, and the two that do not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.gate = torch.nn.Linear(WIDTH, 1)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        mixed = torch.tanh(self.lin(hidden)) * mask.unsqueeze(-1)
        return mixed, positions, mask, self.gate(hidden).squeeze(-1)


class Join(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.positions = torch.nn.Embedding(SEQ, WIDTH)

    def forward(self, mixed: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lin(mixed * torch.sigmoid(gate).unsqueeze(-1)) + self.positions(positions)
        return out, positions


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(hidden) + positions.unsqueeze(-1).float() * 0.01
        return out


def build() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [Embed(), Mixer(), Join(), Head()]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator))


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    """The unsplit model on the whole batch, in one process."""
    modules = build()
    ids, targets = data()
    value: Any = modules[0](ids)
    value = modules[1](**value)
    value = modules[2](*value)
    loss = lm_loss(modules[3](*value), targets)
    loss.backward()  # type: ignore[no-untyped-call]
    return float(loss.detach()), {f"{index}.{name}": p.grad.clone()
                         for index, module in enumerate(modules)
                         for name, p in module.named_parameters() if p.grad is not None}


def train(rank: int, world_size: int, schedule: str, swap: bool) -> dict[str, Any]:
    """One step of ``schedule`` over 2 ranks x 2 stages; losses, gradients, and how many
    batched point-to-point calls its sends and receives made (the end-of-step agreement's
    left out) against those steps (and those of several tensors).
    (Only the batch call is counted: torch checks that a P2POp's function is its own.)"""
    torch.set_num_threads(1)
    spec = ScheduleSpec(ScheduleKind(schedule), ranks=2, microbatches=MICRO, stages_per_rank=2)
    placement = build_schedule(spec).stage_ranks
    modules = build()
    stages = [PipelineStage(module, index, 4) for index, module in enumerate(modules)
              if placement[index] == rank]
    executor = PipelineExecutor(stages, spec, MICRO, lm_loss,
                                swap=SwapOptions(MinGapPolicy(3)) if swap else False)
    calls: Counter[str] = Counter()
    originals = {"batch_isend_irecv": dist.batch_isend_irecv}

    def counting(name: str) -> Callable[..., Any]:
        def call(ops: list[dist.P2POp]) -> Any:
            if any(op.tag != AGREE_TAG for op in ops):  # the end-of-step agreement's aside
                calls[name] += 1
            return originals[name](ops)
        return call

    ids, targets = data()
    executor.step(ids, targets)  # the first step also exchanges the boundaries' shapes
    for stage in stages:
        stage.module.zero_grad(set_to_none=True)
    for name in originals:
        setattr(dist, name, counting(name))
    try:
        report = executor.step(ids, targets)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    order = [s for s in executor.schedule.orders[executor.rank] if s is not None]
    sizes = [len(executor.transport.carried(s)) for s in order
             if s.type in (StepType.FWD_SEND, StepType.FWD_RECV, StepType.BWD_SEND,
                           StepType.BWD_RECV)]
    return {
        "losses": report.losses,
        "grads": {f"{stage.stage_index}.{name}": p.grad.clone()
                  for stage in stages for name, p in stage.module.named_parameters()
                  if p.grad is not None},
        "swapped": report.swapped_chunks,
        "batch_calls": calls["batch_isend_irecv"],
        "p2p_steps": len(sizes),
        "batched_steps": sum(1 for size in sizes if size > 1),
        "groups_alive": executor.manager.active_group_count(),
    }
