"""Run by `dev.py test --full` in each package's own Hatch env (only the siblings it
declares installed): every module of the package imports, torch is not installed beside
pipeswap-schedule, and an undeclared sibling is really absent, so a stray import of one
would have failed.

usage: python .ci/isolation_probe.py NAME DECLARED   (DECLARED: siblings, comma-separated,
or - for none)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys

PACKAGES = {"schedule", "platform", "swap", "runtime"}


def main(name: str, declared: set[str]) -> None:
    if os.environ.get("PIPESWAP_EXPECT_NO_TORCH"):  # set in pipeswap-schedule's env
        for absent in ("torch", "numpy"):
            if importlib.util.find_spec(absent) is not None:
                raise SystemExit(f"{absent} is installed in the env of pipeswap-{name}, which "
                                 "must work without it")
    package = importlib.import_module(f"pipeswap.{name}")
    modules = [info.name for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
               if not info.name.endswith(".__main__")]  # that one runs a command
    for module in modules:
        importlib.import_module(module)
    for sibling in sorted(PACKAGES - declared - {name}):
        try:
            importlib.import_module(f"pipeswap.{sibling}")
        except ImportError:
            continue
        raise SystemExit(f"pipeswap.{sibling} is importable in the env of pipeswap-{name}, "
                         "which does not declare it")
    print(f"  pipeswap.{name}: {len(modules) + 1} modules import with "
          f"{', '.join(sorted(declared)) or 'no sibling'} beside it")


if __name__ == "__main__":
    main(sys.argv[1], set(sys.argv[2].split(",")) - {"-"})
