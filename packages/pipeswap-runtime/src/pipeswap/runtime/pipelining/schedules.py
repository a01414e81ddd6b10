"""The seven schedule classes of ``torch.distributed.pipelining`` over pipeswap's executor
(see :mod:`pipeswap.runtime.pipelining`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pipeswap.runtime.executor.measurements import measured_chunks
from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.executor.pipeline_executor import PipelineExecutor
from pipeswap.runtime.executor.stage import PipelineStage
from pipeswap.schedule import GRANULARITIES

if TYPE_CHECKING:
    from pipeswap.runtime.distributed.transport import PyTree
    from pipeswap.runtime.executor.step_report import StepReport
    from pipeswap.schedule import PeakOutcome, SwapPolicy

__all__ = [
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "Schedule1F1B",
]


class _FirstStage(torch.nn.Module):
    """The first stage's module behind one called with ``args`` and ``kwargs`` (the executor
    passes a dict as keyword arguments), so that ``step(*args, **kwargs)`` reaches it as
    PyTorch's schedules call it: ``module(*args, **kwargs)``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.inner(*args, **kwargs)


class _PipelineSchedule:
    """A pipeswap schedule with the constructor and ``step`` of PyTorch's class of the same
    name; see the module docstring."""

    #: pipeswap's name of the schedule (ScheduleSpec's kind); its layout (one stage a rank,
    #: several looped, or two in a V, as PyTorch places them) the executor checks, on
    #: every rank at once
    _kind: ClassVar[str]

    def __init__(
        self,
        stages: Any,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        swap: bool = False,
        policy: SwapPolicy | None = None,
        budget: int | None = None,
        swap_granularity: str = "auto",
        check_transport: str = "nccl",
        failure_timeout_s: float | None = None,
    ) -> None:
        given = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        self._refusal = _refusal(args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                                 backward_requires_autograd, swap_granularity, budget, policy)
        del defer_pp_recv  # PyTorch's runtime's receive timing; pipeswap's schedule has its own
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._budget = budget
        #: what the plan under ``budget`` expects of this rank (its peak, and by how much
        #: it misses the budget): after the first step, which measured what it plans on
        self.planned: PeakOutcome | None = None
        self._measuring = budget is not None  # the first step runs without swap, measuring
        self._report: StepReport | None = None
        self._granularity, self._transport = swap_granularity, check_transport
        self._failure_timeout_s = failure_timeout_s
        self._stages = [_pipeswap_stage(stage) for stage in given]
        self._modules = [stage.module for stage in self._stages]  # as the user built them
        self._stages = [_callable_with_kwargs(stage) for stage in self._stages]
        self.executor = self._executor(not self._measuring and (swap or policy is not None),
                                       policy, measuring=self._measuring)

    def _executor(self, swap: bool, policy: SwapPolicy | None, measuring: bool = False
                  ) -> PipelineExecutor:
        try:
            executor = PipelineExecutor(
                self._stages, self._kind, self._n_microbatches, self._loss_fn, swap=swap,
                swap_policy=policy, mean_loss=False, setup_check=self._check,
                account_activations=True if self._budget is not None else None,
                swap_granularity=self._granularity if policy is None else "auto",
                check_transport=self._transport,
                failure_timeout_s=self._failure_timeout_s)
        except PipelineSetupError as exc:
            raise PipelineSetupError(f"{type(self).__name__}: {exc}") from exc
        executor.measure_layers = measuring  # what recomputing each layer keeps
        return executor

    def _check(self) -> None:
        """Inside the executor's agreed set-up: a problem with this rank's arguments fails
        it on every rank."""
        if self._refusal is not None:
            raise PipelineSetupError(self._refusal)

    def _plan_budget(self) -> None:
        """After the measuring step: the peak policy under the budget on what it measured
        (each chunk's bytes, per layer), in a new executor (every rank builds it at the
        same point of its run, as the set-up's agreement needs)."""
        from pipeswap.schedule import CostModel, PeakPolicy, uniform_layers

        assert self._budget is not None and self._report is not None
        report = self._report
        chunks = measured_chunks({key: (b.held, b.movable)
                                  for key, b in report.chunk_bytes.items()},
                                 report.layer_held, report.layer_inputs)
        layers = {stage.stage_index: len(stage.layers) for stage in self._stages}
        policy = PeakPolicy(CostModel(chunks=chunks, stages=uniform_layers(layers)),
                            self._budget, granularity=self._granularity,
                            recompute="auto")
        self.executor.close()
        self.executor = self._executor(True, policy)
        self.planned = policy.outcomes.get(self.executor.rank)
        if self.planned is not None and self.planned.shortfall:
            warnings.warn(
                f"rank {self.executor.rank}: no plan meets the budget of {self._budget:,} "
                f"bytes; the best peaks at {self.planned.peak:,} ({self.planned.shortfall:,} "
                f"over), recomputing {self.planned.recomputed_layers} layers a step",
                stacklevel=3)

    @property
    def report(self) -> StepReport | None:
        """The last step's :class:`~pipeswap.runtime.executor.step_report.StepReport` (None before one)."""
        return self._report

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None,
             return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None,
             **kwargs: Any) -> Any:
        """One step of the whole batch: ``args`` and ``kwargs`` (the first stage's module's
        arguments, split into microbatches along dimension 0) on the first stage's rank,
        ``target`` on the last's, where ``losses`` (if given) is filled with each
        microbatch's loss and the last stage's output is returned (merged along dimension
        0; None elsewhere, or without ``return_outputs``); ``loss_kwargs`` go to the loss
        function with each microbatch's output and target."""
        if not torch.is_grad_enabled():
            raise PipelineSetupError(
                "step() runs the backward: call it with gradients enabled (not under "
                "torch.no_grad())")
        first = any(stage.is_first for stage in self._stages)
        inputs: PyTree | None = {"args": tuple(args), "kwargs": dict(kwargs)} if first \
            else None
        self.executor.keep_outputs = return_outputs
        if loss_kwargs and self._loss_fn is not None:
            self.executor.loss_fn = partial(self._loss_fn, **loss_kwargs)
        executor = self.executor
        try:
            self._report = executor.step(inputs, target)
        finally:
            executor.loss_fn = self._loss_fn
        if self.scale_grads and self._n_microbatches != 1:
            for module in self._modules:
                for parameter in module.parameters():
                    if parameter.grad is not None:
                        parameter.grad.div_(self._n_microbatches)
        last = any(stage.is_last for stage in self._stages)
        if last and losses is not None:
            losses.clear()
            losses.extend(executor.losses)
        output = _merged(executor.outputs) if last and return_outputs else None
        executor.outputs = []  # the merged output is the caller's; hold no second copy
        if self._measuring:  # the plan runs from the next step
            self._plan_budget()
            self._measuring = False
        return output


