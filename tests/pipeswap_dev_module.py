"""dev.py loaded as a module, for the tests of its commands and checks (its name is private
to the tests: nothing else imports it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DEV = Path(__file__).resolve().parent.parent / "dev.py"


def dev_module() -> ModuleType:
    """dev.py as a module, loaded once per process."""
    name = "_pipeswap_dev"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DEV)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look themselves up
        spec.loader.exec_module(module)
    return sys.modules[name]
