"""The pipeline-parallel executor that runs pipeswap schedules, swap steps included, on torch.distributed (to come)."""

# torch is imported lazily, inside the functions that need it, never at module level.
from pipeswap.runtime.__about__ import __version__

__all__ = ["__version__"]
