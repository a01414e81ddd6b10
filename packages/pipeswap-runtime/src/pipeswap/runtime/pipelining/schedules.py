"""The seven schedule classes of ``torch.distributed.pipelining`` over pipeswap's executor
(see :mod:`pipeswap.runtime.pipelining`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict, cast

import torch
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.executor.options import (
    FailureHandling,
    Measure,
    Microbatches,
    Numerics,
    SwapOptions,
)
from pipeswap.runtime.executor.pipeline_executor import PipelineExecutor
from pipeswap.runtime.executor.planning import (
    MEASURE_TO_PLAN,
    Measured,
    VaryingChunks,
    budget_policy,
)
from pipeswap.runtime.pipelining.stages import (
    StageArgument,
    merged,
    microbatch_kwargs,
    pipeswap_stage,
)
from pipeswap.schedule import (
    GRANULARITIES,
    TRANSPORTS,
    Granularity,
    SwapPolicy,
    TransportModel,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from pipeswap.runtime.distributed.transport import PyTree
    from pipeswap.runtime.executor.step_report import StepReport
    from pipeswap.schedule import PlanOutcome

class PipeswapOptions(TypedDict, total=False):
    """The keyword arguments pipeswap adds to PyTorch's constructors."""

    swap: bool
    policy: SwapPolicy | None
    budget: int | None
    swap_granularity: Granularity
    check_transport: TransportModel
    failure_timeout_s: float | None


