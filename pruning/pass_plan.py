"""The pre-decode stage: one pass's frozen decisions, handed whole to the data stream.

`PassPlan` is the pruner's `FrozenPlan` of the pass (a candidate bitmap, a keep probability, the
coin) plus, for a pass resumed as a segment, a bitmap of the samples consumed before it: about
0.25 bit per sample, never a dense weight per sample. Weights and kept counts are drawn
from it a chunk at a time. A new loader iterator is created for every pass, so its workers start
with the plan of that pass; the bitmaps travel to spawn-started workers as shared-memory tensors
(`share`), not as a copy per worker. It holds no pruner state that training changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import FrozenPlan
from .bitmap import Bitmap

_CHUNK = 1 << 20  # ids per step of the whole-pass counts: the coin's temporaries stay about 25 MB


@dataclass(frozen=True)
class PassPlan:
    """Weights of every sample for one pass, drawn on demand; 0.0 means skip before decoding."""

    pass_index: int
    frozen: FrozenPlan
    excluded: Bitmap | None = None  # consumed before this segment of the pass began: weight 0

    @classmethod
    def from_pruner(cls, pruner) -> "PassPlan":
        """The pass `pruner` has planned (call `pruner.plan(pass_index)` first; a resumed pruner already
        holds the plan frozen at its pass start, which must not be re-planned)."""
        if pruner.frozen_plan is None:
            raise RuntimeError("the pruner has no plan yet: call pruner.plan(pass_index) first")
        return cls(int(pruner.pass_index), pruner.frozen_plan)

    def __post_init__(self):
        if self.excluded is not None and len(self.excluded) != self.frozen.num_samples:
            raise ValueError(f"excluded flags {len(self.excluded)} samples, the plan {self.frozen.num_samples}")

    def excluding(self, consumed: Bitmap) -> "PassPlan":
        """This plan with the samples of `consumed` skipped (a segment of a resumed pass)."""
        return PassPlan(self.pass_index, self.frozen, consumed)

    @property
    def num_samples(self) -> int:
        return self.frozen.num_samples

    def weights(self, ids: np.ndarray) -> np.ndarray:
        """float32 per id; 0 = skip."""
        weights = self.frozen.weights(ids)
        if self.excluded is not None:
            weights[self.excluded.test(ids)] = 0.0
        return weights

    def weights_between(self, start: int, stop: int) -> np.ndarray:
        """float32 weights of ids [start, stop): one shard's, read by a loader worker."""
        return self.weights(np.arange(start, stop, dtype=np.int64))

    def kept_between(self, start: int, stop: int) -> np.ndarray:
        kept = self.frozen.kept_between(start, stop)
        if self.excluded is not None:
            kept &= ~self.excluded.between(start, stop)
        return kept

    def kept_per_shard(self, first_ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """int64 [S]: kept samples of each shard (ids dense in index order), counted a chunk at a time."""
        boundaries = np.append(np.asarray(first_ids, dtype=np.int64), self.num_samples)
        kept_before = np.zeros(len(boundaries), dtype=np.int64)  # kept ids below each boundary
        running = 0
        for start in range(0, self.num_samples, _CHUNK):
            stop = min(start + _CHUNK, self.num_samples)
            cum = np.cumsum(self.kept_between(start, stop), dtype=np.int64)
            lo, hi = np.searchsorted(boundaries, [start, stop], side="right")  # boundaries in (start, stop]
            kept_before[lo:hi] = running + cum[boundaries[lo:hi] - start - 1]
            running += int(cum[-1])
        kept = np.diff(kept_before)
        if not np.array_equal(np.asarray(first_ids) + np.asarray(counts), boundaries[1:]):
            raise ValueError("shards must list dense ids in index order (first_ids + counts = next first_ids)")
        return kept

    def count_kept(self, among: Bitmap | None = None) -> int:
        """Kept samples of the pass (or only those flagged in `among`), a chunk at a time."""
        total = 0
        for start in range(0, self.num_samples, _CHUNK):
            stop = min(start + _CHUNK, self.num_samples)
            kept = self.kept_between(start, stop)
            if among is not None:
                kept &= among.between(start, stop)
            total += int(np.count_nonzero(kept))
        return total

    def kept_mask(self) -> np.ndarray:
        """bool [N]: the kept samples as a dense mask, one byte per sample (debugging and tests only)."""
        return np.concatenate(
            [
                self.kept_between(start, min(start + _CHUNK, self.num_samples))
                for start in range(0, self.num_samples, _CHUNK)
            ]
        )

    def share(self) -> "PassPlan":
        """This plan with its per-sample arrays in shared memory, so that loader workers started by
        spawn map them instead of unpickling a copy each (torch hands shared tensors over by handle)."""
        frozen = self.frozen
        arrays = [
            a
            for a in (
                frozen.candidates and frozen.candidates.packed,
                frozen.keep_probs,
                frozen.group_probs,
                self.excluded and self.excluded.packed,
            )
            if a is not None
        ]
        if all(isinstance(a, SharedArray) for a in arrays):
            return self
        candidates = (
            None if frozen.candidates is None else Bitmap(SharedArray.of(frozen.candidates.packed), frozen.num_samples)
        )
        keep_probs = None if frozen.keep_probs is None else SharedArray.of(frozen.keep_probs)
        group_probs = None if frozen.group_probs is None else SharedArray.of(frozen.group_probs)
        excluded = None if self.excluded is None else Bitmap(SharedArray.of(self.excluded.packed), len(self.excluded))
        shared = FrozenPlan(
            frozen.seed,
            frozen.pass_index,
            frozen.num_samples,
            frozen.keep_prob,
            candidates,
            frozen.rescale,
            keep_probs,
            group_probs,
            frozen.group_rescale,
        )
        return PassPlan(self.pass_index, shared, excluded)


class SharedArray(np.ndarray):
    """A numpy view of a torch tensor in shared memory that pickles as that tensor: torch's
    multiprocessing reduction passes the segment's handle, so a spawn-started worker maps the same
    pages instead of receiving a copy."""

    @classmethod
    def of(cls, array: np.ndarray) -> "SharedArray":
        tensor = torch.empty(array.shape, dtype=torch.from_numpy(array[:0].copy()).dtype).share_memory_()
        tensor.numpy()[...] = array  # one copy, straight into the shared segment
        view = tensor.numpy().view(cls)
        view._tensor = tensor
        return view

    def __array_finalize__(self, obj):
        self._tensor = None  # slices and results are ordinary arrays: only `of` itself is the segment

    def __reduce_ex__(self, protocol):  # ndarray defines __reduce_ex__, which pickle prefers to __reduce__
        if self._tensor is None:
            return np.asarray(self).__reduce_ex__(protocol)
        return (_from_tensor, (self._tensor,))

    @property
    def is_shared(self) -> bool:
        return self._tensor is not None and self._tensor.is_shared()


def _from_tensor(tensor: torch.Tensor) -> SharedArray:
    view = tensor.numpy().view(SharedArray)
    view._tensor = tensor
    return view
