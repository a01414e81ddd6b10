"""The activation swap manager: offload saved activations to host memory and load them back before backward (to come)."""

# torch is imported lazily, inside the functions that need it, never at module level.
from pipeswap.swap.__about__ import __version__

__all__ = ["__version__"]
