"""What the loop keeps per source of a mixture (pipelines/data/mixture.py): the scorer's strata
(sources beside the task's own), the samples each source forwarded, the pass's per-source
accounting, and a resume that refuses another mixture. With one source all of it is one row.
"""

from __future__ import annotations

import json

import numpy as np

from prunepipe.pipelines.data.mixture import Mixture
from prunepipe.pruning import ScoreNormaliser


class SourceStrata:
    """Strata for the score normaliser: source k's stratum t becomes k * task_strata + t, so that with
    `per_source` each source's losses are normalised within it (InfoBatch's mean threshold then
    prunes each source at its own rate instead of starving the one of smaller losses)."""

    def __init__(self, mixture: Mixture, task_strata: int, per_source: bool):
        self.mixture, self.task_strata = mixture, max(int(task_strata), 1)
        self.per_source = per_source and len(mixture.sources) > 1

    @property
    def num_strata(self) -> int:
        return self.task_strata * (len(self.mixture.sources) if self.per_source else 1)

    def buckets(self, task_buckets: int) -> int:
        """The normaliser's buckets: the task's per source, so that no bucket spans two sources."""
        return task_buckets * (len(self.mixture.sources) if self.per_source else 1)

    def normaliser(self, score) -> ScoreNormaliser:
        """The score normaliser (score.normalise) over these strata, with the task's buckets per source."""
        return ScoreNormaliser(
            score.normalise, self.num_strata, buckets=self.buckets(score.buckets), momentum=score.momentum
        )

    def __call__(self, ids: np.ndarray, strata: np.ndarray | None) -> np.ndarray | None:
        if not self.per_source:
            return strata
        source = np.maximum(self.mixture.source_of(ids), 0)  # padding (id -1) is dropped by the normaliser
        task = np.zeros(len(ids), dtype=np.int64) if strata is None else np.asarray(strata, dtype=np.int64)
        return source * self.task_strata + task


def forwarded_by_source(mixture: Mixture, ids: np.ndarray) -> np.ndarray:
    """int64 [K]: how many of these (real) ids each source holds."""
    return np.bincount(mixture.source_of(ids), minlength=len(mixture.sources)).astype(np.int64)


def count_forwarded(position, mixture: Mixture, buckets, ids: np.ndarray, losses: np.ndarray) -> None:
    """Count a step's real `ids` (with their `losses`) into `position`: consumed this pass, forwarded
    in the run, per source and per aspect-ratio bucket."""
    position.consumed.set(ids)
    position.forwarded_by_source += forwarded_by_source(mixture, ids)
    if buckets.active:
        position.forwarded_by_bucket += buckets.saw(ids, losses)
    position.samples_forwarded += len(ids)


def pass_accounting(mixture: Mixture, kept_per_source: np.ndarray | None, forwarded: np.ndarray | None) -> dict:
    """Per source: samples its rule draws a pass, kept by the pruner, skipped, and forwarded so far in
    the run (every pass, all ranks, padding excluded)."""
    drawn = mixture.per_pass()
    kept = drawn if kept_per_source is None else kept_per_source
    forwarded = np.zeros(len(drawn), dtype=np.int64) if forwarded is None else forwarded
    return {
        name: {"drawn": int(d), "kept": int(k), "skipped": int(d - k), "forwarded": int(f)}
        for name, d, k, f in zip(mixture.names, drawn, kept, forwarded)
    }


def combine_held_out(by_source: dict[str, dict]) -> dict:
    """The held-out metrics over every source's samples from each source's (means over its samples,
    every rank's already, as `mean_over_ranks` leaves them): weighted by their counts, so the model
    runs over each held-out sample once."""
    first = next(iter(by_source.values()))
    counts = {name: int(m["num_samples"]) for name, m in by_source.items()}
    total = sum(counts.values())
    combined = {k: v for k, v in first.items() if not isinstance(v, float)}
    for key in (k for k, v in first.items() if isinstance(v, float)):
        combined[key] = sum(m[key] * counts[name] for name, m in by_source.items()) / max(total, 1)
    combined["num_samples"] = total
    combined["num_samples_by_rank"] = [sum(r) for r in zip(*(m["num_samples_by_rank"] for m in by_source.values()))]
    return combined


def check_same_mixture(mixture: Mixture, recorded: str, checkpoint: str) -> str:
    """The record of `mixture` to keep in the position; a resume whose checkpoint `recorded` another
    mixture is refused, naming what changed (ids would mean other samples, the pruner's scores too)."""
    if recorded:
        changed = mixture.changed_from(json.loads(recorded))
        if changed:
            raise ValueError(
                f"{checkpoint}: the run trained on another mixture of data.train: {changed}. Resume with "
                f"the run's sources (their names, sizes, order and rules), or start a new run (a stage: init)"
            )
    return json.dumps(mixture.record(), sort_keys=True)
