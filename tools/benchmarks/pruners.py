"""Pruner overhead: plan() over N samples, weights() for 1M ids, update() per batch, state bytes per sample.

Run: `python -m prunepipe.tools.benchmarks.pruners` (a markdown table on stdout; docs/pruning.md quotes it).
CPU only; it measures the pruners alone, not a training step.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import torch

from prunepipe.pruning import PRUNERS, Pruner, build_pruner


def median_seconds(function, repeats: int) -> float:
    """Median wall time of `repeats` calls (after one warm-up call)."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def scored(name: str, num_samples: int, num_passes: int = 100) -> Pruner:
    """A pruner that has seen every sample twice (so TED has a score for each), lr reported."""
    pruner = build_pruner(name, num_samples, num_passes, seed=0)
    rng = np.random.default_rng(0)
    chunk = 1 << 20
    for visit in range(2):
        for start in range(0, num_samples, chunk):
            ids = np.arange(start, min(start + chunk, num_samples))
            pruner.update(ids, rng.exponential(1.0 / (1 + visit), len(ids)).astype(np.float32))
        pruner.on_step(1e-3)
    return pruner


def state_bytes_per_sample(pruner: Pruner) -> float:
    """Bytes of the per-sample tables and the frozen plan in the state, per sample."""
    state = pruner.state_dict()
    tensors = list(state["tables"].values())
    for name in ("candidate_bits", "keep_probs"):
        if state["plan"] is not None and state["plan"][name] is not None:
            tensors.append(state["plan"][name])
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors) / pruner.num_samples


def bench(name: str, plan_sizes: list[int], weight_ids: int, batch_sizes: list[int], repeats: int) -> dict:
    row: dict = {"pruner": name}
    fresh_passes = iter(range(10, 10_000))  # a fresh pass each call: plan() of a new pass, inside pruning passes
    for size in plan_sizes:
        pruner = scored(name, size)
        row[f"plan() over {size:,}"] = median_seconds(lambda: pruner.plan(next(fresh_passes) % 80 + 5), repeats)
        if size == weight_ids:
            ids = np.random.default_rng(1).permutation(size)
            weights_time = median_seconds(lambda: pruner.weights(ids), repeats)
            row["bytes/sample"] = state_bytes_per_sample(pruner)
    row[f"weights() of {weight_ids:,} ids"] = weights_time
    pruner = scored(name, max(plan_sizes))
    pruner.plan(20)
    rng = np.random.default_rng(2)
    for batch in batch_sizes:
        batches = [
            (rng.integers(0, pruner.num_samples, batch), rng.exponential(1.0, batch).astype(np.float32))
            for _ in range(64)
        ]

        def update_all(batches=batches):
            for ids, losses in batches:
                pruner.update(ids, torch.from_numpy(losses).to(torch.bfloat16))
                pruner.on_step(1e-3)

        row[f"update() of {batch} ids"] = median_seconds(update_all, max(1, repeats // 2)) / len(batches)
    bytes_per_sample = row.pop("bytes/sample")
    row["state bytes/sample"] = bytes_per_sample  # last column
    return row


def format_table(rows: list[dict]) -> str:
    columns = list(rows[0])

    def cell(key, value):
        if key == "pruner":
            return value
        if key == "state bytes/sample":
            return f"{value:.0f}"
        return f"{value * 1e6:.0f} µs" if value < 1e-3 else f"{value * 1e3:.1f} ms"

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(key, row[key]) for key in columns) + " |" for row in rows]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan-sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--weight-ids", type=int, default=1_000_000, help="must be one of --plan-sizes")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pruners", nargs="+", default=list(PRUNERS))


def run_from_args(args) -> int:
    if args.weight_ids not in args.plan_sizes:
        raise ValueError(f"--weight-ids {args.weight_ids} must be one of --plan-sizes {args.plan_sizes}")
    torch.set_num_threads(1)
    rows = [bench(name, args.plan_sizes, args.weight_ids, args.batch_sizes, args.repeats) for name in args.pruners]
    print(
        f"<!-- {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, numpy {np.__version__}, "
        f"torch {torch.__version__}; median of {args.repeats} -->"
    )
    print(format_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run_from_args(parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
