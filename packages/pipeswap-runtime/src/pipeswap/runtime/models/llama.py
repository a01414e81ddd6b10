"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) for the
training job, and a splitter into pipeline stages for any model whose blocks are a
``ModuleList`` or ``ModuleDict``.

The layout follows torchtitan's Llama: blocks live in ``layers``, a ``ModuleDict`` keyed by
layer index, so a stage's parameter names are the unsplit model's names and checkpoints and
gradients line up across any split.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from pipeswap.runtime.models.gpt import even_runs

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

INIT_STD = 0.02
"""Standard deviation of every embedding and projection weight at initialisation (GPT-2's
choice; small enough that the residual stream starts near the embeddings)."""


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama-style decoder.

    ``ffn_dim`` is the SwiGLU hidden size; left as ``None`` it is derived as Llama derives it,
    two thirds of ``4 * dim`` (the gate keeps the parameter count of a 4x MLP), rounded up to
    a multiple of 16 (Llama rounds to 256, too coarse for small widths): see ``hidden_dim``.
    """

    vocab: int
    seq_len: int = 64
    dim: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "dim", "layers", "heads", "kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.ffn_dim is not None and self.ffn_dim < 1:
            raise ValueError(f"ffn_dim must be at least 1, got {self.ffn_dim}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads}): each key/value head serves a whole group "
                             f"of query heads")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")
        if self.head_dim % 2:
            raise ValueError(f"dim / heads = {self.head_dim} must be even: rotary embeddings "
                             f"rotate pairs of features")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_theta ({self.rope_theta}) and norm_eps ({self.norm_eps}) "
                             f"must be positive")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden size: ``ffn_dim``, or Llama's rule when it is ``None``."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 16 * math.ceil(int(8 * self.dim / 3) / 16)


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm, computed in float32 and returned in the input's dtype: squares
    of bfloat16 activations lose too much precision, and autocast does not cover it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class Rotary(torch.nn.Module):
    """Rotary position embeddings in the half-split layout (feature ``i`` turns with feature
    ``i + head_dim / 2``, as Hugging Face's Llama does). The angles are precomputed for
    ``seq_len`` positions as non-persistent buffers: derived from the config, never saved."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        for name in ("cos", "sin"):
            self.register_buffer(name, torch.empty(config.seq_len, config.head_dim),
                                 persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The angles, computed in float64 where the buffers live (also for a stage built on
        the meta device and given memory later)."""
        device = self.cos.device
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64,
                                 device=device) / self.head_dim
        angles = torch.outer(torch.arange(self.cos.shape[0], dtype=torch.float64, device=device),
                             self.theta ** -exponents)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos.copy_(angles.cos().float())
        self.sin.copy_(angles.sin().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` of shape (batch, length, heads, head_dim), in float32."""
        length = x.shape[1]
        if length > self.cos.shape[0]:
            raise ValueError(f"a sequence of {length} tokens is longer than seq_len "
                             f"({self.cos.shape[0]})")
        cos, sin = self.cos[:length, None, :], self.sin[:length, None, :]
        wide = x.float()
        first, second = wide.chunk(2, dim=-1)
        return (wide * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)


class Attention(torch.nn.Module):
    """Causal self-attention with grouped-query heads: ``kv_heads`` key/value heads, each
    repeated for its ``heads / kv_heads`` query heads before PyTorch's fused attention (its
    ``enable_gqa`` needs torch 2.5)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.wq = torch.nn.Linear(config.dim, config.heads * config.head_dim, bias=False)
        self.wk = torch.nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wv = torch.nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wo = torch.nn.Linear(config.heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        batch, length, _ = x.shape
        q = rope(self.wq(x).view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        k = rope(self.wk(x).view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        repeats = self.heads // self.kv_heads
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.wo(mixed.transpose(1, 2).reshape(batch, length, -1))
        return out


class FeedForward(torch.nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``, ``w1`` the gate and ``w3`` the up projection."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w3 = torch.nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = torch.nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))
        return out


class Block(torch.nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual stream."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Llama(torch.nn.Module):
    """Embedding, blocks, final norm and output projection. Pipeline stages (``split_layers``)
    are this class with some parts set to ``None``: without ``embed`` the input is already the
    hidden state, and without ``norm`` and ``output`` the hidden state is returned.

    Weights start as ``INIT_STD`` normals, norm weights as ones; with ``tie_embeddings`` the
    output projection is the embedding matrix itself.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        embed = torch.nn.Embedding(config.vocab, config.dim)
        self.embed: torch.nn.Embedding | None = embed
        self.rope = Rotary(config)
        self.layers = torch.nn.ModuleDict({str(index): Block(config)
                                           for index in range(config.layers)})
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        output = torch.nn.Linear(config.dim, config.vocab, bias=False)
        self.output: torch.nn.Linear | None = output
        for module in self.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=INIT_STD)
        if config.tie_embeddings:
            output.weight = embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, length) or, without ``embed``, hidden states (batch, length, dim)
        to logits or, without ``output``, hidden states."""
        h: torch.Tensor = x if self.embed is None else self.embed(x)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_llama(config: LlamaConfig, seed: int) -> Llama:
    """A Llama built on the CPU with the same weights on every process for one ``seed``; the
    caller's random state is left as it was."""
    state = torch.random.get_rng_state()
    torch.default_generator.manual_seed(seed)
    try:
        return Llama(config)
    finally:
        torch.random.set_rng_state(state)


