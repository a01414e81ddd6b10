"""The FSDP steps of a schedule, run on PyTorch's FSDP2 (``fully_shard``) modules.

A stage whose module (or some of its submodules) was sharded with ``fully_shard`` keeps its
parameters sharded over the data-parallel group, and the schedule says when they are gathered:
UNSHARD all-gathers every FSDP module of the stage, RESHARD frees the gathered copies, and
REDUCE_GRAD reduce-scatters the gradients the stage's microbatches accumulated. Nothing else
may gather or free them, so :class:`ShardedStage` turns FSDP's own timing off: no reshard
after a forward or a backward, no gradient reduction after each backward. Its implicit
prefetches then find every module already gathered and do nothing; a compute that finds its
stage sharded is refused rather than letting FSDP gather behind the schedule's back.

FSDP2 has no public call that reduces the gradients accumulated over several backwards at a
chosen moment, so :meth:`ShardedStage.reduce_grad` does what PyTorch's own pipelining does
for its REDUCE_GRAD action: it turns gradient sync back on and runs each parameter group's
post-backward and the root's end-of-backward callback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from pipeswap.runtime.errors import PipelineSetupError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, UnshardHandle

    class Sharded(torch.nn.Module, FSDPModule):
        """A module ``fully_shard`` sharded: FSDP2 gives it a class of its own that derives
        from FSDPModule and the module's class."""


def fsdp_modules(module: torch.nn.Module) -> list[Sharded]:
    """The FSDP2 modules in ``module`` (itself included), outermost first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing can be sharded
        return []
    return cast("list[Sharded]", [m for m in module.modules() if isinstance(m, FSDPModule)])


def shard_stage(module: torch.nn.Module, mesh: DeviceMesh,
                blocks: Sequence[torch.nn.Module] = ()) -> torch.nn.Module:
    """Shard a stage's parameters over the data-parallel ``mesh`` (a 1-D DeviceMesh) with
    ``fully_shard``: each of ``blocks`` on its own (it then all-gathers apart from the rest)
    and ``module`` as the root that holds the rest. Returns ``module``, now an FSDP module;
    build the optimizer after this, on its (sharded) parameters."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    return module


class ShardedStage:
    """One stage's FSDP modules, gathered, freed and reduced where the schedule says."""

    def __init__(self, stage_index: int, module: torch.nn.Module,
                 dp_group: dist.ProcessGroup | None) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        self.stage_index = stage_index
        self.modules = fsdp_modules(module)
        if not self.modules:
            raise PipelineSetupError(f"stage {stage_index} has no module sharded with "
                                     "fully_shard")
        if self.modules[0] is not module:
            raise PipelineSetupError(
                f"stage {stage_index}'s module itself is not sharded, only parts of it: apply "
                "fully_shard to the stage's module last "
                "(pipeswap.runtime.executor.sharded_stage.shard_stage does), so that it is the "
                "FSDP root that holds the rest")
        self.root = self.modules[0]  # module itself
        params = [p for m in self.modules for p in m.parameters(recurse=False)]
        # what UNSHARD gathers: every parameter at its full size (FSDP2 keeps each one a
        # DTensor sharded on dim 0 while sharded, and numel() is the global count)
        self.gathered_bytes = sum(p.numel() * p.element_size() for p in module.parameters()
                                  if isinstance(p, DTensor))
        if dp_group is not None:
            wanted = dist.get_process_group_ranks(dp_group)
            for p in params:
                if isinstance(p, DTensor):
                    got = dist.get_process_group_ranks(p.device_mesh.get_group(0))
                    if got != wanted:
                        raise PipelineSetupError(
                            f"stage {stage_index}'s parameters are sharded over ranks {got}, "
                            f"but the data-parallel group is ranks {wanted}: shard each "
                            "stage over the mesh's 'dp' dimension (mesh['dp'])")
                    break
        self._pending: list[UnshardHandle] = []  # unshard handles not yet waited for
        self.gathered = False
        self.prepare()

    def prepare(self) -> None:
        """Leave every gather, free and reduction to the schedule's steps."""
        for m in self.modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.set_requires_gradient_sync(False, recurse=False)
        self.root.set_is_last_backward(False)

    def unshard(self) -> None:
        """UNSHARD: start the all-gathers (waited for by the stage's next compute)."""
        # with async_op, FSDP returns a handle for every module
        self._pending = [handle for m in self.modules
                         if (handle := m.unshard(async_op=True)) is not None]
        self.gathered = True

    def ready(self, at: object) -> bool:
        """Before a compute of the stage: its gathers are done, or the schedule forgot one.
        True when this call waited for them (the stage was just gathered)."""
        if not self.gathered:
            raise PipelineSetupError(
                f"{at}: stage {self.stage_index}'s parameters are sharded; the schedule must "
                "UNSHARD a stage before it computes (build it with fsdp=True)")
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()
        return bool(pending)

    def reshard(self) -> None:
        """RESHARD: free the gathered parameters."""
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()
        for m in self.modules:
            m.reshard()
        self.gathered = False

    def reduce_grad(self) -> None:
        """REDUCE_GRAD: reduce-scatter the gradients accumulated since the last one into the
        sharded parameters' ``.grad`` (averaged over the data-parallel group, as FSDP does)."""
        for m in self.modules:
            m.set_requires_gradient_sync(True, recurse=False)
        self.root.set_is_last_backward(True)
        try:
            state = self.root._get_fsdp_state()
            for each in state._state_ctx.all_states:
                for group in each._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        finally:
            self.prepare()

    def reset(self) -> None:
        """After a failed step: FSDP drops what the step left in flight and reshards."""
        self._pending = []
        self.gathered = False
        reset = getattr(self.root, "reset_iter_state", None)
        if reset is not None:
            reset()
        for m in self.modules:
            m.reshard()
        self.prepare()
