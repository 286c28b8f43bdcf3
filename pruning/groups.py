"""Near-duplicate groups as side data (docs/pruning.md, "dedup"): each sample's group id in, each
sample's group size and its share of the group's passes out, a chunk at a time.

Pure array work: the loop reads the group table beside the shards and hands the arrays over;
nothing here opens a file.
"""

from __future__ import annotations

import numpy as np

_CHUNK = 1 << 20  # samples per step: the temporaries stay a few MB at any table size


def fill_group_sizes(group_of: np.ndarray, out: np.ndarray) -> None:
    """out[i] = how many samples share sample i's group id (group ids in 0..N-1, as a group's
    smallest sample id is). `group_of` is read twice, a chunk at a time (a memory-mapped table is
    never loaded whole); the one transient is an int32 count per possible group id."""
    num_samples = len(group_of)
    if out.shape != (num_samples,) or out.dtype != np.int32:
        raise ValueError(f"group sizes go to an int32[{num_samples}] array, got {out.dtype}{list(out.shape)}")
    counts = np.zeros(num_samples, dtype=np.int32)
    for start in range(0, num_samples, _CHUNK):
        chunk = np.asarray(group_of[start : start + _CHUNK])
        if not np.issubdtype(chunk.dtype, np.integer):
            raise ValueError(f"group ids must be integers, got dtype {chunk.dtype}")
        bad = (chunk < 0) | (chunk >= num_samples)
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"sample {start + at} has group id {int(chunk[at])}; group ids must be in "
                f"0..{num_samples - 1} (a group's smallest sample id)"
            )
        np.add.at(counts, chunk, 1)
    for start in range(0, num_samples, _CHUNK):
        out[start : start + _CHUNK] = counts[np.asarray(group_of[start : start + _CHUNK])]


def size_histogram(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct group sizes int64, samples in groups of each size int64), a chunk at a time. Every
    group of size n puts n samples in bin n, so each count is a multiple of its size (checked: sizes
    that are not a table's group sizes are refused)."""
    totals: dict[int, int] = {}
    for start in range(0, len(sizes), _CHUNK):
        values, counts = np.unique(np.asarray(sizes[start : start + _CHUNK]), return_counts=True)
        for value, count in zip(values.tolist(), counts.tolist()):
            totals[value] = totals.get(value, 0) + count
    values = np.array(sorted(totals), dtype=np.int64)
    counts = np.array([totals[v] for v in values.tolist()], dtype=np.int64)
    if len(values) and values[0] < 1:
        raise ValueError(f"group sizes must be >= 1, got {int(values[0])}")
    uneven = counts % np.maximum(values, 1) != 0
    if uneven.any():
        raise ValueError(
            f"{int(counts[uneven][0])} samples say their group has {int(values[uneven][0])} members, "
            "which is not a whole number of such groups: these are not a group table's sizes"
        )
    return values, counts


def kept_by_groups(per_group: float, values: np.ndarray, counts: np.ndarray) -> float:
    """Expected samples a pass keeps when each group of n contributes min(n, per_group) of them."""
    return float(np.sum(counts * np.minimum(1.0, per_group / values)))


def per_group_for(target: float, values: np.ndarray, counts: np.ndarray) -> float:
    """The per-group count m whose expected kept samples, sum over groups of min(n, m), is `target`
    (kept_by_groups is continuous and rises with m up to every sample)."""
    if target >= counts.sum():
        return float(values.max())
    low, high = 0.0, float(values.max())
    for _ in range(64):  # to float64 precision on [0, largest group]
        middle = 0.5 * (low + high)
        low, high = (middle, high) if kept_by_groups(middle, values, counts) < target else (low, middle)
    return high


def group_shares(sizes: np.ndarray, per_group: float) -> np.ndarray:
    """float16 per sample: min(1, per_group / group size), rounded up to the next float16, so that a
    member's rotation (pruning/base.py `rotation_keeps`) comes round within ceil(n / per_group) passes."""
    exact = np.minimum(1.0, per_group / np.asarray(sizes, dtype=np.float64))
    share = exact.astype(np.float16)
    low = share.astype(np.float64) < exact
    share[low] = np.nextafter(share[low], np.float16(np.inf))
    return share
