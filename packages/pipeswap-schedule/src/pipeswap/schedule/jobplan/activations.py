"""What a model's forward saves for its backward, as pipeswap's swap manager counts it: every
storage autograd saves, once, parameters left out.

The figures are those of pipeswap's built-in blocks, which ``pipeswap-train`` runs: a gated
model (``ModelShape.gated_mlp``) is its Llama (RMSNorm computed in float32, rotary
embeddings, grouped-query attention through ``scaled_dot_product_attention`` with the keys
and values repeated to every head, SwiGLU), any other its GPT (LayerNorm, attention as
explicit matrix products with the scores' softmax kept, a GELU MLP). Per token of a
microbatch, in elements of the activation dtype:

- a Llama block keeps ``10·h + 4·f``: the block's input and each norm's input and output,
  the projections' input, queries, repeated keys and values, the attention's output, the
  residual; the MLP's gate, up, their product's two factors; and in float32 one log-sum-exp
  per head and two norms' scales;
- a GPT block keeps ``8·h + 2·f`` and the softmax of its scores, ``heads·s`` a token; and in
  float32 two norms' mean and scale each;
- the last stage keeps its head's norm input and output (and a Llama's head input, the norm's
  float32 output cast back), then its loss's log-probabilities over the vocabulary in
  float32 and one float32 scalar;
- the first stage keeps, for a GPT, its positions (int64);
- and a rank keeps once what its chunks share: the token ids of the replica's whole batch on
  the first stage and its targets on the last (each microbatch's are views of them), a
  Llama's rotary tables, each GPT block's causal mask.

A split backward (the zero-bubble families) runs a chunk's input gradients (I), then its
weight gradients (W); pipeswap's runtime frees at I all but what the weight nodes saved:
a block's projections' inputs and its norms' (``5·h + f`` a token), the head's input and
norm, the first stage's positions, the batch's ids; the loss's, the targets, the rotary tables
and the masks go at I.

Verified exactly against ``pipeswap-train`` on CPU in float32 (the root integration suite);
in 16 bits the same tensors are counted at two bytes, the float32 ones at four.
"""

from __future__ import annotations

from pipeswap.schedule.jobplan.models import ModelShape

_FP32, _INT64 = 4, 8


def layer_bytes(model: ModelShape, micro_batch: int, seq_len: int, dtype_bytes: int) -> int:
    """One block's saved activations for a microbatch."""
    h, f = model.hidden, model.ffn
    if model.gated_mlp:
        per_token = (10 * h + 4 * f) * dtype_bytes + (model.heads + 2) * _FP32
    else:
        per_token = ((8 * h + 2 * f) * dtype_bytes + 4 * _FP32
                     + model.heads * seq_len * dtype_bytes)
    return micro_batch * seq_len * per_token


def layer_after_input_bytes(model: ModelShape, micro_batch: int, seq_len: int,
                            dtype_bytes: int) -> int:
    """Of one block's saved activations, what a split backward keeps from its I to its W:
    the weight nodes' own (the projections' inputs; a Llama's norms' outputs before their
    scale, a GPT's norms' inputs and statistics)."""
    statistics = 0 if model.gated_mlp else 4 * _FP32
    per_token = (5 * model.hidden + model.ffn) * dtype_bytes + statistics
    return micro_batch * seq_len * per_token


def first_stage_bytes(model: ModelShape, seq_len: int) -> int:
    """What the first stage's embedding saves per microbatch, whatever its size: a GPT's
    positions, one row (its token ids are counted once per rank: :func:`batch_bytes`)."""
    return 0 if model.gated_mlp else seq_len * _INT64


def last_stage_bytes(model: ModelShape, micro_batch: int, seq_len: int,
                     dtype_bytes: int) -> int:
    """What the last stage's head and loss save per microbatch (its targets are counted once
    per rank: :func:`batch_bytes`)."""
    h = model.hidden
    head = (3 * h * dtype_bytes + _FP32) if model.gated_mlp else (2 * h * dtype_bytes
                                                                   + 2 * _FP32)
    return micro_batch * seq_len * (head + model.vocab * _FP32) + _FP32


def last_stage_after_input_bytes(model: ModelShape, micro_batch: int, seq_len: int,
                                 dtype_bytes: int) -> int:
    """Of what the head and the loss save, what a split backward keeps from its I to its W:
    the head's input and its norm's output before the scale (a GPT's norm's input and
    statistics); the loss's go at I."""
    h = model.hidden
    per_token = 2 * h * dtype_bytes + (0 if model.gated_mlp else 2 * _FP32)
    return micro_batch * seq_len * per_token


def weight_grad_bytes(model: ModelShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                      *, blocks: int, first: bool, last: bool) -> int:
    """The gradients a stage's weight nodes receive at a chunk's I and keep until its W (a
    split backward's: not activations, but held with them): each node's output gradient.
    A Llama block's norms, projections and MLP make ``5·h + 2·kv + 2·f`` values a token, a
    GPT block's ``7·h + f``; the embedding ``h`` (a GPT's positions another ``h``); the
    head's norm ``h`` and its logits the vocabulary."""
    h, f = model.hidden, model.ffn
    block = 5 * h + 2 * model.kv_dim + 2 * f if model.gated_mlp else 7 * h + f
    per_token = blocks * block
    if first:
        per_token += h if model.gated_mlp else 2 * h
    if last:
        per_token += h + model.vocab
    return micro_batch * seq_len * per_token * dtype_bytes


def rank_bytes(model: ModelShape, seq_len: int, blocks: int) -> int:
    """What chunks share, counted once however many are in flight: a Llama's rotary tables
    (one for the model: every stage of a rank uses them), or a GPT's causal masks (one per
    block: ``blocks`` of a stage)."""
    if model.gated_mlp:
        return 2 * seq_len * (model.hidden // model.heads) * _FP32
    return blocks * seq_len * seq_len


def batch_bytes(replica_batch: int, seq_len: int) -> int:
    """The token ids of the replica's batch (``replica_batch`` sequences), which the first
    stage's chunks share, or its targets, which the last stage's share: each microbatch's
    are a view of them, counted once while any chunk of the stage is in flight."""
    return replica_batch * seq_len * _INT64
