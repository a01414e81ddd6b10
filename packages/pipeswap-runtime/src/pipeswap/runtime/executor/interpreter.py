"""The step interpreter: runs this rank's order of one step, one handler per step type.

A table maps each :class:`~pipeswap.schedule.StepType` to its handler, as PyTorch's
``_PipelineScheduleRuntime`` dispatches its actions: computes go to the chunk autograd
(:mod:`pipeswap.runtime.executor.backward`), sends and receives to the step's transport, FSDP steps
to the sharded stage, swap steps to the step's swap session. :class:`StepState` holds what
the step's chunks hold from one step of the order to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, ClassVar, cast

from pipeswap.runtime.executor.failure import collective
from pipeswap.runtime.executor.backward import ChunkAutograd, forward_chunk
from pipeswap.runtime.distributed.transport import (
    BoundaryMeta,
    PyTree,
    Transfer,
    Transport,
    flatten,
)
from pipeswap.runtime.errors import PipelineError, PipelineSetupError
from pipeswap.runtime.executor.microbatch import split_tree
from pipeswap.runtime.executor.options import Microbatches
from pipeswap.runtime.executor.step_report import LayerMarks, MemoryAccount
from pipeswap.runtime.executor.swap_session import SwapSession
from pipeswap.runtime.executor.backward_split import SplitCache
from pipeswap.schedule import COMPUTE, FSDP, OVERLAPS, P2P, SENDS, ChunkKey, Step, StepType

if TYPE_CHECKING:
    import torch

    from pipeswap.runtime.executor.measurements import StepTimes
    from pipeswap.runtime.executor.sharded_stage import ShardedStage
    from pipeswap.runtime.executor.stage import PipelineStage
    from pipeswap.swap import SwapManager
    from pipeswap.swap import LayerChain

LossFn = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
Handler = Callable[["Interpreter", "StepState", Step], None]


@dataclass
class StepState:
    """The state of one step: what each chunk holds until its backward is done."""

    number: int  # the executor's count of steps: part of every message tag
    transport: Transport
    session: SwapSession
    memory: MemoryAccount
    chunks: dict[ChunkKey, ChunkAutograd] = field(default_factory=dict)  # forward to last B/W
    # per chunk: its input's gradients, for the tensors that carry one
    grads_in: dict[ChunkKey, list[torch.Tensor | None]] = field(default_factory=dict)
    receives: dict[tuple[StepType, ChunkKey], Transfer] = field(default_factory=dict)
    sends: list[Transfer] = field(default_factory=list)
    micro_inputs: list[PyTree] = field(default_factory=list)
    micro_targets: list[PyTree] = field(default_factory=list)
    # per microbatch, the keyword arguments every stage of the rank is called with
    micro_kwargs: Sequence[Mapping[str, object]] = ()
    loss_fn: LossFn | None = None  # the step's: the executor's, with the step's loss_kwargs
    keep_outputs: bool = False  # keep the last stage's outputs (outputs, below)
    measure_layers: bool = False  # measure every chunk held whole, layer by layer
    at: Step | str | None = None  # where the step is: the step of the order running, or why
    forward_only: bool = False  # an evaluation: forwards alone, without autograd or swap
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # read once, at the end
    outputs: dict[int, PyTree] = field(default_factory=dict)  # the last stage's, if kept
    times: StepTimes | None = None  # what a measured step's computes took


class Interpreter:
    """Runs steps of one rank's order on its ``stages`` (by index); ``swapped``: the chunks
    the schedule swaps and ``recomputed`` those with recomputed layers, by layer index (both
    accounted even when the step does not account every chunk); ``sharded``: the stages
    sharded with FSDP; ``autocast_dtype``: see :meth:`autocast`. :attr:`active` holds, per
    stage, the chain of the streamed chunk whose forward runs there, for the stage's layer
    hooks, and :attr:`recomputing` the layers its forward recomputes, for the stage's
    recompute hooks (and :attr:`layer_marks` measures a chunk held whole layer by layer);
    :attr:`splits`, per stage, how its backwards split into I and W."""

    def __init__(self, stages: Mapping[int, PipelineStage], *, rank: int, microbatches: int,
                 loss_fn: LossFn | None, mean_loss: bool, manager: SwapManager,
                 device: torch.device,
                 autocast_dtype: torch.dtype | None, swapped: set[ChunkKey],
                 recomputed: Mapping[ChunkKey, frozenset[int]],
                 sharded: Mapping[int, ShardedStage]) -> None:
        self.stages = stages
        self.rank = rank
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.loss_scale = microbatches if mean_loss else 1  # what each loss is divided by
        self.manager = manager
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.swapped = swapped
        self.recomputed = recomputed
        self.sharded = sharded
        self.active: dict[int, LayerChain] = {}
        self.recomputing: dict[int, frozenset[int]] = {}
        self.layer_marks: dict[int, LayerMarks] = {}  # per stage, a chunk held whole
        self.splits = {index: SplitCache() for index in stages}

    def run(self, state: StepState, step: Step) -> None:
        """Run one step of the order."""
        handler = self._HANDLERS.get(step.type)
        if handler is None:
            raise PipelineError(f"{step}: the executor runs no {step.type.name} steps")
        if step.type in COMPUTE and self.sharded:
            self.parameters_ready(state, step)
        handler(self, state, step)

    def autocast(self) -> AbstractContextManager[object]:
        """Mixed precision for a forward (and its loss): autocast to ``autocast_dtype``;
        parameters and their gradients stay in their own dtype."""
        if self.autocast_dtype is None:
            return nullcontext()
        import torch

        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # -- computes --------------------------------------------------------------------------

    def parameters_ready(self, state: StepState, step: Step) -> None:
        """Before a compute of a sharded stage: its parameters are gathered (and, just
        gathered, kept out of swap: they are parameters, not activations)."""
        assert step.stage is not None
        sharded = self.sharded.get(step.stage)
        if sharded is not None and collective(state.transport, step,
                                              lambda: sharded.ready(step)):
            self.manager.protect_module(self.stages[step.stage].module)

    def _forward(self, state: StepState, step: Step) -> None:
        """F of one chunk: its input received, handed over or split from the batch, run
        inside the chunk's swap group when it is accounted (a forward-only step's alone,
        without autograd)."""
        key = step.key
        stage_index, micro = key
        stage = self.stages[stage_index]
        x, inputs = self._input(state, key)
        target = state.micro_targets[micro] if stage.is_last and state.micro_targets else None
        kwargs = state.micro_kwargs[micro] if state.micro_kwargs else None
        if state.forward_only:
            state.chunks[key] = evaluate_chunk(stage, micro, (x, kwargs), target, state,
                                               self.autocast())
            return
        redo = self.recomputed.get(key)
        accounted = state.memory.every_chunk or key in self.swapped or redo is not None
        chain = state.session.chain(key)
        if chain is not None:  # streamed: the layers' groups offload as the forward goes
            chain.protect([x, target])
            self.active[stage_index] = chain
        if redo is not None:  # these layers keep their inputs and run again in backward
            state.memory.recomputed_layers += len(redo)
        marks = None  # a chunk held whole, measured layer by layer where asked (or recomputed)
        if chain is None and (redo is not None or state.measure_layers):
            marks = self.layer_marks[stage_index] = LayerMarks(state.session.name(key))
        if redo is not None or marks is not None:
            self.recomputing[stage_index] = redo or frozenset()
        try:
            with self.autocast():
                chunk = forward_chunk(partial(stage.forward, kwargs=kwargs), x, inputs=inputs,
                                      carries=_carries(state, stage), target=target,
                                      loss_fn=state.loss_fn, scale=self.loss_scale,
                                      saving=state.session.forward(key) if accounted else None,
                                      keep=state.keep_outputs)
        finally:
            self.active.pop(stage_index, None)
            self.recomputing.pop(stage_index, None)
            self.layer_marks.pop(stage_index, None)
        if chunk.loss is not None:
            state.losses[micro] = chunk.loss
            if chunk.value is not None:  # kept: nothing reads it in the step
                state.outputs[micro] = chunk.value
        if accounted:
            state.session.protect(key, [x, chunk.value, target, kwargs])
            if chain is not None:
                chain.forward_done()
            state.memory.forward_done(key, state.session, marks)
        state.chunks[key] = chunk

    def _input(self, state: StepState, key: ChunkKey) -> tuple[PyTree, list[torch.Tensor]]:
        """A forward's input (split from the batch, received or handed over locally) and
        its tensors that carry a gradient back."""
        stage_index, micro = key
        if self.stages[stage_index].is_first:
            return state.micro_inputs[micro], []
        meta = state.transport.boundary[stage_index - 1]
        received = self._received(state, StepType.FWD_RECV, key)
        if received is None:  # the previous stage runs here: hand over locally
            received, _ = flatten(self._output(state, (stage_index - 1, micro)), "")
        inputs = [leaf.requires_grad_(True) for leaf, grad in zip(received, meta.grads)
                  if grad and not state.forward_only]
        return meta.unflatten(received), inputs

    def _backward(self, state: StepState, step: Step) -> None:
        """B (dx and dw), I (dx) or W (dw) of one chunk; the autograd is in
        :mod:`pipeswap.runtime.executor.backward`. The swap group ends after the chunk's
        last step."""
        key = step.key
        dx, dw = step.type is not StepType.BWD_WEIGHT, step.type is not StepType.BWD_INPUT
        stage_index, micro = key
        stage = self.stages[stage_index]
        chunk = state.chunks[key]
        if dx:
            grads: list[torch.Tensor] | None = None
            if not stage.is_last:
                grads = self._received(state, StepType.BWD_RECV, key)
                if grads is None:  # the next stage runs here
                    grads = self._gradients(state, stage_index, state.grads_in.pop(
                        (stage_index + 1, micro), None), f"stage {stage_index} micro {micro}")
            redo = self.recomputed.get(key)
            if dw:
                grad_in = chunk.backward(grads)
            else:  # a recomputed layer's weight gradients come from what I made again
                grad_in = chunk.backward_input(
                    grads, self.splits[stage_index], releasing=self.manager.releasing,
                    recomputed=None if redo is None else [
                        p for k in sorted(redo) for p in stage.layers[k].parameters()])
            if not stage.is_first:
                state.grads_in[key] = grad_in
            if redo is not None:
                state.memory.recomputed(key, state.session)
            if not dw:  # the chunk keeps what its W step needs, and only that
                if redo is not None:
                    state.session.release_remade(key)
                state.memory.input_done(key, state.session)
                return
        else:
            chunk.backward_weight()
        if key in state.memory.accounted:
            state.session.finish(key)
        del state.chunks[key]

    def _overlap(self, state: StepState, step: Step) -> None:
        """A forward and a backward the schedule overlaps: run in order."""
        for sub in step.sub_steps:
            self.run(state, sub)

    # -- sends and receives ----------------------------------------------------------------

    def _p2p(self, state: StepState, step: Step) -> None:
        self._post(state, [step], batched=False)

    def _batch(self, state: StepState, step: Step) -> None:
        self._post(state, list(step.sub_steps), batched=True)

    def _post(self, state: StepState, steps: list[Step], batched: bool) -> None:
        pairs = []
        for step in steps:
            if step.type is StepType.FWD_SEND:
                leaves, _ = flatten(self._output(state, step.key), "a stage's output")
                pairs.append((step, [leaf.contiguous() for leaf in leaves]))
            elif step.type is StepType.BWD_SEND:
                grads = self._gradients(state, step.key[0] - 1,
                                        state.grads_in.pop(step.key, None), step)
                pairs.append((step, [grad.contiguous() for grad in grads]))
            else:
                pairs.append((step, state.transport.receive_buffers(step)))
        self._release_sent(state)
        for transfer in state.transport.post(state.number, pairs, batched):
            if transfer.step.type in SENDS:
                state.sends.append(transfer)
            else:
                state.receives[(transfer.step.type, transfer.step.key)] = transfer

    @staticmethod
    def _release_sent(state: StepState) -> None:
        """Let go of the sends that completed (a gradient sent is held by nothing else), so
        that they do not stay until the step ends. NCCL says when a send completed; gloo
        only once it is waited for, at the end of the step."""
        pending = []
        for transfer in state.sends:
            if all(work.is_completed() for work in transfer.works):
                state.transport.wait(transfer)  # returns at once; raises a send's error
            else:
                pending.append(transfer)
        state.sends = pending

    def _gradients(self, state: StepState, boundary: int,
                   grads: list[torch.Tensor | None] | None, at: object) -> list[torch.Tensor]:
        """The gradients of boundary ``boundary``'s tensors that carry one, a tensor each:
        zeros for one the next stage did not use; an error if it used none."""
        import torch

        if grads is None or all(grad is None for grad in grads):
            raise PipelineError(f"{at}: stage {boundary + 1}'s input got no gradient to "
                                "send: does the stage's output depend on its input?")
        meta = state.transport.boundary[boundary]
        metas = [leaf for leaf, grad in zip(meta.leaves, meta.grads) if grad]
        return [grad if grad is not None else torch.zeros(leaf.shape, dtype=leaf.dtype,
                                                          device=self.device)
                for grad, leaf in zip(grads, metas)]

    def _received(self, state: StepState, kind: StepType, key: ChunkKey
                  ) -> list[torch.Tensor] | None:
        transfer = state.receives.pop((kind, key), None)
        return None if transfer is None else state.transport.wait(transfer)

    def _output(self, state: StepState, key: ChunkKey) -> PyTree:
        """The chunk's forward output, its tensors detached, to send or hand over to the
        next stage."""
        import torch
        from torch.utils._pytree import tree_map_only

        chunk = state.chunks.get(key)
        if chunk is None or chunk.value is None:
            raise PipelineError(f"stage {key[0]} micro {key[1]}: its output is needed after "
                                "its backward began")
        detached: PyTree = tree_map_only(torch.Tensor, lambda t: t.detach(), chunk.value)
        return detached

    # -- FSDP and swap ---------------------------------------------------------------------

    def _fsdp(self, state: StepState, step: Step) -> None:
        """UNSHARD, RESHARD or REDUCE_GRAD of a sharded stage."""
        assert step.stage is not None
        sharded = self.sharded[step.stage]
        if step.type is StepType.FSDP_REDUCE_GRAD:
            collective(state.transport, step, sharded.reduce_grad)
            return
        state.memory.flush()
        if step.type is StepType.FSDP_UNSHARD:
            collective(state.transport, step, sharded.unshard)
            state.memory.parameters_changed(sharded.gathered_bytes)
        else:
            collective(state.transport, step, sharded.reshard)
            state.memory.parameters_changed(-sharded.gathered_bytes)

    def _recompute(self, state: StepState, step: Step) -> None:
        """RC: marks the chunk's recomputed layers (the executor read them at set-up)."""

    def _stream_offload(self, state: StepState, step: Step) -> None:
        """SO: the chunk's layers get a swap group each, which its forward offloads."""
        assert step.lag is not None
        stage = self.stages[step.key[0]]
        state.session.stream(step.key, len(stage.layers), step.lag)

    def _swap(self, state: StepState, step: Step) -> None:
        """LO, WO, LL and WL of a chunk swapped whole; WO, SL and WL of a streamed one."""
        kind = step.type
        chain = state.session.chain(step.key)
        if chain is not None:
            if kind is StepType.SWAP_STREAM_LOAD:
                assert step.lag is not None  # Step gives every SL a lag >= 1
                chain.launch_load(step.lag)
                return
            {StepType.SWAP_WAIT_OFFLOAD: chain.wait_offload,
             StepType.SWAP_WAIT_LOAD: chain.wait_load}[kind]()
            return
        name = state.session.name(step.key)
        {StepType.SWAP_LAUNCH_OFFLOAD: self.manager.launch_offload,
         StepType.SWAP_WAIT_OFFLOAD: self.manager.wait_offload,
         StepType.SWAP_LAUNCH_LOAD: self.manager.launch_load,
         StepType.SWAP_WAIT_LOAD: self.manager.wait_load}[kind](name)

    # the step interpreter's table (functions, not bound methods: no reference cycle keeps
    # an interpreter, and the stages and manager it holds, alive after its executor)
    _HANDLERS: ClassVar[dict[StepType, Handler]] = {
        StepType.FWD: _forward,
        **dict.fromkeys((StepType.BWD, StepType.BWD_INPUT, StepType.BWD_WEIGHT), _backward),
        **dict.fromkeys(OVERLAPS, _overlap),
        **dict.fromkeys(P2P, _p2p),
        StepType.BATCH_SEND_RECV: _batch,
        **dict.fromkeys(FSDP, _fsdp),
        StepType.SWAP_STREAM_OFFLOAD: _stream_offload,
        StepType.RECOMPUTE: _recompute,
        **dict.fromkeys((StepType.SWAP_LAUNCH_OFFLOAD, StepType.SWAP_WAIT_OFFLOAD,
                         StepType.SWAP_LAUNCH_LOAD, StepType.SWAP_WAIT_LOAD,
                         StepType.SWAP_STREAM_LOAD), _swap),
    }


