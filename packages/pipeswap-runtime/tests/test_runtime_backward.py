"""The autograd of a chunk's steps (pipeswap.runtime.backward), on one process: W computes only
the weight gradients (FLOPs), I then W gives what B gives (bit for bit where the order of the
maths is the same), with swap, frozen parameters, no parameters and shared parameters."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeswap.platform import get_platform
from pipeswap.runtime import PipelineExecutor, PipelineStage
from pipeswap.runtime.backward import ChunkAutograd, forward_chunk
from pipeswap.runtime.model import GPTConfig, build_gpt, lm_loss, split_stages
from pipeswap.runtime.session import SwapSession
from pipeswap.schedule import MinGapPolicy, ScheduleKind, ScheduleSpec
from pipeswap.swap import SwapManager

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
    W m0, W m1, ...); with a swap session, every chunk is offloaded after its forward and
    loaded back before the backward steps begin. ``steps`` repeats it all without zeroing, so
    ``.grad`` accumulates over steps as it does over microbatches."""
    module = copy.deepcopy(case.module)
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
            step = chunk.backward_input if split else chunk.backward
            got = _count(flops, "I" if split else "B",
                         partial(step, None if grad is None else [grad]))
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
        executor = PipelineExecutor(stages, spec, 4, lm_loss, swap=swap,
                                    swap_policy=MinGapPolicy(3) if swap else None)
        report = executor.step(*batch)
        assert executor.manager.active_group_count() == 0
        assert (report.bytes_offloaded > 0) == swap
        grads[name] = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(grads[name]) == len(list(model.parameters()))
    _same(grads["I/W"], grads["B"], exact=False)
    _same(grads["I/W swap"], grads["I/W"], exact=True)
