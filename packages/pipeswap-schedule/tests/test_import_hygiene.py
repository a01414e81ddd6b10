"""pipeswap.schedule is pure Python: importing it, or any of its modules, never imports torch;
its modules import each other without a cycle; its public names are what ``__all__`` says."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path


import pipeswap.schedule

# Runs in a fresh interpreter: another test (or a plugin) may already have imported torch here.
_IMPORT_EVERYTHING_WITHOUT_TORCH = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    BLOCKED = ("torch", "torchvision", "torchaudio")
    for name in BLOCKED:
        sys.modules[name] = None  # `import torch` now raises ImportError

    import pipeswap.schedule as package

    modules = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        modules.append(info.name)

    leaked = sorted(
        name for name, module in sys.modules.items()
        if module is not None and name.split(".")[0] in BLOCKED
    )
    assert not leaked, f"torch modules imported: {leaked}"
    print("\\n".join(modules))
    """
)


def test_every_module_imports_with_torch_blocked() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERYTHING_WITHOUT_TORCH],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    imported = proc.stdout.split()
    assert "pipeswap.schedule" in imported
    assert "pipeswap.schedule.cli" in imported, imported


_PACKAGE = "pipeswap.schedule"
_ROOT = Path(pipeswap.schedule.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a subpackage by its ``__init__``)."""
    found = {}
    for path in sorted(_ROOT.rglob("*.py")):
        parts = path.relative_to(_ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((_PACKAGE, *parts))] = path
    return found


def _targets(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The package's modules an import statement loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        assert node.level == 0, "the package uses absolute imports"
        base = node.module or ""
        names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return [name for name in names if name in modules]


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and (
        node.test.id == "TYPE_CHECKING")


def _imports(tree: ast.Module, modules: dict[str, Path]
             ) -> tuple[set[str], list[tuple[int, str]]]:
    """The package's modules imported when the module runs, and those imported inside a
    function or class instead (line, module)."""
    top: set[str] = set()
    nested: list[tuple[int, str]] = []

    def visit(node: ast.AST, inside: bool) -> None:
        if isinstance(node, ast.stmt) and _is_type_checking(node):
            return  # never runs: types only
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(node, modules):
                if inside:
                    nested.append((node.lineno, target))
                else:
                    top.add(target)
        inside = inside or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                             ast.ClassDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return top, nested


def test_no_import_cycle_and_no_import_hidden_in_a_function() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, source in modules.items():
        top, nested = _imports(ast.parse(source.read_text()), modules)
        assert not nested, f"{name} imports {nested} inside a function: import at the top"
        graph[name] = top - {name}
    # depth-first search; a module met again while still on the path closes a cycle
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_public_names_are_sorted_and_public() -> None:
    names = pipeswap.schedule.__all__
    assert names == sorted(names)
    assert [n for n in names if n.startswith("_") and n != "__version__"] == []
    assert all(hasattr(pipeswap.schedule, n) for n in names)
