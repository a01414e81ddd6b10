"""Make tests/ importable, so that processes spawned by the end-to-end tests can import the
worker functions in ``pipeswap_e2e_workers`` (spawned children inherit ``sys.path``)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
