"""The pruners: per-sample ids and losses in, keep/skip decisions and weights out.

pruning/ never imports a model or opens a file; torch.distributed appears only in sync.py.
"""

from .base import FrozenPlan, Pruner, first_full_pass, rotation_keeps
from .dedup import Dedup
from .full import Full
from .importance import Importance
from .infobatch import InfoBatch
from .random_pruner import Random
from .registry import PRUNERS, build_pruner, hparam_names
from .scores import NORMALISATIONS, ScoreNormaliser
from .splitmix import uniform_coin
from .sync import gather_batch, gather_ids_losses, gather_tensors
from .ted import TED

__all__ = [
    "Pruner",
    "Full",
    "Random",
    "InfoBatch",
    "TED",
    "Importance",
    "Dedup",
    "build_pruner",
    "PRUNERS",
    "hparam_names",
    "gather_ids_losses",
    "gather_batch",
    "gather_tensors",
    "ScoreNormaliser",
    "NORMALISATIONS",
    "uniform_coin",
    "rotation_keeps",
    "first_full_pass",
    "FrozenPlan",
]
