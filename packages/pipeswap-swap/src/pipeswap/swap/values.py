"""What the swap manager hands its callers: group states, byte counts, and the errors it raises.

Plain values with no behaviour, apart from the manager so that the group records, the
transfers and the streaming layers can name them without importing the manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class GroupState(Enum):
    COLLECTING = "collecting"
    OFFLOADING = "offloading"
    OFFLOADED = "offloaded"
    LOADING = "loading"
    RESIDENT = "resident"
    DONE = "done"
    ABORTED = "aborted"


class SwapError(RuntimeError):
    """A swap call that is not legal now; the message names the group, its state and the call."""


class SwapResidencyError(SwapError):
    """Backward reached an activation whose storage is not on the device."""


class InPlaceModificationError(SwapError):
    """Backward met a saved activation written in place after autograd saved it (the error
    plain autograd raises there too)."""


@dataclass(frozen=True)
class SwapStats:
    """Byte-exact accounting of what the manager moved and holds."""

    bytes_offloaded: int
    bytes_reloaded: int
    # device bytes of resident storages in live groups that a saved activation still holds (a
    # storage whose saved views autograd has all freed, by a backward or by the input part of
    # a split backward, no longer counts)
    device_bytes_held: int
    peak_device_bytes_held: int
    host_bytes_in_use: int
    host_buffers_allocated: int
    host_bytes_allocated: int
    # of host_bytes_allocated: what SwapManager.reserve_host pinned ahead of the steps
    host_bytes_reserved: int
    skipped: dict[str, int]  # reason -> saved tensors (or storages) left alone
    # device bytes an offload left in place because a tensor or storage object outside
    # autograd's saved activations still referenced their storage (freeing them would break
    # that reference)
    bytes_kept_referenced: int


@dataclass(frozen=True)
class GroupBytes:
    """A group's device bytes: all its saved activations hold (what it adds to
    ``device_bytes_held``), and the part not protected (what moves)."""

    held: int
    movable: int


def check_load_depth(depth: object, layers: int, what: str) -> None:
    """Refuse a load depth (how many layers ahead of a backward loads run) that is not a
    whole number from 1 to ``layers`` (at least 1)."""
    if type(depth) is not int or not 1 <= depth <= max(1, layers):
        raise SwapError(f"{what} is the whole number of layers a load runs ahead of the "
                        f"backward, from 1 to {max(1, layers)}, got {depth!r}")