class _PipelineSchedule:
    """A pipeswap schedule with the constructor and ``step`` of PyTorch's class of the same
    name; see the module docstring."""

    #: pipeswap's name of the schedule (ScheduleSpec's kind); its layout (one stage a rank,
    #: several looped, or two in a V, as PyTorch places them) the executor checks, on
    #: every rank at once
    _kind: ClassVar[str]

    def __init__(
        self,
        stages: StageArgument | Sequence[StageArgument],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: object = None,
        kwargs_chunk_spec: object = None,
        output_merge_spec: object = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        swap: bool = False,
        policy: SwapPolicy | None = None,
        budget: int | None = None,
        swap_granularity: Granularity = "auto",
        check_transport: TransportModel = "nccl",
        failure_timeout_s: float | None = None,
    ) -> None:
        given: list[StageArgument] = (list(stages) if isinstance(stages, (list, tuple))
                                      else [cast(StageArgument, stages)])
        self._refusal = _bad_value(
            n_microbatches=n_microbatches, scale_grads=scale_grads, swap=swap, budget=budget,
            policy=policy, check_transport=check_transport,
            failure_timeout_s=failure_timeout_s) or _refusal(
                args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                backward_requires_autograd, swap_granularity, budget, policy,
                _custom_backward(given))
        del defer_pp_recv  # PyTorch's runtime's receive timing; pipeswap's schedule has its own
        self._n_microbatches = n_microbatches
        # without a loss function, as in PyTorch's classes, every step runs forward only
        self._trains = loss_fn is not None
        self._loss_fn = loss_fn or _no_loss
        # what every rank must be given alike: what decides the steps' traffic (forward
        # only; a first step that measures, then a new executor) and what the gradients
        # mean; swap, its policy and the budget's size are each rank's own
        self._agreed = (f"{type(self).__name__}(loss_fn="
                        f"{'given' if loss_fn is not None else 'None'}, "
                        f"scale_grads={scale_grads}, budget="
                        f"{'given' if budget is not None else 'None'}, "
                        f"check_transport={check_transport!r}, "
                        f"failure_timeout_s={failure_timeout_s!r})")
        self.scale_grads = scale_grads
        self._budget = budget
        #: what the plan under ``budget`` expects of this rank (its peak, and by how much
        #: it misses the budget): after the first step, which measured what it plans on
        self.planned: PlanOutcome | None = None
        #: the stages whose chunks the measuring step found of different sizes by
        #: microbatch (the plan sizes each as its stage's largest)
        self.varying: tuple[VaryingChunks, ...] = ()
        self._measuring = budget is not None  # the first step runs without swap, measuring
        self._report: StepReport | None = None
        self._granularity, self._transport = swap_granularity, check_transport
        self._failure_timeout_s = failure_timeout_s
        self._stages = [pipeswap_stage(stage) for stage in given]
        self._modules = [stage.module for stage in self._stages]
        self.executor = self._executor(not self._measuring and (swap or policy is not None),
                                       policy)

    def _executor(self, swap: bool, policy: SwapPolicy | None) -> PipelineExecutor:
        options = SwapOptions(policy, granularity=self._granularity if policy is None
                              else "auto")
        try:
            return PipelineExecutor(
                self._stages, self._kind, self._n_microbatches, self._loss_fn,
                swap=options if swap else False,
                count_activations=True if self._budget is not None else None,
                check_transport=self._transport, numerics=Numerics(mean_loss=False),
                failure=FailureHandling(self._failure_timeout_s, setup_check=self._check,
                                        agreed=self._agreed))
        except PipelineSetupError as exc:
            raise PipelineSetupError(f"{type(self).__name__}: {exc}") from exc

    def _check(self) -> None:
        """Inside the executor's agreed set-up: a problem with this rank's arguments fails
        it on every rank."""
        if self._refusal is not None:
            raise PipelineSetupError(self._refusal)

    def _plan_budget(self) -> None:
        """After the measuring step: the peak policy under the budget on what it measured
        (each chunk's bytes, per layer), in a new executor (every rank builds it at the
        same point of its run, as the set-up's agreement needs)."""
        assert self._budget is not None and self._report is not None
        layers = {stage.stage_index: len(stage.layers) for stage in self._stages}
        measured, self.varying = Measured.of(self._report).at_largest()
        policy = budget_policy(measured, layers, self._budget, granularity=self._granularity)
        self.executor.close()
        self.executor = self._executor(True, policy)
        plan = self.executor.plan
        self.planned = None if plan is None else plan.outcome
        for varying in self.varying:
            warnings.warn(varying.describe(self.executor.rank), stacklevel=3)
        if self.planned is not None and self.planned.shortfall:
            warnings.warn(
                f"rank {self.executor.rank}: no plan meets the budget of {self._budget:,} "
                f"bytes; the best peaks at {self.planned.peak:,} ({self.planned.shortfall:,} "
                f"over), recomputing {self.planned.recomputed_layers} layers a step",
                stacklevel=3)

    @property
    def report(self) -> StepReport | None:
        """The last step's :class:`~pipeswap.runtime.executor.step_report.StepReport` (None
        before one)."""
        return self._report

    def step(self, *args: object, target: PyTree | None = None,
             losses: list[torch.Tensor] | None = None, return_outputs: bool = True,
             loss_kwargs: dict[str, object] | None = None, **kwargs: object
             ) -> Any:  # Any: the last stage's output, whatever the model returns
        """One step of the whole batch: ``args`` and ``kwargs`` (the first stage's module's
        arguments, split into microbatches along dimension 0) on the first stage's rank,
        ``target`` on the last's, where ``losses`` (if given) is filled with each
        microbatch's loss and the last stage's output is returned (merged along dimension
        0; None elsewhere, or without ``return_outputs``); ``loss_kwargs`` go to the loss
        function with each microbatch's output and target."""
        return self._train(self._inputs(args), target,
                           microbatch_kwargs(kwargs, self._n_microbatches), losses,
                           return_outputs, loss_kwargs)

    def _step_microbatches(self, arg_mbs: list[tuple[object, ...]] | None = None,
                           kwarg_mbs: list[dict[str, object]] | None = None,
                           target_mbs: list[PyTree] | None = None,
                           losses: list[torch.Tensor] | None = None,
                           return_outputs: bool = True,
                           loss_kwargs: dict[str, object] | None = None) -> PyTree | None:
        """PyTorch's step on microbatches already split: ``arg_mbs`` (each microbatch's
        positional arguments, on the first stage's rank), ``kwarg_mbs`` (each one's keyword
        arguments, for every stage of the rank) and ``target_mbs`` (on the last stage's
        rank), ``n_microbatches`` of each (checked in the step, so a wrong count fails it on
        every rank)."""
        first = any(stage.is_first for stage in self._stages)
        inputs = (Microbatches(tuple(tuple(args) for args in arg_mbs))
                  if first and arg_mbs is not None else None)
        targets = None if target_mbs is None else Microbatches(tuple(target_mbs))
        return self._train(inputs, targets, [dict(k) for k in kwarg_mbs or ()], losses,
                           return_outputs, loss_kwargs)

    def _train(self, inputs: PyTree | Microbatches | None,
               targets: PyTree | Microbatches | None, stage_kwargs: list[dict[str, object]],
               losses: list[torch.Tensor] | None, return_outputs: bool,
               loss_kwargs: dict[str, object] | None) -> PyTree | None:
        """One training step of the executor, then PyTorch's gradient scaling, losses and
        merged output; the plan under a budget made after the first. Without a loss
        function, the forwards alone (PyTorch's classes then run no backward)."""
        if not self._trains:
            return self._forwards(inputs, None, stage_kwargs, losses, return_outputs)
        if not torch.is_grad_enabled():
            raise PipelineSetupError(
                "step() runs the backward: call it with gradients enabled (not under "
                "torch.no_grad())")
        measure = replace(MEASURE_TO_PLAN if self._measuring else Measure(),
                          outputs=return_outputs)
        report = self._report = self.executor.step(
            inputs, targets, measure=measure, loss_kwargs=loss_kwargs,
            stage_kwargs=stage_kwargs)
        if self.scale_grads and self._n_microbatches != 1:
            for module in self._modules:
                for parameter in module.parameters():
                    if parameter.grad is not None:
                        parameter.grad.div_(self._n_microbatches)
        last = any(stage.is_last for stage in self._stages)
        if last and losses is not None:
            losses.clear()
            losses.extend(report.loss_tensors)
        output = merged(list(report.outputs)) if last and return_outputs else None
        if self._measuring:  # the plan runs from the next step
            self._plan_budget()
            self._measuring = False
        return output

    def eval(self, *args: object, target: PyTree | None = None,
             losses: list[torch.Tensor] | None = None, **kwargs: object
             ) -> Any:  # Any: the last stage's output, whatever the model returns
        """PyTorch's ``eval``: the whole batch forward only (no gradient, no swap), the
        same forwards as :meth:`step`'s; ``losses`` filled with each microbatch's loss where
        ``target`` is given, and the last stage's output returned on its rank, merged along
        dimension 0 (None elsewhere)."""
        return self._forwards(self._inputs(args), target,
                              microbatch_kwargs(kwargs, self._n_microbatches), losses)

    def _forwards(self, inputs: PyTree | Microbatches | None, target: PyTree | None,
                  stage_kwargs: list[dict[str, object]], losses: list[torch.Tensor] | None,
                  return_outputs: bool = True) -> PyTree | None:
        """The forwards alone (``eval``, and every step of a schedule given no loss
        function): each microbatch's loss where a target and a loss function are given, and
        the merged output on the last stage's rank."""
        if not self._trains:
            target = None  # nothing to compute a loss with, as in PyTorch's classes
        report = self.executor.evaluate(inputs, target, stage_kwargs=stage_kwargs)
        if not any(stage.is_last for stage in self._stages):
            return None
        if losses is not None and target is not None:
            losses.clear()
            losses.extend(report.loss_tensors)
        return merged(list(report.outputs)) if return_outputs else None

    def _inputs(self, args: tuple[object, ...]) -> PyTree | None:
        """What the executor splits into microbatches: on the first stage's rank the
        positional arguments, which its module is called with (keyword arguments go to
        every stage, as PyTorch passes them)."""
        if not any(stage.is_first for stage in self._stages):
            return None
        return cast("PyTree", tuple(args))


