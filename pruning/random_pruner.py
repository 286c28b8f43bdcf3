"""`Random`: keep each sample with probability `keep`, weight 1/keep (the baseline InfoBatch's
reviewers asked for). Scores are ignored; the coin of (seed, epoch, id) is the only input.
"""

from __future__ import annotations

from .base import FrozenPlan, Pruner, check_flag, check_range, first_full_pass


class Random(Pruner):
    """Every sample is a candidate, kept with probability `keep` and then weighted 1/keep.

    `delta` < 1 gives it InfoBatch's annealing (full data from pass ceil(num_epochs * delta)),
    for a baseline with the same schedule; the default 1.0 prunes every pass.
    """

    name = "random"

    def __init__(
        self,
        num_samples: int,
        num_epochs: int,
        *,
        seed: int = 0,
        keep: float = 0.7,
        delta: float = 1.0,
        rescale: bool = True,
    ):
        keep = check_range("random", "keep", keep, 0.0, 1.0, low_open=True)
        delta = check_range("random", "delta", delta, 0.0, 1.0)
        rescale = check_flag("random", "rescale", rescale)
        super().__init__(num_samples, num_epochs, seed=seed, keep=keep, delta=delta, rescale=rescale)
        self.keep, self.rescale = keep, rescale
        self.first_full_pass = first_full_pass(self.num_epochs, delta)

    def _freeze(self, epoch: int) -> FrozenPlan:
        if epoch >= self.first_full_pass:
            return self._full_plan(epoch)
        return self._candidate_plan(epoch, self.keep, None, self.rescale)
