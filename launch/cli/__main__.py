"""`python -m prunepipe.launch.cli`, as torchrun and SLURM launch the command line."""

import sys

from prunepipe.launch.cli import main

sys.exit(main())
