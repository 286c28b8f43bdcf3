"""Where the run configs are: the repository's configs/ folder, which a wheel ships as prunepipe/configs/
beside launch/ (package data). A path only: the demo reads its configs there, `prunepipe configs` prints it."""

from __future__ import annotations

import os

# realpath: an editable install reaches this file through src/prunepipe/launch, a link to the repository's
# launch/, and users edit the repository's configs/, not the link beside it
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "configs")