def _no_loss(output: object, target: object) -> torch.Tensor:
    """The loss function of a schedule given none: its steps run forward only, as PyTorch's
    do, so no loss is ever asked for."""
    raise PipelineSetupError("no loss_fn was given to the schedule: pass one to train")


def _bad_value(*, n_microbatches: object, scale_grads: object, swap: object, budget: object,
               policy: object, check_transport: object, failure_timeout_s: object
               ) -> str | None:
    """The first argument of a wrong type or range, said with what to give instead (a
    ``bool`` is no number here, nor a float a byte count)."""
    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(n_microbatches) or cast(int, n_microbatches) < 1:
        return f"n_microbatches={n_microbatches!r}: give a whole number of microbatches, 1 or more"
    for name, flag in (("scale_grads", scale_grads), ("swap", swap)):
        if not isinstance(flag, bool):
            return f"{name}={flag!r}: give True or False"
    if budget is not None and (not whole(budget) or cast(int, budget) < 1):
        return (f"budget={budget!r}: give the activation bytes a rank may hold as a whole "
                "number, 1 or more (2_000_000_000, not 2e9), or None")
    if policy is not None and not callable(getattr(policy, "select", None)):
        return (f"policy={policy!r} is no swap policy (it has no select method): give a "
                "pipeswap.schedule policy (PeakPolicy(...), MinGapPolicy(), ...), or None")
    if check_transport not in TRANSPORTS:
        return f"check_transport={check_transport!r}: give one of {', '.join(TRANSPORTS)}"
    if failure_timeout_s is not None and (
            isinstance(failure_timeout_s, bool) or not isinstance(failure_timeout_s, (int, float))
            or not 0 < failure_timeout_s < math.inf):
        return (f"failure_timeout_s={failure_timeout_s!r}: give the seconds a silent peer "
                "is waited for, a number above 0 (or None: the group's timeout)")
    return None


