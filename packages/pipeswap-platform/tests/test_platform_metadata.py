"""The installed metadata of pipeswap-platform agrees with its source tree and DESIGN.md."""

from __future__ import annotations

import re
from importlib.metadata import distribution

import pipeswap.platform
from pipeswap.platform.__about__ import __version__

DIST = "pipeswap-platform"
# The dependency edges of DESIGN.md: change them there first.
EXPECTED_REQUIRES = {"torch"}

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires() -> dict[str, str]:
    """Each Requires-Dist entry of the installed distribution, by canonical project name."""
    found: dict[str, str] = {}
    for requirement in distribution(DIST).requires or []:
        match = _NAME.match(requirement)
        assert match is not None, f"unparsable Requires-Dist: {requirement!r}"
        found[_canonical(match.group(1))] = requirement
    return found


def test_version_is_the_one_in_about() -> None:
    dist = distribution(DIST)
    assert dist.metadata["Name"] == DIST
    assert dist.version == __version__
    assert pipeswap.platform.__version__ == __version__


def test_requires_exactly_the_declared_dependencies() -> None:
    assert set(_requires()) == EXPECTED_REQUIRES


def test_requirements_are_plain_version_ranges() -> None:
    for requirement in _requires().values():
        # a sibling by path or URL, an extra or a marker would not install from an index
        assert not any(c in requirement for c in "@;["), requirement
        assert ">=" in requirement and "<" in requirement, (
            f"{requirement!r} needs a lower and an upper bound"
        )
