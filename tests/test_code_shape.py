"""dev.py's layout phase refuses functions over 80 lines and classes over 300 in the
packages' sources, save those its allow-list names, and refuses an allow-list entry that no
longer names a unit past its limit, so the list can only shrink."""

from __future__ import annotations

from pathlib import Path

from pipeswap_dev_module import dev_module

MODULE = "packages/pipeswap-demo/src/pipeswap/demo/shapes.py"


def _function(name: str, body_lines: int, indent: str = "") -> str:
    """A function of ``body_lines + 1`` lines."""
    return f"{indent}def {name}() -> None:\n" + f"{indent}    pass\n" * body_lines


def _tree(tmp_path: Path, source: str) -> Path:
    module = tmp_path / MODULE
    module.parent.mkdir(parents=True)
    module.write_text(source)
    return tmp_path


def test_functions_and_classes_within_their_limits_pass(tmp_path: Path) -> None:
    source = _function("short", 79) + "class Fits:\n" + _function("method", 79, "    ") * 3
    assert dev_module().code_shape_problems(_tree(tmp_path, source), {}) == []


def test_a_long_function_a_long_method_and_a_long_nested_function_are_refused(
        tmp_path: Path) -> None:
    source = (_function("top", 80)
              + "class Holder:\n" + _function("method", 80, "    ")
              + "def outer() -> None:\n" + _function("inner", 80, "    "))
    problems = dev_module().code_shape_problems(_tree(tmp_path, source), {})
    # outer holds inner, so it is past the limit too
    assert [p.split(":")[2] for p in problems] == ["top", "Holder.method", "outer", "outer.inner"]
    assert f"{MODULE}::top: a function of 81 lines" in problems[0]


def test_a_long_class_is_refused(tmp_path: Path) -> None:
    source = "class Big:\n" + _function("method", 50, "    ") * 6  # 1 + 6 * 51 lines
    problems = dev_module().code_shape_problems(_tree(tmp_path, source), {})
    assert problems == [f"{MODULE}::Big: a class of 307 lines; split it into units of at most "
                        "300"]


def test_an_allow_listed_unit_passes_while_it_is_still_too_long(tmp_path: Path) -> None:
    root = _tree(tmp_path, _function("top", 100))
    assert dev_module().code_shape_problems(root, {f"{MODULE}::top": "being split"}) == []


def test_an_allow_list_entry_fails_once_its_unit_fits_or_is_gone(tmp_path: Path) -> None:
    root = _tree(tmp_path, _function("top", 10))
    allowed = {f"{MODULE}::top": "being split", f"{MODULE}::gone": "being split"}
    assert dev_module().code_shape_problems(root, allowed) == [
        f"LONG_UNITS in dev.py lists {MODULE}::gone, which no longer exists: remove the entry",
        f"LONG_UNITS in dev.py lists {MODULE}::top, which is now within its limit: remove the "
        "entry",
    ]


def test_a_long_module_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path, "x = 1\n" * 601)
    assert dev_module().code_shape_problems(root, {}) == [
        f"{MODULE} has 601 lines; split it by job into modules of at most 600"]