def _refusal(args_chunk_spec: object, kwargs_chunk_spec: object, output_merge_spec: object,
             backward_requires_autograd: bool, swap_granularity: str, budget: int | None,
             policy: SwapPolicy | None, custom_backward: int | None = None) -> str | None:
    """What pipeswap cannot honour of a schedule's arguments, if anything;
    ``custom_backward``: a stage built with ``dw_builder``."""
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
    if custom_backward is not None:
        return (f"stage {custom_backward} was built with dw_builder, a weight gradient of "
                "its own, which pipeswap's backward (autograd's) would not call: build the "
                "PipelineStage without dw_builder")
    if budget is not None and policy is not None:
        return f"budget={budget!r} plans with the default policy; drop policy=, or budget="
    return None


def _custom_backward(stages: Sequence[StageArgument]) -> int | None:
    """The index of a stage built with PyTorch's ``dw_builder``, if any."""
    return next((stage.stage_index for stage in stages
                 if getattr(stage, "dw_builder", None) is not None), None)


def _along_batch(spec: object) -> bool:
    """Whether a chunk or merge spec says what pipeswap does anyway: dimension 0."""
    if spec is None:
        return True
    values = spec.values() if isinstance(spec, dict) else spec if isinstance(
        spec, (list, tuple)) else [spec]
    return all(getattr(value, "split_dim", None) == 0 for value in values)


class _OneStage(_PipelineSchedule):
    """A class of one stage a rank: PyTorch names its first argument ``stage``."""

    def __init__(self, stage: StageArgument, n_microbatches: int,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 args_chunk_spec: object = None, kwargs_chunk_spec: object = None,
                 output_merge_spec: object = None, scale_grads: bool = True,
                 **options: Unpack[PipeswapOptions]) -> None:
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

    def __init__(self, stages: StageArgument | Sequence[StageArgument],
                 n_microbatches: int,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 output_merge_spec: object = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False,
                 **options: Unpack[PipeswapOptions]) -> None:
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


# PyTorch's schedule bases are abstract classes: registered with them, pipeswap's classes
# pass isinstance and issubclass as PyTorch's own do, for code that picks a stage layout or
# a code path by class (torchtitan's V-shaped schedules, say)
PipelineScheduleSingle.register(ScheduleGPipe)
PipelineScheduleSingle.register(Schedule1F1B)
PipelineScheduleMulti.register(ScheduleInterleaved1F1B)
PipelineScheduleMulti.register(ScheduleLoopedBFS)
PipelineScheduleMulti.register(ScheduleInterleavedZeroBubble)
PipelineScheduleMulti.register(ScheduleZBVZeroBubble)
PipelineScheduleMulti.register(ScheduleDualPipeV)
