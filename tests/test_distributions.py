"""The four pipeswap distributions install together and keep their dependency edges."""

from __future__ import annotations

import importlib
import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from types import ModuleType

import pytest

# distribution -> the distributions it may require (docs/development.md, "Installing the packages")
EDGES: dict[str, set[str]] = {
    "pipeswap-schedule": set(),
    "pipeswap-platform": {"torch"},
    "pipeswap-swap": {"torch", "pipeswap-platform"},
    "pipeswap-runtime": {"torch", "numpy", "pipeswap-schedule", "pipeswap-swap",
                         "pipeswap-platform"},
}
PORTIONS = [name.removeprefix("pipeswap-") for name in EDGES]

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _requires(dist: str, extra: str | None = None) -> dict[str, str]:
    """Each Requires-Dist entry of ``dist`` (of its ``extra``, if given), by canonical
    project name, without the marker."""
    found = {}
    for line in distribution(dist).requires or []:
        requirement, _, raw_marker = line.partition(";")
        marker = raw_marker.strip().replace("'", '"') or None
        if marker != (None if extra is None else f'extra == "{extra}"'):
            continue
        match = _NAME.match(requirement)
        assert match is not None, f"{dist}: unparsable Requires-Dist {requirement!r}"
        found[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = requirement
    return found


def _import(portion: str) -> ModuleType:
    return importlib.import_module(f"pipeswap.{portion}")


@pytest.mark.parametrize("dist", EDGES)
def test_distribution_is_installed(dist: str) -> None:
    try:
        installed = distribution(dist)
    except PackageNotFoundError:
        pytest.fail(f"{dist} is not installed in this environment")
    portion = dist.removeprefix("pipeswap-")
    assert installed.version == _import(portion).__version__


@pytest.mark.parametrize("dist", EDGES)
def test_dependency_edges_follow_the_design(dist: str) -> None:
    assert set(_requires(dist)) == EDGES[dist]


def test_the_extras_are_plots_and_hugging_face_models() -> None:
    """The schedule package's [plot] (matplotlib) and the runtime's [hf] (transformers),
    each a plain version range; no other extra."""
    wanted = {"pipeswap-schedule": ("plot", "matplotlib"), "pipeswap-runtime": ("hf",
                                                                             "transformers")}
    for dist in EDGES:
        extras = distribution(dist).metadata.get_all("Provides-Extra") or []
        assert extras == ([wanted[dist][0]] if dist in wanted else []), dist
    for dist, (extra, package) in wanted.items():
        required = _requires(dist, extra)
        assert set(required) == {package}
        assert ">=" in required[package] and "<" in required[package]


@pytest.mark.parametrize("dist", EDGES)
def test_requirements_are_plain_version_ranges(dist: str) -> None:
    for requirement in _requires(dist).values():
        # a sibling by path or URL, an extra or a marker would not install from an index
        assert not any(c in requirement for c in "@;["), requirement
        assert ">=" in requirement and "<" in requirement, (
            f"{dist}: {requirement!r} needs a lower and an upper bound"
        )


def test_pipeswap_is_a_namespace_spanning_all_portions() -> None:
    pipeswap = importlib.import_module("pipeswap")
    # a regular package (some src/pipeswap/__init__.py) would have a file and hide the others
    assert getattr(pipeswap, "__file__", None) is None, pipeswap.__file__
    roots = [Path(entry).resolve() for entry in pipeswap.__path__]
    for root in roots:
        assert not (root / "__init__.py").exists(), f"{root}/__init__.py breaks PEP 420"
    for portion in PORTIONS:
        module = _import(portion)
        assert module.__file__ is not None
        home = Path(module.__file__).resolve().parent.parent
        assert home in roots, f"pipeswap.{portion} comes from {home}, outside {roots}"
        assert (home / portion / "py.typed").is_file(), f"pipeswap.{portion} lacks py.typed"

