"""Choose a platform by probing what is present; never a device that is not there."""

from __future__ import annotations

from pipeswap.platform.accelerator import AcceleratorPlatform
from pipeswap.platform.cpu import CpuPlatform
from pipeswap.platform.protocol import Platform


class PlatformUnavailableError(RuntimeError):
    """The requested device is not present on this machine."""


def available_platforms() -> list[str]:
    """Device types usable here, the accelerator (if any) first; ``"cpu"`` is always last."""
    import torch

    found = []
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            found.append(accelerator.type)
    return [*found, "cpu"]


def get_platform(name: str | None = None) -> Platform:
    """The platform for ``name`` (``"cpu"``, ``"cuda"``, ...), or the best one present.

    With no name: the machine's accelerator if torch sees one, else the CPU. A name that is
    not present raises :class:`PlatformUnavailableError` listing what is.
    """
    import torch

    available = available_platforms()
    if name is None:
        name = available[0]
    kind, _, index = name.partition(":")
    if kind not in available:
        raise PlatformUnavailableError(
            f"no {name!r} device here; available: {', '.join(available)} "
            "(get_platform() with no name picks the first)")
    if kind == "cpu":
        return CpuPlatform()
    device = torch.device(kind, int(index) if index else torch.accelerator.current_device_index())
    if device.index is not None and device.index >= torch.accelerator.device_count():
        raise PlatformUnavailableError(
            f"no {name!r} device here: {torch.accelerator.device_count()} {kind} device(s)")
    return AcceleratorPlatform(device)