def take_batch(stages: Mapping[int, PipelineStage], rank: int, microbatches: int,
               state: StepState, inputs: PyTree | Microbatches | None,
               targets: PyTree | Microbatches | None,
               input_meta: BoundaryMeta | None) -> None:
    """Split this rank's part of the batch into microbatches, checking it fits (and the
    keyword arguments for every stage, given per microbatch); ``input_meta``: what the first
    step's microbatches of the inputs held."""
    if state.micro_kwargs and len(state.micro_kwargs) != microbatches:
        raise PipelineSetupError(
            f"rank {rank}: keyword arguments for {len(state.micro_kwargs)} microbatches, but "
            f"the step runs {microbatches}: give one mapping per microbatch")
    if any(stage.is_first for stage in stages.values()):
        if inputs is None:
            raise PipelineSetupError(f"rank {rank} runs the first stage: pass inputs")
        state.micro_inputs = _split(inputs, microbatches, "inputs")
        meta = BoundaryMeta.of(state.micro_inputs[0], "the inputs")[0]
        if input_meta is not None and meta != input_meta:
            def shapes(m: BoundaryMeta) -> list[tuple[int, ...]]:
                return [leaf.shape for leaf in m.leaves]

            raise PipelineSetupError(
                f"microbatch shapes changed from {shapes(input_meta)} to "
                f"{shapes(meta)}; stage boundary shapes are fixed after the first step: "
                "keep the batch shape constant (pad), or build a new executor")
    if any(stage.is_last for stage in stages.values()):
        if targets is None:
            if state.forward_only:
                return  # an evaluation without a loss
            raise PipelineSetupError(f"rank {rank} runs the last stage: pass targets")
        state.micro_targets = _split(targets, microbatches, "targets")


