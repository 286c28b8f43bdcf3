"""One pass laid out before any byte is read: the shard order is a pure function of (seed, pass_index),
and the *kept* samples of that order are cut into equal contiguous slices, one per (rank, loader
worker). Every rank derives every rank's batch count from the plan and the index alone, so all ranks
stop at the same step with no collective (docs/design.md, principle 3). Reads no shard.

A bucketed index (aspect-ratio buckets, `ShardIndex.buckets`) is laid out bucket by bucket, so that a
batch holds samples of one bucket only: each bucket's kept samples, in the pass's order, are cut into
whole batches dealt round-robin to the slots (`_bucketed_layout`).
"""

from __future__ import annotations

from bisect import bisect_right
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
    # a bucketed index: int64 [slots, B], each slot's batches of each bucket (a row sums to its entry of
    # `batches`); a slot's slices of bucket b are one contiguous run of b's kept samples
    bucket_batches: np.ndarray | None = None
    kept_per_bucket: np.ndarray | None = None  # int64 [B] for a bucketed index: each bucket's kept samples
    # the samples the pass takes before pruning (a mixture: every walk its draw takes), what `kept` is a
    # share of; 0 where the caller did not say (ShardStream.layout does)
    length: int = 0

    @property
    def steps(self) -> int:
        """Batches per rank in this pass: the same on every rank."""
        return int(self.batches[0].sum())

    @property
    def tail(self) -> int:
        """Kept samples that no rank trains on this pass: at most (world * (workers + 1)) * batch; for a
        bucketed index at most B * (batch - 1) + (world - 1) * batch (each bucket's last partial batch,
        and at most one batch trimmed from every rank but one)."""
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
    shard_of_unit = np.arange(len(index), dtype=np.int64) if unit_shard is None else unit_shard
    copy_of_unit = np.zeros(num_units, dtype=np.int64) if unit_copy is None else unit_copy
    if index.buckets is not None:
        # the buckets in an order of the pass's own, so that the trim and the deal's wrap fall on
        # another bucket each pass, never on the same one run-long
        bucket_order = np.random.default_rng([seed, pass_index, _BUCKET_ORDER_SALT]).permutation(index.num_buckets)
        return _bucketed_layout(
            index, order, bucket_order, kept_per_shard, shard_of_unit, copy_of_unit, world_size, workers, batch_size
        )
    ordered_cum = np.concatenate([[0], np.cumsum(kept_per_shard[order])]).astype(np.int64).tolist()
    total = ordered_cum[-1]
    slots = world_size * workers
    bounds = [t * total // slots for t in range(slots + 1)]
    unit_list, shard_list, copy_list = order.tolist(), shard_of_unit.tolist(), copy_of_unit.tolist()
    slices = [
        tuple(_pieces(unit_list, ordered_cum, bounds[t], bounds[t + 1], shard_list, copy_list)) for t in range(slots)
    ]
    sizes = np.diff(bounds).reshape(world_size, workers)
    batches = sizes // batch_size
    steps = int(batches.sum(axis=1).min())
    for rank in range(world_size):  # trim the ranks above the minimum, largest worker first
        while batches[rank].sum() > steps:
            batches[rank, int(np.argmax(batches[rank]))] -= 1
    return PassLayout(order, tuple(slices), batches.astype(np.int64), total, batch_size)


_BUCKET_ORDER_SALT = 0x627563  # "buc": the pass's bucket order is a stream apart from its unit order


def _bucketed_layout(
    index: ShardIndex,
    order: np.ndarray,
    bucket_order: np.ndarray,
    kept_of_unit: np.ndarray,
    unit_shard: np.ndarray,
    unit_copy: np.ndarray,
    world_size: int,
    workers: int,
    batch_size: int,
) -> PassLayout:
    """Batches of one bucket each, as a pure function of (the units' kept counts and buckets, the
    pass's unit `order`, world, workers, batch).

    Bucket by bucket, in the pass's `bucket_order`: its units in the pass's order, its kept samples cut into
    n_b = floor(K_b / batch) whole batches. The batches are dealt round-robin over deal positions
    d = 0, 1, 2, ..., a position carrying over from one bucket to the next; position d is rank
    d % world, worker (d // world) % workers. So slot totals differ by at most one, and so do rank
    totals. A slot's share of bucket b is one contiguous run of b's kept samples: the runs follow
    the deal order from b's first position, and b's partial last batch (K_b mod batch samples) joins
    the run of the slot dealt b's last batch (or, for a bucket of no whole batch, the next slot in the
    deal): read, never decoded, so that its shards are still read to their ends. Then every rank
    above the smallest total drops batches (at most one), from its largest worker first (the first
    such), from the last bucket in `bucket_order` that worker holds batches of."""
    num_buckets = index.num_buckets
    slots = world_size * workers
    unit_bucket = index.buckets[unit_shard]
    deal_slot = np.array([(d % world_size) * workers + (d // world_size) % workers for d in range(slots)])
    bucket_batches = np.zeros((slots, num_buckets), dtype=np.int64)
    kept_per_bucket = np.zeros(num_buckets, dtype=np.int64)
    slices: list[list[SliceOfShard]] = [[] for _ in range(slots)]
    shard_list, copy_list = unit_shard.tolist(), unit_copy.tolist()  # Python ints: the walk below is scalar
    position = 0
    for b in bucket_order.tolist():
        mine = order[unit_bucket[order] == b]
        cum = np.concatenate([[0], np.cumsum(kept_of_unit[mine])]).astype(np.int64).tolist()
        total, mine = cum[-1], mine.tolist()
        kept_per_bucket[b] = total
        n = total // batch_size
        per_offset = n // slots + (np.arange(slots) < n % slots)  # batches of deal positions position + i
        last = max(0, min(n, slots) - 1)  # the offset whose run takes the partial batch
        start = 0
        for i in range(last + 1):  # the offsets after `last` hold nothing of this bucket
            slot = int(deal_slot[(position + i) % slots])
            size = int(per_offset[i]) * batch_size + (total - n * batch_size if i == last else 0)
            bucket_batches[slot, b] = per_offset[i]
            slices[slot].extend(_pieces(mine, cum, start, start + size, shard_list, copy_list))
            start += size
        position = (position + n) % slots
    batches = bucket_batches.sum(axis=1).reshape(world_size, workers)
    steps = int(batches.sum(axis=1).min())
    for rank in range(world_size):
        while batches[rank].sum() > steps:
            worker = int(np.argmax(batches[rank]))
            slot = rank * workers + worker
            held = np.flatnonzero(bucket_batches[slot, bucket_order])
            b = int(bucket_order[held[-1]])
            bucket_batches[slot, b] -= 1
            batches[rank, worker] -= 1
    return PassLayout(
        order,
        tuple(tuple(s) for s in slices),
        batches.astype(np.int64),
        int(kept_per_bucket.sum()),
        batch_size,
        bucket_batches=bucket_batches,
        kept_per_bucket=kept_per_bucket,
    )


def _pieces(
    units: list[int], cum: list[int], lo: int, hi: int, unit_shard: list[int], unit_copy: list[int]
) -> list[SliceOfShard]:
    """The pieces of kept samples [lo, hi) of the run of `units` (cumulative kept counts `cum`)."""
    pieces = []
    if hi <= lo:
        return pieces
    j = bisect_right(cum, lo) - 1
    while j < len(units) and cum[j] < hi:
        start = max(lo, cum[j]) - cum[j]
        end = min(hi, cum[j + 1]) - cum[j]
        if end > start:
            u = units[j]
            to_end = end == cum[j + 1] - cum[j]
            pieces.append(SliceOfShard(unit_shard[u], start, end, to_end, unit_copy[u]))
        j += 1
    return pieces


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
