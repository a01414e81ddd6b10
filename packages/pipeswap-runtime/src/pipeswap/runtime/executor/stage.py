"""A pipeline stage: one slice of the model, its place in the pipeline, and its process group."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from pipeswap.runtime.distributed.transport import MAX_BOUNDARY_TENSORS, BoundaryMeta, flatten
from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.swap import find_layers

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from pipeswap.runtime.distributed.transport import PyTree


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: ``module`` maps what the previous stage
    returned (or, on the first stage, a microbatch of the inputs) to what the next takes.

    Between stages goes a tensor, or tuples, lists and dicts of tensors (hidden states next to
    masks or position ids; integer tensors too). A tuple is passed to the next stage's module
    as positional arguments and a dict as keyword arguments; anything else as the one
    argument. The tensors the stage computes with grad carry a gradient back; the others
    (a mask, position ids) cross forward only. The last stage's output goes to the loss
    function with the microbatch's targets. ``group`` is the pipeline's process group (None:
    the default group).

    ``layers``: the stage's layers in the order its forward calls them, each called once,
    for streaming swap (one swap group per layer). Default: the children of an
    ``nn.Sequential``, else the entries of a ``layers`` ModuleList or ModuleDict, else the
    whole module as one layer (see :func:`pipeswap.swap.layers.find_layers`).

    ``device``: where the module lives, where the caller says (PyTorch's stages do); the
    executor refuses a stage on another device than its platform's.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        group: dist.ProcessGroup | None = None,
        layers: Sequence[torch.nn.Module] | None = None,
        device: torch.device | str | None = None,
    ) -> None:

        if not 0 <= stage_index < num_stages:
            raise PipelineSetupError(
                f"stage_index must be in [0, {num_stages}), got {stage_index}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.device = device
        self.layers = list(find_layers(module) if layers is None else layers)
        if not self.layers:
            raise PipelineSetupError(f"stage {stage_index}: layers is empty; give the stage's "
                                     "layers in call order, or leave it out")
        inside = {id(m) for m in module.modules()}
        if any(id(layer) not in inside for layer in self.layers):
            raise PipelineSetupError(f"stage {stage_index}: every one of layers must be a "
                                     "submodule of the stage's module")

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, value: PyTree, kwargs: Mapping[str, object] | None = None) -> PyTree:
        """The module on ``value``, unpacked as the class docstring says, and on keyword
        arguments the step gives every stage (``kwargs``: a microbatch's, tensors and other
        values alike); its output must be a pytree of tensors."""
        extra = kwargs or {}
        out: PyTree  # once flatten has checked it
        if isinstance(value, tuple):
            out = self.module(*value, **extra)
        elif isinstance(value, dict):
            out = self.module(**value, **extra)
        else:
            out = self.module(value, **extra)
        flatten(out, f"stage {self.stage_index}'s output")
        return out

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages})"


def output_meta(stage: PipelineStage, meta: BoundaryMeta, device: torch.device,
                autocast: Callable[[], AbstractContextManager[object]],
                kwargs: Mapping[str, object] | None = None) -> BoundaryMeta:
    """What ``stage`` outputs for an input described by ``meta``: its structure, shapes,
    dtypes, and which tensors carry a gradient back, from one dry run on zeros.

    The dry run records autograd (to see which outputs need a gradient) but runs no
    backward, and buffers and the random state are restored afterwards, so it leaves no trace
    in the model. A stage sharded with FSDP must be gathered around the call.
    """
    import torch


    index = stage.stage_index
    saved = {name: b.clone() for name, b in stage.module.named_buffers()}
    with torch.enable_grad(), torch.random.fork_rng(
            devices=[] if device.type == "cpu" else [device.index or 0],
            device_type=device.type if device.type != "cpu" else "cuda"):
        leaves = [torch.zeros(leaf.shape, dtype=leaf.dtype, device=device).requires_grad_(grad)
                  for leaf, grad in zip(meta.leaves, meta.grads)]
        with autocast():
            out = stage.forward(meta.unflatten(leaves), kwargs)
        for name, b in stage.module.named_buffers():
            b.copy_(saved[name])
    boundary, _ = BoundaryMeta.of(out, f"stage {index}'s output")
    del out, leaves  # the dry run's graph
    if not any(boundary.grads):
        raise PipelineSetupError(
            f"stage {index}'s output ({', '.join(str(leaf.dtype) for leaf in boundary.leaves)}) "
            "has no tensor computed with grad, so no gradient would reach the stages "
            "before it: return at least one floating tensor that depends on the stage's "
            "parameters or input")
    if len(boundary.leaves) > MAX_BOUNDARY_TENSORS:
        raise PipelineSetupError(
            f"stage {index} outputs {len(boundary.leaves)} tensors; at most "
            f"{MAX_BOUNDARY_TENSORS} cross a stage boundary: pack some together")
    return boundary
