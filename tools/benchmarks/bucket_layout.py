"""A bucketed pass at scale, side by side with the same samples unbucketed: what `latents encode --buckets`
(a tar per bucket of each input shard) and the bucketed layout (batches of one bucket, equal steps per
rank) cost at a pass boundary. Each rank computes the layout alone at every pass start.

Run: `prunepipe bench buckets --samples 1e8` (a markdown table; `--json` for JSON lines). The indexes are
synthetic and read no file: input shards of `--shard-size` images spread over the table's buckets by a
bell over the log aspect ratio centred on the square (web images: mostly near square, few at 4:1), the
bucketed one listing a tar per (input shard, bucket it holds), as `latents encode --buckets` writes them.
Measured for each, in this one process: the tars, the index's pickled bytes (what a spawn-started loader
worker receives), `pass_layout` time for `--nodes` x `--ranks-per-node` ranks of `--workers` loader
workers (median of `--repeats`, the pass's kept counts from a plan keeping `--kept` of each shard), the
layout's pickled bytes, and the tail (kept samples no batch takes). Ratios are bucketed / unbucketed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import platform
import statistics
import sys
import time

import numpy as np

from prunepipe.pipelines.data.layout import pass_layout
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.tools.commands.aspect_buckets import BucketTable, load_buckets
from prunepipe.tools.commands.latents import bucket_shard


def bucket_shares(sizes: list[tuple[int, int]], spread: float = 0.35) -> np.ndarray:
    """float [B]: each bucket's share of the images, a bell of width `spread` over log(h / w) at 0."""
    ratios = np.log(np.array([h / w for h, w in sizes]))
    shares = np.exp(-0.5 * (ratios / spread) ** 2)
    return shares / shares.sum()


def indexes(samples: int, shard_size: int, table: BucketTable) -> tuple[ShardIndex, ShardIndex]:
    """(the input shards unbucketed, the same images as a tar per bucket of each input shard, named and
    described as `latents encode --buckets` writes them for an SD VAE)."""
    sizes = list(table.sizes)
    inputs = max(1, samples // shard_size)
    per_input = np.floor(shard_size * bucket_shares(sizes)).astype(np.int64)
    per_input[np.argmax(per_input)] += shard_size - int(per_input.sum())  # each input shard holds shard_size
    held = np.flatnonzero(per_input)
    counts = np.tile(per_input[held], inputs)
    buckets = np.tile(held, inputs).astype(np.int64)
    bucketed = ShardIndex(
        tuple(bucket_shard(f"shard-{i // len(held):06d}.tar", b, len(sizes)) for i, b in enumerate(buckets)),
        counts,
        "bucketed",
        {"buckets": table.index_entries(4, 8)},
        buckets=buckets,
    )
    plain = ShardIndex(tuple(f"shard-{i:06d}.tar" for i in range(inputs)), np.full(inputs, shard_size), "plain")
    return plain, bucketed


def measure(index: ShardIndex, args, world: int) -> dict:
    """One index's tars, bytes and pass layout time (median of args.repeats), for `world` ranks."""
    rng = np.random.default_rng(0)
    kept = rng.binomial(index.counts, args.kept).astype(np.int64)  # a plan's per-shard kept counts
    times, layout = [], None
    for repeat in range(args.repeats):
        start = time.perf_counter()
        layout = pass_layout(
            index,
            kept,
            seed=0,
            pass_index=repeat,
            world_size=world,
            num_workers=args.workers,
            batch_size=args.batch_size,
        )
        times.append(time.perf_counter() - start)
    return {
        "index": index.path,
        "tars": len(index),
        "samples": index.num_samples,
        "index_mb": len(pickle.dumps(index)) / 1e6,
        "layout_s": statistics.median(times),
        "layout_mb": len(pickle.dumps(layout)) / 1e6,
        "steps": layout.steps,
        "tail": layout.tail,
        "tail_share": layout.tail / max(layout.kept, 1),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=float, default=1e8, help="images (default: %(default)g)")
    parser.add_argument("--shard-size", type=int, default=10_000, help="images an input shard (img2dataset's 10k)")
    parser.add_argument("--buckets", default="pixart512", help="a table latents encode takes (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--workers", type=int, default=8, help="loader workers per rank")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--kept", type=float, default=0.7, help="share of each shard the plan keeps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="JSON lines instead of the markdown table")


def run_from_args(args) -> int:
    table = load_buckets(args.buckets)
    world = args.nodes * args.ranks_per_node
    plain, bucketed = indexes(int(args.samples), args.shard_size, table)
    rows = [measure(plain, args, world), measure(bucketed, args, world)]
    ratio = {k: rows[1][k] / rows[0][k] for k in ("tars", "index_mb", "layout_s", "layout_mb") if rows[0][k]}
    if args.json:
        for row in (*rows, {"index": "bucketed / unbucketed", **ratio}):
            print(json.dumps(row))
        return 0
    print(
        f"<!-- {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, numpy {np.__version__}; "
        f"{args.nodes} nodes x {args.ranks_per_node} ranks x {args.workers} workers, batch {args.batch_size}, "
        f"{args.buckets} ({len(table.sizes)} buckets), input shards of {args.shard_size}, {args.kept:.0%} kept -->"
    )
    print("| index | tars | samples | index (MB) | layout (s) | layout (MB) | steps | tail |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['index']} | {row['tars']:,} | {row['samples']:.3g} | {row['index_mb']:.1f} | "
            f"{row['layout_s']:.2f} | {row['layout_mb']:.1f} | {row['steps']:,} | {row['tail']:,} "
            f"({row['tail_share']:.3%}) |"
        )
    print(
        "| bucketed / unbucketed | "
        + " | ".join(f"x{ratio[k]:.1f}" if k in ratio else "" for k in ("tars",))
        + f" | | x{ratio.get('index_mb', math.nan):.1f} | x{ratio.get('layout_s', math.nan):.1f} | "
        f"x{ratio.get('layout_mb', math.nan):.1f} | | |"
    )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run_from_args(parser.parse_args()))


if __name__ == "__main__":
    main()
