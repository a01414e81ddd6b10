"""The autograd of a chunk's steps (pipeswap.runtime.executor.backward), on one process: W computes
only the weight gradients (FLOPs), I then W gives what B gives (bit for bit where the order of the
maths is the same), with swap, frozen parameters, no parameters and shared parameters; a stage's
split is analysed once per graph shape and stays right when shapes or the model change."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeswap.platform import get_platform
from pipeswap.runtime import SwapOptions
from pipeswap.runtime import PipelineExecutor, PipelineStage
from pipeswap.runtime.executor import backward
from pipeswap.runtime.executor import backward_split as analysis
from pipeswap.runtime.executor.backward import ChunkAutograd, forward_chunk
from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, lm_loss, split_stages
from pipeswap.runtime.executor.swap_session import SwapSession
from pipeswap.runtime.executor.backward_split import SplitCache
from pipeswap.schedule import MinGapPolicy, ScheduleKind, ScheduleSpec
from pipeswap.swap import SwapError, SwapManager

CONFIG = GPTConfig(vocab=32, seq_len=16, width=32, heads=4, layers=3)
MICRO = 3
T = TypeVar("T")


def _gpt_stages() -> list[torch.nn.Module]:
    return list(split_stages(build_gpt(CONFIG, seed=0), 3))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 64))


@dataclass
class _Case:
    """A stage and its microbatches: the inputs, and the targets on the last stage (other
    stages get fixed random output gradients)."""

    module: torch.nn.Module
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor] | None = None


def _case(kind: str) -> _Case:
    generator = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, CONFIG.vocab, (4, CONFIG.seq_len), generator=generator)
           for _ in range(MICRO)]
    hidden = [torch.randn(4, CONFIG.seq_len, CONFIG.width, generator=generator)
              for _ in range(MICRO)]
    first, middle, last = _gpt_stages()
    if kind == "first":
        return _Case(first, ids)
    if kind == "middle":
        return _Case(middle, hidden)
    if kind == "last":
        return _Case(last, hidden, ids)
    assert kind == "mlp"
    return _Case(_mlp(), [torch.randn(8, 64, generator=generator) for _ in range(MICRO)])


@dataclass
class _Result:
    input_grads: list[torch.Tensor | None]
    grads: list[torch.Tensor | None]
    flops: dict[str, int]


def _count(flops: dict[str, int] | None, step: str, fn: Callable[[], T]) -> T:
    if flops is None:
        return fn()
    with FlopCounterMode(display=False) as counter:
        result = fn()
    flops[step] = flops.get(step, 0) + counter.get_total_flops()
    return result


def _run(case: _Case, split: bool, *, manager: SwapManager | None = None,
         steps: int = 1, count: bool = False) -> _Result:
    """Forward every microbatch, then B of each, or I of each then W of each (I m0, I m1, ...,
    W m0, W m1, ...), the splits from one cache as a stage's; with a swap session, every chunk
    is offloaded after its forward and loaded back before the backward steps begin. ``steps``
    repeats it all without zeroing, so ``.grad`` accumulates over steps as it does over
    microbatches."""
    module = copy.deepcopy(case.module)
    cache = SplitCache()
    session = None
    if manager is not None:
        manager.protect_module(module)  # as the executor does with its stages' modules
        session = SwapSession(manager, f"run{id(module):x}")
    flops: dict[str, int] | None = {} if count else None
    input_grads: list[torch.Tensor | None] = []
    for _ in range(steps):
        chunks: list[ChunkAutograd] = []
        for micro, x in enumerate(case.inputs):
            x = x.detach().requires_grad_(x.is_floating_point())
            target = case.targets[micro] if case.targets is not None else None
            saving = session.forward((0, micro)) if session is not None else None
            chunk = forward_chunk(module, x, target=target, loss_fn=lm_loss, scale=MICRO,
                                  saving=saving)
            if session is not None:
                session.protect((0, micro), [x, chunk.value, target])
                session.manager.launch_offload(session.name((0, micro)))
                session.manager.wait_offload(session.name((0, micro)))
            chunks.append(chunk)
        if session is not None:
            for micro in range(len(chunks)):
                session.manager.launch_load(session.name((0, micro)))
                session.manager.wait_load(session.name((0, micro)))
        grads = [None if case.targets is not None else _output_grad(chunk, micro)
                 for micro, chunk in enumerate(chunks)]
        for chunk, grad in zip(chunks, grads):
            given = None if grad is None else [grad]
            got = _count(flops, "I" if split else "B",
                         partial(chunk.backward_input, given, cache) if split
                         else partial(chunk.backward, given))
            input_grads.append(got[0] if got else None)
        if split:
            for chunk in chunks:
                _count(flops, "W", chunk.backward_weight)
        if session is not None:
            for micro in range(len(chunks)):
                session.finish((0, micro))
    return _Result(input_grads, [p.grad for p in module.parameters()], flops or {})


def _output_grad(chunk: ChunkAutograd, micro: int) -> torch.Tensor:
    assert chunk.outputs is not None
    generator = torch.Generator().manual_seed(10 + micro)
    return torch.randn(chunk.outputs[0].shape, generator=generator)


def _same(got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor | None], *,
          exact: bool) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), index
        if a is not None and b is not None:
            assert torch.allclose(a, b, rtol=1e-6, atol=0), index
            if exact:
                assert torch.equal(a, b), index


# -- (1) W costs only the weight gradients -------------------------------------------------

@pytest.mark.parametrize("kind", ["middle", "last", "mlp"])
def test_input_and_weight_parts_cost_one_backward(kind: str) -> None:
    case = _case(kind)
    full = _run(case, split=False, count=True).flops["B"]
    split = _run(case, split=True, count=True).flops
    assert full > 0
    assert split["I"] + split["W"] == pytest.approx(full, rel=0.05), (split, full)
    assert split["W"] < 0.6 * full, (split, full)  # a second backward would cost >= B
    assert split["I"] < 0.6 * full, (split, full)


def test_the_first_stage_leaves_the_whole_backward_to_w() -> None:
    case = _case("first")  # token ids: no input gradient, so nothing for I to do
    full = _run(case, split=False, count=True).flops["B"]
    split = _run(case, split=True, count=True).flops
    assert split["I"] == 0 and split["W"] == full > 0


# -- (2) I then W equals B ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["first", "middle", "last", "mlp"])
def test_input_then_weight_equals_the_whole_backward(kind: str) -> None:
    case = _case(kind)
    full, split = _run(case, split=False, steps=2), _run(case, split=True, steps=2)
    assert all(g is not None for g in full.grads)
    _same(split.grads, full.grads, exact=True)
    _same(split.input_grads, full.input_grads, exact=True)
    assert all((g is None) == (kind == "first") for g in split.input_grads)


@pytest.mark.parametrize("kind", ["middle", "twice"])
def test_parameter_hooks_run_once_as_in_the_whole_backward(kind: str) -> None:
    """Each parameter's gradient goes once through its accumulate node (tensor hooks, then
    ``.grad``, then post-accumulate hooks): in W, or in I for a weight used at two depths."""
    case = _case("middle") if kind == "middle" else _Case(_Twice(), [torch.randn(8, 16)])
    module = copy.deepcopy(case.module)
    calls: list[tuple[str, int]] = []

    def tensor_hook(index: int) -> Callable[[torch.Tensor | None], None]:
        return lambda grad: calls.append(("grad" if grad is not None else "none", index))

    for index, param in enumerate(module.parameters()):
        param.register_hook(tensor_hook(index))  # type: ignore[no-untyped-call]
        param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda _p, i=index: calls.append(("accumulated", i)))
    x = case.inputs[0].detach().requires_grad_(True)
    chunk = forward_chunk(module, x)
    assert chunk.outputs is not None
    chunk.backward_input([torch.ones_like(chunk.outputs[0])])
    in_input = list(calls)
    chunk.backward_weight()
    count = len(list(module.parameters()))
    assert sorted(calls) == sorted([("grad", i) for i in range(count)]
                                   + [("accumulated", i) for i in range(count)])
    if kind == "middle":
        assert not in_input
    else:  # lin (used twice) in I, other in W
        assert sorted(in_input) == [("accumulated", 0), ("accumulated", 1), ("grad", 0),
                                    ("grad", 1)]
    assert chunk.outputs is None and chunk.inputs is None and chunk.output is None


def test_each_chunk_runs_its_backward_steps_once_in_order() -> None:
    module = _mlp()
    chunk = forward_chunk(module, torch.randn(2, 64, requires_grad=True))
    with pytest.raises(RuntimeError, match="run I first"):
        chunk.backward_weight()
    chunk.backward_input([torch.ones(2, 64)])
    with pytest.raises(RuntimeError, match="once"):
        chunk.backward([torch.ones(2, 64)])
    chunk.backward_weight()
    with pytest.raises(RuntimeError, match="W once"):
        chunk.backward_weight()


# -- (3) swap between F and I changes no bit ----------------------------------------------------

@pytest.mark.parametrize("kind", ["first", "middle", "last"])
def test_swap_between_forward_and_input_changes_no_bit(kind: str) -> None:
    case = _case(kind)
    manager = SwapManager(get_platform("cpu"))
    plain = _run(case, split=True)
    swapped = _run(case, split=True, manager=manager)
    assert manager.stats().bytes_offloaded > 0
    assert manager.stats().bytes_reloaded == manager.stats().bytes_offloaded
    assert manager.active_group_count() == 0
    _same(swapped.grads, plain.grads, exact=True)
    _same(swapped.input_grads, plain.input_grads, exact=True)
    _same(swapped.grads, _run(case, split=False, manager=manager).grads, exact=True)


@pytest.mark.parametrize("kind", ["middle", "last", "twice", "weight norm"])
def test_i_frees_what_w_does_not_need_and_w_frees_the_rest(kind: str) -> None:
    """The swap manager's hooks hold what autograd saves, so a node that saved its own output
    (softmax, log-softmax) stays alive until a backward frees it: after I only what W needs
    may stay (the rest of the dx path and the loss go), after W nothing."""
    case = _case(kind) if kind in ("middle", "last") else _Case(
        (_Twice if kind == "twice" else _WeightNorm)(), [torch.randn(8, 16)])
    module = copy.deepcopy(case.module)
    manager = SwapManager(get_platform("cpu"))
    manager.protect_module(module)
    session = SwapSession(manager, "t")
    x = case.inputs[0].detach().requires_grad_(True)
    target = case.targets[0] if case.targets is not None else None
    chunk = forward_chunk(module, x, target=target, loss_fn=lm_loss, scale=MICRO,
                          saving=session.forward((0, 0)))
    session.protect((0, 0), [x, chunk.value, target])
    del x
    name = session.name((0, 0))
    saved = manager.group_bytes(name).movable  # bytes of saved tensors still alive
    chunk.backward_input(None if target is not None else [_output_grad(chunk, 0)])
    gc.collect()
    after_input = manager.group_bytes(name).movable
    if kind == "last":  # the loss's log-softmax (logits-sized) is among what goes
        assert saved - after_input >= 4 * CONFIG.seq_len * CONFIG.vocab * 4
    assert after_input < saved
    chunk.backward_weight()
    gc.collect()
    assert manager.group_bytes(name).movable == 0
    session.finish((0, 0))


# -- (4) frozen parameters, no parameters, shared parameters -------------------------------

def test_frozen_parameters_get_no_gradient_and_the_rest_match() -> None:
    case = _case("middle")
    attention, feed_forward = case.module[0], case.module[1]  # type: ignore[index]
    attention.qkv.requires_grad_(False)
    feed_forward.norm.weight.requires_grad_(False)
    full, split = _run(case, split=False, count=True), _run(case, split=True, count=True)
    frozen = [not p.requires_grad for p in case.module.parameters()]
    assert any(frozen) and not all(frozen)
    assert [g is None for g in split.grads] == frozen
    _same(split.grads, full.grads, exact=True)
    _same(split.input_grads, full.input_grads, exact=True)
    assert split.flops["I"] + split.flops["W"] == full.flops["B"]


@pytest.mark.parametrize("kind", ["no parameters", "all frozen", "frozen first"])
def test_stages_without_trainable_parameters(kind: str) -> None:
    generator = torch.Generator().manual_seed(3)
    if kind == "frozen first":
        module = copy.deepcopy(_gpt_stages()[0]).requires_grad_(False)
        case = _Case(module, [torch.randint(0, CONFIG.vocab, (2, 16), generator=generator)])
    else:
        module = (torch.nn.Sequential(torch.nn.GELU(),
                                      torch.nn.LayerNorm(32, elementwise_affine=False))
                  if kind == "no parameters" else _mlp().requires_grad_(False))
        width = 32 if kind == "no parameters" else 64
        case = _Case(module, [torch.randn(4, width, generator=generator) for _ in range(2)])
    if kind == "frozen first":  # its output needs no gradient: B has nothing to run
        split = _run(case, split=True, count=True)
        assert split.input_grads == [None] and split.flops == {"I": 0, "W": 0}
        return
    full, split = _run(case, split=False), _run(case, split=True, count=True)
    assert all(g is None for g in split.grads)
    assert split.flops["W"] == 0
    _same(split.input_grads, full.input_grads, exact=True)


class _Twice(torch.nn.Module):
    """One Linear applied twice in a row: its weight is reached through the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.other = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(torch.tanh(self.other(self.lin(x))))
        return out


