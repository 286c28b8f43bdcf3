"""Scores that measure the sample, not the noise drawn with it: per-sample losses made comparable
across strata before they reach a pruner. A diffusion loss is dominated by the timestep drawn (at
small t the noise is nearly visible, at large t the target is nearly unpredictable), so a sample's
last loss says more about its last timestep than about the sample; an MAE loss depends on whether
the mask hid the image's busy or its flat patches. Dividing by the running mean loss of its stratum
bucket (or taking a z-score within the bucket) leaves what is the sample's.

The statistics are updated from the globally gathered batch, so every rank holds the same ones; the
normaliser is a state object like a pruner. The training loss is never changed here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NORMALISATIONS = ("none", "stratum_mean", "stratum_zscore")
_EPS = 1e-12


class ScoreNormaliser:
    """(losses, strata) of a gathered batch -> scores; `strata` are ints in [0, num_strata)."""

    def __init__(self, kind: str = "none", num_strata: int = 1, *, buckets: int = 20, momentum: float = 0.99):
        if kind not in NORMALISATIONS:
            raise ValueError(f"score.normalise={kind!r} is not accepted; accepted: {', '.join(NORMALISATIONS)}")
        if buckets < 1 or num_strata < 1:
            raise ValueError(f"score.buckets ({buckets}) and the number of strata ({num_strata}) must be >= 1")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"score.momentum must be in [0, 1), got {momentum}")
        self.kind, self.num_strata, self.buckets, self.momentum = kind, int(num_strata), int(buckets), float(momentum)
        self.mean = np.zeros(self.buckets, dtype=np.float64)  # running mean loss per bucket
        self.mean_square = np.zeros(self.buckets, dtype=np.float64)
        self.seen = np.zeros(self.buckets, dtype=np.int64)

    def bucket(self, strata: np.ndarray) -> np.ndarray:
        """Equal-width buckets over [0, num_strata)."""
        strata = np.asarray(strata, dtype=np.int64)
        if len(strata) and (strata.min() < 0 or strata.max() >= self.num_strata):
            raise ValueError(f"stratum {int(strata.max())} is outside 0..{self.num_strata - 1}")
        return np.minimum(strata * self.buckets // self.num_strata, self.buckets - 1)

    def __call__(self, ids: np.ndarray, losses: np.ndarray, strata: np.ndarray | None) -> np.ndarray:
        """Update the bucket statistics with the real, finite samples of this batch, then score it."""
        losses = np.asarray(losses, dtype=np.float32)
        if self.kind == "none":
            return losses
        if strata is None:
            raise ValueError(
                f"score.normalise={self.kind} needs a task that reports strata (ldm: the timestep, "
                f"mae: the share its mask hid); this task reports none: set score.normalise=none"
            )
        buckets = self.bucket(strata)
        usable = (np.asarray(ids) >= 0) & np.isfinite(losses)
        self._update(buckets[usable], losses[usable].astype(np.float64))
        mean = self.mean[buckets]
        if self.kind == "stratum_mean":
            scores = losses / np.maximum(mean, _EPS)
        else:
            std = np.sqrt(np.maximum(self.mean_square[buckets] - mean**2, 0.0))
            scores = (losses - mean) / np.maximum(std, _EPS)
        # non-finite losses stay non-finite, so the pruner refuses and counts them as it does raw ones
        return np.where(np.isfinite(losses), scores, losses).astype(np.float32)

    def _update(self, buckets: np.ndarray, losses: np.ndarray) -> None:
        """Per bucket: the batch's mean folded into an exponential average (the first batch sets it)."""
        for b in np.unique(buckets):
            values = losses[buckets == b]
            first, second = values.mean(), (values**2).mean()
            if self.seen[b] == 0:
                self.mean[b], self.mean_square[b] = first, second
            else:
                keep = self.momentum ** len(values)  # a batch of n samples moves it as n single updates
                self.mean[b] = keep * self.mean[b] + (1 - keep) * first
                self.mean_square[b] = keep * self.mean_square[b] + (1 - keep) * second
            self.seen[b] += len(values)

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {
            "score_normaliser": self.kind,
            "num_strata": self.num_strata,
            "buckets": self.buckets,
            "momentum": self.momentum,
            "mean": torch.from_numpy(self.mean.copy()),
            "mean_square": torch.from_numpy(self.mean_square.copy()),
            "seen": torch.from_numpy(self.seen.copy()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {
            "score_normaliser": self.kind,
            "num_strata": self.num_strata,
            "buckets": self.buckets,
            "momentum": self.momentum,
        }
        differing = [f"{k}: saved {state.get(k)!r}, configured {v!r}" for k, v in mine.items() if state.get(k) != v]
        if differing:
            raise ValueError("score normaliser state does not match the config (" + "; ".join(differing) + ")")
        self.mean[...] = state["mean"].numpy()
        self.mean_square[...] = state["mean_square"].numpy()
        self.seen[...] = state["seen"].numpy()
