"""`prunepipe shards dedup`: near-duplicate groups of a split from its embeddings, written beside its
index.json (groups/NAME.npy + NAME.json, pipelines/data/side_tables.py), with a report at several
thresholds (NAME.report.json) and a picture of a few groups (NAME.png).

The groups at every report threshold come from the same pairwise similarities, found once at the
lowest threshold (tools/commands/near_duplicates.py).
"""

from __future__ import annotations

import os
import time

import numpy as np

from prunepipe.pipelines.atomic_write import atomic_open
from prunepipe.pipelines.data.side_tables import make_header, open_embeddings, table_paths, write_json
from prunepipe.tools.commands.group_picture import draw_groups
from prunepipe.tools.commands.near_duplicates import group_stats, near_duplicate_groups

REPORT_THRESHOLDS = (0.8, 0.85, 0.9, 0.95, 0.98)


def default_groups_name(embeddings: str, threshold: float) -> str:
    return f"{embeddings}_{threshold:g}"


def dedup_shards(
    shards_dir: str,
    embeddings: str,
    threshold: float,
    *,
    clusters: int | None = None,
    report_thresholds=REPORT_THRESHOLDS,
    out: str | None = None,
    picture: bool = True,
    spill: bool = True,
    seed: int = 0,
) -> dict:
    """Group the split's samples whose `embeddings` rows have inner product >= `threshold` (through
    chains of such pairs); write the groups, the report and the picture; return the report."""
    table = open_embeddings(shards_dir, embeddings)
    name = out or default_groups_name(embeddings, threshold)
    array_path, header_path = table_paths(shards_dir, "groups", name)
    missing = table.missing_ids()
    valid = None
    if len(missing):
        valid = np.ones(len(table), dtype=bool)
        valid[missing] = False
    thresholds = sorted({float(threshold), *(float(t) for t in report_thresholds)})
    start = time.perf_counter()
    found = near_duplicate_groups(table.rows, thresholds, clusters=clusters, valid=valid, spill=spill, seed=seed)
    seconds = time.perf_counter() - start
    groups = found.groups[float(threshold)]
    stats = {f"{t:g}": {**group_stats(found.groups[t]), "pairs": found.pairs[t]} for t in thresholds}
    made_by = {
        "threshold": float(threshold),
        "clusters": found.clusters,
        "spill": spill,
        "seed": seed,
        "embeddings": {
            "name": embeddings,
            "model": table.header.get("model"),
            "weights_sha256": table.header.get("weights_sha256"),
            "dim": table.dim,
        },
        "samples": len(groups),
        "missing": int(len(missing)),
        **stats[f"{threshold:g}"],
        "meaning": "group id = the smallest sample id in the group; a sample is its group's first "
        "(the one a deduplication keeps) when its group id is its own id",
    }
    os.makedirs(os.path.dirname(array_path), exist_ok=True)
    for stale in (header_path, array_path):  # the old table is unreadable from now on, not half replaced
        if os.path.exists(stale):
            os.remove(stale)
    with atomic_open(array_path, "wb", suffix=".partial") as f:  # a killed writer's: remove_gone_partials
        np.save(f, groups)
    write_json(header_path, make_header(shards_dir, "groups", groups.shape, **made_by))
    cluster_sizes = found.cluster_sizes
    report = {
        "groups": name,
        "embeddings": embeddings,
        "threshold": float(threshold),
        "clusters": found.clusters,
        "cluster_size": {"max": int(cluster_sizes.max()), "mean": float(cluster_sizes.mean())},
        "spill": spill,
        "samples": len(groups),
        "missing": int(len(missing)),
        "seconds": round(seconds, 2),
        "thresholds": stats,
        "files": {"groups": array_path, "header": header_path},
    }
    if picture:
        picture_path = array_path[: -len(".npy")] + ".png"
        drawn = draw_groups(shards_dir, groups, picture_path, seed=seed)
        report["files"]["picture"] = picture_path if drawn else None
        report["picture_groups"] = drawn
    report_path = array_path[: -len(".npy")] + ".report.json"
    report["files"]["report"] = report_path
    write_json(report_path, report)
    return report


def report_lines(report: dict) -> list[str]:
    """The report as a small table, one line per threshold."""
    lines = [
        f"{report['samples']} samples ({report['missing']} without an embedding), {report['clusters']} clusters "
        f"(largest {report['cluster_size']['max']}), {report['seconds']} s",
        f"{'threshold':>9} {'groups':>9} {'with copies':>11} {'largest':>7} {'redundant':>9}  sizes",
    ]
    for t, s in report["thresholds"].items():
        mark = " <- written" if float(t) == report["threshold"] else ""
        sizes = " ".join(f"{k}:{v}" for k, v in s["size_histogram"].items())
        lines.append(
            f"{t:>9} {s['groups']:>9} {s['groups_with_copies']:>11} {s['largest_group']:>7} "
            f"{s['redundant_fraction']:>9.2%}  {sizes}{mark}"
        )
    lines += [f"{key}: {path}" for key, path in report["files"].items() if path]
    return lines
