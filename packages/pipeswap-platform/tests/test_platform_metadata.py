"""pipeswap-platform installs and imports in an env holding only it and its declared dependencies.

Its dependency edges and version ranges are checked with all four packages together in
tests/test_distributions.py.
"""

from __future__ import annotations

from importlib.metadata import distribution

import pipeswap.platform
from pipeswap.platform.__about__ import __version__


def test_installed_distribution_is_this_source_tree() -> None:
    dist = distribution("pipeswap-platform")
    assert dist.metadata["Name"] == "pipeswap-platform"
    assert dist.version == __version__ == pipeswap.platform.__version__
