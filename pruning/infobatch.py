"""InfoBatch (Qin et al., ICLR 2024, arXiv 2303.04947): soft-prune below-mean-loss samples, rescale the rest.

Written from the paper and docs/design.md; nothing is imported or copied from the reference package
(it patches DataLoader internals, reseeds numpy globally and cannot be checkpointed).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import FrozenPlan, Pruner, check_flag, check_range, first_full_pass
from .bitmap import Bitmap


def float32_strictly_below(threshold: float) -> np.float32:
    """The float32 t32 such that, for every float32 s, s < t32 exactly when s < threshold.

    Comparing a float32 table with a python float would round the threshold to float32 (NEP 50)
    and could flip samples that sit at the mean; rounding it up instead keeps the test exact.
    """
    rounded = np.float32(threshold)
    if float(rounded) < threshold:
        rounded = np.nextafter(rounded, np.float32(np.inf))
    return rounded


def smoothed(previous: np.ndarray, seen: np.ndarray, losses: np.ndarray, momentum: float) -> np.ndarray:
    """The new score of each id: its loss on a first visit (or with momentum 0), else
    momentum * previous + (1 - momentum) * loss."""
    if momentum == 0.0:
        return losses
    return np.where(
        seen.astype(bool), np.float32(momentum) * previous + np.float32(1.0 - momentum) * losses, losses
    ).astype(np.float32)


class InfoBatch(Pruner):
    """Score = last loss of each sample; each pass, samples scored below the mean of the seen
    scores are skipped with probability `prune_ratio` and kept ones weighted 1/(1 - prune_ratio)
    (the paper's "prune and rescale": the expected gradient is unchanged; `rescale=False` keeps
    them at weight 1, so skipped samples lose weight); passes from
    ceil(num_passes * delta) on train on full data with weight 1 (the paper's "annealing").
    Unseen samples are never pruned. `momentum` > 0 (ours, not the paper's) scores each sample by an
    average over its visits instead of its last loss, so one noisy mask or timestep weighs less.
    """

    name = "infobatch"

    def __init__(
        self,
        num_samples: int,
        num_passes: int,
        *,
        seed: int = 0,
        prune_ratio: float = 0.5,
        delta: float = 0.875,
        rescale: bool = True,
        momentum: float = 0.0,
    ):
        prune_ratio = check_range("infobatch", "prune_ratio", prune_ratio, 0.0, 1.0, high_open=True)
        delta = check_range("infobatch", "delta", delta, 0.0, 1.0)
        rescale = check_flag("infobatch", "rescale", rescale)
        momentum = check_range("infobatch", "momentum", momentum, 0.0, 1.0, high_open=True)
        super().__init__(
            num_samples, num_passes, seed=seed, prune_ratio=prune_ratio, delta=delta, rescale=rescale, momentum=momentum
        )
        self.prune_ratio, self.rescale, self.momentum = prune_ratio, rescale, momentum
        self.first_full_pass = first_full_pass(self.num_passes, delta)
        # 5 bytes per sample: the last loss, and whether there is one. Zero means "unseen" in both,
        # so np.zeros (calloc) leaves the pages of never-seen ids unallocated.
        self._score = np.zeros(self.num_samples, dtype=np.float32)
        self._seen = np.zeros(self.num_samples, dtype=np.uint8)
        self._threshold: float | None = None  # mean seen score frozen by the last plan()
        self._candidates = 0

    def _record(self, ids: np.ndarray, losses: np.ndarray) -> None:
        self._score[ids] = smoothed(self._score[ids], self._seen[ids], losses, self.momentum)
        self._seen[ids] = 1

    def _freeze(self, pass_index: int) -> FrozenPlan:
        self._threshold, self._candidates = None, 0
        if pass_index >= self.first_full_pass or self.prune_ratio == 0.0:
            return self._full_plan(pass_index)
        seen = self._seen.view(np.bool_)
        num_seen = int(np.count_nonzero(seen))
        if num_seen == 0:
            return self._full_plan(pass_index)
        # unseen entries hold 0.0, so the sum over the whole table is the sum over the seen ones
        self._threshold = float(np.sum(self._score, dtype=np.float64)) / num_seen
        threshold = float32_strictly_below(self._threshold)

        def below(start: int, stop: int) -> np.ndarray:  # unseen samples (score 0.0) are never pruned
            return (self._score[start:stop] < threshold) & seen[start:stop]

        candidates = Bitmap.from_chunks(self.num_samples, below)
        self._candidates = candidates.count()
        return self._candidate_plan(pass_index, 1.0 - self.prune_ratio, candidates, self.rescale)

    def _tables(self) -> dict[str, np.ndarray]:
        return {"score": self._score, "seen": self._seen}

    def _scalars(self) -> dict[str, Any]:
        return {"threshold": self._threshold, "candidates": self._candidates}

    def _load_scalars(self, scalars: dict[str, Any]) -> None:
        self._threshold = None if scalars["threshold"] is None else float(scalars["threshold"])
        self._candidates = int(scalars["candidates"])

    def _extra_stats(self) -> dict[str, Any]:
        return {
            "threshold": self._threshold,
            "below_threshold": self._candidates,
            "annealing": self.pass_index is not None and self.pass_index >= self.first_full_pass,
            "first_full_pass": self.first_full_pass,
        }
