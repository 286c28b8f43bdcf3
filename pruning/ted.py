"""TED (Xiao, Li, Nie, ECAI 2024, arXiv 2405.03228): prune the samples the model learns through the others.

The paper has no public code; this is our reading of it (docs/pruning.md lists every
interpretation). Like every pruner it only sees ids, losses and learning rates.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import FrozenPlan, Pruner, check_flag, check_range, first_full_pass
from .bitmap import Bitmap
from .splitmix import uniform_coin

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_TIE_BREAK_SALT = 0x7ED_71E5  # a coin stream of its own for breaking score ties in plan()

UNSEEN, SEEN_ONCE, SCORED = 0, 1, 2  # values of the per-sample `visits` table
_CHUNK = 1 << 20  # samples per step of plan(): its temporaries stay a few MB at any table size


def _to_key(scores: np.ndarray) -> np.ndarray:
    """float32 -> uint32 in the same order (negative floats: all bits flipped; others: the sign bit)."""
    bits = scores.view(np.uint32)
    return bits ^ np.where(bits >> np.uint32(31), np.uint32(0xFFFFFFFF), np.uint32(0x80000000))


def _from_key(key: np.uint32) -> np.float32:
    bits = key ^ (np.uint32(0x80000000) if key >> np.uint32(31) else np.uint32(0xFFFFFFFF))
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


class TED(Pruner):
    """Internal generalization (IG) score, progressive kept fraction, exploration, unbiased weights.

    Score. By a first-order Taylor expansion, a sample's loss change between two visits is the
    inner product of its gradient with the parameter updates in between, i.e. with the sum of
    lr_t * d_t over those steps. Dividing the loss drop by the learning-rate mass sum(lr_t) gives
    a rate that does not depend on the schedule; its EMA over visits (`momentum`) is the score.
    A high score means the loss falls fast while the model trains on other data: the sample is
    learned through the others (high IG) and is pruned first. A sample needs two visits to be
    scored; unscored samples are never pruned.

    Between visits. A sample is visited at most once per pass, so between two visits lie one
    update that contains it and about a pass of updates that do not. Visits in consecutive passes
    can also fall a few steps apart (late in one pass, early in the next); over so little mass the
    loss noise swamps the rate, so a visit less than `min_span` passes' worth of learning-rate
    mass after the last measured one is not a measurement and leaves that anchor in place. A pruned
    sample is not visited at all: it is re-measured only when the exploration slice re-admits it,
    and that measurement spans every pass it sat out, which is IG in its purest form.

    Plan of pass `pass_index`. The kept fraction falls linearly from 1.0 at pass 0 to `target` at pass
    `ramp * num_passes`. The `m` highest-scored samples form the pruned set, with m chosen so the
    expected kept fraction is that target; each of them is still kept with probability `explore`
    (the exploration slice, re-measured and re-ranked) and then weighted 1/explore, so every
    sample's expected weight is 1 and the expected gradient equals the full-data one. From pass
    ceil(num_passes * delta) on, training uses full data with weight 1, as in InfoBatch.
    """

    name = "ted"

    def __init__(
        self,
        num_samples: int,
        num_passes: int,
        *,
        seed: int = 0,
        target: float = 0.7,
        ramp: float = 0.25,
        explore: float = 0.1,
        momentum: float = 0.5,
        min_span: float = 0.5,
        delta: float = 0.875,
        rescale: bool = True,
    ):
        target = check_range("ted", "target", target, 0.0, 1.0, low_open=True)
        rescale = check_flag("ted", "rescale", rescale)
        ramp = check_range("ted", "ramp", ramp, 0.0, 1.0)
        explore = check_range("ted", "explore", explore, 0.0, 1.0, low_open=True)
        momentum = check_range("ted", "momentum", momentum, 0.0, 1.0, high_open=True)
        min_span = check_range("ted", "min_span", min_span, 0.0, 1.0)
        delta = check_range("ted", "delta", delta, 0.0, 1.0)
        super().__init__(
            num_samples,
            num_passes,
            seed=seed,
            target=target,
            ramp=ramp,
            explore=explore,
            momentum=momentum,
            min_span=min_span,
            delta=delta,
            rescale=rescale,
        )
        self.target, self.ramp, self.explore, self.momentum = target, ramp, explore, momentum
        self.rescale = rescale
        self.min_span = min_span
        self.first_full_pass = first_full_pass(self.num_passes, delta)
        # 13 bytes per sample (+1 for the frozen plan); zero means "nothing yet" in every table,
        # so np.zeros (calloc) leaves never-seen ids unallocated.
        self._score = np.zeros(self.num_samples, dtype=np.float32)  # EMA of loss drop per unit lr mass
        self._last_loss = np.zeros(self.num_samples, dtype=np.float32)
        self._lr_mass_at_visit = np.zeros(self.num_samples, dtype=np.float32)
        self._visits = np.zeros(self.num_samples, dtype=np.uint8)  # UNSEEN, SEEN_ONCE or SCORED
        self._lr_mass = 0.0  # sum of the learning rates of all optimizer steps so far
        self._steps = 0
        self._lr_mass_at_plan = 0.0  # lr mass when the current pass was planned
        self._pass_lr_mass = 0.0  # lr mass of the last completed pass: the unit of `min_span`
        self._score_threshold: float | None = None  # lowest score in the pruned set of the plan
        self._pruned_set = 0
        self._scored_at_plan = 0

    # -- the schedule ----------------------------------------------------------------------------

    def kept_fraction_target(self, pass_index: int) -> float:
        """The expected kept fraction of pass `pass_index`: 1.0 -> target over the ramp, 1.0 when annealing."""
        if pass_index >= self.first_full_pass:
            return 1.0
        ramp_passes = self.ramp * self.num_passes
        progress = 1.0 if ramp_passes == 0 else min(1.0, pass_index / ramp_passes)
        return 1.0 - (1.0 - self.target) * progress

    # -- recording -------------------------------------------------------------------------------

    def on_step(self, lr: float) -> None:
        lr = float(lr)
        if not np.isfinite(lr) or lr < 0:
            raise ValueError(f"ted: on_step(lr) needs a finite learning rate >= 0, got {lr}")
        self._lr_mass += lr
        self._steps += 1

    def _record(self, ids: np.ndarray, losses: np.ndarray) -> None:
        visits = self._visits[ids]
        # both masses rounded to float32, so no step in between gives exactly zero mass
        lr_mass_now = np.float32(self._lr_mass)
        elapsed = float(lr_mass_now) - self._lr_mass_at_visit[ids].astype(np.float64)
        measurable = (visits != UNSEEN) & (elapsed > 0) & (elapsed >= self.min_span * self._pass_lr_mass)
        if measurable.any():
            measured = ids[measurable]
            drop = self._last_loss[measured].astype(np.float64) - losses[measurable]
            rate = np.clip(drop / elapsed[measurable], -_FLOAT32_MAX, _FLOAT32_MAX)
            smoothed = self.momentum * self._score[measured] + (1.0 - self.momentum) * rate
            self._score[measured] = np.where(visits[measurable] == SCORED, smoothed, rate)
            self._visits[measured] = SCORED
        first_visit = visits == UNSEEN
        self._visits[ids[first_visit]] = SEEN_ONCE
        anchored = measurable | first_visit  # a visit too soon after the anchor keeps the anchor
        self._last_loss[ids[anchored]] = losses[anchored]
        self._lr_mass_at_visit[ids[anchored]] = lr_mass_now

    # -- planning --------------------------------------------------------------------------------

    def _freeze(self, pass_index: int) -> FrozenPlan:
        if pass_index != self.pass_index:  # a new pass begins; re-planning the same pass changes nothing here
            self._pass_lr_mass = self._lr_mass - self._lr_mass_at_plan
            self._lr_mass_at_plan = self._lr_mass
        self._score_threshold, self._pruned_set, self._scored_at_plan = None, 0, 0
        kept_target = self.kept_fraction_target(pass_index)
        if kept_target >= 1.0 or self.explore >= 1.0:
            return self._full_plan(pass_index)
        if self._recorded_losses and not self._steps:
            raise RuntimeError(
                "ted: losses were recorded but on_step(lr) was never called; TED normalises loss "
                "drops by the learning-rate mass, so call pruner.on_step(lr) after every optimizer step"
            )
        num_scored = sum(int(np.count_nonzero(mask)) for _, _, mask in self._scored_chunks())
        self._scored_at_plan = num_scored
        # expected kept = N - (1 - explore) * m  ==  kept_target * N
        wanted = round((1.0 - kept_target) * self.num_samples / (1.0 - self.explore))
        pruned_set_size = min(num_scored, wanted)
        if pruned_set_size == 0:
            return self._full_plan(pass_index)
        pruned_set = self._highest_scores(num_scored, pruned_set_size, pass_index)
        self._pruned_set = pruned_set_size
        return self._candidate_plan(pass_index, self.explore, pruned_set, self.rescale)

    def _scored_chunks(self):
        """(start, scores of the chunk, scored mask of the chunk) over the table, a chunk at a time."""
        for start in range(0, self.num_samples, _CHUNK):
            yield start, self._score[start : start + _CHUNK], self._visits[start : start + _CHUNK] == SCORED

    def _highest_scores(self, num_scored: int, count: int, pass_index: int) -> Bitmap:
        """The `count` scored samples with the highest scores; ties broken by a coin, not by id."""
        lowest_pruned_score = self._scored_quantile(num_scored - count)
        self._score_threshold = float(lowest_pruned_score)
        selected = Bitmap.from_chunks(
            self.num_samples,
            lambda start, stop: (self._score[start:stop] > lowest_pruned_score) & (self._visits[start:stop] == SCORED),
        )
        missing = count - selected.count()
        if missing > 0:
            tied = np.concatenate(
                [
                    start + np.flatnonzero(mask & (scores == lowest_pruned_score))
                    for start, scores, mask in self._scored_chunks()
                ]
            )
            coin = uniform_coin(self.seed ^ _TIE_BREAK_SALT, pass_index, tied)
            selected.set(tied[np.argpartition(coin, missing - 1)[:missing]])
        return selected

    def _scored_quantile(self, rank: int) -> np.float32:
        """The scored score at position `rank` in ascending order (what np.partition would put there),
        by a two-pass radix select over 16-bit halves of order-preserving keys: no copy of the scores."""
        high, rank = self._key_histogram_pick(rank, None)
        low, _ = self._key_histogram_pick(rank, high)
        return _from_key((np.uint32(high) << np.uint32(16)) | np.uint32(low))

    def _key_histogram_pick(self, rank: int, high: int | None) -> tuple[int, int]:
        """The 16-bit bin holding ascending position `rank` (of the high halves, or of the low halves
        among keys whose high half is `high`) and the position within that bin."""
        histogram = np.zeros(1 << 16, dtype=np.int64)
        for _, scores, mask in self._scored_chunks():
            keys = _to_key(scores[mask])
            if high is None:
                histogram += np.bincount(keys >> np.uint32(16), minlength=1 << 16)
            else:
                keys = keys[(keys >> np.uint32(16)) == high]
                histogram += np.bincount(keys & np.uint32(0xFFFF), minlength=1 << 16)
        below = np.cumsum(histogram)
        bin_ = int(np.searchsorted(below, rank, side="right"))
        return bin_, rank - (int(below[bin_ - 1]) if bin_ else 0)

    # -- state and stats -------------------------------------------------------------------------

    def _tables(self) -> dict[str, np.ndarray]:
        return {
            "score": self._score,
            "last_loss": self._last_loss,
            "lr_mass_at_visit": self._lr_mass_at_visit,
            "visits": self._visits,
        }

    def _scalars(self) -> dict[str, Any]:
        return {
            "lr_mass": self._lr_mass,
            "steps": self._steps,
            "lr_mass_at_plan": self._lr_mass_at_plan,
            "pass_lr_mass": self._pass_lr_mass,
            "score_threshold": self._score_threshold,
            "pruned_set": self._pruned_set,
            "scored_at_plan": self._scored_at_plan,
        }

    def _load_scalars(self, scalars: dict[str, Any]) -> None:
        self._lr_mass = float(scalars["lr_mass"])
        self._steps = int(scalars["steps"])
        self._lr_mass_at_plan = float(scalars["lr_mass_at_plan"])
        self._pass_lr_mass = float(scalars["pass_lr_mass"])
        threshold = scalars["score_threshold"]
        self._score_threshold = None if threshold is None else float(threshold)
        self._pruned_set = int(scalars["pruned_set"])
        self._scored_at_plan = int(scalars["scored_at_plan"])

    def _extra_stats(self) -> dict[str, Any]:
        pass_index = self.pass_index
        return {
            "kept_fraction_target": 1.0 if pass_index is None else self.kept_fraction_target(pass_index),
            "expected_kept_fraction": 1.0 - self._pruned_set * (1.0 - self.explore) / self.num_samples,
            "pruned_set": self._pruned_set,
            "scored_samples": self._scored_at_plan,
            "threshold": self._score_threshold,
            "lr_mass": self._lr_mass,
            "pass_lr_mass": self._pass_lr_mass,
            "steps": self._steps,
            "annealing": pass_index is not None and pass_index >= self.first_full_pass,
            "first_full_pass": self.first_full_pass,
        }
