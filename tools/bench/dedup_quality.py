"""How well `prunepipe shards dedup` finds the near-duplicates of the bundled redundant set, whose
copies are known: a train key `ORIGINAL_dupNNNNN` is a near-duplicate (moved by up to 2 px, 12% zoom,
brightness, contrast and colour within 10%) of the train sample keyed ORIGINAL (tools/sources.py).

For each embedding (the 64-bit perceptual hash and its 144-bit variant; the bundled feature net,
trained here on the same shards' labels) and each threshold: precision and recall of the pairs of samples put in one group, against
the pairs of one original's family (the original and all its copies). Crops of one photograph that
overlap are not copies, so a group joining two of them counts against precision.

    python -m tools.bench.dedup_quality --data /tmp/redundant [--out docs/dedup_quality.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

from pipelines.data.shards import ShardIndex, read_keys
from pipelines.data.side_tables import open_embeddings
from tools.embed import embed_shards
from tools.near_duplicates import group_stats, near_duplicate_groups, pair_precision_recall
from tools.perceptual_hash import threshold_for_hamming

COPY_KEY = re.compile(r"^(?P<original>.+)_dup\d{5}$")


EMBEDDINGS = {  # name -> (model spec, thresholds on the inner product)
    "phash": ("phash", [threshold_for_hamming(h, 64) for h in (4, 6, 8, 10, 12, 14)]),
    "phash-12": ("phash:12", [threshold_for_hamming(h, 144) for h in (28, 32, 36, 40, 44, 48)]),  # 12x12 frequencies
    "feature-net": ("feature-net", [0.95, 0.98, 0.99, 0.995, 0.998, 0.999]),
}


def known_families(keys: list[str]) -> np.ndarray:
    """int64 [N]: each sample's family = the id of the original it copies (its own id if none)."""
    id_of = {key: i for i, key in enumerate(keys)}
    family = np.arange(len(keys), dtype=np.int64)
    for i, key in enumerate(keys):
        match = COPY_KEY.match(key)
        if match:
            if match["original"] not in id_of:
                raise ValueError(f"key {key!r}: its original {match['original']!r} is not in the split")
            family[i] = id_of[match["original"]]
    return family


def split_keys(folder: str) -> list[str]:
    index = ShardIndex.load(folder)
    return [key for url in index.urls for key, _ in read_keys(url)]


def prepare(data: str) -> str:
    """The redundant set's train split (written when absent) with its phash and feature-net embeddings."""
    train = os.path.join(data, "train")
    if not os.path.exists(os.path.join(train, "index.json")):
        from tools.shards import write_shards

        write_shards("redundant", data)
    net = os.path.join(data, "feature_net.safetensors")
    if not os.path.exists(net):
        from tools.feature_net import train_feature_net

        train_feature_net(data, net)
    for name, (spec, _) in EMBEDDINGS.items():
        if not os.path.exists(os.path.join(train, "embeddings", name + ".json")):
            embed_shards(train, spec, name=name, batch_size=256, device="cpu")
    return train


def measure(train: str, clusters: int | None = None, spill: bool = True) -> dict:
    family = known_families(split_keys(train))
    copies = int((family != np.arange(len(family))).sum())
    results = {"samples": len(family), "copies": copies, "originals_copied": int(len(np.unique(family[family != np.arange(len(family))]))),
               "embeddings": {}}
    for name, (_, thresholds) in EMBEDDINGS.items():
        table = open_embeddings(train, name)
        start = time.perf_counter()
        found = near_duplicate_groups(table.rows, thresholds, clusters=clusters, spill=spill, show_progress=False)
        rows = []
        for t in thresholds:
            quality = pair_precision_recall(found.groups[t], family)
            stats = group_stats(found.groups[t])
            hamming = {"hamming": int(np.floor((1 - t) * table.dim / 2 + 1e-9))} if name.startswith("phash") else {}
            rows.append({"threshold": round(t, 4), **hamming,
                         "precision": round(quality["precision"], 4), "recall": round(quality["recall"], 4),
                         "groups_with_copies": stats["groups_with_copies"],
                         "redundant_fraction": round(stats["redundant_fraction"], 4)})
        results["embeddings"][name] = {"model": table.header["model"], "clusters": found.clusters,
                                       "seconds": round(time.perf_counter() - start, 2), "rows": rows}
    results["true_redundant_fraction"] = round(copies / len(family), 4)
    return results


def markdown(results: dict) -> str:
    lines = [f"{results['samples']} train samples, {results['copies']} of them known copies of "
             f"{results['originals_copied']} originals (true redundant fraction "
             f"{results['true_redundant_fraction']:.2%})", "",
             "| embedding | threshold | precision | recall | groups with copies | redundant fraction |",
             "|---|---|---|---|---|---|"]
    for name, result in results["embeddings"].items():
        for row in result["rows"]:
            threshold = f"{row['threshold']:g}" + (f" (hamming <= {row['hamming']:g})" if "hamming" in row else "")
            lines.append(f"| {name} | {threshold} | {row['precision']:.3f} | {row['recall']:.3f} | "
                         f"{row['groups_with_copies']} | {row['redundant_fraction']:.2%} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="folder of `prunepipe shards write --source redundant` "
                                                     "(written there when absent)")
    parser.add_argument("--clusters", type=int, help="k-means clusters (default: sqrt of the samples)")
    parser.add_argument("--no-spill", action="store_true")
    parser.add_argument("--out", help="also write the results as JSON here")


def run_from_args(args: argparse.Namespace) -> int:
    results = measure(prepare(args.data), args.clusters, not args.no_spill)
    print(markdown(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run_from_args(parser.parse_args()))


if __name__ == "__main__":
    main()
