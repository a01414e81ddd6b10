"""The activation swap manager: offload saved activations to host memory, load them back
before backward, and account for every byte.

torch is imported lazily: importing this package is cheap.
"""

from pipeswap.swap.__about__ import __version__
from pipeswap.swap.layer_recompute import recompute_hooks
from pipeswap.swap.layers import LayerChain, find_layers, layer_hooks
from pipeswap.swap.manager import SwapManager
from pipeswap.swap.offload import LayerOffload
from pipeswap.swap.pool import HostBufferPool, PoolExhaustedError, size_class
from pipeswap.swap.values import (
    GroupBytes,
    GroupState,
    InPlaceModificationError,
    SwapError,
    SwapResidencyError,
    SwapStats,
)

__all__ = [
    "GroupBytes",
    "GroupState",
    "HostBufferPool",
    "InPlaceModificationError",
    "LayerChain",
    "LayerOffload",
    "PoolExhaustedError",
    "SwapError",
    "SwapManager",
    "SwapResidencyError",
    "SwapStats",
    "__version__",
    "find_layers",
    "layer_hooks",
    "recompute_hooks",
    "size_class",
]
