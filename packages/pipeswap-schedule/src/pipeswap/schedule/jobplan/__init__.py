"""From a model, a cluster and a batch to the fastest configuration that fits
(``pipeswap-schedule plan``): the presets, the memory model, the search and its report."""

from pipeswap.schedule.jobplan.evaluate import Judge, Outcome
from pipeswap.schedule.jobplan.machines import MACHINE_PRESETS, Machine, machine_preset
from pipeswap.schedule.jobplan.memory import Job, MemoryParts
from pipeswap.schedule.jobplan.models import MODEL_PRESETS, ModelShape, from_hf_config, model_preset
from pipeswap.schedule.jobplan.report import as_data, render
from pipeswap.schedule.jobplan.search import NoFit, Plan, best_of_all, plan
from pipeswap.schedule.jobplan.space import Config, SearchSpace

__all__ = ["MACHINE_PRESETS", "MODEL_PRESETS", "Config", "Job", "Judge", "Machine",
           "MemoryParts", "ModelShape", "NoFit", "Outcome", "Plan", "SearchSpace", "as_data",
           "best_of_all", "from_hf_config", "machine_preset", "model_preset", "plan",
           "render"]
