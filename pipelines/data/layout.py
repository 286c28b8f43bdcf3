"""One pass laid out before any byte is read: the shard order is a pure function of (seed, pass_index),
and the *kept* samples of that order are cut into equal contiguous slices, one per (rank, loader
worker). Every rank derives every rank's batch count from the plan and the index alone, so all ranks
stop at the same step with no collective (docs/design.md, principle 3). Reads no shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prunepipe.pipelines.data.mixture import PassUnits
from prunepipe.pipelines.data.shards import ShardIndex


@dataclass(frozen=True)
class SliceOfShard:
    """Kept samples `[kept_start, kept_end)` (ordinals among the shard's kept samples) of one shard."""

    shard: int
    kept_start: int
    kept_end: int
    to_shard_end: bool  # the slice ends with the shard: read to its end, checking its length
    copy: int = 0  # which walk of its source this is (pipelines/data/mixture.py); 0 for a single folder


@dataclass(frozen=True)
class PassLayout:
    """Who reads what in one pass, identical on every rank and worker."""

    shard_order: np.ndarray  # int64 [U]: the units (shards, or walks over shards in a mixture) in reading order
    slices: tuple[tuple[SliceOfShard, ...], ...]  # per slot = rank * workers + worker
    batches: np.ndarray  # int64 [world, workers]: batches each worker yields
    kept: int  # kept samples in the pass
    batch_size: int
    kept_per_source: np.ndarray | None = None  # int64 [K] in a mixture: each source's kept samples

    @property
    def steps(self) -> int:
        """Batches per rank in this pass: the same on every rank."""
        return int(self.batches[0].sum())

    @property
    def tail(self) -> int:
        """Kept samples that no rank trains on this pass (at most (world * (workers + 1)) * batch)."""
        return self.kept - self.steps * self.batches.shape[0] * self.batch_size


def pass_layout(
    index: ShardIndex,
    kept_per_shard: np.ndarray | None,
    *,
    seed: int,
    pass_index: int,
    world_size: int,
    num_workers: int,
    batch_size: int,
    units: PassUnits | None = None,
) -> PassLayout:
    """Deterministic shard order, split of kept samples over ranks then workers, batch counts.

    `kept_per_shard` (int64 [S], the plan's `kept_per_shard`; None = all kept) is all the layout
    needs of the plan: nothing per sample. A mixture's pass walks some shards more than once or in
    part: `units` then lists the walks and their kept counts, and the order permutes the walks."""
    workers = max(1, num_workers)
    unit_shard = unit_copy = None
    if units is not None:
        unit_shard, unit_copy, kept_per_shard = units.shard, units.copy, units.kept
        shard_counts = index.counts[unit_shard]
        if (kept_per_shard > shard_counts).any():
            raise ValueError(f"a mixture's walk keeps more samples than its shard of {index.path} holds")
    elif kept_per_shard is None:
        kept_per_shard = index.counts.copy()
    else:
        kept_per_shard = np.asarray(kept_per_shard, dtype=np.int64)
        if kept_per_shard.shape != (len(index),) or (kept_per_shard > index.counts).any():
            raise ValueError(
                f"plan gives kept counts for {len(kept_per_shard)} shards but {index.path} "
                f"indexes {len(index)} (or more kept than a shard holds)"
            )
    num_units = len(index) if units is None else len(unit_shard)
    order = np.random.default_rng([seed, pass_index]).permutation(num_units).astype(np.int64)
    ordered_cum = np.concatenate([[0], np.cumsum(kept_per_shard[order])])
    total = int(ordered_cum[-1])
    slots = world_size * workers
    bounds = [t * total // slots for t in range(slots + 1)]
    slices = []
    for t in range(slots):
        lo, hi = bounds[t], bounds[t + 1]
        mine = []
        j = int(np.searchsorted(ordered_cum, lo, side="right")) - 1
        while j < len(order) and ordered_cum[j] < hi:
            start = max(lo, ordered_cum[j]) - ordered_cum[j]
            end = min(hi, ordered_cum[j + 1]) - ordered_cum[j]
            if end > start:
                to_end = bool(end == ordered_cum[j + 1] - ordered_cum[j])
                u = int(order[j])
                if units is None:
                    mine.append(SliceOfShard(u, int(start), int(end), to_end))
                else:
                    mine.append(SliceOfShard(int(unit_shard[u]), int(start), int(end), to_end, int(unit_copy[u])))
            j += 1
        slices.append(tuple(mine))
    sizes = np.diff(bounds).reshape(world_size, workers)
    batches = sizes // batch_size
    steps = int(batches.sum(axis=1).min())
    for rank in range(world_size):  # trim the ranks above the minimum, largest worker first
        while batches[rank].sum() > steps:
            batches[rank, int(np.argmax(batches[rank]))] -= 1
    return PassLayout(order, tuple(slices), batches.astype(np.int64), total, batch_size)


def batches_taken_per_worker(batches: np.ndarray, taken: int) -> tuple[np.ndarray, int]:
    """How many of each worker's batches the first `taken` loader batches were, and which worker
    yields the next one.

    torch's DataLoader hands out an IterableDataset's batches cyclically over its workers, passing
    over exhausted ones. A resumed loader starts its cycle at its worker 0, so that worker must play
    the part of the worker that was next in line: the rest of the cycle is then the same.
    """
    per_worker = np.zeros(len(batches), dtype=np.int64)
    left, last = taken, -1
    while left > 0:
        active = np.flatnonzero(per_worker < batches)
        if len(active) == 0:
            raise ValueError(f"cannot skip {taken} batches: the pass has only {int(batches.sum())}")
        step = active[:left]
        per_worker[step] += 1
        left -= len(step)
        last = int(step[-1])
    return per_worker, (last + 1) % len(batches)
