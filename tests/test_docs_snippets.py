"""The docs show what their snippets print: README.md and docs/*.md cannot drift from the code.

A fenced block right after an HTML comment marker (invisible on GitHub) is checked:

``<!-- checked -->`` before a ```python block
    The block runs in a fresh interpreter of this environment, with torch made unimportable
    (a checked snippet must not need it). What it prints must be what the docs show: the
    ```text block right after it if there is one, else its ``# -> OUTPUT`` comments, one
    printed line each, in order (no such comment: it prints nothing).
``<!-- checked -->`` before a block of ``$ pipeswap-schedule ...`` commands
    Each command (continued over lines ending in ``\\``) runs through bash with this
    environment's ``pipeswap-schedule`` first on PATH; its standard output and error
    together must be the lines after it, up to the next ``$``. Every command must start
    with ``pipeswap-schedule`` (pipes and redirections are fine).
``<!-- checked file: NAME -->`` before a block
    The block's text is written to NAME, for the commands after it on the same page.
``<!-- unchecked: WHY -->``
    Says why a block that looks checkable (below) is not run.

Each page runs in a temporary directory of its own, its blocks in page order, so a command
can read a file an earlier command of the page wrote. Comparison is line by line, trailing
whitespace and blank lines at either end ignored; as with doctest's ELLIPSIS, a line that
is only ``...`` stands for any number of lines, and ``...`` inside a line for any text.

Not run: snippets that need torch, a GPU, torchrun or several processes (pipeswap-train,
the runtime, swap and platform APIs, the demo and its table), commands of dev.py, pip and
hatch, and fragments that are not whole programs. ``test_every_torch_free_snippet_is_
checked_or_says_why`` makes sure no snippet of the schedule package (a ```python block
importing only ``pipeswap.schedule``, or a ``pipeswap-schedule`` command) goes unmarked.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI = Path(sys.executable).parent / "pipeswap-schedule"

MARKER = re.compile(r"^<!--\s*(checked|unchecked)\b\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")
OUTPUT_COMMENT = re.compile(r"\s#\s->\s(.*)$")
NO_TORCH = "import sys; sys.modules['torch'] = None\n"  # `import torch` raises ImportError
TIMEOUT_S = 60


@dataclass
class Block:
    """One fenced block of a page: where it starts (1-based line of the fence), its info
    string, its lines, and the marker before it (``None``, ``"checked"``, ``"file NAME"``,
    ``"unchecked"``)."""

    page: Path
    line: int
    lang: str
    lines: list[str]
    marker: str | None
    output: Block | None = field(default=None)  # the ```text block a python block prints

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse(page: Path) -> list[Block]:
    """The page's fenced blocks, each with the marker on the line right before its fence;
    a ```text block right after a checked ```python block is that block's output."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            comment = MARKER.match(lines[i])
            if comment is None and lines[i].lstrip().startswith("<!--") and re.search(
                    r"\b(un)?checked\b", lines[i]):
                raise AssertionError(f"{page.name}:{i + 1}: unreadable marker {lines[i]!r}")
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{page.name}:{i + 1}: unclosed fence"
        marker = None
        if i > 0 and (comment := MARKER.match(lines[i - 1])):
            kind, rest = comment.groups()
            if kind == "unchecked":
                assert rest.startswith(":") and rest[1:].strip(), (
                    f"{page.name}:{i}: say why: <!-- unchecked: WHY -->")
                marker = "unchecked"
            elif rest:
                name = re.fullmatch(r"file:\s*(\S+)", rest)
                assert name, f"{page.name}:{i}: unknown marker {lines[i - 1]!r}"
                marker = f"file {name.group(1)}"
            else:
                marker = "checked"
        block = Block(page, i + 1, fence.group(1), lines[i + 1:end], marker)
        previous = blocks[-1] if blocks else None
        if (block.lang == "text" and marker is None and previous is not None
                and previous.marker == "checked" and previous.lang == "python"
                and all(not s.strip() for s in lines[previous.line + len(previous.lines) + 1:i])):
            previous.output = block
        else:
            blocks.append(block)
        i = end + 1
    return blocks


