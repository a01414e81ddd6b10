"""Property test: random sequences of calls on per-layer groups (LayerChain).

Several chains live at once on one manager (the CPU platform, whose copy streams are real
worker threads), each over a small random stack of layers run with a random lag. Their steps
(the forward, ``wait_offload``, ``launch_load``, ``wait_load``, the backward, ``finish``,
``abort``) come in random order, illegal ones included, mixed with plain manager calls on the
chains' group names. A model predicts every outcome: each group's state, which groups the
backward loads ahead, and every byte (per group: what it holds on the device and in host
buffers; per manager: what left the device, what came back, what stayed because something
still referenced it). After every call the manager must agree with the model; a call the
model calls illegal must raise a SwapError naming its group (a plain call must leave the
manager exactly as it was); a backward must either compute every gradient bit of plain
autograd or, when it reaches a storage that is off the device, raise SwapResidencyError naming
its group, exactly when the model says so.

When a backward is legal (read from the code, see :meth:`ChainCalls._backward`): a group the
backward reads must be resident when it is first read. It is if nothing released it
(collecting, offloading, resident, or offloaded with nothing to move), or if
``launch_load`` armed it (``load_ahead``): then its first read makes it resident, whatever
its state (an offload still in flight ends there, releasing nothing), and starts the load of
the layer before it. So after ``chain.launch_load()`` every backward is legal,
``wait_offload``/``wait_load`` or not; without it, a backward reaching a released storage of
an offloaded or loading group is refused. A ``chain.launch_load`` refused (a group missing)
arms nothing.

Nothing here references a storage outside autograd's saved tensors once a forward returned,
so no call after one keeps a storage for a reference, nor warns: not a plain
``launch_offload`` of a group that took over a storage whose copy the layer before's offload
still has queued (that copy is no reference), nor a first read of an offloading group.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pipeswap.platform import get_platform
from pipeswap.swap import GroupBytes, GroupState, LayerChain, SwapError, SwapManager
from pipeswap.swap import SwapResidencyError, layer_hooks, size_class

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py

# CI replays a fixed set of examples (derandomized) so that a run is repeatable; elsewhere
# every run explores new ones.
PROPERTY_SETTINGS = settings(
    deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=os.environ.get("CI") == "true")

COLLECTING, OFFLOADING, OFFLOADED = (
    GroupState.COLLECTING, GroupState.OFFLOADING, GroupState.OFFLOADED)
LOADING, RESIDENT = GroupState.LOADING, GroupState.RESIDENT

# -- layers --------------------------------------------------------------------------------

# What a layer does to its activation (batch, width), and what autograd saves then. Every
# activation storage a layer saves is one (batch, width) float32 tensor's.
KINDS = (
    "gelu",   # Linear, GELU: saves its input and the Linear's output
    "relu",   # Linear, ReLU: saves its input and its output, which the next layer's Linear
              # saves again (the storage then moves to the next layer's group)
    "none",   # negation: saves nothing
    "views",  # Linear, then the product of its output's two halves: saves two views of one
              # storage (and its input)
)
LINEAR_FIRST = frozenset({"gelu", "relu", "views"})  # the kinds that save their input
MAX_CHAINS = 3
# A chain's steps after its forward, in the documented order (next_step takes them).
STEPS = ("wait_offload", "launch_load", "wait_load", "backward", "finish")


class Layer(torch.nn.Module):
    def __init__(self, kind: str, width: int) -> None:
        super().__init__()
        self.kind = kind
        self.linear = torch.nn.Linear(width, width) if kind in LINEAR_FIRST else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.linear is None:
            return -h
        t: torch.Tensor = self.linear(h)
        if self.kind == "gelu":
            return torch.nn.functional.gelu(t)
        if self.kind == "relu":
            return torch.relu(t)
        a, b = t.chunk(2, dim=-1)
        return torch.cat([a * b, a - b], dim=-1)


@dataclass(frozen=True)
class Stack:
    """A new chain: its layers, their width, the batch, the lag, and how its forward ends."""

    kinds: tuple[str, ...]
    width: int
    batch: int
    lag: int
    offload_last: bool
    cut_short: bool  # the last layer is not run: forward_done refuses
    seed: int


stacks = st.builds(
    Stack, kinds=st.lists(st.sampled_from(KINDS + ("relu", "none")), min_size=2,
                          max_size=5).map(tuple),
    width=st.sampled_from((4, 6, 8)), batch=st.integers(1, 3),
    lag=st.sampled_from((1, 1, 2, 3, 4)), offload_last=st.booleans(),
    cut_short=st.integers(0, 5).map(lambda v: v == 0), seed=st.integers(0, 2**16))


def through(layers: Sequence[Layer], h: torch.Tensor) -> torch.Tensor:
    """The loss of ``h`` through ``layers``; each layer's input is referenced (here) while
    it runs, as in any forward."""
    for layer in layers:
        h = layer(h)
    return h.tanh().sum()  # saves its output, into the last layer's group


def storages(kinds: Sequence[str], ran: int) -> list[int]:
    """How many activation storages each layer's group holds once a forward ran the first
    ``ran`` layers and the loss."""
    counts = [0] * len(kinds)
    for j in range(ran):
        if kinds[j] in LINEAR_FIRST:
            counts[j] += 1  # its input (the layer before's ReLU output moves here)
            handed = kinds[j] == "relu" and j + 1 < ran and kinds[j + 1] in LINEAR_FIRST
            counts[j] += 0 if handed else 1  # GELU's input, the views' base, ReLU's output
    counts[-1] += 1  # the loss's tanh output
    return counts


def gradients(loss: torch.Tensor, leaf: torch.Tensor, layers: Sequence[Layer]
              ) -> list[torch.Tensor]:
    """The loss, then its gradients for the input and every parameter (nothing accumulates
    anywhere, so a backward refused half way leaves no trace)."""
    params = [p for layer in layers for p in layer.parameters()]
    return [loss.detach(), *torch.autograd.grad(loss, [leaf, *params])]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included)."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(
        a.view(torch.int32), b.view(torch.int32))


# -- the model -----------------------------------------------------------------------------


@dataclass
class Chain:
    """One chain, its forward's graph, and what the manager should hold for it (per layer)."""

    chain: LayerChain
    layers: list[Layer]
    kinds: tuple[str, ...]
    lag: int
    ran: int  # layers its forward ran (all, or all but the last: a forward cut short)
    unit: int  # bytes of each of its activation storages
    leaf: torch.Tensor
    want: list[torch.Tensor]  # loss and gradients of plain autograd
    held: list[int]  # bytes each group saved
    protected: list[int]  # of which the caller's input (protected: it never moves)
    states: list[GroupState | None]
    loss: torch.Tensor | None = None
    graph: bool = True  # the saved activations are alive (no backward ran or failed yet)
    last_ended: bool = False
    progress: int = 0  # how far next_step took it along STEPS
    launched: list[int] = field(default_factory=list)  # the chain's offloads not yet freed
    freed: list[int] = field(default_factory=list)  # freed, deferred storages not released
    armed: set[int] = field(default_factory=set)  # loaded ahead at their first read
    copied: list[int] = field(default_factory=list)  # in host buffers while offloading
    released: list[int] = field(default_factory=list)  # off the device (offloaded, loading)
    loading: list[int] = field(default_factory=list)  # what the load in flight brings back
    # copied, but still referenced by the forward when the chain freed its layer: on the
    # device, with a host copy, until chain.wait_offload releases it (release_deferred)
    deferred: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.copied = [0] * self.layers_count
        self.released = [0] * self.layers_count
        self.loading = [0] * self.layers_count
        self.deferred = [0] * self.layers_count

    @property
    def layers_count(self) -> int:
        return len(self.kinds)

    @property
    def names(self) -> tuple[str, ...]:
        return self.chain.names

    def group_bytes(self, k: int) -> GroupBytes:
        if not self.graph:
            return GroupBytes(0, 0)  # every saved view is gone
        held = self.held[k] - (self.released[k] if self.states[k] is OFFLOADED else 0)
        return GroupBytes(held, held - self.protected[k])

    def host_bytes(self, k: int) -> int:
        state = self.states[k]
        moved = (self.copied[k] if state is OFFLOADING
                 else self.released[k] + self.deferred[k] if state is OFFLOADED
                 else self.released[k] if state is LOADING else 0)
        return moved // self.unit * size_class(self.unit)


