"""`python -m tools.benchmarks.lossless` = `prunepipe bench lossless`."""

import sys

from tools.benchmarks.lossless.run import main

sys.exit(main())
