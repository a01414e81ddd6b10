"""The ``pipeswap-schedule`` command line (:mod:`~pipeswap.schedule.cli.commands`) and its
``simulate`` command (:mod:`~pipeswap.schedule.cli.simulate_command`).

A folder of its own because it uses the policies (:mod:`pipeswap.schedule.policies`), which
use the modules beside it: the imports between the folders go one way.
"""

from pipeswap.schedule.cli.commands import main

__all__ = ["main"]
