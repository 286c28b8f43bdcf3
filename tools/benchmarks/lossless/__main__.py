"""`python -m prunepipe.tools.benchmarks.lossless` = `prunepipe bench lossless`."""

import sys

from prunepipe.tools.benchmarks.lossless.run import main

sys.exit(main())
