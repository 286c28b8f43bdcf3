"""Benchmark: what a pruned sample costs in the stream, measured side by side in one run.

Streams the same shards with every sample kept, with a pre-decode stage that drops half, reading
bytes only, and skipping every sample (what a pruned sample costs: its tar headers are parsed, its
bytes seeked past); prints samples/s and the cost of a skipped sample as a fraction of a decoded
one. Usage: python -m prunepipe.tools.benchmarks.stream [--source photos --size 64 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.shards import ShardIndex, read_shard
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pruning.base import FrozenPlan
from prunepipe.pruning.pass_plan import PassPlan
from prunepipe.tools.commands.shards import write_shards


def clock(workers: int):
    """CPU seconds of this process when everything runs in it (robust to other load on the
    machine), wall seconds when loader workers do the work."""
    return time.process_time if workers == 0 else time.perf_counter


def time_pass(index: ShardIndex, plan: PassPlan | None, size: int, batch: int, workers: int) -> tuple[float, int]:
    stream = ShardStream(index, batch_size=batch, decoder=SampleDecoder(resolution=size), shuffle_buffer=256)
    now = clock(workers)
    start = now()
    delivered = sum(len(b) for b in stream.pass_loader(0, plan, num_workers=workers))
    return now() - start, delivered


def time_reading(index: ShardIndex, workers: int, keep: bool) -> tuple[float, int]:
    """Every shard through the tar reader, each sample's bytes read (keep) or skipped."""
    now = clock(workers)
    start = now()
    n = sum(
        sample is not None
        for shard, url in enumerate(index.urls)
        for _, sample in read_shard(url, lambda _: keep, expected=index.expected(shard))
    )
    return now() - start, n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default="photos", choices=("digits", "photos"))
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", help="existing shard folder (with index.json); default: write a temporary one")


def run_from_args(args) -> int:

    with tempfile.TemporaryDirectory() as tmp:
        location = args.data
        if location is None:
            write_shards(args.source, tmp, size=args.size, shard_size=500, val_fraction=0.0)
            location = os.path.join(tmp, "train")
        index = ShardIndex.load(location)
        n = index.num_samples
        half = PassPlan(0, FrozenPlan(7, 0, n, 0.5, None))  # every sample a candidate, kept with p 0.5
        runs = {"decode all": [], "drop 50% before decode": [], "read bytes only": [], "skip every sample": []}
        counts = {}
        for _ in range(args.repeats):  # interleaved, so drift in machine speed hits all runs alike
            for name, fn in (
                ("decode all", lambda: time_pass(index, None, args.size, args.batch, args.workers)),
                ("drop 50% before decode", lambda: time_pass(index, half, args.size, args.batch, args.workers)),
                ("read bytes only", lambda: time_reading(index, args.workers, keep=True)),
                ("skip every sample", lambda: time_reading(index, args.workers, keep=False)),
            ):
                seconds, delivered = fn()
                runs[name].append(seconds)
                counts[name] = delivered
        t = {name: float(np.median(v)) for name, v in runs.items()}
        kind = "CPU seconds of this process" if args.workers == 0 else "wall seconds"
        print(
            f"{n} samples of {args.source} at {args.size}px, batch {args.batch}, workers {args.workers}, "
            f"median of {args.repeats}, {kind}"
        )
        print(f"{'run':<26}{'seconds':>9}{'samples/s':>12}{'decoded':>9}")
        for name in runs:
            print(f"{name:<26}{t[name]:9.3f}{n / t[name]:12.0f}{counts[name]:9d}")
        per_decoded = t["decode all"] / n
        per_skipped_direct = t["skip every sample"] / n
        # From the two passes alone: full = n (r + d), half = n r + (n/2) d  =>  r / (r + d).
        per_skipped_derived = (2 * t["drop 50% before decode"] - t["decode all"]) / t["decode all"]
        print(
            f"skipped / decoded sample cost: {per_skipped_direct / per_decoded:.3f} (skip-every-sample pass), "
            f"{per_skipped_derived:.3f} (derived from the two passes)"
        )
        print(
            f"time of the 50%-dropped pass: {t['drop 50% before decode'] / t['decode all']:.3f} of the full pass "
            f"(ideal 0.500)"
        )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    main()