def _refusal(args_chunk_spec: Any, kwargs_chunk_spec: Any, output_merge_spec: Any,
             backward_requires_autograd: bool, swap_granularity: str, budget: int | None,
             policy: SwapPolicy | None) -> str | None:
    """What pipeswap cannot honour of a schedule's arguments, if anything."""
    for spec, what in ((args_chunk_spec, "args_chunk_spec"),
                       (kwargs_chunk_spec, "kwargs_chunk_spec"),
                       (output_merge_spec, "output_merge_spec")):
        if not _along_batch(spec):
            return (f"pipeswap splits every input and merges every output along dimension "
                    f"0; drop {what} (or give TensorChunkSpec(0) only)")
    if swap_granularity not in GRANULARITIES:
        return (f"unknown swap_granularity {swap_granularity!r}; use one of "
                f"{', '.join(GRANULARITIES)}")
    if not backward_requires_autograd:
        return "pipeswap's backward runs autograd; drop backward_requires_autograd=False"
    if budget is not None and policy is not None:
        return f"budget={budget!r} plans with the default policy; drop policy=, or budget="
    if budget is not None and budget < 1:
        return (f"budget={budget!r} keeps nothing: give the activation bytes a rank may hold "
                "(1 or more)")
    return None


def _along_batch(spec: Any) -> bool:
    """Whether a chunk or merge spec says what pipeswap does anyway: dimension 0."""
    if spec is None:
        return True
    values = spec.values() if isinstance(spec, dict) else spec if isinstance(
        spec, (list, tuple)) else [spec]
    return all(getattr(value, "split_dim", None) == 0 for value in values)