class _Branches(torch.nn.Module):
    """One Linear on two parallel branches, a positional embedding that does not need the
    input, and a scalar gain."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.pos = torch.nn.Embedding(8, 16)
        self.gain = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos(torch.arange(x.shape[0]))
        out: torch.Tensor = self.lin(x) * self.lin(x * 2) * self.gain.exp()
        return out


class _WeightNorm(torch.nn.Module):
    """A weight-normalised matrix used at two depths: the norm and the gain's exp save their
    own outputs, on the parameters' side of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.v = torch.nn.Parameter(torch.randn(16, 16))
        self.gain = torch.nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.v / self.v.norm(dim=1, keepdim=True) * self.gain.exp()[:, None]
        out: torch.Tensor = torch.tanh(torch.tanh(x @ w.t()).softmax(-1) @ w.t())
        return out


@pytest.mark.parametrize("module", [_Twice, _Branches, _WeightNorm])
def test_parameters_reached_through_several_paths(module: type[torch.nn.Module]) -> None:
    torch.manual_seed(4)
    generator = torch.Generator().manual_seed(5)
    case = _Case(module(), [torch.randn(8, 16, generator=generator) for _ in range(MICRO)])
    full = _run(case, split=False, steps=2, count=True)
    split = _run(case, split=True, steps=2, count=True)
    _same(split.grads, full.grads, exact=False)
    _same(split.input_grads, full.input_grads, exact=False)
    assert split.flops["I"] + split.flops["W"] == full.flops["B"]


