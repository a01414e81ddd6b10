"""What the swap manager and the executor need from a device, as a typed protocol.

``get_platform()`` returns the machine's accelerator (through torch's device-generic APIs) or
the CPU platform, whose copy streams are worker threads so that asynchronous ordering bugs
show up without a GPU. torch is imported lazily: importing this package is cheap.
"""

from pipeswap.platform.__about__ import __version__
from pipeswap.platform.probe import PlatformUnavailableError, available_platforms, get_platform
from pipeswap.platform.protocol import AllocationPeak, Event, MemoryStats, Platform, Stream

__all__ = [
    "AllocationPeak",
    "Event",
    "MemoryStats",
    "Platform",
    "PlatformUnavailableError",
    "Stream",
    "__version__",
    "available_platforms",
    "get_platform",
]
