"""`Full`: the full-data baseline through the same code path as the pruners (every weight is 1).

It records nothing and decides nothing; it must stay a pruner so the trainer has one loop.
"""

from __future__ import annotations

from .base import FrozenPlan, Pruner


class Full(Pruner):
    """Keeps every sample with weight 1."""

    name = "full"

    def __init__(self, num_samples: int, num_passes: int, *, seed: int = 0):
        super().__init__(num_samples, num_passes, seed=seed)

    def _freeze(self, pass_index: int) -> FrozenPlan:
        return self._full_plan(pass_index)
