"""Near-duplicate groups from L2-normalised embeddings, as SemDeDup finds them (Abbas et al. 2023,
arXiv 2303.09540): spherical k-means splits the rows into clusters, every pair within a cluster whose
inner product reaches the threshold is found exactly (faiss range search on a flat inner-product
index of that cluster), and the connected components of those pairs are the groups.

Why per cluster: an exact search over all N rows costs N^2 inner products; within k clusters of
about N/k rows it costs N^2/k, and each cluster is searched alone (another machine, another time),
so at 1e9 the work shards by cluster. What it misses: a pair split across two clusters. Near
duplicates sit far closer to each other than to a centroid's boundary, so that is rare; the
benchmarks measure it (docs/dedup.md). Arrays in, arrays out: no file is read or written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from prunepipe.pipelines.progress import progress

KMEANS_ITERATIONS = 20
KMEANS_POINTS_PER_CLUSTER = 64  # k-means on a sample: centroids only need to split the rows (faiss caps at 256)
ROWS_AT_ONCE = 1 << 16  # rows converted to float32 at a time for the assignment
QUERIES_AT_ONCE = 4096  # range-search queries at a time: bounds the result lists of a dense cluster


def default_clusters(count: int) -> int:
    """sqrt(N): assigning costs N*k inner products and the searches N*N/k; the sum is least at k = sqrt(N)."""
    return max(1, int(round(math.sqrt(count))))


@dataclass
class NearDuplicates:
    """Groups at each threshold: int32 [N], a sample's group = the smallest sample id in it."""

    groups: dict[float, np.ndarray]
    clusters: int
    cluster_sizes: np.ndarray  # int64 [clusters]
    pairs: dict[float, int] = field(default_factory=dict)  # pairs found at or above each threshold


