"""pipeswap.schedule is pure Python: importing it, or any of its modules, never imports torch;
its public names are what ``__all__`` says. (The import rules every package keeps, no cycle
and no needless import inside a function, are tests/test_import_rules.py's.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap


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


def test_the_public_names_are_sorted_and_public() -> None:
    names = pipeswap.schedule.__all__
    assert names == sorted(names)
    assert [n for n in names if n.startswith("_") and n != "__version__"] == []
    assert all(hasattr(pipeswap.schedule, n) for n in names)
