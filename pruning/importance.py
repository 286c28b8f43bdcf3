"""`importance`: this project's pruner (not from a paper). Soft keep probabilities by importance
sampling: the variance-optimal probability of keeping a sample grows with the size of its gradient,
and its loss stands in for that size. Sample i is kept with

    p_i = clip(c * (s_i / mean s) ** alpha, p_min, 1),    weight 1 / p_i,

where s_i is its last score and c is set so that the expected kept fraction meets `keep`. InfoBatch
is the step-function case (one probability below the mean, 1 above); here every sample gets its own.
Unseen samples are kept (p = 1), the last (1 - delta) of the passes train on full data, and with
`rescale` (the default) every sample's expected weight is 1, so the expected gradient is unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import FrozenPlan, Pruner, check_flag, check_range, first_full_pass
from .infobatch import smoothed

_BISECTIONS = 60  # c to float64 precision on [0, hi]


class Importance(Pruner):
    name = "importance"

    def __init__(
        self,
        num_samples: int,
        num_passes: int,
        *,
        seed: int = 0,
        keep: float = 0.7,
        alpha: float = 1.0,
        p_min: float = 0.1,
        delta: float = 0.875,
        rescale: bool = True,
        momentum: float = 0.0,
    ):
        keep = check_range("importance", "keep", keep, 0.0, 1.0, low_open=True)
        alpha = check_range("importance", "alpha", alpha, 0.0, 8.0)
        p_min = check_range("importance", "p_min", p_min, 0.0, 1.0, low_open=True)
        delta = check_range("importance", "delta", delta, 0.0, 1.0)
        rescale = check_flag("importance", "rescale", rescale)
        momentum = check_range("importance", "momentum", momentum, 0.0, 1.0, high_open=True)
        super().__init__(
            num_samples,
            num_passes,
            seed=seed,
            keep=keep,
            alpha=alpha,
            p_min=p_min,
            delta=delta,
            rescale=rescale,
            momentum=momentum,
        )
        self.keep, self.alpha, self.p_min, self.rescale, self.momentum = keep, alpha, p_min, rescale, momentum
        self.first_full_pass = first_full_pass(self.num_passes, delta)
        self._score = np.zeros(self.num_samples, dtype=np.float32)  # last score; 0 and unseen alike until seen
        self._seen = np.zeros(self.num_samples, dtype=np.uint8)
        self._scale = 0.0  # c of the last plan
        self._expected_keep = 1.0

    def _record(self, ids: np.ndarray, losses: np.ndarray) -> None:
        # a size: a negative score (a normalised one) counts as 0; `momentum` averages over visits
        self._score[ids] = smoothed(self._score[ids], self._seen[ids], np.maximum(losses, 0.0), self.momentum)
        self._seen[ids] = 1

    def keep_probabilities(self) -> tuple[np.ndarray, float]:
        """(p float32 [N], c) from the current scores: unseen samples 1, the mean of p as close to `keep`
        as p_min and 1 allow."""
        seen = self._seen.view(np.bool_)
        p = np.ones(self.num_samples, dtype=np.float32)
        num_seen = int(np.count_nonzero(seen))
        if num_seen == 0:
            return p, 0.0
        scores = self._score[seen].astype(np.float64)
        mean = scores.mean()
        ratio = (scores / mean) ** self.alpha if mean > 0 else np.ones_like(scores)
        wanted = self.keep * self.num_samples - (self.num_samples - num_seen)  # kept among the seen

        def kept(c: float) -> float:
            return float(np.clip(c * ratio, self.p_min, 1.0).sum())

        if wanted <= kept(0.0):  # even p_min everywhere keeps more than asked: keep at p_min
            scale = 0.0
        else:
            low, high = 0.0, 1.0
            while kept(high) < min(wanted, num_seen) and high < 1e12:
                high *= 2.0
            for _ in range(_BISECTIONS):
                middle = 0.5 * (low + high)
                low, high = (middle, high) if kept(middle) < wanted else (low, middle)
            scale = high
        p[seen] = np.clip(scale * ratio, self.p_min, 1.0).astype(np.float32)
        return p, scale

    def _freeze(self, pass_index: int) -> FrozenPlan:
        if pass_index >= self.first_full_pass or not self._seen.any():
            self._scale, self._expected_keep = 0.0, 1.0
            return self._full_plan(pass_index)
        p, self._scale = self.keep_probabilities()
        self._expected_keep = float(p.mean(dtype=np.float64))
        return self._per_sample_plan(pass_index, p, self.rescale)

    def _tables(self) -> dict[str, np.ndarray]:
        return {"score": self._score, "seen": self._seen}

    def _scalars(self) -> dict[str, Any]:
        return {"scale": self._scale, "expected_keep": self._expected_keep}

    def _load_scalars(self, scalars: dict[str, Any]) -> None:
        self._scale, self._expected_keep = float(scalars["scale"]), float(scalars["expected_keep"])

    def _extra_stats(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "expected_keep": self._expected_keep,
            "annealing": self.pass_index is not None and self.pass_index >= self.first_full_pass,
        }
