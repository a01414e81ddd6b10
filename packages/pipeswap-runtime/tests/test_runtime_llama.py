"""The Llama-style decoder and the generic layer splitter (pipeswap.runtime.models.llama), on one
CPU process: stages chained equal the unsplit model bit for bit and keep its parameter names,
attention is causal and grouped-query attention matches a per-head reference, bf16 autocast works,
tied embeddings are found across stages, and bad input fails with a clear message."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

from pipeswap.runtime.models.llama import (
    Block,
    Llama,
    LlamaConfig,
    TiedParameter,
    build_llama,
    split_layers,
    tied_parameter_names,
)
from pipeswap.runtime.models.gpt import lm_loss

CONFIG = LlamaConfig(vocab=32, seq_len=16, dim=32, layers=4, heads=4, kv_heads=2)
TIED = LlamaConfig(vocab=32, seq_len=16, dim=32, layers=4, heads=4, kv_heads=2,
                   tie_embeddings=True)


def _tokens(config: LlamaConfig = CONFIG, batch: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(config.vocab, (batch, config.seq_len), generator=generator)


def _block(model: Llama, index: int) -> Block:
    block = model.layers[str(index)]
    assert isinstance(block, Block)
    return block


def _chain(stages: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def _names(modules: Sequence[torch.nn.Module]) -> set[tuple[str, int]]:
    return {(name, id(parameter)) for module in modules
            for name, parameter in module.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("num_stages", range(1, CONFIG.layers + 1))
def test_chained_stages_equal_the_model(config: LlamaConfig, num_stages: int) -> None:
    model = build_llama(config, seed=0)
    stages = split_layers(model, num_stages)
    tokens = _tokens(config)
    expected = model(tokens)
    torch.autograd.backward(expected.sum())
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    out = _chain(stages, tokens)
    torch.autograd.backward(out.sum())
    assert torch.equal(out, expected)
    assert [name for name, p in model.named_parameters()
            if p.grad is not None and torch.equal(p.grad, grads[name])] == list(grads)


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
def test_stages_keep_the_model_names_and_share_its_parameters(config: LlamaConfig) -> None:
    model = build_llama(config, seed=0)
    stages = split_layers(model, 3)
    assert [list(stage.layers) for stage in stages] == [["0", "1"], ["2"], ["3"]]
    assert _names(stages) == _names([model])
    assert {key for stage in stages for key in stage.state_dict()} == set(model.state_dict())
    assert [stage.embed is not None for stage in stages] == [True, False, False]
    assert [stage.output is not None for stage in stages] == [False, False, True]
    assert [stage.norm is not None for stage in stages] == [False, False, True]
    assert all(stage.rope is model.rope for stage in stages)
    assert list(model.layers) == ["0", "1", "2", "3"] and model.output is not None


def test_causal() -> None:
    model = build_llama(CONFIG, seed=0)
    tokens = _tokens()
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % CONFIG.vocab
    before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.equal(before[:, 10:], after[:, 10:])


def _reference_attention(model: Llama, x: torch.Tensor) -> torch.Tensor:
    """The first block's attention, one query head at a time, each on key/value head
    ``head // (heads / kv_heads)``."""
    attention = _block(model, 0).attention
    config = model.config
    batch, length, _ = x.shape
    q = model.rope(attention.wq(x).view(batch, length, config.heads, config.head_dim))
    k = model.rope(attention.wk(x).view(batch, length, config.kv_heads, config.head_dim))
    v = attention.wv(x).view(batch, length, config.kv_heads, config.head_dim)
    mask = torch.ones(length, length, dtype=torch.bool).triu(1)
    heads = []
    for head in range(config.heads):
        group = head // (config.heads // config.kv_heads)
        scores = q[:, :, head] @ k[:, :, group].transpose(1, 2) / math.sqrt(config.head_dim)
        heads.append(scores.masked_fill(mask, float("-inf")).softmax(-1) @ v[:, :, group])
    out: torch.Tensor = attention.wo(torch.cat(heads, dim=-1))
    return out


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention(kv_heads: int) -> None:
    config = LlamaConfig(vocab=32, seq_len=16, dim=32, heads=4, kv_heads=kv_heads)
    model = build_llama(config, seed=0)
    attention = _block(model, 0).attention
    assert attention.wq.weight.shape == (32, 32)
    assert attention.wk.weight.shape == attention.wv.weight.shape == (kv_heads * 8, 32)
    assert attention.wo.weight.shape == (32, 32)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    out = attention(x, model.rope)
    assert out.shape == (2, 16, 32)
    assert torch.allclose(out, _reference_attention(model, x), rtol=1e-5, atol=1e-6)
    assert model(_tokens(config)).shape == (3, 16, 32)


def test_bf16_autocast_gives_finite_loss_and_float32_grads() -> None:
    model = build_llama(CONFIG, seed=0)
    tokens = _tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
        loss = lm_loss(logits, tokens[:, 1:])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert torch.isfinite(loss)
    torch.autograd.backward(loss)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.dtype == torch.float32, name
        assert torch.isfinite(parameter.grad).all(), name


