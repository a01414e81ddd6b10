"""The import rules of the four packages, read from their sources (nothing is imported):

- no import cycle inside a package, type-only imports (under ``if TYPE_CHECKING:``) counted,
  nor between its folders (each module taken as its folder; a package's top ``__init__``,
  which only gathers the public names, as a node of its own);
- an import inside a function only where it makes something lazy: the module it imports
  loads torch or another heavy optional dependency (:data:`HEAVY`) when imported, worked out
  from the imports each module runs at load, and the importing module has not loaded it
  already;
- a package takes from a sibling only what the sibling's top-level ``__all__`` names;
- at most :data:`ANY_BUDGET` source lines use ``Any``, each saying why in a comment
  ``# Any: <reason>`` on that line.

Each rule is a function over a tree of packages, tested here on small trees that break it and
then applied to the repository.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = frozenset({"torch", "transformers", "matplotlib", "numpy"})  # optional, slow to load
ANY_BUDGET = 16
PACKAGES = ("schedule", "platform", "swap", "runtime")
_ANY_REASON = re.compile(r"#.*\bAny: \S")


@dataclass(frozen=True)
class Import:
    """One import statement: the modules it loads (besides their parents), where it runs,
    and the names a ``from`` import takes."""

    line: int
    targets: tuple[str, ...]
    local: bool  # inside a function: runs when the function is called
    typing_only: bool  # under ``if TYPE_CHECKING:``: never runs
    source: str  # a ``from`` import's module; "" for ``import x``
    names: tuple[str, ...]  # what a ``from`` import takes


@dataclass(frozen=True)
class Module:
    name: str
    package: str  # the distribution's top package, e.g. "pipeswap.swap"
    path: Path
    is_package: bool  # an __init__.py
    imports: tuple[Import, ...]


def _dotted(path: Path, src: Path) -> tuple[str, bool]:
    parts = path.relative_to(src).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, known: set[str]) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.append(Import(node.lineno, tuple(a.name for a in node.names), local,
                                typing_only, "", ()))
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, "pipeswap imports absolutely"
            base, names = node.module, tuple(a.name for a in node.names)
            modules = tuple(f"{base}.{n}" for n in names if f"{base}.{n}" in known)
            # the package itself only where a name is no submodule (else it is a parent)
            wanted = modules if len(modules) == len(names) else (base, *modules)
            found.append(Import(node.lineno, wanted, local, typing_only, base, names))
        guarded = node.body if isinstance(node, ast.If) and _is_type_checking(node.test) else []
        local = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, local, typing_only or child in guarded)

    visit(tree, False, False)
    return found


def read_modules(root: Path) -> dict[str, Module]:
    """Every module under ``root``/packages/*/src by dotted name."""
    paths: dict[str, tuple[Path, str, bool]] = {}
    for package_dir in sorted(root.glob("packages/pipeswap-*")):
        package = "pipeswap." + package_dir.name.removeprefix("pipeswap-")
        for path in sorted((package_dir / "src").rglob("*.py")):
            name, is_package = _dotted(path, package_dir / "src")
            paths[name] = (path, package, is_package)
    known = set(paths)
    return {name: Module(name, package, path, is_package,
                         tuple(_imports(ast.parse(path.read_text()), known)))
            for name, (path, package, is_package) in paths.items()}


def _parents(name: str) -> list[str]:
    """The packages Python imports before ``name`` (``a.b.c``: ``a`` and ``a.b``)."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def loaded_at_import(modules: Mapping[str, Module]) -> dict[str, frozenset[str]]:
    """Per module, every module importing it loads (itself, its parents, what their
    imports that run at load import, transitively through the packages' own modules)."""
    done: dict[str, frozenset[str]] = {}
    for start in modules:
        seen: set[str] = set()
        stack = [start, *_parents(start)]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            module = modules.get(name)
            if module is None:
                continue  # outside the packages: what it loads is its own affair
            for item in module.imports:
                if not item.local and not item.typing_only:
                    for target in item.targets:
                        stack += [target, *_parents(target)]
        done[start] = frozenset(seen)
    return done


def lazy_import_problems(modules: Mapping[str, Module]) -> list[str]:
    """Imports inside functions that make nothing lazy: what they load that the importing
    module has not loaded at import (through its own imports or its packages' ``__init__``)
    holds no heavy dependency."""
    loaded = loaded_at_import(modules)
    problems = []
    for module in modules.values():
        for item in module.imports:
            if not item.local or item.typing_only:
                continue
            brings = set().union(*(loaded.get(t, {t, *_parents(t)}) for t in item.targets))
            new = brings - loaded[module.name]
            where = f"{module.name}:{item.line} imports {', '.join(item.targets)} in a function"
            if not new:
                problems.append(f"{where}, all loaded already when the module is imported: "
                                "import at the top")
            elif not {name.split(".")[0] for name in new} & HEAVY:
                problems.append(f"{where}, which loads no heavy dependency "
                                f"({', '.join(sorted(HEAVY))}): import at the top")
    return problems


def _graph(modules: Mapping[str, Module], package: str,
           node: Callable[[Module], str]) -> dict[str, set[str]]:
    """The package's import graph (type-only imports included, those in functions not),
    each module mapped to ``node(module)``; no self-edges."""
    graph: dict[str, set[str]] = {}
    for module in modules.values():
        if module.package != package:
            continue
        edges = graph.setdefault(node(module), set())
        for item in module.imports:
            if item.local:
                continue
            for target in item.targets:
                if target in modules and modules[target].package == package:
                    edges.add(node(modules[target]))
        edges.discard(node(module))
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected part of ``graph`` with more than one node,
    as the path ``a -> ... -> a``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[list[str]] = []

    def connect(name: str) -> None:  # Tarjan's algorithm
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            if target not in index:
                connect(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == name:
                    break
            if len(part) > 1:
                parts.append(sorted(part))

    for name in sorted(graph):
        if name not in index:
            connect(name)
    return [_cycle_in(graph, set(part), part[0]) for part in parts]


def _cycle_in(graph: Mapping[str, set[str]], part: set[str], start: str) -> list[str]:
    """A shortest cycle from ``start`` back to it inside ``part`` (breadth first)."""
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for name in frontier:
            for target in sorted(graph.get(name, set()) & part):
                if target == start:
                    path = [name]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if target not in came:
                    came[target] = name
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is on no cycle in {sorted(part)}")


def module_cycles(modules: Mapping[str, Module], package: str) -> list[list[str]]:
    return cycles(_graph(modules, package, lambda module: module.name))


def folder_of(module: Module) -> str:
    """The folder a module sits in, as a dotted name; a distribution's top ``__init__`` is
    a node of its own (it gathers the public names from every folder)."""
    if module.is_package:
        return f"{module.name} (__init__)" if module.name == module.package else module.name
    return module.name.rpartition(".")[0]


def folder_cycles(modules: Mapping[str, Module], package: str) -> list[list[str]]:
    return cycles(_graph(modules, package, folder_of))


@cache
def _public_names(init: Path) -> frozenset[str]:
    """What a package's ``__init__`` lists in ``__all__`` (nothing, without one)."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def sibling_import_problems(modules: Mapping[str, Module]) -> list[str]:
    """Imports of a sibling package's module, or of a name its ``__all__`` leaves out."""
    problems = []
    for module in modules.values():
        for item in module.imports:
            for target in (item.source,) if item.source else item.targets:
                sibling = ".".join(target.split(".")[:2])
                if sibling == module.package or sibling not in modules:
                    continue
                where = f"{module.name}:{item.line}"
                if target != sibling:
                    problems.append(f"{where} imports {target}: take what {sibling}.__all__ "
                                    f"names from {sibling} itself")
                    continue
                public = _public_names(modules[sibling].path)
                missing = [name for name in item.names if name not in public]
                if missing:
                    problems.append(f"{where} imports {missing} from {sibling}, whose "
                                    "__all__ does not name them")
    return problems


def any_lines(root: Path) -> tuple[list[str], list[str]]:
    """(every source line using ``Any``, those of them without ``# Any: <reason>``)."""
    used, unexplained = [], []
    for path in sorted(root.glob("packages/*/src/pipeswap/**/*.py")):
        text = path.read_text()
        lines = sorted({node.lineno for node in ast.walk(ast.parse(text))
                        if (isinstance(node, ast.Name) and node.id == "Any")
                        or (isinstance(node, ast.Attribute) and node.attr == "Any")})
        comments = {token.start[0]: token.string
                    for token in tokenize.generate_tokens(io.StringIO(text).readline)
                    if token.type == tokenize.COMMENT}
        source = text.splitlines()
        for line in lines:
            shown = f"{path.relative_to(root)}:{line}: {source[line - 1].strip()}"
            used.append(shown)
            if not _ANY_REASON.search(comments.get(line, "")):
                unexplained.append(shown)
    return used, unexplained