# -- (5) the split cache ------------------------------------------------------------------------

def _analyses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry (the shape's length) per graph the split analyses: a cache miss."""
    seen: list[int] = []
    analyse = analysis._analyse

    def counted(shape: tuple[object, ...]) -> object:
        seen.append(len(shape))
        return analyse(shape)

    monkeypatch.setattr(analysis, "_analyse", counted)
    return seen


def _split_step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor,
                cache: SplitCache | None) -> list[torch.Tensor | None]:
    """I then W of one chunk, from zeroed gradients: the input's and the parameters'."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    chunk = forward_chunk(module, x)
    [got] = chunk.backward_input([grad], cache)
    chunk.backward_weight()
    return [got, *(p.grad for p in module.parameters())]


def _full_step(module: torch.nn.Module, x: torch.Tensor,
               grad: torch.Tensor) -> list[torch.Tensor | None]:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    [got] = forward_chunk(module, x).backward([grad])
    return [got, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("kind", ["middle", "last"])
def test_a_stage_analyses_its_graph_once(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every microbatch of every step builds a graph of the same shape: one analysis, and
    the gradients of the reused split are B's, bit for bit."""
    seen = _analyses(monkeypatch)
    case = _case(kind)
    full, split = _run(case, split=False, steps=2), _run(case, split=True, steps=2)
    assert len(seen) == 1
    _same(split.grads, full.grads, exact=True)
    _same(split.input_grads, full.input_grads, exact=True)