def _pipeswap_stage(stage: Any) -> PipelineStage:
    """pipeswap's stage for a PyTorch ``PipelineStage`` (its submodule, index, stage count,
    group and device), or the pipeswap stage itself."""
    if isinstance(stage, PipelineStage):
        return stage
    missing = [name for name in ("submod", "stage_index", "num_stages", "device")
               if not hasattr(stage, name)]
    if missing:
        raise PipelineSetupError(
            f"{stage!r} is neither torch.distributed.pipelining's PipelineStage nor "
            f"pipeswap's (it has no {', '.join(missing)})")
    return PipelineStage(stage.submod, stage.stage_index, stage.num_stages,
                         group=getattr(stage, "group", None), device=stage.device)


def _callable_with_kwargs(stage: PipelineStage) -> PipelineStage:
    """The first stage with its module behind :class:`_FirstStage`; others as they are."""
    if not stage.is_first:
        return stage
    return PipelineStage(_FirstStage(stage.module), stage.stage_index,
                         stage.num_stages, group=stage.group, layers=stage.layers,
                         device=stage.device)


def _merged(outputs: Sequence[PyTree]) -> Any:
    """The microbatches' outputs joined along dimension 0, as PyTorch's default merge."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    if not outputs:
        return None
    flat = [tree_flatten(output) for output in outputs]
    spec = flat[0][1]
    leaves = [torch.cat([leaves[k] for leaves, _ in flat])
              if isinstance(flat[0][0][k], torch.Tensor) else flat[0][0][k]
              for k in range(len(flat[0][0]))]
    return tree_unflatten(leaves, spec)


class _OneStage(_PipelineSchedule):
    """A class of one stage a rank: PyTorch names its first argument ``stage``."""

    def __init__(self, stage: Any, n_microbatches: int,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True,
                 **options: Any) -> None:
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads, **options)


class ScheduleGPipe(_OneStage):
    """PyTorch's ``ScheduleGPipe``: every forward, then every backward."""

    _kind = "gpipe"


class Schedule1F1B(_OneStage):
    """PyTorch's ``Schedule1F1B``: one forward, one backward in the steady state."""

    _kind = "1f1b"


class ScheduleInterleaved1F1B(_PipelineSchedule):
    """PyTorch's ``ScheduleInterleaved1F1B``: rank r runs stages r, r + P, ..."""

    _kind = "interleaved-1f1b"


class ScheduleLoopedBFS(_PipelineSchedule):
    """PyTorch's ``ScheduleLoopedBFS``: rank r runs stages r, r + P, ..., breadth first (its
    constructor, as PyTorch's, takes no chunk specs)."""

    _kind = "looped-bfs"

    def __init__(self, stages: Any, n_microbatches: int,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False,
                 **options: Any) -> None:
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads,
                         backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, **options)


class ScheduleInterleavedZeroBubble(_PipelineSchedule):
    """PyTorch's ``ScheduleInterleavedZeroBubble``: looped stages, backward split into the
    input's gradient and the weights'."""

    _kind = "interleaved-zb"


class ScheduleZBVZeroBubble(_PipelineSchedule):
    """PyTorch's ``ScheduleZBVZeroBubble``: rank r runs stages r and 2P - 1 - r (a V)."""

    _kind = "zbv"


class ScheduleDualPipeV(_PipelineSchedule):
    """PyTorch's ``ScheduleDualPipeV``: stages in a V, as ZBV."""

    _kind = "dualpipev"
