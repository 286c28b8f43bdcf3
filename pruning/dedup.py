"""`dedup`: dynamic deduplication by near-duplicate groups, then pruning by score on what remains
(this project's pruner, docs/pruning.md). A loss does not see redundancy: near-duplicates score
about as high as unique samples, so InfoBatch skips them as often. A group table does: each pass a
group of n near-duplicates contributes about m of its members, a rotation taking each in turn, and
Importance- or InfoBatch-style pruning by score acts on the rest, so that the pass keeps `keep` of
the samples in expectation. Unlike a static deduplication, every member is still seen across passes.

The groups are side data handed over as each sample's group size (`use_groups`); the loop reads the
table beside the shards (pipelines/training/groups.py). Nothing here sees a model or opens a file.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import FrozenPlan, Pruner, check_flag, check_range, first_full_pass
from .groups import group_shares, kept_by_groups, per_group_for, size_histogram
from .infobatch import float32_strictly_below, smoothed

THEN = ("importance", "infobatch")
_CHUNK = 1 << 20  # samples per step of plan(): float32 temporaries of a few MB at any table size
_BISECTIONS = 48  # Importance's scale c to about 1e-14 of its bracket
_RATIO_MAX = float(np.finfo(np.float16).max)  # a larger score ratio keeps its sample at p = 1 anyway


class Dedup(Pruner):
    """Keep probability of sample i in a pruned pass: g_i * p_i, two independent decisions.

    - g_i = min(1, m / n_i), n_i the size of its group: a rotation keeps each member a share g_i of
      the passes, at least once in any ceil(n_i / m) of them (pruning/base.py `rotation_keeps`).
      m = `per_group`, raised when the groups alone would keep less than `keep`.
    - p_i from its score among what the groups keep, set so that the mean of g * p over all samples
      is `keep`: `then: importance` (p_i = clip(c (s_i / mean s) ** alpha, p_min, 1)) or
      `then: infobatch` (below-mean samples skipped with one probability, at most `prune_ratio`);
      the mean is over what the groups keep (each seen score weighted by g_i). Unseen samples: p = 1.

    `static`: the rotation stands still, so each group gives the same members every pass and the
    others are never seen: a static deduplication at the same compute, the control that says what
    the rotation adds (with `delta: 1` no pass trains on everything, as after removing them once).

    Weight of a kept sample: (1/p_i if `rescale`) x (1/g_i if `group_rescale`). `group_rescale`
    true keeps the duplicated distribution in expectation (every sample's expected weight is 1);
    false (the default) gives a group of n the expected weight min(n, m) of m samples, so the
    expectation moves toward the deduplicated data, what a deduplication trains on.
    """

    name = "dedup"

    def __init__(
        self,
        num_samples: int,
        num_passes: int,
        *,
        seed: int = 0,
        keep: float = 0.7,
        per_group: float = 1.0,
        then: str = "importance",
        alpha: float = 1.0,
        p_min: float = 0.1,
        prune_ratio: float = 0.5,
        delta: float = 0.875,
        rescale: bool = True,
        group_rescale: bool = False,
        momentum: float = 0.0,
        static: bool = False,
    ):
        keep = check_range("dedup", "keep", keep, 0.0, 1.0, low_open=True)
        per_group = check_range("dedup", "per_group", per_group, 0.0, float(2**31), low_open=True)
        if then not in THEN:
            raise ValueError(f"dedup: then must be one of {', '.join(THEN)}, got {then!r}")
        alpha = check_range("dedup", "alpha", alpha, 0.0, 8.0)
        p_min = check_range("dedup", "p_min", p_min, 0.0, 1.0, low_open=True)
        prune_ratio = check_range("dedup", "prune_ratio", prune_ratio, 0.0, 1.0, high_open=True)
        delta = check_range("dedup", "delta", delta, 0.0, 1.0)
        rescale = check_flag("dedup", "rescale", rescale)
        group_rescale = check_flag("dedup", "group_rescale", group_rescale)
        momentum = check_range("dedup", "momentum", momentum, 0.0, 1.0, high_open=True)
        static = check_flag("dedup", "static", static)
        super().__init__(
            num_samples,
            num_passes,
            seed=seed,
            keep=keep,
            per_group=per_group,
            then=then,
            alpha=alpha,
            p_min=p_min,
            prune_ratio=prune_ratio,
            delta=delta,
            rescale=rescale,
            group_rescale=group_rescale,
            momentum=momentum,
            static=static,
        )
        self.keep, self.per_group, self.then, self.alpha, self.p_min = keep, per_group, then, alpha, p_min
        self.prune_ratio, self.rescale, self.group_rescale, self.momentum = (
            prune_ratio,
            rescale,
            group_rescale,
            momentum,
        )
        self.static = static
        self.first_full_pass = first_full_pass(self.num_passes, delta)
        self._score = np.zeros(self.num_samples, dtype=np.float32)  # last score; 0 and unseen alike until seen
        self._seen = np.zeros(self.num_samples, dtype=np.uint8)
        # side data, not state: each sample's group size (read-only, shared per node by the loop)
        self._group_size: np.ndarray | None = None
        self._groups = {"digest": "", "source": "none (every sample its own group)"}
        self._sizes = np.ones(1, np.int64), np.array([self.num_samples], np.int64)  # size histogram
        self._per_group_used, self._per_group_raised = per_group, False
        self._scale: float | None = None  # importance: c of the last plan
        self._threshold: float | None = None  # the weighted mean score of the last plan
        self._below_skip = 0.0  # infobatch: skip probability of below-mean samples in the last plan
        self._expected_keep = 1.0

    # -- the groups ----------------------------------------------------------------------------

    def use_groups(self, group_size: np.ndarray, *, digest: str, source: str) -> None:
        """Each sample's group size (int32 [N], >= 1; pruning/groups.py `fill_group_sizes` makes it
        from a group table), read-only and never copied: the node's ranks may share it. `digest`
        names the table (a checkpoint records it and refuses to load into a run with another one);
        `source` says where it came from, for messages."""
        if group_size.shape != (self.num_samples,) or group_size.dtype != np.int32:
            raise ValueError(
                f"dedup: group sizes are int32[{self.num_samples}] (one per sample of the index), "
                f"got {group_size.dtype}{list(group_size.shape)} from {source}"
            )
        if not digest:
            raise ValueError("dedup: a group table needs a digest that names it")
        self._sizes = size_histogram(group_size)
        self._group_size = group_size
        self._groups = {"digest": str(digest), "source": str(source)}
        # the groups alone keep sum(min(n, m)) samples: if that is below `keep`, m rises to meet it
        wanted = self.keep * self.num_samples
        at_least = kept_by_groups(self.per_group, *self._sizes)
        self._per_group_raised = at_least < wanted
        self._per_group_used = per_group_for(wanted, *self._sizes) if self._per_group_raised else self.per_group

    # -- scores --------------------------------------------------------------------------------

    def _record(self, ids: np.ndarray, losses: np.ndarray) -> None:
        # a size, as for Importance: a negative (normalised) score counts as 0
        self._score[ids] = smoothed(self._score[ids], self._seen[ids], np.maximum(losses, 0.0), self.momentum)
        self._seen[ids] = 1

    # -- the plan ------------------------------------------------------------------------------

    def _chunks(self):
        for start in range(0, self.num_samples, _CHUNK):
            yield start, min(start + _CHUNK, self.num_samples)

    def _group_probs(self) -> np.ndarray | None:
        """float16 [N]: each sample's share g of its group; None when every group is a single sample."""
        if self._group_size is None or self._per_group_used >= self._sizes[0].max():
            return None
        shares = np.empty(self.num_samples, dtype=np.float16)
        for start, stop in self._chunks():
            shares[start:stop] = group_shares(self._group_size[start:stop], self._per_group_used)
        return shares

    def _share(self, groups: np.ndarray | None, start: int, stop: int) -> np.ndarray | float:
        return 1.0 if groups is None else groups[start:stop].astype(np.float32)

    def _mean_seen_score(self, groups: np.ndarray | None) -> tuple[float, float, float]:
        """(mean score of the seen samples weighted by g, sum of g over the seen, sum of g over all)."""
        weighted = seen_share = all_share = 0.0
        for start, stop in self._chunks():
            g = self._share(groups, start, stop)
            seen = self._seen[start:stop].view(np.bool_)
            g_seen = np.where(seen, g, np.float32(0))
            weighted += float(np.dot(g_seen.astype(np.float64), self._score[start:stop]))
            seen_share += float(g_seen.sum(dtype=np.float64))
            all_share += float(np.sum(g, dtype=np.float64)) if groups is not None else stop - start
        return (weighted / seen_share if seen_share > 0 else 0.0), seen_share, all_share

    def _freeze(self, pass_index: int) -> FrozenPlan:
        self._scale, self._threshold, self._below_skip, self._expected_keep = None, None, 0.0, 1.0
        if pass_index >= self.first_full_pass:
            return self._full_plan(pass_index)
        groups = self._group_probs()
        if groups is None and not self._seen.any():
            return self._full_plan(pass_index)
        mean, seen_share, all_share = self._mean_seen_score(groups)
        self._threshold = mean if seen_share > 0 else None
        probs = np.ones(self.num_samples, dtype=np.float16)
        # what the score must still remove: the groups keep all_share, the pass may keep keep * N (when
        # per_group was raised, the groups meet keep alone: what float16 rounding leaves is not pruned)
        excess = all_share - self.keep * self.num_samples
        if seen_share > 0 and excess > 0 and not self._per_group_raised:
            if self.then == "importance":
                self._importance_probs(probs, groups, mean)
            else:
                self._infobatch_probs(probs, groups, mean, excess)
        expected = 0.0
        for start, stop in self._chunks():
            expected += float(
                np.sum(probs[start:stop].astype(np.float32) * self._share(groups, start, stop), dtype=np.float64)
            )
        self._expected_keep = expected / self.num_samples
        for array in (probs, groups):
            if array is not None:
                array.flags.writeable = False  # the plan is frozen: nothing may edit it mid-pass
        return FrozenPlan(
            self.seed,
            pass_index,
            self.num_samples,
            self._expected_keep,
            None,
            self.rescale,
            probs,
            groups,
            self.group_rescale,
            rotate=not self.static,
        )

    def _importance_probs(self, probs: np.ndarray, groups: np.ndarray | None, mean: float) -> None:
        """p = clip(c r, p_min, 1) with r = (s / mean) ** alpha for seen samples, 1 for unseen, and c
        such that sum g p = keep * N. `probs` holds r (float16, inf for unseen) while c is sought, so
        the search needs no temporaries beyond a chunk."""
        for start, stop in self._chunks():
            seen = self._seen[start:stop].view(np.bool_)
            ratio = self._score[start:stop] / np.float32(mean) if mean > 0 else np.ones(stop - start, np.float32)
            if self.alpha != 1.0:
                ratio = ratio ** np.float32(self.alpha)
            probs[start:stop] = np.where(seen, np.minimum(ratio, _RATIO_MAX), np.inf)

        def kept(c: float) -> float:  # expected kept samples at scale c > 0 (c * inf = inf: unseen keep p = 1)
            total = 0.0
            for start, stop in self._chunks():
                p = np.clip(np.float32(c) * probs[start:stop].astype(np.float32), self.p_min, 1.0)
                total += float(np.sum(p * self._share(groups, start, stop), dtype=np.float64))
            return total

        wanted = self.keep * self.num_samples
        if kept(np.finfo(np.float32).tiny) >= wanted:  # even p_min everywhere keeps more than asked
            scale = float(np.finfo(np.float32).tiny)
        else:
            low, high = 0.0, 1.0
            while kept(high) < wanted and high < 1e12:
                high *= 2.0
            for _ in range(_BISECTIONS):
                middle = 0.5 * (low + high)
                low, high = (middle, high) if kept(middle) < wanted else (low, middle)
            scale = high
        for start, stop in self._chunks():
            probs[start:stop] = np.clip(np.float32(scale) * probs[start:stop].astype(np.float32), self.p_min, 1.0)
        self._scale = scale

    def _infobatch_probs(self, probs: np.ndarray, groups: np.ndarray | None, mean: float, excess: float) -> None:
        """Seen samples scored below the (weighted) mean are skipped with the probability r that
        removes `excess` expected samples, at most prune_ratio; p = 1 - r for them, 1 for the rest."""
        threshold = float32_strictly_below(mean)
        below_share = 0.0
        for start, stop in self._chunks():
            below = (self._score[start:stop] < threshold) & self._seen[start:stop].view(np.bool_)
            below_share += float(np.sum(np.where(below, self._share(groups, start, stop), 0.0), dtype=np.float64))
        if below_share <= 0:
            return
        skip = min(self.prune_ratio, excess / below_share)
        keep_below = np.float16(1.0 - skip)
        for start, stop in self._chunks():
            below = (self._score[start:stop] < threshold) & self._seen[start:stop].view(np.bool_)
            probs[start:stop][below] = keep_below
        self._below_skip = 1.0 - float(keep_below)

    # -- state ---------------------------------------------------------------------------------

    def _tables(self) -> dict[str, np.ndarray]:
        return {"score": self._score, "seen": self._seen}

    def _scalars(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "threshold": self._threshold,
            "below_skip": self._below_skip,
            "expected_keep": self._expected_keep,
            "groups_digest": self._groups["digest"],
            "groups_source": self._groups["source"],
        }

    def _load_scalars(self, scalars: dict[str, Any]) -> None:
        self._scale = None if scalars["scale"] is None else float(scalars["scale"])
        self._threshold = None if scalars["threshold"] is None else float(scalars["threshold"])
        self._below_skip, self._expected_keep = float(scalars["below_skip"]), float(scalars["expected_keep"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As every pruner's, and the state must come from a run with the same group table."""
        scalars = state.get("scalars", {})
        saved = scalars.get("groups_digest", "")
        if saved != self._groups["digest"]:
            raise ValueError(
                f"dedup: the pruner state was saved with the group table {scalars.get('groups_source', 'none')} "
                f"(digest {saved or 'none'}), this run has {self._groups['source']} (digest "
                f"{self._groups['digest'] or 'none'}); resume with the table the run began with (pruner.groups), "
                f"or start a new run"
            )
        super().load_state_dict(state)

    def _extra_stats(self) -> dict[str, Any]:
        grouped = int(self._sizes[1][self._sizes[0] > 1].sum())
        return {
            "expected_keep": self._expected_keep,
            "per_group": self._per_group_used,
            "scale": self._scale,
            "threshold": self._threshold,
            "below_skip": self._below_skip,
            "grouped_samples": grouped,
            "groups": self._groups["source"],
            "annealing": self.pass_index is not None and self.pass_index >= self.first_full_pass,
            "first_full_pass": self.first_full_pass,
        }
