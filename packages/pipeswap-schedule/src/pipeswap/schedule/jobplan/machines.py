"""The GPUs a plan is made for: device memory, achieved compute, the host link each way and
whether its two ways run at once, the stage-to-stage link, and the host memory a node shares
among its GPUs. Each figure is a preset's, or the user's where given."""

from __future__ import annotations

from dataclasses import dataclass

from pipeswap.schedule.costs import Link
from pipeswap.schedule.errors import ScheduleError

GIB = 1 << 30


@dataclass(frozen=True)
class Machine:
    """One GPU of a cluster, and its node. ``flops``: dense 16-bit FLOP/s achieved by a
    transformer's matmuls (not the datasheet's peak)."""

    name: str
    memory_bytes: int
    flops: float
    link: Link
    p2p_bandwidth: float
    p2p_latency: float
    host_memory_bytes: int  # per node, shared by its GPUs
    gpus_per_node: int
    source: str = ""

    def __post_init__(self) -> None:
        if self.memory_bytes < 1 or self.host_memory_bytes < 1 or self.gpus_per_node < 1:
            raise ScheduleError(f"machine {self.name}: memory, host memory and GPUs per node "
                                "must be positive")
        if not (self.flops > 0 and self.p2p_bandwidth > 0 and self.p2p_latency >= 0):
            raise ScheduleError(f"machine {self.name}: FLOP/s and bandwidths must be > 0")


_PCIE5 = Link(55e9, 55e9, duplex=True)
_PCIE4 = Link(25e9, 25e9, duplex=True)

MACHINE_PRESETS: dict[str, Machine] = {machine.name: machine for machine in (
    Machine("h100-sxm", 80 * GIB, 450e12, _PCIE5, p2p_bandwidth=360e9, p2p_latency=10e-6,
            host_memory_bytes=2048 * GIB, gpus_per_node=8,
            source="80 GB HBM3; about 45% of 989 TFLOP/s dense bf16; host link PCIe Gen5 x16 "
                   "(55 GB/s measured pinned); NVLink 4 at 80% of 450 GB/s; a DGX H100 node "
                   "(2 TB, 8 GPUs)"),
    Machine("h100-pcie", 80 * GIB, 300e12, _PCIE5, p2p_bandwidth=50e9, p2p_latency=10e-6,
            host_memory_bytes=1024 * GIB, gpus_per_node=8,
            source="80 GB HBM2e; about 40% of 756 TFLOP/s dense bf16; PCIe Gen5 x16 to host "
                   "and between GPUs (no NVSwitch); 1 TB, 8 GPUs a node"),
    Machine("h200", 141 * 10**9, 450e12, _PCIE5, p2p_bandwidth=360e9, p2p_latency=10e-6,
            host_memory_bytes=2048 * GIB, gpus_per_node=8,
            source="141 GB HBM3e; Hopper compute and host link as h100-sxm; an HGX H200 "
                   "node (2 TB, 8 GPUs)"),
    Machine("a100-80gb", 80 * GIB, 150e12, _PCIE4, p2p_bandwidth=240e9, p2p_latency=10e-6,
            host_memory_bytes=1024 * GIB, gpus_per_node=8,
            source="80 GB HBM2e; about 48% of 312 TFLOP/s dense bf16; PCIe Gen4 x16 (25 GB/s "
                   "pinned); NVLink 3 at 80% of 300 GB/s; a DGX A100 node (1 TB, 8 GPUs)"),
    Machine("gh200", 96 * 10**9, 450e12, Link(297e9, 375e9, duplex=True),
            p2p_bandwidth=360e9, p2p_latency=10e-6, host_memory_bytes=480 * 10**9,
            gpus_per_node=1,
            source="96 GB HBM3; Hopper compute; NVLink-C2C to its 480 GB LPDDR5X (297 GB/s "
                   "D2H, 375 GB/s H2D measured); one GPU a node"),
)}


def machine_preset(name: str) -> Machine:
    found = MACHINE_PRESETS.get(name)
    if found is None:
        raise ScheduleError(f"unknown GPU preset {name!r}: choose one of "
                            f"{', '.join(MACHINE_PRESETS)}")
    return found
