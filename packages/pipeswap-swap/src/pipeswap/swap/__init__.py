"""The activation swap manager: offload saved activations to host memory, load them back
before backward, and account for every byte.

torch is imported lazily: importing this package is cheap.
"""

from pipeswap.swap.__about__ import __version__
from pipeswap.swap.manager import (
    GroupBytes,
    GroupState,
    InPlaceModificationError,
    SwapError,
    SwapManager,
    SwapResidencyError,
    SwapStats,
)
from pipeswap.swap.layers import LayerChain, find_layers
from pipeswap.swap.offload import LayerOffload
from pipeswap.swap.pool import HostBufferPool, PoolExhaustedError

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
]
