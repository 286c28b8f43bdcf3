"""Pruning at scale: bytes per sample per node and per rank, plan + layout time per pass
boundary for a simulated world of nodes x ranks, and save/load time of the pruner state.

Run: `prunepipe bench scale --samples 100000000` (a markdown table on stdout, JSON lines with
`--json`). Each pruner is measured in a fresh child process so that its peak RSS is its own. Every
sample is scored (TED: twice, with a learning rate between) through the pruner's `_record`, the
update path without the per-batch de-duplication, which would only make filling 1e9 ids slow.
What is measured, and how:
- `tables`, `plan`, `consumed`, `groups`: numpy `nbytes` of the score tables, the frozen plan's arrays,
  the pass's consumed bitmap and (dedup) the group sizes of a synthetic table with 40% of the samples
  in groups of 4, per sample; per rank = all four, for a process alone.
- `peak RSS`: the child's high-water resident memory (VmHWM, reset after the imports) above its RSS
  after imports, per sample: before loading a saved state, and with it.
- `plan + layout`: one `pruner.plan(pass_index)`, the pass's per-shard kept counts and `pass_layout` for
  nodes x ranks_per_node ranks (what each rank computes at a pass boundary), on one thread.
- `node`: `--node-ranks` real processes (gloo) of one node sharing their tables as training does
  (pipelines/training/node_tables.py), each planning and laying out the pass, holding the plan's
  shared-memory copy for loader workers and a full consumed bitmap: the sum of their Pss growth
  (shared pages counted once) per sample, and the largest private (Uss) growth of a rank other
  than local rank 0, per sample.
- `--sources K` (K > 1): the same N samples as K sources instead (K index.json folders, weighted so
  that a pass takes the first source 2.5 times, the second 0.3 times and the others alike, in part),
  measured side by side with one folder of the same N samples, each in its own child: the pass
  boundary as training computes it with a mixture (`ShardStream.layout`: `pruner.plan`, the plan's
  per-shard kept counts, the mixture's draw, `pass_units`, `pass_layout`), its peak RSS growth above
  the filled tables and its time, and the ratios mixture / single.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

_CHUNK = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Start the high-water mark again from the current RSS (Linux >= 4.0), past the imports' peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def score_everything(pruner, visits: int) -> float:
    """Record a loss for every sample `visits` times; seconds taken."""
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for visit in range(visits):
        for first in range(0, pruner.num_samples, _CHUNK):
            ids = np.arange(first, min(first + _CHUNK, pruner.num_samples), dtype=np.int64)
            losses = rng.exponential(1.0 / (1 + visit), len(ids)).astype(np.float32)
            if pruner._writes_tables:  # a node's other ranks leave its shared tables to local rank 0
                pruner._record(ids, losses)
        pruner.on_step(1e-3)
    return time.perf_counter() - start


GROUPED_SHARE, GROUP_SIZE = 0.4, 4  # dedup's synthetic table: 40% of the samples in groups of 4


def synthetic_group_table(samples: int, folder: str) -> str:
    """A group table for dedup, written once per size: the first 40% of the ids in groups of 4
    consecutive ids (a group's id is its first), the rest alone. Only its sizes matter here."""
    from prunepipe.pipelines.data.group_table import write_group_table

    path = os.path.join(folder, f"groups-{samples}.npy")
    if not os.path.exists(path):
        group_of = np.arange(samples, dtype=np.int32)
        grouped = int(samples * GROUPED_SHARE) // GROUP_SIZE * GROUP_SIZE
        group_of[:grouped] -= group_of[:grouped] % GROUP_SIZE
        write_group_table(path, group_of, {"made_by": "prunepipe.tools.benchmarks.scale: synthetic"})
    return path


def give_synthetic_groups(
    pruner, samples: int, folder: str, rank: int = 0, local_rank: int = 0, local_size: int = 1, token: str = ""
):
    """dedup's group sizes from the synthetic table, as the loop gives them (shared per node); the sizes."""
    from prunepipe.pipelines.data.group_table import open_group_table
    from prunepipe.pipelines.training.groups import give_groups

    give_groups(
        pruner, open_group_table(synthetic_group_table(samples, folder), samples), rank, local_rank, local_size, token
    )
    return pruner._group_size


def plan_arrays(frozen) -> list:
    """The frozen plan's per-sample arrays (a candidate bitmap, keep probabilities, group shares)."""
    return [
        a
        for a in (frozen.candidates and frozen.candidates.packed, frozen.keep_probs, frozen.group_probs)
        if a is not None
    ]


def measure(
    name: str, samples: int, nodes: int, ranks_per_node: int, workers: int, shard_size: int, folder: str
) -> dict:
    """One pruner's row (run in a child process: see `main`)."""
    from prunepipe.pipelines.checkpoint.parts import CheckpointParts
    from prunepipe.pipelines.checkpoint.pruner_state import CheckpointedPruner
    from prunepipe.pipelines.data.layout import pass_layout
    from prunepipe.pipelines.data.shards import ShardIndex
    from prunepipe.pruning import build_pruner
    from prunepipe.pruning.bitmap import Bitmap
    from prunepipe.pruning.pass_plan import PassPlan

    torch.set_num_threads(1)
    if name == "dedup":
        synthetic_group_table(samples, folder)  # written before the baseline: not the pruner's memory
    reset_peak_rss()
    baseline = rss_bytes()
    counts = np.full(-(-samples // shard_size), shard_size, dtype=np.int64)
    counts[-1] = samples - shard_size * (len(counts) - 1)
    index = ShardIndex(tuple(f"shard-{i:07d}.tar" for i in range(len(counts))), counts)
    pruner = build_pruner(name, samples, 100, seed=0)
    groups_bytes = give_synthetic_groups(pruner, samples, folder).nbytes if name == "dedup" else 0
    fill_seconds = score_everything(pruner, 2 if name == "ted" else 1)
    world = nodes * ranks_per_node
    start_boundary = time.perf_counter()
    pruner.plan(5)
    planned = time.perf_counter()
    plan = PassPlan.from_pruner(pruner)
    layout = pass_layout(
        index,
        plan.kept_per_shard(index.first_ids, index.counts),
        seed=0,
        pass_index=5,
        world_size=world,
        num_workers=workers,
        batch_size=256,
    )
    boundary = time.perf_counter() - start_boundary
    consumed = Bitmap.zeros(samples)  # what the loop keeps per pass
    frozen = plan.frozen
    tables = sum(t.nbytes for t in pruner._tables().values())
    plan_bytes = sum(a.nbytes for a in plan_arrays(frozen))
    consumed_bytes = consumed.packed.nbytes
    per_rank = plan_bytes + consumed_bytes + groups_bytes
    # as a checkpoint holds it: the small state in pruner.pt, the tables as files (pipelines/checkpoint/pruner_state.py)
    checkpoint = os.path.join(folder, f"{name}-checkpoint")
    os.makedirs(checkpoint, exist_ok=True)
    start = time.perf_counter()
    CheckpointParts(pruner=CheckpointedPruner(pruner)).save(checkpoint)
    saved = time.perf_counter() - start
    file_bytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(checkpoint) for f in files)
    peak_before_load = peak_rss_bytes()
    del pruner, plan, frozen, consumed  # a resumed process holds one pruner: the one it loads into
    start = time.perf_counter()
    loader = CheckpointedPruner(build_pruner(name, samples, 100, seed=0))
    if name == "dedup":  # the same table: the state names it
        give_synthetic_groups(loader.pruner, samples, folder)
    CheckpointParts(pruner=loader).load(checkpoint)
    loaded = time.perf_counter() - start
    shutil.rmtree(checkpoint)
    return {
        "pruner": name,
        "samples": samples,
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "workers": workers,
        "shards": len(index),
        "kept_fraction": layout.kept / samples,
        "steps": layout.steps,
        "tables_B": tables / samples,
        "plan_B": plan_bytes / samples,
        "consumed_B": consumed_bytes / samples,
        "groups_B": groups_bytes / samples,
        "per_rank_B": (tables + per_rank) / samples,  # one process alone: tables, plan, consumed, group sizes
        "peak_rss_B": (peak_before_load - baseline) / samples,
        "peak_rss_with_load_B": (peak_rss_bytes() - baseline) / samples,
        "plan_s": planned - start_boundary,
        "boundary_s": boundary,
        "fill_s": fill_seconds,
        "save_s": saved,
        "load_s": loaded,
        "state_file_B": file_bytes / samples,
    }


def memory_of_process() -> tuple[int, int]:
    """(Pss, Uss) in bytes: the proportional share of every page (shared ones split among the
    processes that map them, so a node's Pss sum counts its shared tables once) and the pages
    mapped by this process alone."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields["Pss"], fields["Private_Clean"] + fields["Private_Dirty"]


def node_rank(
    rank: int,
    port: int,
    name: str,
    samples: int,
    ranks_per_node: int,
    nodes: int,
    workers: int,
    shard_size: int,
    out: str,
) -> None:
    """One rank of a simulated node: shared tables, every sample scored, one pass boundary."""
    import torch.distributed as dist

    from prunepipe.pipelines.data.layout import pass_layout
    from prunepipe.pipelines.data.shards import ShardIndex
    from prunepipe.pipelines.training.node_tables import NodeTables, run_token
    from prunepipe.pruning import build_pruner
    from prunepipe.pruning.bitmap import Bitmap
    from prunepipe.pruning.pass_plan import PassPlan

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks_per_node)
    counts = np.full(-(-samples // shard_size), shard_size, dtype=np.int64)
    counts[-1] = samples - shard_size * (len(counts) - 1)
    index = ShardIndex(tuple(f"shard-{i:07d}.tar" for i in range(len(counts))), counts)
    dist.barrier()
    before = memory_of_process()
    pruner = build_pruner(name, samples, 100, seed=0)
    token = run_token()
    tables = NodeTables(pruner, rank, rank, ranks_per_node, token)
    if name == "dedup":  # the group sizes once per node too, read-only
        give_synthetic_groups(pruner, samples, os.path.dirname(out), rank, rank, ranks_per_node, token)
    score_everything(pruner, 2 if name == "ted" else 1)
    tables.wait_for_writer()
    start = time.perf_counter()
    pruner.plan(5)
    plan = PassPlan.from_pruner(pruner)
    layout = pass_layout(
        index,
        plan.kept_per_shard(index.first_ids, index.counts),
        seed=0,
        pass_index=5,
        world_size=nodes * ranks_per_node,
        num_workers=workers,
        batch_size=256,
    )
    boundary = time.perf_counter() - start
    for_workers = plan.share()  # what a pass loader with workers hands them: the bitmap in shared memory
    consumed = Bitmap.zeros(samples)
    consumed.packed[:] = 0xFF  # the end of a pass: every page of the bitmap written
    dist.barrier()
    after = memory_of_process()
    found = [None] * ranks_per_node
    dist.all_gather_object(found, (after[0] - before[0], after[1] - before[1], boundary, layout.steps))
    del for_workers
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.barrier()
    dist.destroy_process_group()


def measure_node(
    name: str, samples: int, nodes: int, ranks_per_node: int, workers: int, shard_size: int, folder: str
) -> dict:
    """A node of `ranks_per_node` real processes (gloo) sharing their tables: bytes per sample of the
    node (Pss sum) and of each rank beyond local rank 0 (its private pages)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(folder, f"{name}-node.json")
    mp.start_processes(
        node_rank,
        args=(port, name, samples, ranks_per_node, nodes, workers, shard_size, out),
        nprocs=ranks_per_node,
        join=True,
        start_method="spawn",
    )
    ranks = json.load(open(out))
    extra = [uss for _, uss, _, _ in ranks[1:]]
    return {
        "node_pss_B": sum(pss for pss, _, _, _ in ranks) / samples,
        "extra_rank_uss_B": max(extra) / samples if extra else 0.0,
        "node_boundary_s": max(b for _, _, b, _ in ranks),
        "node_steps": sorted({st for *_, st in ranks}),
    }


# ----------------------------------------------------------------------------- --sources: a mixture's pass boundary
FIRST_TAKEN, SECOND_TAKEN = 2.5, 0.3  # times a pass takes the first and second source of a mixture


def source_sizes(samples: int, sources: int) -> np.ndarray:
    """int64 [K]: `samples` split into K sources as evenly as whole samples allow."""
    return np.diff(np.arange(sources + 1, dtype=np.int64) * samples // sources)


def mixture_weights(sources: int) -> list[float]:
    """Weights for K sources of equal size whose pass (the sources' total) takes the first 2.5 times,
    the second 0.3 times and each other source (K - 2.8) / (K - 2) times (in part for K > 2)."""
    if sources == 1:
        return [1.0]
    rest = (sources - FIRST_TAKEN - SECOND_TAKEN) / (sources - 2) if sources > 2 else 0.0
    return [FIRST_TAKEN, SECOND_TAKEN] + [rest] * (sources - 2)


def write_sources(samples: int, sources: int, shard_size: int, folder: str) -> Any:
    """`data.train` for `samples` in `sources` index.json folders (shards of `shard_size`, the last
    of each source short), written once under `folder`; K = 1: the folder itself, as a single run has it."""
    from prunepipe.pipelines.data.shards import ShardIndex

    entries = []
    for k, size in enumerate(source_sizes(samples, sources)):
        path = os.path.join(folder, f"sources-{samples}-{sources}", f"source-{k:04d}")
        if not os.path.exists(os.path.join(path, "index.json")):
            os.makedirs(path, exist_ok=True)
            counts = np.full(-(-int(size) // shard_size), shard_size, dtype=np.int64)
            counts[-1] = size - shard_size * (len(counts) - 1)
            ShardIndex.write(path, [(f"shard-{i:07d}.tar", int(c)) for i, c in enumerate(counts)])
        entries.append({"name": f"source-{k}", "path": path})
    if sources == 1:
        return entries[0]["path"]
    return [{**e, "weight": w} for e, w in zip(entries, mixture_weights(sources))]


def mixture_boundary(mixture, plan, *, seed: int, pass_index: int, world: int, workers: int, batch_size: int) -> dict:
    """One pass boundary as `ShardStream.layout` computes it for a mixture, a step at a time: the
    plan's per-shard kept counts, the draw, the pass's units, the layout; the seconds of each."""
    from prunepipe.pipelines.data.layout import pass_layout
    from prunepipe.pipelines.data.mixture import pass_units

    index = mixture.index
    start = time.perf_counter()
    kept = plan.kept_per_shard(index.first_ids, index.counts)
    counted = time.perf_counter()
    draw = mixture.draw(seed, pass_index)
    units = pass_units(index, mixture.shard_source, draw, kept, plan.kept_between)
    walked = time.perf_counter()
    layout = pass_layout(
        index,
        kept,
        seed=seed,
        pass_index=pass_index,
        world_size=world,
        num_workers=workers,
        batch_size=batch_size,
        units=None if draw.whole else units,
    )
    per_source = np.bincount(mixture.shard_source[units.shard], weights=units.kept, minlength=len(mixture.sources))
    laid = time.perf_counter()
    return {
        "draw": draw,
        "units": units,
        "layout": layout,
        "kept_per_source": per_source.astype(np.int64),
        "kept_s": counted - start,
        "units_s": walked - counted,
        "layout_s": laid - walked,
    }


def measure_sources(
    name: str, samples: int, sources: int, nodes: int, ranks_per_node: int, workers: int, shard_size: int, folder: str
) -> dict:
    """One pruner's pass boundary over `samples` in `sources` sources (a child process: see `main`)."""
    from prunepipe.pipelines.data.mixture import Mixture
    from prunepipe.pruning import build_pruner
    from prunepipe.pruning.pass_plan import PassPlan

    torch.set_num_threads(1)
    train = write_sources(samples, sources, shard_size, folder)  # on disk before the baseline
    reset_peak_rss()
    baseline = rss_bytes()
    mixture = Mixture.load(train)
    index_bytes = sum(a.nbytes for a in (mixture.index.counts, mixture.index.sizes, mixture.index.crcs))
    index_bytes += mixture.shard_source.nbytes + mixture.offsets.nbytes
    pruner = build_pruner(name, samples, 100, seed=0)
    fill_seconds = score_everything(pruner, 2 if name == "ted" else 1)
    filled_peak, filled = peak_rss_bytes(), rss_bytes()
    reset_peak_rss()  # from here: what the pass boundary adds above the filled tables
    start = time.perf_counter()
    pruner.plan(5)
    plan = PassPlan.from_pruner(pruner)
    planned = time.perf_counter()
    done = mixture_boundary(
        mixture, plan, seed=0, pass_index=5, world=nodes * ranks_per_node, workers=workers, batch_size=256
    )
    boundary = time.perf_counter() - start
    boundary_peak = peak_rss_bytes()
    draw, units, layout = done["draw"], done["units"], done["layout"]
    if layout.kept != int(units.kept.sum()) or layout.kept != int(done["kept_per_source"].sum()):
        raise AssertionError(f"kept: layout {layout.kept}, units {units.kept.sum()}, sources {done['kept_per_source']}")
    return {
        "pruner": name,
        "samples": samples,
        "sources": sources,
        "shards": len(mixture.index),
        "units": len(units.shard),
        "partial_units": int(np.count_nonzero(units.copy == np.asarray(draw.full)[mixture.shard_source[units.shard]])),
        "drawn": int(draw.drawn.sum()),
        "kept": layout.kept,
        "drawn_per_source": draw.drawn.tolist(),
        "kept_per_source": done["kept_per_source"].tolist(),
        "steps": layout.steps,
        "tables_B": sum(t.nbytes for t in pruner._tables().values()) / samples,
        "plan_B": sum(a.nbytes for a in plan_arrays(plan.frozen)) / samples,
        "index_B": index_bytes / samples,
        "units_B": (units.shard.nbytes + units.copy.nbytes + units.kept.nbytes) / samples,
        "order_B": layout.shard_order.nbytes / samples,
        "peak_rss_B": (max(filled_peak, boundary_peak) - baseline) / samples,
        "boundary_peak_B": (boundary_peak - filled) / samples,
        "plan_s": planned - start,
        "kept_s": done["kept_s"],
        "units_s": done["units_s"],
        "layout_s": done["layout_s"],
        "boundary_s": boundary,
        "fill_s": fill_seconds,
    }


def compare_sources(single: dict, mixed: dict) -> dict:
    """The mixture's row over the single folder's: ratios of memory and time."""
    row = {"pruner": single["pruner"], "samples": single["samples"], "sources": mixed["sources"]}
    for key in ("peak_rss_B", "boundary_peak_B", "boundary_s", "units_s"):
        row[f"{key}_ratio"] = mixed[key] / single[key] if single[key] else float("nan")
    return row


def format_sources_table(rows: list[dict]) -> str:
    columns = [
        ("pruner", "{}"),
        ("samples", "{:.0e}"),
        ("sources", "{}"),
        ("units", "{}"),
        ("partial_units", "{}"),
        ("drawn", "{}"),
        ("kept", "{}"),
        ("tables_B", "{:.3f}"),
        ("plan_B", "{:.3f}"),
        ("index_B", "{:.4f}"),
        ("units_B", "{:.4f}"),
        ("peak_rss_B", "{:.2f}"),
        ("boundary_peak_B", "{:.3f}"),
        ("plan_s", "{:.1f}"),
        ("units_s", "{:.1f}"),
        ("layout_s", "{:.1f}"),
        ("boundary_s", "{:.1f}"),
    ]
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if "peak_rss_B_ratio" in row:
            cells = [row["pruner"], f"{row['samples']:.0e}", f"ratio {row['sources']}/1"] + [""] * (len(columns) - 3)
            for key, at in (("peak_rss_B", "peak_rss_B"), ("boundary_peak_B", "boundary_peak_B")):
                cells[[n for n, _ in columns].index(at)] = f"x{row[key + '_ratio']:.3f}"
            cells[[n for n, _ in columns].index("units_s")] = f"x{row['units_s_ratio']:.1f}"
            cells[[n for n, _ in columns].index("boundary_s")] = f"x{row['boundary_s_ratio']:.2f}"
            lines.append("| " + " | ".join(cells) + " |")
        else:
            lines.append("| " + " | ".join(fmt.format(row[n]) if n in row else "-" for n, fmt in columns) + " |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    columns = [
        ("pruner", "{}"),
        ("samples", "{:.0e}"),
        ("tables_B", "{:.3f}"),
        ("plan_B", "{:.3f}"),
        ("consumed_B", "{:.3f}"),
        ("groups_B", "{:.3f}"),
        ("per_rank_B", "{:.2f}"),
        ("peak_rss_B", "{:.2f}"),
        ("peak_rss_with_load_B", "{:.2f}"),
        ("plan_s", "{:.1f}"),
        ("boundary_s", "{:.1f}"),
        ("save_s", "{:.1f}"),
        ("load_s", "{:.1f}"),
        ("state_file_B", "{:.2f}"),
        ("node_pss_B", "{:.2f}"),
        ("extra_rank_uss_B", "{:.3f}"),
        ("node_boundary_s", "{:.1f}"),
    ]
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += [
        "| " + " | ".join(fmt.format(row[name]) if name in row else "-" for name, fmt in columns) + " |" for row in rows
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=float, default=1e8, help="samples in the simulated table (1e8, 1e9)")
    parser.add_argument("--pruners", nargs="+", default=["infobatch", "ted", "random", "importance"])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4, help="loader workers per rank in the layout")
    parser.add_argument("--shard-size", type=int, default=10_000)
    parser.add_argument("--folder", default=None, help="where the state is saved (default: a temporary folder)")
    parser.add_argument(
        "--node-ranks",
        type=int,
        default=8,
        help="real processes of one simulated node that share their tables (1: skip the node measurement)",
    )
    parser.add_argument(
        "--sources",
        type=int,
        default=1,
        help="K > 1: the samples as K weighted sources (one taken 2.5x, one 0.3x, the rest in part), "
        "the pass boundary measured beside one folder of the same samples; 1: the measurement above",
    )
    parser.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child's own pruner
    parser.add_argument("--mixture-child", type=int, default=0, help=argparse.SUPPRESS)  # its sources


def run_from_args(args: argparse.Namespace) -> int:
    samples = int(args.samples)
    folder = args.folder or tempfile.mkdtemp(prefix="prunepipe-scale-")
    if args.sources < 1:
        print(f"--sources: at least 1, got {args.sources}", file=sys.stderr)
        return 2
    if args.one and args.mixture_child:
        row = measure_sources(
            args.one,
            samples,
            args.mixture_child,
            args.nodes,
            args.ranks_per_node,
            args.workers,
            args.shard_size,
            folder,
        )
        print(json.dumps(row))
        return 0
    if args.one:
        row = measure(args.one, samples, args.nodes, args.ranks_per_node, args.workers, args.shard_size, folder)
        if args.node_ranks > 1:
            row.update(
                measure_node(args.one, samples, args.nodes, args.node_ranks, args.workers, args.shard_size, folder)
            )
        print(json.dumps(row))
        return 0
    rows = []
    children = [(name, k) for name in args.pruners for k in ((1, args.sources) if args.sources > 1 else (0,))]
    for name, sources in children:
        command = [
            sys.executable,
            "-m",
            "prunepipe.tools.benchmarks.scale",
            "--one",
            name,
            "--samples",
            str(samples),
            "--nodes",
            str(args.nodes),
            "--ranks-per-node",
            str(args.ranks_per_node),
            "--workers",
            str(args.workers),
            "--shard-size",
            str(args.shard_size),
            "--folder",
            folder,
            "--node-ranks",
            str(args.node_ranks),
            "--mixture-child",
            str(sources),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))),
        )
        if done.returncode != 0:
            print(f"{name}: the measuring child failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
        if sources > 1:  # beside the single folder measured just before
            rows.append(compare_sources(rows[-2], rows[-1]))
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    if args.sources > 1 and not args.json:
        print(
            f"<!-- {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, numpy "
            f"{np.__version__}, torch {torch.__version__}; {args.nodes} nodes x {args.ranks_per_node} ranks, "
            f"{args.workers} workers per rank, shards of {args.shard_size}; 1 folder vs {args.sources} sources -->"
        )
        print(format_sources_table(rows))
    elif not args.json:
        print(
            f"<!-- {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, numpy "
            f"{np.__version__}, torch {torch.__version__}; {args.nodes} nodes x {args.ranks_per_node} ranks, "
            f"{args.workers} workers per rank, shards of {args.shard_size} -->"
        )
        print(format_table(rows))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run_from_args(parser.parse_args()))


if __name__ == "__main__":
    main()
