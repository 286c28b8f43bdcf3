"""Pruners by config name: `pruner: {name: infobatch, prune_ratio: 0.5, delta: 0.875}` -> an instance.

Only names and hyper-parameters are checked here; each pruner checks the values itself.
"""

from __future__ import annotations

from typing import Any

from .base import Pruner
from .dedup import Dedup
from .full import Full
from .importance import Importance
from .infobatch import InfoBatch
from .random_pruner import Random
from .ted import TED

PRUNERS: dict[str, type[Pruner]] = {cls.name: cls for cls in (Full, Random, InfoBatch, TED, Importance, Dedup)}


def hparam_names(cls: type[Pruner]) -> list[str]:
    """The hyper-parameters a pruner accepts: its keyword-only arguments other than `seed`."""
    return list(cls.hparam_defaults())


def build_pruner(name: str, num_samples: int, num_passes: int, seed: int = 0, **hparams: Any) -> Pruner:
    """The pruner called `name` (case-insensitive), or a ValueError naming the accepted values."""
    cls = PRUNERS.get(str(name).lower())
    if cls is None:
        raise ValueError(f"unknown pruner {name!r}; accepted names: {', '.join(sorted(PRUNERS))}")
    accepted = hparam_names(cls)
    unknown = sorted(set(hparams) - set(accepted))
    if unknown:
        raise ValueError(
            f"pruner {cls.name!r} has no hyper-parameter {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(accepted) if accepted else 'none'}"
        )
    return cls(num_samples, num_passes, seed=seed, **hparams)
