"""`Random`: keep each sample with probability `keep`, weight 1/keep (the baseline that tells
selection from mere subsampling). Scores are ignored; the coin of (seed, pass_index, id) is the only input.
"""

from __future__ import annotations

from .base import FrozenPlan, Pruner, check_flag, check_range, first_full_pass


class Random(Pruner):
    """Every sample is a candidate, kept with probability `keep` and then weighted 1/keep.

    `delta` < 1 gives it InfoBatch's annealing (full data from pass ceil(num_passes * delta)),
    for a baseline with the same schedule; the default 1.0 prunes every pass.
    """

    name = "random"

    def __init__(
        self,
        num_samples: int,
        num_passes: int,
        *,
        seed: int = 0,
        keep: float = 0.7,
        delta: float = 1.0,
        rescale: bool = True,
    ):
        keep = check_range("random", "keep", keep, 0.0, 1.0, low_open=True)
        delta = check_range("random", "delta", delta, 0.0, 1.0)
        rescale = check_flag("random", "rescale", rescale)
        super().__init__(num_samples, num_passes, seed=seed, keep=keep, delta=delta, rescale=rescale)
        self.keep, self.rescale = keep, rescale
        self.first_full_pass = first_full_pass(self.num_passes, delta)

    def _freeze(self, pass_index: int) -> FrozenPlan:
        if pass_index >= self.first_full_pass:
            return self._full_plan(pass_index)
        return self._candidate_plan(pass_index, self.keep, None, self.rescale)
