"""A recomputed layer that saves a view of one of its module's buffers (a rotary table, a
mask), recomputed in some microbatches and kept in others: the recompute puts the buffers
back as the first run found them without writing to a buffer it need not write to, so the
other microbatches' saved views stay valid and losses and gradients are bit-identical to
the run that recomputes nothing."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from pipeswap.runtime import PipelineExecutor, PipelineStage, SwapOptions
from pipeswap.schedule import (
    ChunkKey,
    Order,
    RankPlan,
    ScheduleKind,
    ScheduleSpec,
    SwapCandidate,
)

WIDTH, SEQ, MICRO = 8, 6, 4


class CachedTable(torch.nn.Module):
    """A layer whose forward multiplies by a slice of a buffer it holds (as a rotary cache
    does): autograd saves that view of the buffer for the backward."""

    table: torch.Tensor

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("table", torch.randn(2 * SEQ, WIDTH, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected: torch.Tensor = self.proj(x)
        return projected * self.table[:x.shape[-2]]


class _RecomputeSome:
    """Recomputes ``layers`` of the chunks of the microbatches ``micros`` only, swaps
    nothing."""

    def __init__(self, layers: tuple[int, ...], micros: set[int]) -> None:
        self.layers, self.micros = layers, micros

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order) -> RankPlan:
        recomputed: dict[ChunkKey, tuple[int, ...]] = {
            c.key: self.layers for c in candidates if c.micro in self.micros}
        return RankPlan(rank, {}, recomputed)


def _run(policy: _RecomputeSome | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(CachedTable(1), torch.nn.GELU(), CachedTable(2))
    stage = PipelineStage(model, 0, 1)
    spec = ScheduleSpec(ScheduleKind.GPIPE, ranks=1, microbatches=MICRO)
    swap = SwapOptions(policy) if policy is not None else False
    executor = PipelineExecutor([stage], spec, MICRO, torch.nn.functional.mse_loss, swap=swap)
    if policy is not None:
        assert executor.plan is not None and executor.plan.recomputed  # some chunks recompute
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(2 * MICRO, SEQ, WIDTH, generator=generator)
    targets = torch.randn(2 * MICRO, SEQ, WIDTH, generator=generator)
    losses = []
    for _ in range(2):  # a second step too: the buffers' versions carry over
        model.zero_grad(set_to_none=True)
        losses += list(executor.step(inputs, targets).losses)
    executor.close()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return losses, grads


@pytest.mark.parametrize("layers", [(0,), (2,), (0, 2)])
def test_a_layer_saving_a_view_of_its_buffer_recomputes_bit_identically(
        group: None, layers: tuple[int, ...]) -> None:
    plain_losses, plain_grads = _run(None)
    losses, grads = _run(_RecomputeSome(layers, {0, 2}))
    assert losses == plain_losses
    assert grads.keys() == plain_grads.keys() and len(grads) == 4
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name