def split_layers(model: ModuleT, num_stages: int, *, layers: str = "layers",
                 first: Sequence[str] = ("embed",),
                 last: Sequence[str] = ("norm", "output")) -> list[ModuleT]:
    """Splits ``model`` into ``num_stages`` contiguous pipeline stages of its blocks, the
    submodule ``layers`` (a ``ModuleList`` or ``ModuleDict``), spread evenly with the earlier
    stages taking the extra blocks. The submodules named in ``first`` stay only on the first
    stage and those in ``last`` only on the last; elsewhere they are ``None``, so the model's
    forward must skip a missing part. Other submodules stay on every stage.

    Each stage is a shallow copy of ``model`` (same class, same forward) with its own
    containers of submodules, parameters, buffers and hooks: it shares every module, parameter
    and buffer with ``model`` (no weights are copied), while a hook registered on a stage (as
    FSDP registers them) or a part replaced in it touches that stage alone.

    Parameter names do not change: a stage's blocks keep their keys. A ``ModuleDict`` slice
    is a ``ModuleDict``; a ``ModuleList`` slice stays a ``ModuleList`` (so the model's forward
    can still iterate it) whose entries keep their original indices as names, so indexing it
    by position does not work.
    """
    for name in (layers, *first, *last):
        if name not in model._modules:
            raise ValueError(f"{type(model).__name__} has no submodule named {name!r}")
    blocks = model._modules[layers]
    if not isinstance(blocks, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        raise ValueError(f"{type(model).__name__}.{layers} is a {type(blocks).__name__}; "
                         f"split_layers splits a ModuleList or ModuleDict of blocks")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    named = list(blocks._modules.items())
    if len(named) < num_stages:
        raise ValueError(f"{len(named)} blocks in {layers!r} cannot fill {num_stages} stages: "
                         f"use at least {num_stages} layers")
    stages = []
    for index, run in enumerate(even_runs(len(named), num_stages)):
        kept = (torch.nn.ModuleList() if isinstance(blocks, torch.nn.ModuleList)
                else torch.nn.ModuleDict())
        for key, block in named[run.start:run.stop]:
            kept.add_module(key, block)
        stage = copy.copy(model)
        for attribute, value in vars(model).items():
            if isinstance(value, (dict, set)):
                vars(stage)[attribute] = copy.copy(value)
        stage._modules[layers] = kept
        for name in (*(first if index > 0 else ()), *(last if index < num_stages - 1 else ())):
            stage._modules[name] = None
        stages.append(stage)
    return stages


@dataclass(frozen=True)
class TiedParameter:
    """One parameter held by two stages, e.g. a tied embedding: the first stage that holds it
    and its name there, a later stage and its name there. Each stage computes only its own
    part of the gradient, so the ranks running the two must sum their gradients."""

    stage: int
    name: str
    other_stage: int
    other_name: str


def tied_parameter_names(stages: Sequence[torch.nn.Module]) -> list[TiedParameter]:
    """The parameters that more than one stage holds (by identity), each later holder paired
    with the first, in stage and parameter order."""
    first_holder: dict[int, tuple[int, str]] = {}
    tied = []
    for index, stage in enumerate(stages):
        for name, parameter in stage.named_parameters():
            holder = first_holder.setdefault(id(parameter), (index, name))
            if holder[0] != index:
                tied.append(TiedParameter(*holder, index, name))
    return tied
