"""How much of a per-sample score is the sample, and how much the mask or timestep drawn with it.

For one trained run: draw K masks (MAE) or timesteps and noise (diffusion) for every sample of a
split with the run's own weights, and measure, for the raw loss and for the loss normalised within
its stratum (the share the mask hid, the timestep; bucket means pooled over all draws, as the
running normaliser settles to them):

- `between_share`: the share of the score's variance that lies between samples (one-way ANOVA,
  the intraclass correlation ICC(1)); 1 = the draw does not matter, 0 = the score is all draw;
- `rank_corr`: Spearman correlation of two independent draws' scores over the samples;
- `below_mean_agree`: how often two draws agree on whether a sample is below the mean (InfoBatch's
  candidates), beside `chance`, the agreement of two independent coins with the same marginals.

With sample keys that name near-duplicates (`_dup`, as `prunepipe shards write --source redundant`
writes them) it also reports, per kind, the mean relative score and, from the run's last pruner
state, how often its pruner would skip a sample of that kind in its last pruned passes.

    prunepipe bench scores RUN [--draws 8] [--samples 2000] [--split train]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import scipy.stats
import torch

from prunepipe.pipelines.checkpoint.store import load_checkpoint_states, newest_intact
from prunepipe.pipelines.config import load_config, pruner_hparams
from prunepipe.pipelines.data.shards import ShardIndex, read_shard
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.evaluation.records import resolve_run_dir
from prunepipe.pipelines.tasks.build import build_task
from prunepipe.pipelines.tasks.randomness import SampleRandomness
from prunepipe.pipelines.training.groups import use_group_table
from prunepipe.pruning import ScoreNormaliser, build_pruner

DRAW_SEED = 7_000_003  # far from any training seed: these draws are not the training run's
NORMALISER_BUCKETS = 20


def sample_keys(folder: str, count: int) -> list[str]:
    """The `__key__` of the first `count` samples of a split, in id order."""
    keys: list[str] = []
    index = ShardIndex.load(folder)
    for shard, url in enumerate(index.urls):
        for _, sample in read_shard(url, expected=index.expected(shard)):
            keys.append("" if sample is None else str(sample.get("__key__", "")))
            if len(keys) == count:
                return keys
    return keys


def draw_losses(task, model, batches, draws: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids [N], losses [K, N] and strata [K, N] (-1 where the task reports none) of K draws."""
    ids, losses, strata = [], [], []
    with torch.no_grad():
        for batch in batches:
            per_draw = [
                task.per_sample(model, batch, SampleRandomness(DRAW_SEED + k, 0, batch.ids)) for k in range(draws)
            ]
            ids.append(batch.ids.numpy())
            losses.append(np.stack([out.loss.float().numpy() for out in per_draw]))
            strata.append(
                np.stack(
                    [
                        out.stratum.numpy() if out.stratum is not None else np.full(len(batch.ids), -1)
                        for out in per_draw
                    ]
                )
            )
    return np.concatenate(ids), np.concatenate(losses, axis=1), np.concatenate(strata, axis=1)


def normalised(losses: np.ndarray, strata: np.ndarray, num_strata: int) -> np.ndarray:
    """Each loss over the mean loss of its stratum bucket, pooled over every draw and sample."""
    if num_strata <= 0 or (strata < 0).any():
        return losses
    buckets = ScoreNormaliser("stratum_mean", num_strata, buckets=NORMALISER_BUCKETS).bucket(strata)
    means = np.zeros(NORMALISER_BUCKETS)
    for b in np.unique(buckets):
        means[b] = losses[buckets == b].mean()
    return losses / np.maximum(means[buckets], 1e-12)


def reliability(scores: np.ndarray) -> dict:
    """scores [K, N] -> between_share, rank_corr, below_mean_agree and its chance level."""
    k, n = scores.shape
    sample_means = scores.mean(axis=0)
    within = scores.var(axis=0, ddof=1).mean()  # mean square within samples
    between = k * sample_means.var(ddof=1)  # mean square between samples
    icc = (between - within) / (between + (k - 1) * within)
    pairs = [(a, a + 1) for a in range(0, k - 1, 2)]  # disjoint pairs: independent estimates
    rank = np.mean([scipy.stats.spearmanr(scores[a], scores[b])[0] for a, b in pairs])
    below = scores < scores.mean(axis=1, keepdims=True)
    agree = np.mean([np.mean(below[a] == below[b]) for a, b in pairs])
    q = below.mean()
    return {
        "between_share": float(icc),
        "rank_corr": float(rank),
        "below_mean_agree": float(agree),
        "chance": float(q * q + (1 - q) * (1 - q)),
    }


def kinds_of(keys: list[str]) -> np.ndarray | None:
    """'duplicate' or 'unique' per key, or None when no key names a near-duplicate."""
    duplicate = np.array(["_dup" in key for key in keys])
    return np.where(duplicate, "duplicate", "unique") if duplicate.any() else None


