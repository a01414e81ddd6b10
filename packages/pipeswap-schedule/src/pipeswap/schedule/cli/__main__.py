"""``python -m pipeswap.schedule.cli``: the ``pipeswap-schedule`` command."""

import sys

from pipeswap.schedule.cli.commands import main

if __name__ == "__main__":  # imported (as every module is by the import checks): no command
    sys.exit(main())
