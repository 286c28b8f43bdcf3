"""`python -m tools.bench.lossless` = `prunepipe bench lossless`."""

import sys

from tools.bench.lossless.run import main

sys.exit(main())
