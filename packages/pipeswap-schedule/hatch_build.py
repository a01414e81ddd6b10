"""The optional compiled build of pipeswap-schedule: its simulator and swap planners
compiled with mypyc from the same source, so they give the same figures, sooner.

Off by default: the package stays pure Python. ``HATCH_BUILD_HOOKS_ENABLE=true pip install
packages/pipeswap-schedule`` (or ``hatch build``) compiles the modules listed under this
hook in pyproject.toml; it needs a C compiler and the Python headers.
"""

from __future__ import annotations

import os
from typing import Any

from hatch_mypyc.plugin import MypycBuildHook


class CompiledBuild(MypycBuildHook):
    """hatch-mypyc, with mypy told where the ``pipeswap`` namespace starts: it has no
    ``__init__.py`` (PEP 420), and the hook hides pyproject.toml's mypy settings while it
    compiles."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        before = os.environ.get("MYPYPATH")
        os.environ["MYPYPATH"] = os.pathsep.join(
            [os.path.join(self.root, "src"), *([before] if before else [])])
        try:
            super().initialize(version, build_data)
        except BaseException:
            self.clean([version])  # what a failed compile left in the source tree
            raise
        finally:
            if before is None:
                del os.environ["MYPYPATH"]
            else:
                os.environ["MYPYPATH"] = before

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        """Leave no compiled module in the source tree once the wheel holds them: an
        editable install of the tree would import them instead of its source."""
        self.clean([version])


def get_build_hook() -> type[CompiledBuild]:
    """This hook, named: the module also holds hatch-mypyc's, which Hatch would otherwise
    find beside it."""
    return CompiledBuild
