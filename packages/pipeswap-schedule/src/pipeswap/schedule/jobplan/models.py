"""The models a plan is made for: a transformer's dimensions, by preset name, from a Hugging
Face ``config.json`` (read as JSON: no transformers import), or given one by one; and what
one layer of it costs (parameters, FLOPs; its saved activations are
:mod:`pipeswap.schedule.jobplan.activations`'s)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeswap.schedule.errors import ScheduleError


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer. ``gated_mlp``: SwiGLU's three matrices (Llama); else
    two (GPT). ``tied``: the output head shares the embedding's weights."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated_mlp: bool = True
    tied: bool = False

    def __post_init__(self) -> None:
        for field_name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            if getattr(self, field_name) < 1:
                raise ScheduleError(f"model {self.name}: {field_name} must be >= 1, got "
                                    f"{getattr(self, field_name)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ScheduleError(
                f"model {self.name}: {self.heads} heads must divide hidden {self.hidden}, and "
                f"{self.kv_heads} key/value heads must divide the heads")

    @property
    def kv_dim(self) -> int:
        """The width of the keys (and of the values): grouped-query attention's."""
        return self.hidden // self.heads * self.kv_heads

    def layer_params(self) -> int:
        """One block's weights: attention (Q and the output, K and V at the key/value
        width), the MLP's matrices, two norms' scales."""
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return attention + mlp + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """The output head and the final norm (the head's weights shared where tied)."""
        return (0 if self.tied else self.vocab * self.hidden) + self.hidden

    def params(self) -> int:
        return (self.layers * self.layer_params() + self.embedding_params()
                + self.head_params())

    def layer_forward_flops(self, micro_batch: int, seq_len: int) -> float:
        """One block's forward on ``micro_batch`` sequences: two FLOPs per weight and token,
        and the attention scores and their use (``4·b·s²·h``, causal masking not
        discounted)."""
        tokens = micro_batch * seq_len
        return 2.0 * tokens * self.layer_params() + 4.0 * micro_batch * seq_len**2 * self.hidden

    def head_forward_flops(self, micro_batch: int, seq_len: int) -> float:
        return 2.0 * micro_batch * seq_len * self.hidden * self.vocab

    def boundary_bytes(self, micro_batch: int, seq_len: int, dtype_bytes: int) -> int:
        """One stage-to-stage message: a microbatch's hidden states."""
        return micro_batch * seq_len * self.hidden * dtype_bytes

    def describe(self) -> str:
        return (f"{self.name}: {self.params() / 1e9:.1f}B parameters, {self.layers} layers, "
                f"hidden {self.hidden}, {self.heads} heads ({self.kv_heads} key/value), FFN "
                f"{self.ffn}, vocabulary {self.vocab}")


MODEL_PRESETS: dict[str, ModelShape] = {shape.name: shape for shape in (
    ModelShape("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
               vocab=128256),
    ModelShape("llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
               vocab=128256),
    ModelShape("llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248,
               vocab=128256),
    ModelShape("gpt-small", layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072,
               vocab=50257, gated_mlp=False, tied=True),
)}


def model_preset(name: str) -> ModelShape:
    found = MODEL_PRESETS.get(name)
    if found is None:
        raise ScheduleError(f"unknown model preset {name!r}: choose one of "
                            f"{', '.join(MODEL_PRESETS)}, give a Hugging Face config.json, "
                            "or give the dimensions (--layers, --hidden, ...)")
    return found


#: The config.json keys a shape needs, with the names some families use instead.
_HF_KEYS = {"layers": ("num_hidden_layers", "n_layer"), "hidden": ("hidden_size", "n_embd"),
            "heads": ("num_attention_heads", "n_head"), "vocab": ("vocab_size",)}


def from_hf_config(path: str | Path) -> ModelShape:
    """The shape a Hugging Face ``config.json`` describes (read as JSON)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScheduleError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ScheduleError(f"{path}: a config.json holds an object, not "
                            f"{type(data).__name__}")
    return shape_of(data, str(Path(path).parent.name or path))


def shape_of(config: Mapping[str, object], name: str) -> ModelShape:
    """The shape of a Hugging Face config's fields."""
    found: dict[str, int] = {}
    missing = []
    for field_name, keys in _HF_KEYS.items():
        value = next((config[key] for key in keys if key in config), None)
        if not isinstance(value, int) or isinstance(value, bool):
            missing.append(" or ".join(keys))
        else:
            found[field_name] = value
    if missing:
        raise ScheduleError(f"config {name} lacks {', '.join(missing)} (integers): give a "
                            "decoder-only model's config.json, or the dimensions")
    kv = config.get("num_key_value_heads", found["heads"])
    gated = str(config.get("hidden_act", config.get("activation_function", "silu"))) in (
        "silu", "swiglu") and "n_embd" not in config
    ffn = config.get("intermediate_size", config.get("n_inner"))
    if not isinstance(ffn, int):
        ffn = 4 * found["hidden"]
    return ModelShape(name, found["layers"], found["hidden"], found["heads"],
                      kv if isinstance(kv, int) else found["heads"], ffn, found["vocab"],
                      gated_mlp=gated,  # Hugging Face ties the head unless told not to
                      tied=bool(config.get("tie_word_embeddings", True)))
