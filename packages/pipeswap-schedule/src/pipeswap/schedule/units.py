"""Sizes and times as people write them (``512MiB``, ``55GB``, ``12ms``), for every command
line that takes one.

Plain functions raising :class:`ValueError`, so that any parser can use them; the
``pipeswap-schedule`` options wrap them as argparse types
(:mod:`pipeswap.schedule.cli.simulate_command`).
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]?)(i?)B?\s*$")
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us)?\s*$")
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_SECONDS = {"s": 1.0, None: 1.0, "ms": 1e-3, "us": 1e-6}

#: The largest byte count :func:`parse_bytes` takes: 1 EiB, beyond any device or host.
MAX_BYTES = 2**60


def parse_size(text: str) -> float:
    """A size or rate: '4GiB' -> 4 * 2**30, '55GB' -> 55e9, '1.5e9' -> 1.5e9. K, M, G and T
    are powers of 1000, Ki, Mi, Gi and Ti powers of 1024; the B is optional."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 1073741824, 1GiB, 512MiB, 55GB)")
    number, prefix, binary = match.groups()
    return float(number) * float((1024 if binary else 1000) ** _POWERS[prefix])


def parse_bytes(text: str) -> int:
    """A byte count written as :func:`parse_size` reads it (``3MiB``, ``55GB``, ``1.5e9``),
    from 0 to :data:`MAX_BYTES`; a fraction of a byte is dropped."""
    value = parse_size(text)
    if not 0 <= value <= MAX_BYTES:
        raise ValueError(f"{text!r} is out of range: give 0 to 2**60 bytes (1 EiB)")
    return int(value)


def parse_time(text: str) -> float:
    """Seconds: '0.012' and '12ms' -> 0.012, '800us' -> 8e-4."""
    match = _TIME.match(text)
    if match is None:
        raise ValueError(f"not a time: {text!r} (examples: 0.012, 12ms, 800us)")
    number, unit = match.groups()
    return float(number) * _SECONDS[unit]
