"""`prunepipe shards dedup` at 1e6 embeddings of 512 dims: wall time and peak RSS of the command, and
precision and recall against near-duplicate groups planted in synthetic embeddings (so the answer is
known).

The rows: unit vectors around `--centres` directions (two rows of one centre have an inner product
of about 0.5, like unrelated images of one kind), of which `--copied` are near-duplicates (inner
product about 0.99) of a third as many originals. They are written beside a stand-in index.json as
embeddings/synthetic.npy, then `prunepipe shards dedup` runs in a fresh process (its peak RSS is its
own: os.wait4's ru_maxrss) with `--no-picture` (there are no images).

    python -m prunepipe.tools.benchmarks.dedup_scale --samples 1e6 --dim 512 --folder /tmp/dedup_scale
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from prunepipe.pipelines.data.group_table import open_groups
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.data.side_tables import make_header, table_paths, write_json
from prunepipe.tools.commands.near_duplicates import pair_precision_recall

ROWS_AT_ONCE = 1 << 16
NAME = "synthetic"


def write_planted(
    folder: str,
    samples: int,
    dim: int,
    *,
    centres: int,
    copied: float,
    spread: float = 1.0,
    copy_noise: float = 0.1,
    seed: int = 0,
) -> np.ndarray:
    """Write the planted embeddings and a stand-in index for them; return the true groups (int32 [N],
    each sample's smallest family member)."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    ShardIndex.write(folder, [("synthetic-never-read.tar", samples)], source="prunepipe.tools.benchmarks.dedup_scale")
    array_path, header_path = table_paths(folder, "embeddings", NAME)
    os.makedirs(os.path.dirname(array_path), exist_ok=True)
    rows = np.lib.format.open_memmap(array_path, mode="w+", dtype=np.float16, shape=(samples, dim))
    directions = rng.standard_normal((centres, dim)).astype(np.float32)
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    for start in range(0, samples, ROWS_AT_ONCE):
        n = min(ROWS_AT_ONCE, samples - start)
        x = directions[rng.integers(0, centres, n)] + spread * rng.standard_normal((n, dim), np.float32) / np.sqrt(dim)
        rows[start : start + n] = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
    order = rng.permutation(samples)
    copies = np.sort(order[: int(copied * samples)])
    originals = rng.choice(order[len(copies) :], max(1, len(copies) // 3), replace=False)
    source = originals[rng.integers(0, len(originals), len(copies))]
    for start in range(0, len(copies), ROWS_AT_ONCE):
        part, of = copies[start : start + ROWS_AT_ONCE], source[start : start + ROWS_AT_ONCE]
        x = rows[np.sort(of)][np.argsort(np.argsort(of))].astype(np.float32)  # rows of `of`, read in file order
        x += copy_noise * rng.standard_normal(x.shape, np.float32) / np.sqrt(dim)
        rows[part] = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
    rows.flush()
    del rows
    write_json(
        header_path,
        make_header(
            folder,
            "embeddings",
            (samples, dim),
            model="synthetic (prunepipe.tools.benchmarks.dedup_scale)",
            weights=None,
            weights_sha256=None,
            dim=dim,
            count=samples,
            missing={"count": 0, "first_ids": [], "first_keys": [], "file": None},
            planted={"centres": centres, "copied": copied, "spread": spread, "copy_noise": copy_noise, "seed": seed},
        ),
    )
    family = np.arange(samples, dtype=np.int64)
    family[copies] = source
    first = np.full(samples, samples, dtype=np.int64)
    np.minimum.at(first, family, np.arange(samples))
    return first[family].astype(np.int32)


def run_dedup(folder: str, threshold: float, clusters: int | None, report_thresholds: list[float]) -> dict:
    """`prunepipe shards dedup` in a fresh process: wall seconds, peak RSS, load average before and after."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    command = [
        sys.executable,
        "-m",
        "prunepipe.launch.cli",
        "shards",
        "dedup",
        folder,
        "--embeddings",
        NAME,
        "--threshold",
        str(threshold),
        "--no-picture",
        "--report-thresholds",
        *map(str, report_thresholds),
    ]
    if clusters:
        command += ["--clusters", str(clusters)]
    load_before = os.getloadavg()
    start = time.perf_counter()
    child = subprocess.Popen(
        command,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root, "TQDM_DISABLE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output}")
    return {
        "command": " ".join(command[1:]),
        "wall_seconds": round(seconds, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # ru_maxrss is in KiB on Linux
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "output": output,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=float, default=1e6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--centres", type=int, default=1000, help="directions the rows cluster around")
    parser.add_argument("--copied", type=float, default=0.1, help="share of the rows that are planted copies")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--clusters", type=int, help="k-means clusters (default: the command's, sqrt of the samples)")
    parser.add_argument("--folder", help="where the embeddings go (default: a temporary folder, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the embeddings")
    parser.add_argument("--out", help="also write the result as JSON here")


def run_from_args(args: argparse.Namespace) -> int:
    import shutil

    samples = int(args.samples)
    folder = args.folder or tempfile.mkdtemp(prefix="prunepipe-dedup-scale-")
    try:
        start = time.perf_counter()
        truth = write_planted(folder, samples, args.dim, centres=args.centres, copied=args.copied)
        written = time.perf_counter() - start
        result = run_dedup(folder, args.threshold, args.clusters, [0.85, 0.95])
        groups = open_groups(folder, f"{NAME}_{args.threshold:g}").rows
        with open(table_paths(folder, "groups", f"{NAME}_{args.threshold:g}")[0][:-4] + ".report.json") as f:
            report = json.load(f)
        quality = pair_precision_recall(groups, truth)
        result.update(
            samples=samples,
            dim=args.dim,
            write_seconds=round(written, 1),
            dedup_seconds=report["seconds"],
            clusters=report["clusters"],
            largest_cluster=report["cluster_size"]["max"],
            precision=round(quality["precision"], 5),
            recall=round(quality["recall"], 5),
            true_redundant=int((truth != np.arange(samples)).sum()),
            found_redundant=report["thresholds"][f"{args.threshold:g}"]["redundant"],
            cores=len(os.sched_getaffinity(0)),
        )
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(result.pop("output"))
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run_from_args(parser.parse_args()))


if __name__ == "__main__":
    main()