def skip_probability(run_cfg, folder: str, num_samples: int, passes: int = 4) -> np.ndarray | None:
    """Per sample, the share of `passes` pruned passes in which the run's pruner, holding the scores
    of its last checkpoint, skips it (the last pruned passes: same scores, each pass its own coins);
    None for a run without a pruner."""
    state = load_checkpoint_states(folder, read_model=False)["pruner"]
    if state is None or run_cfg.pruner["name"] == "full":
        return None
    pruner = build_pruner(
        run_cfg.pruner["name"], num_samples, run_cfg.num_passes, seed=run_cfg.seed, **pruner_hparams(run_cfg.pruner)
    )
    if run_cfg.pruner.get("groups"):  # dedup: its group table, which the checkpoint's state must match
        use_group_table(pruner, run_cfg.pruner["groups"], run_cfg.data.train, ShardIndex.load(run_cfg.data.train))
    pruner.load_state_dict(state)
    ids = np.arange(num_samples, dtype=np.int64)
    last = max(pruner.first_full_pass - 1, 0)
    skipped = np.zeros(num_samples)
    recent = range(max(last - passes + 1, 0), last + 1)
    for pass_index in recent:
        pruner.plan(pass_index)
        skipped += pruner.weights(ids) == 0
    return skipped / len(recent)


def analyse(
    run: str,
    *,
    draws: int = 8,
    samples: int = 2000,
    split: str = "train",
    runs_dir: str = "runs",
    batch_size: int = 128,
) -> dict:
    if draws < 2:
        raise ValueError(f"--draws must be >= 2 (pairs of draws are compared), got {draws}")
    run_dir = resolve_run_dir(run, runs_dir)
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    folder = newest_intact(run_dir, doing="reading scores")
    if folder is None:
        raise FileNotFoundError(f"run {run_dir}: no intact checkpoint to read weights from")
    with torch.random.fork_rng(devices=[]):  # the initialisation drawn here is overwritten
        task = build_task(cfg, strata=True)
    task.model.load_state_dict(load_checkpoint_states(folder)["model"], strict=True)
    task.model.eval()
    data = getattr(cfg.data, split)
    batches = read_split(
        data,
        resolution=cfg.data.resolution,
        channels=cfg.data.channels,
        batch_size=batch_size,
        max_samples=samples,
        desc=f"{split} x {draws} draws",
    )
    ids, losses, strata = draw_losses(task, task.model, batches, draws)
    report = {
        "run": run_dir,
        "checkpoint": folder,
        "split": split,
        "draws": draws,
        "samples": len(ids),
        "raw": reliability(losses),
    }
    scores = normalised(losses, strata, task.num_strata)
    if scores is not losses:
        report["normalised"] = reliability(scores)
    kinds = kinds_of(sample_keys(data, len(ids))) if split == "train" else None
    if kinds is not None:
        skip = skip_probability(cfg, folder, ShardIndex.load(cfg.data.train).num_samples)
        per_kind = {}
        for kind in ("unique", "duplicate"):
            mine = kinds == kind
            row = {
                "samples": int(mine.sum()),
                "raw_relative": float(losses[:, mine].mean() / losses.mean()),
                "normalised_relative": float(scores[:, mine].mean() / scores.mean()),
            }
            if skip is not None:
                row["skip_probability"] = float(skip[ids[mine]].mean())
            per_kind[kind] = row
        report["kinds"] = per_kind
    return report


def render(report: dict) -> str:
    lines = [
        f"{report['run']}: {report['samples']} {report['split']} samples x {report['draws']} draws",
        f"{'score':<12}{'between-sample share':>22}{'rank corr of 2 draws':>22}{'below-mean agree':>18}{'chance':>8}",
    ]
    for name in ("raw", "normalised"):
        if name in report:
            r = report[name]
            lines.append(
                f"{name:<12}{r['between_share']:>22.3f}{r['rank_corr']:>22.3f}{r['below_mean_agree']:>18.3f}"
                f"{r['chance']:>8.3f}"
            )
    for kind, row in report.get("kinds", {}).items():
        skip = f", pruner skips {row['skip_probability']:.1%}" if "skip_probability" in row else ""
        lines.append(
            f"{kind}: {row['samples']} samples, mean raw score x{row['raw_relative']:.3f} of all, "
            f"normalised x{row['normalised_relative']:.3f}{skip}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run folder, or its name under --runs-dir")
    parser.add_argument("--draws", type=int, default=8, help="masks / timesteps drawn per sample")
    parser.add_argument("--samples", type=int, default=2000, help="the first N samples of the split (0 = all)")
    parser.add_argument("--split", choices=("train", "val"), default="train")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--json", default="", help="also write the report to this JSON file")


def run_from_args(args) -> int:
    report = analyse(args.run, draws=args.draws, samples=args.samples, split=args.split, runs_dir=args.runs_dir)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