# -- the rules on small trees that break them ------------------------------------------------


def _write(root: Path, files: Mapping[str, str]) -> Path:
    """``files`` by path under packages/ (``demo/x/one.py`` lands in pipeswap-demo's src)."""
    for name, text in files.items():
        package, _, rest = name.partition("/")
        path = root / "packages" / f"pipeswap-{package}" / "src" / "pipeswap" / package / rest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_through_a_type_only_import_is_one(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "demo/__init__.py": "from pipeswap.demo.d import D\n",
        "demo/a.py": "from pipeswap.demo.b import B\n",
        "demo/b.py": "from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from pipeswap.demo.a import A\n",
        "demo/c.py": "def f():\n    from pipeswap.demo.a import A\n",  # runs later: no edge
        "demo/d.py": "from pipeswap.demo import c\n",  # a submodule: no edge to its parent
    })
    assert module_cycles(read_modules(root), "pipeswap.demo") == [
        ["pipeswap.demo.a", "pipeswap.demo.b", "pipeswap.demo.a"]]
    (root / "packages/pipeswap-demo/src/pipeswap/demo/b.py").write_text("B = 1\n")
    assert module_cycles(read_modules(root), "pipeswap.demo") == []


def test_folders_that_import_each_other_are_a_cycle(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "demo/__init__.py": "from pipeswap.demo.x.one import One\n",  # the top gathers
        "demo/errors.py": "",
        "demo/x/__init__.py": "",
        "demo/x/one.py": "import pipeswap.demo.errors\nfrom pipeswap.demo.y.two import Two\n",
        "demo/x/three.py": "",
        "demo/y/__init__.py": "",
        "demo/y/two.py": "from pipeswap.demo.x import three\n",
    })
    modules = read_modules(root)
    assert module_cycles(modules, "pipeswap.demo") == []
    assert folder_cycles(modules, "pipeswap.demo") == [
        ["pipeswap.demo.x", "pipeswap.demo.y", "pipeswap.demo.x"]]
    (root / "packages/pipeswap-demo/src/pipeswap/demo/y/two.py").write_text("")
    assert folder_cycles(read_modules(root), "pipeswap.demo") == []