class _Gated(torch.nn.Module):
    """An MLP whose forward takes an extra layer for wide batches: two graph shapes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.inner, self.extra = _mlp(), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        return torch.tanh(self.extra(out)) if x.shape[0] > 4 else out


def test_the_cached_split_follows_shapes_and_model_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One stage's cache through tensor shapes that change (the split is reused), a graph that
    changes with them, a parameter frozen, replaced and hooked: each chunk's gradients are
    B's on a twin of the module changed alike, bit for bit, whatever the cache holds."""
    seen = _analyses(monkeypatch)
    modules = [_Gated(), _Gated()]  # split, full
    split_module, full_module = modules
    cache = SplitCache()
    generator = torch.Generator().manual_seed(8)
    hooked: list[int] = []

    def change(what: str) -> None:
        for index, module in enumerate(modules):
            inner = module.inner
            assert isinstance(inner, torch.nn.Sequential)
            first, second = inner[0], inner[2]
            assert isinstance(first, torch.nn.Linear) and isinstance(second, torch.nn.Linear)
            if what == "freeze":
                first.bias.requires_grad_(False)
            elif what == "replace":
                torch.manual_seed(9)
                second.weight = torch.nn.Parameter(torch.randn(64, 256) / 16)
            elif what == "hook":
                second.weight.register_hook(  # type: ignore[no-untyped-call]
                    lambda grad, i=index: hooked.append(i))

    # (batch size, change before it, analyses expected after it)
    script = [(8, "", 1), (6, "", 1), (3, "", 2), (8, "", 2), (2, "", 2),
              (8, "freeze", 3), (3, "freeze", 4), (8, "replace", 4), (8, "hook", 5),
              (3, "", 6)]
    for size, what, analyses in script:
        if what:
            change(what)
        x = torch.randn(size, 64, generator=generator)
        grad = torch.randn(size, 64, generator=generator)
        _same(_split_step(split_module, x, grad, cache), _full_step(full_module, x, grad),
              exact=True)
        assert len(seen) == analyses, (size, what)
    assert hooked == [0, 1, 0, 1]  # once per backward, split or whole


