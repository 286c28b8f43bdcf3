"""The pre-decode stage: one pass's frozen decisions, handed whole to the data stream.

`PassPlan` is a per-pass snapshot (a float32 weight per id, 0 = skip) made in the main process
after `pruner.plan(epoch)`. A new loader iterator is created for every pass, so its workers are
started with the plan of that pass: no stale fork snapshot, no persistent worker that never sees
the new plan. It holds no pruner state that training changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PassPlan:
    """Weights of every sample for one pass: `weights[id]`, 0.0 means skip before decoding."""

    epoch: int
    weights: np.ndarray  # float32 [N]

    @classmethod
    def from_pruner(cls, pruner, num_samples: int, chunk: int = 1 << 22) -> "PassPlan":
        """Snapshot the pass `pruner` has planned (call `pruner.plan(epoch)` first; a resumed
        pruner already holds the plan frozen at its pass start, which must not be re-planned)."""
        if pruner.epoch is None:
            raise RuntimeError("the pruner has no plan yet: call pruner.plan(epoch) first")
        weights = np.empty(num_samples, dtype=np.float32)
        for start in range(0, num_samples, chunk):  # chunked: bounded temporaries at 1e8+ samples
            ids = np.arange(start, min(start + chunk, num_samples), dtype=np.int64)
            weights[start : start + len(ids)] = pruner.weights(ids)
        return cls(int(pruner.epoch), weights)

    @classmethod
    def keep_all(cls, num_samples: int, epoch: int) -> "PassPlan":
        return cls(epoch, np.ones(num_samples, dtype=np.float32))

    def __post_init__(self):
        if self.weights.dtype != np.float32 or self.weights.ndim != 1:
            raise TypeError("PassPlan.weights must be a 1-D float32 array (one weight per sample id)")
        if not np.isfinite(self.weights).all() or (self.weights < 0).any():
            raise ValueError("PassPlan.weights must be finite and non-negative")

    @property
    def num_samples(self) -> int:
        return len(self.weights)

    @property
    def kept(self) -> np.ndarray:
        return self.weights > 0

    def kept_fraction(self) -> float:
        return float(self.kept.mean()) if len(self.weights) else 1.0

    def weight(self, sample_id: int) -> float:
        return float(self.weights[sample_id])