def test_rmsnorm_returns_the_input_dtype() -> None:
    norm = _block(build_llama(CONFIG, seed=0), 0).attention_norm
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    wide = x.float()
    assert torch.equal(out, (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5))
                       .to(torch.bfloat16))


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_outputs_are_not_views(autocast: bool) -> None:
    """FSDP warns when a sharded module returns a view."""
    model = build_llama(CONFIG, seed=0)
    stages = split_layers(model, CONFIG.layers)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert model(_tokens())._base is None
        h = _tokens()
        for stage in stages:
            h = stage(h)
            assert h._base is None
        h = torch.randn(3, CONFIG.seq_len, CONFIG.dim)
        for index in range(CONFIG.layers):
            h = _block(model, index)(h, model.rope)
            assert h._base is None


def test_tied_embeddings_are_found_across_the_first_and_last_stage() -> None:
    model = build_llama(TIED, seed=0)
    assert model.output is not None and model.embed is not None
    assert model.output.weight is model.embed.weight
    assert tied_parameter_names(split_layers(model, 3)) == [
        TiedParameter(0, "embed.weight", 2, "output.weight")]
    assert tied_parameter_names(split_layers(model, 1)) == []
    assert tied_parameter_names(split_layers(build_llama(CONFIG, seed=0), 3)) == []


def test_build_is_reproducible_and_leaves_the_random_state_alone() -> None:
    state = torch.random.get_rng_state()
    first, again, other = (build_llama(CONFIG, seed) for seed in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(),
                               other.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(a, c) == ("norm" in name), name


def test_hidden_dim() -> None:
    assert CONFIG.hidden_dim == 96  # int(8 * 32 / 3) = 85, up to a multiple of 16
    assert LlamaConfig(vocab=8).hidden_dim == 176
    assert LlamaConfig(vocab=8, ffn_dim=100).hidden_dim == 100


class _Toy(torch.nn.Module):
    """A model whose blocks are a plain ModuleList that its forward iterates."""

    def __init__(self) -> None:
        super().__init__()
        self.stem: torch.nn.Module | None = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
        self.head: torch.nn.Module | None = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stem is not None:
            x = self.stem(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        if self.head is not None:
            x = self.head(x)
        return x


def test_split_a_module_list() -> None:
    torch.manual_seed(0)
    toy = _Toy()
    stages = split_layers(toy, 2, layers="blocks", first=("stem",), last=("head",))
    assert [list(dict(stage.blocks.named_children())) for stage in stages] == [
        ["0", "1", "2"], ["3", "4"]]
    assert all(isinstance(stage.blocks, torch.nn.ModuleList) for stage in stages)
    assert _names(stages) == _names([toy])
    x = torch.randn(3, 4)
    assert torch.equal(_chain(stages, x), toy(x))
    assert len(toy.blocks) == 5 and toy.stem is not None and toy.head is not None
    again = split_layers(stages[1], 2, layers="blocks", first=("stem",), last=("head",))
    assert [list(dict(stage.blocks.named_children())) for stage in again] == [["3"], ["4"]]
    assert _names(again) == _names(stages[1:])


def test_stages_have_their_own_hooks() -> None:
    model = build_llama(CONFIG, seed=0)
    stages = split_layers(model, 2)
    calls: list[int] = []
    stages[1].register_forward_pre_hook(lambda module, args: calls.append(1))
    model(_tokens())
    stages[0](_tokens())
    assert calls == []
    stages[1](stages[0](_tokens()))
    assert calls == [1]


@pytest.mark.parametrize(("build", "message"), [
    (lambda: LlamaConfig(vocab=8, heads=4, kv_heads=3),
     r"heads \(4\) must be a multiple of kv_heads \(3\)"),
    (lambda: LlamaConfig(vocab=8, dim=30), r"dim \(30\) must be a multiple of heads \(4\)"),
    (lambda: LlamaConfig(vocab=8, dim=12, kv_heads=1), r"dim / heads = 3 must be even"),
    (lambda: LlamaConfig(vocab=8, kv_heads=0), r"kv_heads must be at least 1, got 0"),
    (lambda: LlamaConfig(vocab=8, ffn_dim=0), r"ffn_dim must be at least 1, got 0"),
    (lambda: LlamaConfig(vocab=8, norm_eps=0.0), r"must be positive"),
])
def test_config_errors(build: Callable[[], LlamaConfig], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_split_errors() -> None:
    model = build_llama(CONFIG, seed=0)
    with pytest.raises(ValueError, match=r"4 blocks in 'layers' cannot fill 5 stages"):
        split_layers(model, 5)
    with pytest.raises(ValueError, match=r"num_stages must be at least 1, got 0"):
        split_layers(model, 0)
    with pytest.raises(ValueError, match=r"Llama has no submodule named 'blocks'"):
        split_layers(model, 2, layers="blocks")
    with pytest.raises(ValueError, match=r"Llama.norm is a RMSNorm; split_layers splits a "
                                         r"ModuleList or ModuleDict of blocks"):
        split_layers(model, 2, layers="norm")
    with pytest.raises(ValueError, match=r"Llama has no submodule named 'tok_embeddings'"):
        split_layers(model, 2, first=("tok_embeddings",))


def test_too_long_a_sequence() -> None:
    model = build_llama(CONFIG, seed=0)
    with pytest.raises(ValueError, match=r"17 tokens is longer than seq_len \(16\)"):
        model(torch.zeros(1, 17, dtype=torch.long))
