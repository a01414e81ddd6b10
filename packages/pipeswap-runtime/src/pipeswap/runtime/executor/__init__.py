"""Running a schedule on this rank: the executor, its set-up, the step interpreter, the
chunk autograd, stages, swap sessions, step reports, FSDP-sharded stages and replay."""

from pipeswap.runtime.executor.interpreter import LossFn
from pipeswap.runtime.executor.pipeline_executor import PipelineExecutor
from pipeswap.runtime.executor.step_report import StepReport

__all__ = ["LossFn", "PipelineExecutor", "StepReport"]
