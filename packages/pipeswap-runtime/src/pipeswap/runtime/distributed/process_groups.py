"""The process groups pipeswap makes next to the caller's, and what it reads of a group.

pipeswap's control traffic (the set-up's agreements, the shape exchange, the end-of-step
agreement, the failure protocol's broken links) is small CPU tensors. A group made by plain
``init_process_group("nccl")``, as a torchrun script writes it, has no CPU backend; where the
caller's group lacks one, pipeswap makes a gloo group over the same ranks for that traffic,
and the transport's own group gets gloo for the CPU next to the caller's backend for the
device (:func:`with_cpu_backend`).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING

from pipeswap.runtime.errors import PipelineSetupError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    import torch.distributed as dist

    return group if group is not None else dist.distributed_c10d._get_default_group()


def device_types(group: dist.ProcessGroup | None) -> list[str]:
    """The device types ``group`` has a backend for (``["cuda"]`` for plain NCCL)."""
    return [device.type for device in _group(group)._device_types]


def has_cpu_backend(group: dist.ProcessGroup | None) -> bool:
    return "cpu" in device_types(group)


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta:
    """The timeout ``group`` was created with (torch's default where it does not say)."""
    import torch
    import torch.distributed as dist

    pg = _group(group)
    for kind in device_types(pg):
        try:
            timeout: datetime.timedelta = pg._get_backend(torch.device(kind)).options._timeout
            return timeout
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout


def with_cpu_backend(group: dist.ProcessGroup | None) -> str:
    """``group``'s backend configuration with gloo for CPU tensors where it has no CPU
    backend: ``"cuda:nccl"`` (plain NCCL) gives ``"cuda:nccl,cpu:gloo"``."""
    import torch.distributed as dist

    config = str(dist.get_backend_config(_group(group)))
    pairs = dict(item.split(":", 1) for item in config.split(",") if ":" in item)
    if not pairs:  # a backend of one name for every device it has
        pairs = dict.fromkeys(device_types(group), config)
    pairs.setdefault("cpu", "gloo")
    return ",".join(f"{kind}:{name}" for kind, name in pairs.items())


def control_group(group: dist.ProcessGroup | None, *, local: bool
                  ) -> dist.ProcessGroup | None:
    """A group over ``group``'s ranks that takes CPU tensors: ``group`` itself when it
    can, else a new gloo group with its timeout. ``local``: only ``group``'s ranks make it
    (``use_local_synchronization``); otherwise every rank of the world must call this in the
    same order, as every rank builds an executor over a group that spans the world."""
    import torch.distributed as dist

    if has_cpu_backend(group):
        return group
    ranks = dist.get_process_group_ranks(_group(group))
    made: dist.ProcessGroup = dist.new_group(
        ranks, timeout=group_timeout(group), backend="gloo", use_local_synchronization=local)
    return made


def only_gloo(config: str) -> bool:
    """Whether a backend configuration (``"cpu:gloo,cuda:nccl"``) runs gloo alone, whose
    operations fail by themselves when a peer breaks its connections."""
    return {item.split(":", 1)[-1] for item in config.split(",")} == {"gloo"}


def operation_timeout(detection: datetime.timedelta) -> datetime.timedelta:
    """The per-operation timeout of a group whose failed peers a watch finds in
    ``detection`` (:mod:`pipeswap.runtime.distributed.peer_watch`): long, on every backend.
    A stopped or vanished peer is found by its silence and the group stopped; a peer that
    is slow but alive still beats, and an operation waiting for it must not fail (NCCL's
    watchdog would kill the rank, gloo would raise and blame the healthy neighbour)."""
    return max(10 * detection, datetime.timedelta(minutes=30))


def bound_cpu_half(group: dist.ProcessGroup | None, timeout: datetime.timedelta) -> None:
    """Give ``group``'s gloo backend for CPU tensors ``timeout`` where the group also has
    another backend (``cpu:gloo,cuda:nccl``), whose long timeout it shared: the CPU half
    carries the waits outside a step (the set-up's agreements, a checkpoint's), which no
    watch bounds."""
    import torch
    import torch.distributed as dist

    config = str(dist.get_backend_config(_group(group)))
    if only_gloo(config) or "cpu" not in device_types(group):
        return
    backend = _group(group)._get_backend(torch.device("cpu"))
    backend._set_default_timeout(timeout)


def transport_group(group: dist.ProcessGroup | None, device: torch.device, *, local: bool,
                    timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """The transport's own group over ``group``'s ranks: ``group``'s backends and timeout
    (or ``timeout``), gloo for CPU where ``group`` has none, and on an accelerator its
    communicator created now (``device_id``), so that a first batch of point-to-point
    operations need not involve every rank of the group."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(_group(group))
    made: dist.ProcessGroup = dist.new_group(
        ranks, timeout=timeout or group_timeout(group), backend=with_cpu_backend(group),
        use_local_synchronization=local,
        device_id=device if device.type != "cpu" else None)
    return made


def data_parallel_group(mesh: DeviceMesh | None, dp_group: dist.ProcessGroup | None,
                        group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The data-parallel group, from ``mesh`` or as given; the stages' ``group`` must be
    the mesh's pipeline group."""
    import torch.distributed as dist

    if mesh is None:
        return dp_group
    if dp_group is not None:
        raise PipelineSetupError("give DataParallel a mesh or a group, not both (the mesh "
                                 "holds the data-parallel group)")
    names = mesh.mesh_dim_names or ()
    if mesh.ndim != 2 or set(names) != {"pp", "dp"}:
        raise PipelineSetupError(
            f"mesh has dimensions {names or mesh.ndim}; the executor needs a 2-D mesh "
            "named ('pp', 'dp'), e.g. pipeswap.runtime.pipeline_mesh(device, ranks, dp, "
            "timeout_s)")
    pipeline = dist.get_process_group_ranks(mesh.get_group("pp"))
    ours = (list(range(dist.get_world_size())) if group is None
            else dist.get_process_group_ranks(group))
    if ours != pipeline:
        raise PipelineSetupError(
            f"the stages' group has ranks {ours} but the mesh's pipeline group is "
            f"{pipeline}: build each PipelineStage with group=mesh.get_group('pp')")
    return mesh.get_group("dp")


def control_groups(group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
                   dp_size: int, *, spans_world: bool, replayed: bool
                   ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """The groups of the pipeline's and the data-parallel replicas' control traffic (CPU
    tensors): the caller's own, or gloo groups over their ranks where they have no CPU
    backend (plain NCCL); see :mod:`pipeswap.runtime.distributed.process_groups`."""
    if replayed:
        return group, dp_group
    control = control_group(group, local=not spans_world)
    if dp_size == 1:
        return control, dp_group
    return control, control_group(dp_group, local=True)


def free_groups(groups: Sequence[dist.ProcessGroup | None], *, spans_world: bool) -> None:
    """Free the groups with an accelerator backend that an executor made, once it is done
    with them (each NCCL communicator holds device memory): destroyed where they span the
    world; otherwise shut down (their work finished, their communicators freed), the group
    kept, as destroying it would let a new group repeat a live group's name (see
    :func:`new_transport`). gloo's are left: they hold no device memory, and torch warns as
    it destroys one made with a backend per device."""
    import torch.distributed as dist

    for group in groups:
        if group is None or only_gloo(str(dist.get_backend_config(group))):
            continue
        with suppress(Exception):  # already broken by a failure: nothing left to free
            if spans_world:
                dist.destroy_process_group(group)
            else:
                group.shutdown()