def _carries(state: StepState, stage: PipelineStage
              ) -> Callable[[PyTree], list[torch.Tensor]] | None:
    """How to pick a stage output's tensors that carry a gradient back (as the shape
    exchange found them); None on the last stage, whose loss does."""
    if stage.is_last:
        return None
    meta = state.transport.boundary[stage.stage_index]

    def carried(out: PyTree) -> list[torch.Tensor]:
        leaves, _ = flatten(out, f"stage {stage.stage_index}'s output")
        picked = [leaf for leaf, grad in zip(leaves, meta.grads) if grad]
        if any(not leaf.requires_grad for leaf in picked):
            raise PipelineError(
                f"stage {stage.stage_index}'s output changed which tensors need a "
                "gradient since the first step; keep the stage's outputs alike")
        return picked

    return carried


def evaluate_chunk(stage: PipelineStage, micro: int,
                   call: tuple[PyTree, Mapping[str, object] | None], target: PyTree | None,
                   state: StepState, autocast: AbstractContextManager[object]
                   ) -> ChunkAutograd:
    """A forward-only step's forward of one chunk, without autograd: its output kept to
    send on, and on the last stage the loss (where a target is given) and, where the step
    keeps outputs, the output."""
    import torch
    from torch.utils._pytree import tree_map_only

    with torch.no_grad(), autocast:
        out = stage.forward(*call)
        loss_fn: Callable[..., torch.Tensor] | None = state.loss_fn  # targets: any pytree
        loss = loss_fn(out, target) if target is not None and loss_fn is not None else None
    if stage.is_last:
        if loss is not None:
            state.losses[micro] = loss.detach()
        if state.keep_outputs:
            state.outputs[micro] = tree_map_only(torch.Tensor, torch.Tensor.detach, out)
    return ChunkAutograd((), (), out, loss)


def finish_order(state: StepState, rank: int) -> None:
    """After the order: every send is done, and every receive was consumed."""
    for transfer in state.sends:
        state.transport.wait(transfer)
    if state.receives:
        raise PipelineError(
            f"rank {rank}: the schedule posted receives no step consumed: "
            f"{', '.join(str(t.step) for t in state.receives.values())}")


def _split(value: PyTree | Microbatches, microbatches: int, what: str) -> list[PyTree]:
    """``value`` in microbatches: split along dimension 0, or as given already split."""
    if not isinstance(value, Microbatches):
        return split_tree(value, microbatches, what)
    if len(value.parts) != microbatches:
        raise PipelineSetupError(
            f"{what} given in {len(value.parts)} microbatches, but the step runs "
            f"{microbatches}: give one part per microbatch")
    return [cast("PyTree", part) for part in value.parts]