def test_an_import_in_a_function_must_make_something_heavy_lazy(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "demo/__init__.py": "",
        "demo/heavy.py": "import torch\n\ndef f():\n    import torch\n",
        "demo/light.py": "import json\n",
        "demo/user.py": (
            "import os\n\n"
            "def f():\n"
            "    import torch\n"  # lazy: fine
            "    from pipeswap.demo import heavy\n"  # loads torch: fine
            "    from pipeswap.demo.light import x\n"  # nothing heavy
            "    import os\n"  # loaded already
        ),
    })
    assert lazy_import_problems(read_modules(root)) == [
        "pipeswap.demo.heavy:4 imports torch in a function, all loaded already when the "
        "module is imported: import at the top",
        "pipeswap.demo.user:6 imports pipeswap.demo.light in a function, which loads no heavy "
        "dependency (matplotlib, numpy, torch, transformers): import at the top",
        "pipeswap.demo.user:7 imports os in a function, all loaded already when the module is "
        "imported: import at the top",
    ]


def test_a_sibling_gives_only_what_its_all_names(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "demo/__init__.py": "from pipeswap.demo.inner import Public\n__all__ = ['Public']\n",
        "demo/inner.py": "Public = Hidden = 1\n",
        "user/__init__.py": "",
        "user/own.py": "",
        "user/uses.py": (
            "import pipeswap.demo\n"
            "from pipeswap.demo import Public\n"
            "from pipeswap.user import own\n"
            "from pipeswap.demo import Hidden\n"
            "from pipeswap.demo.inner import Public\n"
            "import pipeswap.demo.inner\n"
        ),
    })
    assert sibling_import_problems(read_modules(root)) == [
        "pipeswap.user.uses:4 imports ['Hidden'] from pipeswap.demo, whose __all__ does not "
        "name them",
        "pipeswap.user.uses:5 imports pipeswap.demo.inner: take what pipeswap.demo.__all__ "
        "names from pipeswap.demo itself",
        "pipeswap.user.uses:6 imports pipeswap.demo.inner: take what pipeswap.demo.__all__ "
        "names from pipeswap.demo itself",
    ]