def _float_rows(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """float32 rows of `ids` (ascending), normalised again (float16 storage leaves norms 1 +- 1e-3)."""
    x = np.asarray(rows[ids], dtype=np.float32)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return x


def spherical_kmeans(rows: np.ndarray, ids: np.ndarray, k: int, seed: int) -> np.ndarray:
    """float32 [k, D] unit centroids of the rows `ids`, trained on at most 64 rows per centroid."""
    import faiss

    rng = np.random.default_rng(seed)
    sample = (
        ids
        if len(ids) <= k * KMEANS_POINTS_PER_CLUSTER
        else np.sort(rng.choice(ids, k * KMEANS_POINTS_PER_CLUSTER, replace=False))
    )
    x = _float_rows(rows, sample)
    kmeans = faiss.Kmeans(
        x.shape[1],
        k,
        niter=KMEANS_ITERATIONS,
        spherical=True,
        seed=seed,
        verbose=False,
        min_points_per_centroid=1,
        max_points_per_centroid=KMEANS_POINTS_PER_CLUSTER,
    )
    kmeans.train(x)
    return kmeans.centroids


def assign_clusters(rows: np.ndarray, ids: np.ndarray, centroids: np.ndarray, nearest: int = 2) -> np.ndarray:
    """int64 [len(ids), nearest]: the centroids of largest inner product for each row, nearest first."""
    import faiss

    index = faiss.IndexFlatIP(centroids.shape[1])
    index.add(np.ascontiguousarray(centroids, dtype=np.float32))
    labels = np.empty((len(ids), nearest), dtype=np.int64)
    for start in range(0, len(ids), ROWS_AT_ONCE):
        part = ids[start : start + ROWS_AT_ONCE]
        labels[start : start + len(part)] = index.search(_float_rows(rows, part), nearest)[1]
    return labels


def pairs_within(
    x: np.ndarray, threshold: float, queries: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i, j, inner product) of every pair i < j of the rows `x` with inner product >= threshold and
    i among the first `queries` rows (default: all), found exactly by faiss' range search on a flat
    inner-product index."""
    import faiss

    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    # faiss keeps inner products strictly above its radius: ask a hair lower, cut at >= here
    radius = float(np.nextafter(np.float32(threshold), np.float32(-np.inf)))
    found_i, found_j, found_ip = [], [], []
    queries = len(x) if queries is None else queries
    for start in range(0, queries, QUERIES_AT_ONCE):
        limits, ips, js = index.range_search(x[start : min(start + QUERIES_AT_ONCE, queries)], radius)
        i = np.repeat(np.arange(start, start + len(limits) - 1), np.diff(limits.astype(np.int64)))
        keep = (js > i) & (ips >= threshold)  # each pair once, never a row with itself
        found_i.append(i[keep])
        found_j.append(js[keep])
        found_ip.append(ips[keep])
    return np.concatenate(found_i), np.concatenate(found_j), np.concatenate(found_ip)


def first_of_components(count: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """int64 [count]: for each node of the graph with edges (i, j), the smallest node of its component."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    graph = coo_matrix((np.ones(len(i), dtype=np.int8), (i, j)), shape=(count, count)).tocsr()
    _, labels = connected_components(graph, directed=False)
    _, first = np.unique(labels, return_index=True)  # the first (smallest) node of each label
    return first[labels]


def merge_across_clusters(groups: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`groups` (each sample's group's first id) joined along the edges (a, b) found across clusters."""
    if len(a) == 0:
        return groups
    labels = first_of_components(len(groups), groups[a], groups[b])  # the graph of the groups' first ids
    return labels[groups].astype(np.int32)


def near_duplicate_groups(
    rows: np.ndarray,
    thresholds,
    *,
    clusters: int | None = None,
    valid: np.ndarray | None = None,
    spill: bool = True,
    seed: int = 0,
    show_progress: bool = True,
) -> NearDuplicates:
    """Groups of `rows` (float [N, D], L2-normalised; a memory map is read a cluster at a time) at each
    threshold on the inner product. Rows not `valid` (missing embeddings) are their own group.

    With `spill`, each cluster's search also holds the rows whose second-nearest centroid it is
    (queried by the cluster's own rows only), so a pair split across two neighbouring clusters is
    still found, at twice the search cost: SemDeDup's split with IVF-style multi-assignment."""
    n = len(rows)
    if n >= 2**31:
        raise ValueError(f"{n} rows: group ids are int32, at most {2**31 - 1} samples")
    thresholds = sorted({float(t) for t in thresholds}, reverse=True)
    if not thresholds or not all(-1.0 <= t <= 1.0 for t in thresholds):
        raise ValueError(f"thresholds are inner products of unit rows, in [-1, 1]: got {thresholds}")
    ids = np.arange(n, dtype=np.int64) if valid is None else np.flatnonzero(valid).astype(np.int64)
    k = min(clusters or default_clusters(len(ids)), max(len(ids), 1))
    groups = {t: np.arange(n, dtype=np.int32) for t in thresholds}
    pairs = dict.fromkeys(thresholds, 0)
    if len(ids) < 2:
        return NearDuplicates(groups, k, np.array([len(ids)], dtype=np.int64), pairs)
    spill = spill and k > 1
    if k > 1:
        labels = assign_clusters(rows, ids, spherical_kmeans(rows, ids, k, seed), nearest=2 if spill else 1)
        order = np.argsort(labels[:, 0], kind="stable")  # within a cluster, ids stay ascending
        sizes = np.bincount(labels[:, 0], minlength=k)
        if spill:
            guest_order = np.argsort(labels[:, 1], kind="stable")
            guest_ends = np.cumsum(np.bincount(labels[:, 1], minlength=k)).tolist()
        del labels
    else:
        order, sizes = np.arange(len(ids)), np.array([len(ids)])
    ends = np.cumsum(sizes).tolist()
    across_a, across_b, across_ip = [], [], []
    bar = progress(len(ids), desc="near-duplicates", unit="row", disable=not show_progress)
    for c, (end, size) in enumerate(zip(ends, sizes.tolist())):
        bar.update(size)
        if size == 0:
            continue
        members = ids[order[end - size : end]]
        guests = ids[guest_order[(guest_ends[c - 1] if c else 0) : guest_ends[c]]] if spill else ids[:0]
        if size + len(guests) < 2:
            continue
        i, j, ip = pairs_within(_float_rows(rows, np.concatenate([members, guests])), thresholds[-1], queries=size)
        inside = j < size
        across_a.append(members[i[~inside]])
        across_b.append(guests[j[~inside] - size])
        across_ip.append(ip[~inside])
        i, j, ip = i[inside], j[inside], ip[inside]
        for t in thresholds:
            at = ip >= t
            pairs[t] += int(at.sum())
            if at.any():
                groups[t][members] = members[first_of_components(size, i[at], j[at])]
    bar.close()
    if spill:
        a, b, ip = np.concatenate(across_a), np.concatenate(across_b), np.concatenate(across_ip)
        a, b = np.minimum(a, b), np.maximum(a, b)
        pair_ids, first = np.unique(a * n + b, return_index=True)  # a pair seen from both of its clusters once
        a, b, ip = a[first], b[first], ip[first]
        for t in thresholds:
            at = ip >= t
            pairs[t] += int(at.sum())
            groups[t] = merge_across_clusters(groups[t], a[at], b[at])
    return NearDuplicates(groups, k, sizes.astype(np.int64), pairs)


def size_buckets(sizes: np.ndarray) -> dict[str, int]:
    """Group counts by size: 1, 2, 3-4, 5-8, ... (powers of two), the empty buckets left out."""
    buckets: dict[str, int] = {}
    top = int(sizes.max()) if len(sizes) else 1
    low = 1
    while low <= top:
        high = low if low <= 2 else 2 * (low - 1)  # 3-4, 5-8, 9-16, ...
        count = int(((sizes >= low) & (sizes <= high)).sum())
        if count:
            buckets[str(low) if low == high else f"{low}-{high}"] = count
        low = high + 1
    return buckets


def group_stats(groups: np.ndarray) -> dict:
    """Group count, size histogram and the redundant fraction (samples that are not their group's first)."""
    n = len(groups)
    sizes = np.bincount(groups, minlength=n)
    sizes = sizes[sizes > 0]
    redundant = n - len(sizes)
    return {
        "samples": n,
        "groups": int(len(sizes)),
        "groups_with_copies": int((sizes > 1).sum()),
        "redundant": int(redundant),
        "redundant_fraction": redundant / max(n, 1),
        "largest_group": int(sizes.max()) if len(sizes) else 0,
        "size_histogram": size_buckets(sizes),
    }


def pair_precision_recall(predicted: np.ndarray, truth: np.ndarray) -> dict:
    """Precision and recall of the pairs of samples put in one group, against the true groups (both
    int [N] labels): pairs counted from the contingency table, never listed."""

    def pairs(counts: np.ndarray) -> int:
        counts = counts.astype(np.int64)
        return int((counts * (counts - 1) // 2).sum())

    predicted, truth = np.asarray(predicted, dtype=np.int64), np.asarray(truth, dtype=np.int64)
    _, cells = np.unique(predicted * (int(truth.max()) + 1) + truth, return_counts=True)
    both = pairs(cells)
    found, true = pairs(np.unique(predicted, return_counts=True)[1]), pairs(np.unique(truth, return_counts=True)[1])
    return {
        "precision": both / found if found else 1.0,
        "recall": both / true if true else 1.0,
        "pairs_found": found,
        "pairs_true": true,
        "pairs_both": both,
    }