class ChainCalls(RuleBasedStateMachine):
    """Drives one manager with random calls on several layer chains, against the model."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = SwapManager(get_platform(DEVICE))
        self.chains: list[Chain] = []
        self.created = 0
        self.running: LayerChain | None = None  # the chain whose forward runs
        self.offloaded = self.reloaded = 0

    # -- model transitions (each mirrors one successful manager call) ------------------------

    def _launch(self, c: Chain, k: int) -> None:
        c.states[k] = OFFLOADING
        c.copied[k] = c.held[k] - c.protected[k] if c.graph else 0

    def _wait_offload(self, c: Chain, k: int, deferred: int = 0) -> None:
        """``deferred``: bytes of the copy the forward still references (a chain's free)."""
        deferred = deferred if c.graph else 0
        released = c.copied[k] - deferred if c.graph else 0
        c.released[k], c.deferred[k], c.copied[k] = released, deferred, 0
        c.states[k] = OFFLOADED
        self.offloaded += released

    def _free(self, c: Chain, k: int, deferred: int = 0) -> None:
        """LayerChain's free of layer ``k`` (wait_offload deferring what is referenced)."""
        self._wait_offload(c, k, deferred)
        c.freed.append(k)

    def _release_deferred(self, c: Chain, k: int) -> None:
        released = c.deferred[k] if c.graph else 0  # a dead storage just returns its buffer
        c.released[k] += released
        c.deferred[k] = 0
        self.offloaded += released

    def _launch_load(self, c: Chain, k: int) -> None:
        c.loading[k] = c.released[k] if c.graph else 0
        c.deferred[k] = 0  # never released: its host buffer returns
        c.states[k] = LOADING

    def _wait_load(self, c: Chain, k: int) -> None:
        self.reloaded += c.loading[k]
        c.loading[k] = c.released[k] = 0
        c.states[k] = RESIDENT

    def _drop(self, c: Chain, k: int) -> None:
        c.states[k] = None
        c.armed.discard(k)
        c.copied[k] = c.released[k] = c.loading[k] = c.deferred[k] = 0

    def _abort(self, c: Chain, k: int) -> None:
        if c.states[k] is LOADING:
            self.reloaded += c.loading[k]
        elif c.states[k] is OFFLOADED and c.graph:
            self.reloaded += c.released[k]  # restored; a dead storage is forgotten
        self._drop(c, k)

    def _end(self, c: Chain, k: int) -> None:
        if c.states[k] is LOADING:  # the load in flight is waited for
            self._wait_load(c, k)
        if c.states[k] in (RESIDENT, COLLECTING):
            self._drop(c, k)
        else:
            self._abort(c, k)

    def _forward_done(self, c: Chain, offload_last: bool) -> str | None:
        """LayerChain.forward_done; the text its SwapError must hold, if it fails."""
        last = c.layers_count - 1
        if not c.last_ended:
            return "without ending it"
        if offload_last:
            if c.states[last] is not COLLECTING:
                return repr(c.names[last])
            self._launch(c, last)
            c.launched.append(last)
        freed = last - c.lag
        if freed >= 0 and freed in c.launched:
            c.launched.remove(freed)
            if c.states[freed] is not OFFLOADING:
                return repr(c.names[freed])
            self._free(c, freed)
        return None

    # -- checks --------------------------------------------------------------------------------

    def _state(self, name: str) -> GroupState | None:
        try:
            return self.mgr.group_state(name)
        except SwapError:
            return None

    def _expect(self, call: Callable[[], object], error: str | None) -> None:
        """Run ``call``: it must succeed if ``error`` is None, else raise a SwapError whose
        message holds ``error`` (the group's name, quoted)."""
        try:
            call()
        except SwapError as exc:
            assert error is not None, f"legal call failed: {exc}"
            assert error in str(exc), f"expected a refusal naming {error}, got: {exc}"
            return
        assert error is None, f"illegal call succeeded (expected a refusal naming {error})"

    def _exact(self, c: Chain) -> None:
        """The backward of a chain whose groups are all gone: legal, and exact."""
        loss, c.loss, c.graph = c.loss, None, False
        if loss is not None:
            got = gradients(loss, c.leaf, c.layers[:c.ran])
            assert all(same_bits(a, b) for a, b in zip(c.want, got, strict=True))

    def _retire(self) -> None:
        """Forget chains with nothing left: no group, no graph."""
        self.chains = [c for c in self.chains
                       if c.graph or any(s is not None for s in c.states)]

    def _pick(self, data: st.DataObject) -> Chain:
        return self.chains[data.draw(st.integers(0, len(self.chains) - 1), label="chain")]

    @invariant()
    def manager_matches_the_model(self) -> None:
        live = held = host = 0
        for c in self.chains:
            for k, name in enumerate(c.names):
                assert self._state(name) is c.states[k], (name, self._state(name), c.states[k])
                if c.states[k] is None:
                    continue
                live += 1
                expected = c.group_bytes(k)
                assert self.mgr.group_bytes(name) == expected, (name, c.states[k])
                held += expected.held
                host += c.host_bytes(k)
        stats = self.mgr.stats()
        assert self.mgr.active_group_count() == live
        assert stats.device_bytes_held == held >= 0
        assert stats.host_bytes_in_use == host
        assert (stats.bytes_offloaded, stats.bytes_reloaded, stats.bytes_kept_referenced) == (
            self.offloaded, self.reloaded, 0)
        if live == 0:
            assert stats.device_bytes_held == 0 and stats.host_bytes_in_use == 0

    # -- rules ---------------------------------------------------------------------------------

    @initialize(stack=stacks)
    def first_forward(self, stack: Stack) -> None:
        self.forward(stack)

    @rule(stack=stacks)
    def new_forward(self, stack: Stack) -> None:
        if len(self.chains) == MAX_CHAINS:  # the oldest step fails: aborted, still exact
            oldest = self.chains[0]
            oldest.chain.abort()
            for k in range(oldest.layers_count):
                self._abort(oldest, k)
            self.manager_matches_the_model()
            self._exact(oldest)
            self._retire()
        self.forward(stack)

    def forward(self, stack: Stack) -> None:
        """A new chain's forward, hooks active, then forward_done; one cut short before its
        last layer is refused by forward_done and aborted, as LayerOffload does."""
        kinds, width, batch, lag = stack.kinds, stack.width, stack.batch, stack.lag
        offload_last, cut_short = stack.offload_last, stack.cut_short
        torch.manual_seed(stack.seed)
        layers = [Layer(kind, width) for kind in kinds]
        x = torch.randn(batch, width)
        ran = len(layers) - 1 if cut_short else len(layers)
        reference = x.clone().requires_grad_(True)
        want = gradients(through(layers[:ran], reference), reference, layers[:ran])

        names = [f"c{self.created}.l{k}" for k in range(len(layers))]
        self.created += 1
        chain = LayerChain(self.mgr, names, lag)

        def active() -> LayerChain | None:
            return chain if self.running is chain else None

        layer_hooks(layers, active)
        leaf = x.clone().requires_grad_(True)
        chain.protect(leaf)  # the caller's input stays on the device
        unit = batch * width * 4
        held = [count * unit for count in storages(kinds, ran)]
        protected = [unit if k == 0 and kinds[0] in LINEAR_FIRST else 0
                     for k in range(len(kinds))]
        c = Chain(chain, layers, kinds, lag, ran, unit, leaf, want, held, protected,
                  [COLLECTING] * len(kinds))
        self.chains.append(c)

        # The model's forward: layer j's end launches it and frees layer j - lag. At lag 1,
        # a ReLU output the next layer does not save stays in its group, and the forward
        # still holds it (the next layer's input): its release is deferred.
        deferred = 0
        for j in range(ran):
            if j == len(kinds) - 1:
                c.last_ended = True
                continue
            self._launch(c, j)
            c.launched.append(j)
            freed = j - lag
            if freed >= 0 and freed in c.launched:
                c.launched.remove(freed)
                defer = lag == 1 and kinds[freed] == "relu" and kinds[j] == "none"
                deferred += defer
                self._free(c, freed, unit if defer else 0)
        error = self._forward_done(c, offload_last)
        assert (error is not None) == cut_short

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.running = chain
            try:
                with chain.forward():
                    c.loss = through(layers[:ran], leaf)
            finally:
                self.running = None
            self._expect(lambda: chain.forward_done(offload_last=offload_last), error)
        assert not caught, [str(w.message) for w in caught]
        event(f"forward: {'cut short' if cut_short else 'whole'}"
              f"{', a release deferred' if deferred else ''}")
        if cut_short:
            self.manager_matches_the_model()
            chain.abort()
            for k in range(len(kinds)):
                self._abort(c, k)
        else:
            assert chain.layer_bytes == tuple(
                GroupBytes(h, h - p) for h, p in zip(held, protected, strict=True))

    @rule(data=st.data(), call=st.sampled_from(
        ("wait_offload", "launch_load", "wait_load", "finish", "abort", "forward",
         "forward_done")))
    def random_chain_call(self, data: st.DataObject, call: str) -> None:
        if self.chains:
            self.chain_call(data, call, self._pick(data))

    def chain_call(self, data: st.DataObject, call: str, c: Chain) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._chain_call(data, call, c)
        assert not caught, [str(w.message) for w in caught]
        self._retire()

    def _chain_call(self, data: st.DataObject, call: str, c: Chain) -> None:
        chain, n = c.chain, c.layers_count
        last = n - 1
        error: str | None = None
        if call == "wait_offload":
            # frees its launched layers in order, then releases what each freed layer
            # deferred, up to a refusal
            while c.launched:
                k = c.launched.pop(0)
                if c.states[k] is not OFFLOADING:
                    error = repr(c.names[k])
                    break
                self._free(c, k)
            for k in c.freed if error is None else ():
                if c.states[k] is not OFFLOADED:
                    error = repr(c.names[k])
                    break
                self._release_deferred(c, k)
            if error is None:
                c.freed = []
            self._expect(chain.wait_offload, error)
        elif call == "launch_load":
            missing = [k for k in range(n) if c.states[k] is None]
            if missing:  # refused by load_ahead, which arms nothing then
                error = repr(c.names[missing[0]])
                self._expect(chain.launch_load, error)
            else:
                c.armed = set(range(n))
                if c.states[last] is OFFLOADED:
                    self._launch_load(c, last)
                self._expect(chain.launch_load, None)
        elif call == "wait_load":
            if c.states[last] is None:
                error = repr(c.names[last])
            elif c.states[last] is LOADING:
                self._wait_load(c, last)
            self._expect(chain.wait_load, error)
        elif call == "finish":  # ends every group, then refuses if one was missing
            missing = [k for k in range(n) if c.states[k] is None]
            error = repr(c.names[missing[0]]) if missing else None
            for k in range(n):
                if c.states[k] is not None:
                    self._end(c, k)
            self._expect(chain.finish, error)
        elif call == "abort":
            for k in range(n):
                self._abort(c, k)
            self._expect(chain.abort, None)
        elif call == "forward":
            def again() -> None:
                with chain.forward():
                    raise AssertionError("a chain's second forward started")

            error = "its forward already ran"
            self._expect(again, error)
        else:  # a second forward_done: launches the last layer if asked and still collecting
            offload_last = data.draw(st.booleans(), label="offload_last")
            error = self._forward_done(c, offload_last)
            self._expect(lambda: chain.forward_done(offload_last=offload_last), error)
        event(f"chain {call}: {'refused' if error else 'ok'}")

    @rule(data=st.data(), call=st.sampled_from(
        ("launch_offload", "wait_offload", "launch_load", "wait_load", "finish_group",
         "end_group", "abort_group")))
    def plain_call(self, data: st.DataObject, call: str) -> None:
        """A manager call on one of a chain's groups, whatever the chain is doing."""
        if not self.chains:
            return
        c = self._pick(data)
        k = data.draw(st.integers(0, c.layers_count - 1), label="layer")
        name, state = c.names[k], c.states[k]
        legal = {"launch_offload": state is COLLECTING, "wait_offload": state is OFFLOADING,
                 "launch_load": state is OFFLOADED, "wait_load": state is LOADING,
                 "finish_group": state in (RESIDENT, COLLECTING),
                 "end_group": state is not None, "abort_group": True}[call]
        event(f"{call} {'legal' if legal else 'refused'}")
        before = self.mgr.stats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                getattr(self.mgr, call)(name)
            except SwapError as exc:
                assert not legal, f"legal {call} in state {state} failed: {exc}"
                assert repr(name) in str(exc)
                assert self.mgr.stats() == before  # nothing moved, nothing counted
                assert not caught
                return
        assert legal, f"{call}({name!r}) in state {state} succeeded"
        {"launch_offload": self._launch, "wait_offload": self._wait_offload,
         "launch_load": self._launch_load, "wait_load": self._wait_load,
         "finish_group": self._drop, "end_group": self._end,
         "abort_group": self._abort}[call](c, k)
        assert not caught, [str(w.message) for w in caught]
        self._retire()

    @rule(data=st.data())
    def next_step(self, data: st.DataObject) -> None:
        """The step that takes a chain along its documented order (random calls seldom
        do), whatever else happened to it."""
        if not self.chains:
            return
        c = self._pick(data)
        if c.progress == len(STEPS):
            return
        step = STEPS[c.progress]
        c.progress += 1
        if step != "backward":
            self.chain_call(data, step, c)
        elif c.graph:
            self._backward(c)
            self._retire()

    @rule(data=st.data())
    def backward(self, data: st.DataObject) -> None:
        """A random chain's backward."""
        graphs = [i for i, c in enumerate(self.chains) if c.graph]
        if not graphs:
            return
        self._backward(self.chains[data.draw(st.sampled_from(graphs), label="chain")])
        self._retire()

    def _backward(self, c: Chain) -> None:
        """A chain's backward, wherever its groups are.

        It reads its groups from the last layer down (a group that saved nothing is never
        read). At a group's first read, if armed: the group is made resident (an offload in
        flight ended, releasing nothing; its load launched and waited for) and the layer
        before it, if offloading or offloaded, starts loading. Then the read needs the
        group's storages resident: a group offloaded or loading with something released
        refuses the backward.
        """
        refused: int | None = None
        for k in reversed(range(c.layers_count)):
            if c.held[k] == 0 or c.states[k] is None:
                continue
            if k in c.armed:
                c.armed.discard(k)
                if c.states[k] is OFFLOADING:
                    event("backward: first read of an offloading group")
                    c.copied[k], c.states[k] = 0, RESIDENT
                if c.states[k] is OFFLOADED:
                    self._launch_load(c, k)
                if c.states[k] is LOADING:
                    self._wait_load(c, k)
                before = k - 1
                if before >= 0 and c.states[before] is OFFLOADING:
                    self._wait_offload(c, before)
                if before >= 0 and c.states[before] is OFFLOADED:
                    self._launch_load(c, before)
            if c.states[k] in (OFFLOADED, LOADING) and c.released[k]:
                refused = k
                break
        loss, c.loss, c.graph = c.loss, None, False  # spent either way; dropped here
        assert loss is not None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = gradients(loss, c.leaf, c.layers[:c.ran])
            except SwapResidencyError as exc:
                assert refused is not None, f"backward refused: {exc}"
                assert repr(c.names[refused]) in str(exc), str(exc)
                event("backward refused")
            else:
                assert refused is None, f"backward read {c.names[refused]!r}, off the device"
                assert all(same_bits(a, b) for a, b in zip(c.want, got, strict=True))
                event("backward exact")
        del loss
        assert not caught, [str(w.message) for w in caught]

    def teardown(self) -> None:
        try:
            for c in self.chains:
                c.chain.abort()
                for k in range(c.layers_count):
                    self._abort(c, k)
            self.manager_matches_the_model()
            stats = self.mgr.stats()
            assert self.mgr.active_group_count() == 0
            assert stats.device_bytes_held == 0 and stats.host_bytes_in_use == 0
            for c in self.chains:  # abort put everything back: no data was lost
                self._exact(c)
        finally:
            self.mgr.close()


TestChainCalls = ChainCalls.TestCase
TestChainCalls.settings = settings(PROPERTY_SETTINGS, max_examples=150, stateful_step_count=40)
