"""How well `prunepipe shards dedup` finds the copies of the bundled redundant set, whose copies are
known: a train key `ORIGINAL_dupNNNNN` is a near-duplicate (moved by up to 2 px, 12% zoom, brightness,
contrast and colour within 10%) of the train sample keyed ORIGINAL, and `_dupexact`, `_dupjpeg`,
`_dupcrop` an exact, re-encoded or cropped copy (tools/commands/sources.py:copy_key).

For each embedding (the 64-bit perceptual hash and its 144-bit variant; the bundled feature net,
trained here on the same shards' labels) and each threshold: precision and recall of the pairs of samples put in one group, against
the pairs of one original's family (the original and all its copies). Crops of one photograph that
overlap are not copies, so a group joining two of them counts against precision. Beside them, for
each kind of copy, the share of copies put in their original's group.

    python -m prunepipe.tools.benchmarks.dedup_quality --data /tmp/redundant [--out docs/dedup_quality.json]
    python -m prunepipe.tools.benchmarks.dedup_quality --data /tmp/redundant-web --embeddings phash-12 --redundant-copies heavy \
        --redundant-originals 1000 --redundant-exact 0.25 --redundant-jpeg 0.25 --redundant-crop 0.25
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from prunepipe.pipelines.data.shards import ShardIndex, read_keys
from prunepipe.pipelines.data.side_tables import open_embeddings
from prunepipe.tools.commands.embed import embed_shards
from prunepipe.tools.commands.near_duplicates import group_stats, near_duplicate_groups, pair_precision_recall
from prunepipe.tools.commands.perceptual_hash import threshold_for_hamming
from prunepipe.tools.commands.redundant_options import (
    COPY_KINDS,
    REDUNDANT_FLAGS,
    add_redundant_arguments,
    redundant_options,
)
from prunepipe.tools.commands.sources import COPY_KEY, check_copy_kinds, copies_by_kind, copy_kind

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
    return [key for shard, url in enumerate(index.urls) for key, _ in read_keys(url, expected=index.expected(shard))]


# write_shards' options -> the flag that sets them, for the message when a folder was written otherwise
OPTION_FLAGS = {"size": "--resolution", "crops_per_photo": "--crops-per-photo", **REDUNDANT_FLAGS}


def same_option(recorded, wanted) -> bool:
    if isinstance(wanted, dict):  # shares of the kinds of copy
        recorded, wanted = check_copy_kinds(recorded), check_copy_kinds(wanted)
        return all(abs(recorded[kind] - wanted[kind]) < 1e-9 for kind in wanted)
    return recorded == wanted


def check_written_as_asked(train: str, options: dict) -> None:
    """A folder already written must hold the set the flags ask for: measuring another would mislead."""
    meta = ShardIndex.load(train).meta
    for option, wanted in options.items():
        recorded = meta.get(option)
        if recorded is not None and not same_option(recorded, wanted):
            raise ValueError(
                f"{train}: written with {option} {recorded}, but {OPTION_FLAGS[option]} asks for "
                f"{wanted}; give another --data folder, or the flags it was written with"
            )


def prepare(data: str, options: dict | None = None, embeddings=tuple(EMBEDDINGS)) -> str:
    """The redundant set's train split (written with write_shards' `options` when absent, else checked
    against them) with its `embeddings` (the feature net trained first when it is one of them)."""
    options = options or {}
    train = os.path.join(data, "train")
    if not os.path.exists(os.path.join(train, "index.json")):
        from prunepipe.tools.commands.shards import write_shards

        write_shards("redundant", data, **options)
    check_written_as_asked(train, options)
    net = os.path.join(data, "feature_net.safetensors")
    if "feature-net" in embeddings and not os.path.exists(net):
        from prunepipe.tools.commands.feature_net import train_feature_net

        train_feature_net(data, net)
    for name in embeddings:
        if not os.path.exists(os.path.join(train, "embeddings", name + ".json")):
            embed_shards(train, EMBEDDINGS[name][0], name=name, batch_size=256, device="cpu")
    return train


def found_with_original(groups: np.ndarray, family: np.ndarray, kinds: np.ndarray) -> dict[str, float]:
    """The share of copies put in one group with their original: of all copies ("all") and of each
    kind present. Unlike pair recall, every copy counts once, whatever the size of its family."""
    together = groups == groups[family]
    shares = {"all": round(float(together[kinds != ""].mean()), 4) if (kinds != "").any() else 1.0}
    return shares | {
        kind: round(float(together[kinds == kind].mean()), 4) for kind in COPY_KINDS if (kinds == kind).any()
    }


def known_copies(keys: list[str], family: np.ndarray) -> dict:
    """What the split holds: its copies, of how many originals, how many of each kind, and how they
    spread over the originals (the largest and median count, the originals copied once)."""
    is_copy = family != np.arange(len(family))
    copies_each = np.bincount(family[is_copy], minlength=len(family))
    copies_each = copies_each[copies_each > 0]
    return {
        "samples": len(family),
        "copies": int(is_copy.sum()),
        "originals_copied": len(copies_each),
        "copies_by_kind": {kind: n for kind, n in copies_by_kind(keys).items() if n},
        "copies_per_original": {
            "largest": int(copies_each.max(initial=0)),
            "median": float(np.median(copies_each)) if len(copies_each) else 0.0,
            "one": int((copies_each == 1).sum()),
        },
    }


def measure(train: str, clusters: int | None = None, spill: bool = True, embeddings=tuple(EMBEDDINGS)) -> dict:
    keys = split_keys(train)
    family = known_families(keys)
    kinds = np.array([copy_kind(key) or "" for key in keys])
    results = {**known_copies(keys, family), "embeddings": {}}
    copies = results["copies"]
    for name in embeddings:
        thresholds = EMBEDDINGS[name][1]
        table = open_embeddings(train, name)
        start = time.perf_counter()
        found = near_duplicate_groups(table.rows, thresholds, clusters=clusters, spill=spill, show_progress=False)
        rows = []
        for t in thresholds:
            quality = pair_precision_recall(found.groups[t], family)
            stats = group_stats(found.groups[t])
            hamming = {"hamming": int(np.floor((1 - t) * table.dim / 2 + 1e-9))} if name.startswith("phash") else {}
            rows.append(
                {
                    "threshold": round(t, 4),
                    **hamming,
                    "precision": round(quality["precision"], 4),
                    "recall": round(quality["recall"], 4),
                    "groups_with_copies": stats["groups_with_copies"],
                    "redundant_fraction": round(stats["redundant_fraction"], 4),
                    "found_by_kind": found_with_original(found.groups[t], family, kinds),
                }
            )
        results["embeddings"][name] = {
            "model": table.header["model"],
            "clusters": found.clusters,
            "seconds": round(time.perf_counter() - start, 2),
            "rows": rows,
        }
    results["true_redundant_fraction"] = round(copies / len(family), 4)
    return results


def markdown(results: dict) -> str:
    """The table: pair precision and recall, and the share of copies found with their original, of
    all copies and, with more than one kind of copy, of each kind."""
    kinds = ["all"] + (list(results["copies_by_kind"]) if len(results["copies_by_kind"]) > 1 else [])
    spread = results["copies_per_original"]
    lines = [
        f"{results['samples']} train samples, {results['copies']} of them known copies of "
        f"{results['originals_copied']} originals (true redundant fraction "
        f"{results['true_redundant_fraction']:.2%}); copies per original: largest {spread['largest']}, "
        f"median {spread['median']:g}, {spread['one']} originals copied once; by kind: "
        + ", ".join(f"{kind} {n}" for kind, n in results["copies_by_kind"].items()),
        "",
        "| embedding | threshold | precision | recall | groups with copies | redundant fraction |"
        + "".join(f" {'copies' if kind == 'all' else kind} found |" for kind in kinds),
        "|---|---|---|---|---|---|" + "---|" * len(kinds),
    ]
    for name, result in results["embeddings"].items():
        for row in result["rows"]:
            threshold = f"{row['threshold']:g}" + (f" (hamming <= {row['hamming']:g})" if "hamming" in row else "")
            lines.append(
                f"| {name} | {threshold} | {row['precision']:.3f} | {row['recall']:.3f} | "
                f"{row['groups_with_copies']} | {row['redundant_fraction']:.2%} |"
                + "".join(f" {row['found_by_kind'][kind]:.3f} |" for kind in kinds)
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        required=True,
        help="folder of `prunepipe shards write --source redundant` (written there with the flags below when absent)",
    )
    parser.add_argument(
        "--embeddings",
        nargs="+",
        choices=tuple(EMBEDDINGS),
        default=list(EMBEDDINGS),
        help="the embeddings to group by (feature-net trains a network first)",
    )
    parser.add_argument("--clusters", type=int, help="k-means clusters (default: sqrt of the samples)")
    parser.add_argument("--no-spill", action="store_true")
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--resolution", dest="size", type=int, default=32, help="image side of the set")
    parser.add_argument("--crops-per-photo", type=int, default=250)
    add_redundant_arguments(parser)


def write_options(args: argparse.Namespace) -> dict:
    """write_shards' options for the set the flags describe."""
    return {"size": args.size, "crops_per_photo": args.crops_per_photo, **redundant_options(args)}


def run_from_args(args: argparse.Namespace) -> int:
    embeddings = tuple(dict.fromkeys(args.embeddings))
    results = measure(prepare(args.data, write_options(args), embeddings), args.clusters, not args.no_spill, embeddings)
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
