"""What the swap manager and the executor need from a device: a typed platform protocol with torch-accelerator and CPU implementations (to come)."""

# torch is imported lazily, inside the functions that need it, never at module level.
from pipeswap.platform.__about__ import __version__

__all__ = ["__version__"]
