"""``python -m pipeswap.runtime.train``: the same as ``pipeswap-train`` (and torchrun's way
in: ``torchrun --nproc-per-node 4 -m pipeswap.runtime.train``)."""

import sys

from pipeswap.runtime.train.cli import main

sys.exit(main())