def _normalised(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def matches(expected: list[str], actual: str) -> bool:
    """Whether ``actual`` is ``expected``, line by line, with doctest's ELLIPSIS: a line of
    only ``...`` matches any lines, ``...`` inside a line any text of that line."""
    pattern = ""
    for line in _normalised("\n".join(expected)):
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += "[^\n]*?".join(map(re.escape, line.split("..."))) + r"\n"
    text = "".join(line + "\n" for line in _normalised(actual))
    return re.fullmatch(pattern, text) is not None


def _mismatch(where: str, what: str, expected: list[str], actual: str) -> str:
    diff = difflib.unified_diff(_normalised("\n".join(expected)), _normalised(actual),
                                "the docs show", "it prints", lineterm="")
    return f"{where}: {what}\n" + "\n".join(diff)


def _run_python(block: Block, workdir: Path) -> str | None:
    """Run a checked python block; a mismatch message, or None."""
    code = "\n".join(block.lines)
    if block.output is not None:
        expected = block.output.lines
        assert not OUTPUT_COMMENT.search(code), (
            f"{block.where}: show the output as `# -> ` comments or a ```text block, not both")
    else:
        expected = [m.group(1) for line in block.lines if (m := OUTPUT_COMMENT.search(line))]
    script = workdir / f"{block.page.stem}_{block.line}.py"
    script.write_text(code + "\n")
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH + f"import runpy; runpy.run_path({str(script)!r}, "
         "run_name='__main__')"],
        cwd=workdir, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        return f"{block.where}: the snippet failed (exit {done.returncode}):\n{done.stderr}"
    if not matches(expected, done.stdout):
        return _mismatch(block.where, "the snippet prints something else", expected,
                         done.stdout)
    return None


def commands(block: Block) -> list[tuple[int, str, list[str]]]:
    """A console block's commands: (line, command without ``$ ``, the output lines shown)."""
    found: list[tuple[int, str, list[str]]] = []
    continued = False  # the line before was a command's, ending in a backslash
    for offset, line in enumerate(block.lines):
        if continued:
            found[-1] = (found[-1][0], found[-1][1] + "\n" + line, [])
            continued = line.endswith("\\")
        elif line.startswith("$ "):
            found.append((block.line + 1 + offset, line[2:], []))
            continued = line.endswith("\\")
        else:
            assert found, f"{block.where}: a checked command block starts with `$ `"
            found[-1][2].append(line)
    return found


def _run_commands(block: Block, workdir: Path) -> list[str]:
    """Run a checked block of commands; a message per mismatch."""
    env = dict(os.environ, PATH=f"{CLI.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    failures = []
    for line, command, expected in commands(block):
        where = f"{block.page.relative_to(ROOT)}:{line}"
        assert command.startswith("pipeswap-schedule "), (
            f"{where}: only pipeswap-schedule commands are run: {command!r}")
        done = subprocess.run(["bash", "-c", command], cwd=workdir, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=TIMEOUT_S)
        if not matches(expected, done.stdout):
            failures.append(_mismatch(
                where, f"`{command}` prints something else (exit {done.returncode})",
                expected, done.stdout))
    return failures


def _checkable(block: Block) -> bool:
    """Whether a block looks like a torch-free snippet of the schedule package."""
    text = "\n".join(block.lines)
    if block.lang == "python":
        imports = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", text, re.M)
        return ("pipeswap.schedule" in imports
                and all(not name.startswith(("torch", "pipeswap.")) or name == "pipeswap.schedule"
                        for name in imports))
    command = r"^(\$ )?pipeswap-schedule +(orders|show|validate|simulate|convert|-)"
    return re.search(command, text, re.M) is not None


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_docs_show_what_their_snippets_print(page: Path, tmp_path: Path) -> None:
    assert CLI.exists(), f"no pipeswap-schedule console script next to {sys.executable}"
    failures: list[str] = []
    for block in parse(page):
        if block.marker is None or block.marker == "unchecked":
            continue
        if block.marker.startswith("file "):
            (tmp_path / block.marker[5:]).write_text("\n".join(block.lines) + "\n")
        elif block.lang == "python":
            failure = _run_python(block, tmp_path)
            failures += [failure] if failure else []
        else:
            failures += _run_commands(block, tmp_path)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


def test_every_torch_free_snippet_is_checked_or_says_why() -> None:
    unmarked = [block.where for page in PAGES for block in parse(page)
                if block.marker is None and _checkable(block)]
    assert not unmarked, (
        "these snippets of the schedule package are neither run nor say why: put "
        "<!-- checked --> (or <!-- unchecked: WHY -->) on the line before each: "
        + ", ".join(unmarked))


def test_the_checked_snippets_are_there() -> None:
    """A marker lost in an edit would silently check nothing: count them."""
    checked = {page.name: sum(block.marker == "checked" for block in parse(page))
               for page in PAGES}
    assert checked["README.md"] >= 3 and checked["schedules.md"] >= 7, checked
    assert checked["simulate.md"] >= 3, checked


def test_the_comparison_takes_ellipses_and_can_fail() -> None:
    shown = ["rank 0: 2 of 4", "...", "rank 1: ... swapped", "done"]
    assert matches(shown, "rank 0: 2 of 4  \nx\ny\nrank 1: 2 of 4 chunks swapped\ndone\n\n")
    assert matches(shown, "rank 0: 2 of 4\nrank 1:  swapped\ndone")
    assert not matches(shown, "rank 0: 2 of 4\nrank 1: swapped\ndone\nmore")
    assert not matches(shown, "rank 0: 3 of 4\nrank 1: 2 swapped\ndone")
    assert not matches(["(((0, 1), (0, 3))"], "(((0, 1), (0, 2))")