@pytest.mark.parametrize("size", [1, 8])
def test_a_full_cache_forgets_its_oldest_shape(size: int, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """Two graph shapes in turn: a cache of one analyses each chunk, a larger one twice."""
    seen = _analyses(monkeypatch)
    module, twin = _Gated(), _Gated()
    cache = SplitCache(size)
    generator = torch.Generator().manual_seed(10)
    for batch in [8, 2, 8, 2]:  # two shapes, alternating
        x, grad = (torch.randn(batch, 64, generator=generator) for _ in range(2))
        _same(_split_step(module, x, grad, cache), _full_step(twin, x, grad), exact=True)
    assert len(seen) == (4 if size == 1 else 2)


class _Doubled(torch.autograd.Function):
    """A custom Function that saves its input."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        out: torch.Tensor = grad * 2 * x
        return out


class _Saving(torch.nn.Module):
    """Nodes that save tensors one after another between two Linears, a custom Function
    among them, and one on a parameter's side (W runs it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.scale = torch.nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x).softmax(-1)
        h = _Doubled.apply(h.tanh())  # type: ignore[no-untyped-call]
        out: torch.Tensor = self.second(h.exp() * self.scale.sigmoid())
        return out


def test_one_backward_frees_a_batch_of_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes I frees go in batches, fewer backwards than nodes; with a custom Function
    among them and swap's hooks holding every saved tensor, I then W still equals B and
    leaves nothing."""
    calls: list[int] = []
    release = backward._release

    def counted(nodes: list[object], targets: list[object]) -> None:
        calls.append(len(nodes))
        release(nodes, targets)  # type: ignore[arg-type]

    monkeypatch.setattr(backward, "_release", counted)
    generator = torch.Generator().manual_seed(12)
    for case in [_case("middle"), _Case(_Saving(), [torch.randn(8, 16, generator=generator)
                                                     for _ in range(MICRO)])]:
        calls.clear()
        manager = SwapManager(get_platform("cpu"))
        full = _run(case, split=False, steps=2)
        split = _run(case, split=True, steps=2, manager=manager)
        _same(split.grads, full.grads, exact=True)
        _same(split.input_grads, full.input_grads, exact=True)
        assert manager.active_group_count() == 0
        assert len(calls) < sum(calls), calls  # some backward freed several nodes


# -- the executor's I and W steps ---------------------------------------------------------------


def test_the_executor_splits_zbv_backwards_into_exact_i_and_w_steps(group: None) -> None:
    """ZBV on one rank (two stages: I and W of both) gives B's gradients, with and without
    swap, bit for bit between the two."""
    config = GPTConfig(vocab=16, seq_len=8, width=16, heads=2, layers=2)
    generator = torch.Generator().manual_seed(6)
    batch = (torch.randint(0, 16, (8, 8), generator=generator),
             torch.randint(0, 16, (8, 8), generator=generator))
    grads: dict[str, list[torch.Tensor]] = {}
    for name, kind, swap in [("B", "interleaved-1f1b", False), ("I/W", "zbv", False),
                             ("I/W swap", "zbv", True)]:
        model = build_gpt(config, seed=0)
        stages = [PipelineStage(part, index, 2)
                  for index, part in enumerate(split_stages(model, 2))]
        spec = ScheduleSpec(ScheduleKind(kind), ranks=1, microbatches=4, stages_per_rank=2)
        # The gap rule swaps every chunk it can: exactness is tested on real copies.
        executor = PipelineExecutor(stages, spec, 4, lm_loss,
                                    swap=SwapOptions(MinGapPolicy(3)) if swap else False)
        report = executor.step(*batch)
        assert executor.manager.active_group_count() == 0
        assert (report.bytes_offloaded > 0) == swap
        grads[name] = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(grads[name]) == len(list(model.parameters()))
    _same(grads["I/W"], grads["B"], exact=False)
    _same(grads["I/W swap"], grads["I/W"], exact=True)


def test_the_executor_analyses_each_stage_once(group: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """ZBV on one rank, two steps: the second stage's I steps share one analysis (the first
    stage has no dx path: nothing to analyse)."""
    seen = _analyses(monkeypatch)
    config = GPTConfig(vocab=16, seq_len=8, width=16, heads=2, layers=2)
    generator = torch.Generator().manual_seed(13)
    stages = [PipelineStage(part, index, 2)
              for index, part in enumerate(split_stages(build_gpt(config, seed=0), 2))]
    spec = ScheduleSpec(ScheduleKind("zbv"), ranks=1, microbatches=4, stages_per_rank=2)
    executor = PipelineExecutor(stages, spec, 4, lm_loss)
    for _ in range(2):
        executor.step(torch.randint(0, 16, (8, 8), generator=generator),
                      torch.randint(0, 16, (8, 8), generator=generator))
    assert len(seen) == 1


# -- recomputed layers -----------------------------------------------------------------------

class _Gate(torch.nn.Module):
    """A layer without parameters that saves tensors (tanh and sigmoid their outputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * torch.sigmoid(x)


def _recomputed_split(layers: list[torch.nn.Module], chosen: set[int], x: torch.Tensor,
                      run: Callable[..., Any]) -> None:
    """I then W of one chunk whose ``chosen`` layers are recomputed, as the executor runs
    them: I with their parameters, then their frames dropped, then W."""
    from pipeswap.swap import recompute_hooks

    manager = SwapManager(get_platform("cpu"))
    recording: list[set[int] | None] = [chosen]
    remove = recompute_hooks(manager, layers, lambda: recording[0])
    chunk = forward_chunk(run, x, saving=manager.group_context("chunk"))
    recording[0] = None
    remove()
    out = chunk.outputs
    assert out is not None
    chunk.backward_input([torch.ones_like(out[0])], SplitCache(), releasing=manager.releasing,
                         recomputed=[p for k in chosen for p in layers[k].parameters()])
    manager.release_remade("chunk")
    chunk.backward_weight()
    manager.finish_group("chunk")
    assert manager.stats().device_bytes_held == 0


def test_a_first_stage_recomputing_a_layer_without_parameters_splits_exactly() -> None:
    """The first stage has no input gradient, so its I does nothing and W a whole backward,
    unless it recomputes: then I runs the whole backward while the recompute's tensors are
    there, even when the recomputed layers have no parameters of their own."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8), _Gate(), torch.nn.Linear(8, 8)]

    def run(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        return x

    x = torch.randn(4, 8)
    run(x).sum().backward()  # type: ignore[no-untyped-call]
    want = [p.grad.clone() for layer in layers for p in layer.parameters() if p.grad is not None]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    _recomputed_split(layers, {1}, x, run)
    got = [p.grad for layer in layers for p in layer.parameters() if p.grad is not None]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(want, got))


class _Scaled(torch.nn.Module):
    """A layer scaled by a tensor it is given: another layer's parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * scale


def test_w_reaching_a_recomputed_layer_through_a_parameter_it_does_not_own_says_so() -> None:
    """A split backward computes a recomputed layer's weight gradients in I, from its own
    parameters; a weight node in it that leads to another layer's parameter stays in W,
    which cannot read the recomputed tensors any more: it fails, naming the way out."""
    torch.manual_seed(0)
    scale = torch.nn.Parameter(torch.randn(8))
    owner, used = torch.nn.Linear(8, 8), _Scaled()

    def run(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = used(owner(x), scale)
        return out

    with pytest.raises(SwapError, match="reaches the layer through a parameter it does not "
                       "own .* run the schedule without the I/W split"):
        _recomputed_split([owner, used], {1}, torch.randn(2, 8, requires_grad=True), run)