def test_each_line_using_any_says_why(tmp_path: Path) -> None:
    root = _write(tmp_path, {"demo/a.py": (
        "from typing import Any\n"
        "import typing\n"
        "x: Any = 1  # Any: a reason\n"
        "y: typing.Any = 2\n"
        "z: list[Any] = []  # noqa\n"
    )})
    used, unexplained = any_lines(root)
    where = "packages/pipeswap-demo/src/pipeswap/demo/a.py"
    assert used == [f"{where}:3: x: Any = 1  # Any: a reason", f"{where}:4: y: typing.Any = 2",
                    f"{where}:5: z: list[Any] = []  # noqa"]
    assert unexplained == used[1:]


# -- the repository --------------------------------------------------------------------------


@cache
def _repository() -> dict[str, Module]:
    return read_modules(ROOT)


def test_the_sources_are_read_as_python_loads_them() -> None:
    loaded = loaded_at_import(_repository())
    assert any("torch" in loaded[name] for name in loaded if name.startswith("pipeswap.runtime."))
    assert "torch" not in loaded["pipeswap.schedule.cli"]  # the schedule works without torch
    assert "torch" not in loaded["pipeswap.swap"]  # imports torch lazily, as it says
    assert {"pipeswap.swap.manager", "pipeswap.platform"} <= loaded["pipeswap.swap"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_modules(package: str) -> None:
    found = module_cycles(_repository(), f"pipeswap.{package}")
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_folders(package: str) -> None:
    found = folder_cycles(_repository(), f"pipeswap.{package}")
    assert not found, "folder cycles:\n" + "\n".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_in_functions_make_something_lazy(package: str) -> None:
    problems = [p for p in lazy_import_problems(_repository())
                if p.startswith(f"pipeswap.{package}.") or p.startswith(f"pipeswap.{package}:")]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package", PACKAGES)
def test_siblings_are_used_through_their_public_names(package: str) -> None:
    problems = [p for p in sibling_import_problems(_repository())
                if p.startswith(f"pipeswap.{package}.") or p.startswith(f"pipeswap.{package}:")]
    assert not problems, "\n".join(problems)


def test_any_is_rare_and_explained() -> None:
    used, unexplained = any_lines(ROOT)
    assert len(used) <= ANY_BUDGET, (
        f"{len(used)} source lines use Any, over the budget of {ANY_BUDGET}:\n"
        + "\n".join(used))
    assert not unexplained, "say why in a trailing `# Any: <reason>`:\n" + "\n".join(unexplained)
