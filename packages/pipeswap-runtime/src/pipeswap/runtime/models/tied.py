"""Parameters shared by two stages (a tied input and output embedding) across ranks.

Split on one process, the first and the last stage hold the same parameter object, and
autograd sums both uses into one ``.grad``. Across ranks each holds a copy, and each
computes only its own use's gradient: :class:`TiedGradients` sums them, after a step's
backward and before the optimizer, so both copies get the same gradient and, from the same
weights and optimizer, stay equal. Where both stages run on one rank (a V-shaped schedule)
the object is still shared and nothing needs summing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeswap.runtime.distributed.process_groups import group_timeout
from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.models.llama import TiedParameter

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from pipeswap.runtime.executor.stage import PipelineStage


class TiedGradients:
    """Sums the gradients of the ``tied`` parameters (found with
    :func:`pipeswap.runtime.models.llama.tied_parameter_names` on the whole model's stages) between
    the ranks of ``stage_ranks`` that hold them. Collective when built: every rank of the
    pipeline builds it, with the same ``tied`` (each pair of ranks gets a group of its own,
    made by the pair alone where the pipeline is one replica of several); ``group`` is the
    pipeline's process group (None: the default group)."""

    def __init__(self, stages: Sequence[PipelineStage], stage_ranks: Sequence[int],
                 tied: Sequence[TiedParameter], group: dist.ProcessGroup | None = None
                 ) -> None:
        import torch.distributed as dist

        mine = {stage.stage_index: stage for stage in stages}
        pipeline = dist.get_world_size(group) if group is not None else dist.get_world_size()
        alone = pipeline != dist.get_world_size()  # other replicas make their own groups
        self._pairs: list[tuple[torch.Tensor, dist.ProcessGroup]] = []
        for pair in tied:
            ranks = sorted({stage_ranks[pair.stage], stage_ranks[pair.other_stage]})
            if len(ranks) == 1:
                continue  # one rank holds both: one parameter object, one gradient
            global_ranks = [r if group is None else dist.get_global_rank(group, r)
                            for r in ranks]
            if alone and dist.get_rank() not in global_ranks:
                continue
            pair_group = dist.new_group(global_ranks, timeout=group_timeout(group),
                                         use_local_synchronization=alone)
            for index, name in ((pair.stage, pair.name), (pair.other_stage, pair.other_name)):
                if index in mine:
                    parameters = dict(mine[index].module.named_parameters())
                    if name not in parameters:
                        raise PipelineSetupError(
                            f"stage {index} has no parameter {name!r} to tie: find the tied "
                            "parameters on the stages this job builds")
                    self._pairs.append((parameters[name], pair_group))

    def sum_gradients(self) -> None:
        """Add the other rank's gradient of each tied parameter to this rank's (no gradient
        on one side counts as zero)."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for parameter, group in self._pairs:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            grad = parameter.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)
