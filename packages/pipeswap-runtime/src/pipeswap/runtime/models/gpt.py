"""A small GPT-style model for the training job and the end-to-end tests, and its split into
pipeline stages.

Each transformer block is two residual sublayers, attention and MLP, each a module of its own
in the model's ``nn.Sequential``: a stage's layers for streaming swap are then the sublayers,
and the residual stream a sublayer reads is held by nothing else once the next one runs, so
each sublayer's activations can leave the device one sublayer later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq_len: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 4


class Embed(torch.nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(config.vocab, config.width)
        self.positions = torch.nn.Embedding(config.seq_len, config.width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.tokens(ids) + self.positions(positions)
        return out


class Attention(torch.nn.Module):
    """A block's first sublayer: pre-norm causal self-attention, with its residual."""

    mask: torch.Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm = torch.nn.LayerNorm(config.width)
        self.qkv = torch.nn.Linear(config.width, 3 * config.width)
        self.proj = torch.nn.Linear(config.width, config.width)
        self.register_buffer("mask", torch.empty(config.seq_len, config.seq_len,
                                                 dtype=torch.bool), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The causal mask, computed where it lives (also for a stage built on the meta
        device and given memory later)."""
        self.mask.copy_(torch.ones_like(self.mask).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(self.mask[:length, :length], float("-inf"))
        mixed = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, length, width)
        out: torch.Tensor = x + self.proj(mixed)
        return out


class FeedForward(torch.nn.Module):
    """A block's second sublayer: pre-norm GELU MLP, with its residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(config.width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(config.width, 4 * config.width),
                                       torch.nn.GELU(),
                                       torch.nn.Linear(4 * config.width, config.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.mlp(self.norm(x))
        return out


#: The modules of one transformer block, in the model's Sequential.
SUBLAYERS = (Attention, FeedForward)


class Head(torch.nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(config.width)
        self.out = torch.nn.Linear(config.width, config.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added apart: Linear on a 3-D input returns a view of its 2-D result,
        # which FSDP warns about when a sharded stage returns it.
        out: torch.Tensor = torch.nn.functional.linear(self.norm(x), self.out.weight)
        return out + self.out.bias


def build_gpt(config: GPTConfig, seed: int) -> torch.nn.Sequential:
    """Embedding, ``layers`` blocks (each an attention and an MLP sublayer), head: the same
    weights on every rank for one seed."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        embed = Embed(config)  # first: each part draws its weights in the model's order
        blocks = [sublayer(config) for _ in range(config.layers) for sublayer in SUBLAYERS]
        return torch.nn.Sequential(embed, *blocks, Head(config))
    finally:
        torch.random.set_rng_state(generator_state)


def even_runs(count: int, parts: int) -> list[range]:
    """``count`` items in ``parts`` contiguous runs as even as can be, the earlier runs
    taking the extra ones."""
    runs, start = [], 0
    for index in range(parts):
        end = start + count // parts + (index < count % parts)
        runs.append(range(start, end))
        start = end
    return runs


def split_stages(model: torch.nn.Sequential, num_stages: int) -> list[torch.nn.Sequential]:
    """Contiguous stages with the blocks spread evenly (a block's two sublayers together); the
    embedding joins the first stage and the head the last. Each stage shares its modules with
    ``model``."""
    embed, *sublayers, head = list(model)
    width = len(SUBLAYERS)
    blocks = [sublayers[start:start + width] for start in range(0, len(sublayers), width)]
    if len(blocks) < num_stages:
        raise ValueError(f"{len(blocks)} blocks cannot fill {num_stages} stages: use at least "
                         f"{num_stages} layers")
    stages = []
    for index, run in enumerate(even_runs(len(blocks), num_stages)):
        parts = [sublayer for block in blocks[run.start:run.stop] for sublayer in block]
        if index == 0:
            parts = [embed, *parts]
        if index == num_stages - 1:
            parts = [*parts, head]
        stages.append(torch.nn.Sequential(*parts))
    return stages


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the microbatch."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
