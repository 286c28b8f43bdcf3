"""Run folders as a comparison reads them: config.yaml, the per-pass records of metrics.jsonl (each
step once after a resume, `read_metrics`), and eval records (eval/step_*.json or `kind: eval` lines).
Read-only; evaluates and judges nothing.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from prunepipe.pipelines.evaluation.records import EVAL_DIR, PRIMARY_METRICS

RESUME = "resume"  # a resume marker's kind in metrics.jsonl (pipelines/training/metrics.py)
EVALUATED, LOGGED = "eval record", "training log"  # RunSummary.quality_from
# config keys that name a run or say how it is operated, not what it trains: runs differing only in
# these are seeds of one setting
IDENTITY_KEYS = (
    "name",
    "runs_dir",
    "run_dir",
    "seed",
    "log_every",
    "checkpoint",
    "debug_sync",
    "debug_device_sync",
    "dist_timeout_seconds",
    "eval",
)


@dataclass
class RunSummary:
    """What a comparison needs from one run folder."""

    path: str
    name: str
    task: str
    pruner: str
    seed: int
    passes: int
    passes_done: int = 0
    samples_forwarded: int = 0
    optimizer_steps: int = 0
    wall_seconds: float = 0.0
    metrics: dict = field(default_factory=dict)  # final quality: the latest eval record, else last held-out
    metrics_source: str = ""
    # where `metrics` come from: EVALUATED (an eval record of the run's last step), LOGGED (the training
    # log's last held-out record: the loop's held-out samples and weights), or "" (neither)
    quality_from: str = ""
    # eval.precision of the eval record `metrics` come from ("fp32", "bf16"); None when they come from
    # the training log
    precision: str | None = None
    trajectory: list = field(default_factory=list)  # per-pass records of metrics.jsonl
    evals: list = field(default_factory=list)  # eval records of the compared weights, by optimizer step
    evaluated_weights: tuple = ()  # the weights (ema, raw) any eval record of the run is of
    setting: str = ""  # the config without IDENTITY_KEYS: equal for seeds of one setting


def load_run(path: str, weights: str = "ema") -> RunSummary:
    """Summarise a run folder; quality comes from its latest eval/step_*.json with `weights`, or,
    when it was never evaluated, from the held-out metrics of its last pass (the training log)."""
    config_path = os.path.join(path, "config.yaml")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"run {path!r}: no config.yaml (not a prunepipe run folder)")
    config = OmegaConf.to_container(OmegaConf.load(config_path))
    run = RunSummary(
        path,
        str(config.get("name", os.path.basename(path))),
        config.get("task", "?"),
        str((config.get("pruner") or {}).get("name", "?")),
        int(config.get("seed", 0)),
        int(config.get("num_passes", 0)),
    )
    run.setting = json.dumps({k: v for k, v in config.items() if k not in IDENTITY_KEYS}, sort_keys=True, default=str)
    log_path = os.path.join(path, "metrics.jsonl")
    records = read_metrics(log_path) if os.path.isfile(log_path) else []
    run.trajectory = [r for r in records if r.get("kind") == "pass"]
    evals = [r for r in records if r.get("kind") == "eval"]
    for eval_path in glob.glob(os.path.join(path, EVAL_DIR, "step_*.json")):
        with open(eval_path) as f:
            evals.append({**json.load(f), "path": eval_path})
    run.evaluated_weights = tuple(sorted({e.get("weights", "ema") for e in evals}))
    run.evals = sorted(
        (e for e in evals if e.get("weights", "ema") == weights),
        key=lambda e: (e.get("optimizer_steps", 0), "path" in e),
    )
    if run.trajectory:
        last = run.trajectory[-1]
        run.passes_done = int(last["pass_index"]) + 1
        run.samples_forwarded = int(last["samples_forwarded"])
        run.optimizer_steps = int(last["optimizer_steps"])
        run.wall_seconds = float(last["wall_seconds"])
    if run.evals and run.evals[-1].get("optimizer_steps", 0) >= run.optimizer_steps:
        run.metrics = dict(run.evals[-1]["metrics"])
        run.metrics_source = os.path.relpath(run.evals[-1].get("path", log_path), path)
        run.precision = run.evals[-1]["precision"]
        run.quality_from = EVALUATED
    elif run.trajectory:
        run.metrics = held_out_metrics(run.trajectory[-1])
        older = (
            f"; its newest eval record is of step {run.evals[-1].get('optimizer_steps', 0)}, it trained to step "
            f"{run.optimizer_steps}"
            if run.evals
            else ""
        )
        run.metrics_source = f"metrics.jsonl, last pass held-out (not evaluated{older})"
        run.quality_from = LOGGED
    return run


def read_metrics(log_path: str) -> list[dict]:
    """The records of a metrics.jsonl as the run's history stands, in file order. A resumed run logs
    again the steps after its checkpoint: at each resume marker (pipelines/training/metrics.py) the
    earlier records past its `from_step` are dropped, and of records of one kind at one step (and
    pass, and weights) the latest is kept, so a plot or a comparison counts each step once. A line a
    kill cut short is skipped."""
    records: list[dict] = []
    with open(log_path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of a process killed mid-write
                continue
            if not isinstance(record, dict):
                continue
            if record.get("kind") == RESUME:
                at = int(record.get("from_step", 0))
                records = [r for r in records if r.get("kind") == RESUME or int(r.get("optimizer_steps", 0)) <= at]
            records.append(record)
    latest = {_step_key(r): i for i, r in enumerate(records)}
    return [r for i, r in enumerate(records) if latest[_step_key(r)] == i]


def _step_key(record: dict) -> tuple:
    """What makes two records the same record written twice (a resume marker is never one)."""
    if record.get("kind") == RESUME:
        return (RESUME, id(record))
    return (record.get("kind"), record.get("optimizer_steps"), record.get("pass_index"), record.get("weights"))


def held_out_metrics(record: dict) -> dict:
    return {k: float(v) for k, v in (record.get("held_out") or {}).items() if k in PRIMARY_METRICS}


def trajectory_value(run: RunSummary, metric: str, samples: float) -> float | None:
    """`run`'s held-out `metric` at `samples` forwarded, linearly interpolated between pass ends;
    None outside the logged range."""
    import numpy as np

    points = [
        (r["samples_forwarded"], r["held_out"][metric]) for r in run.trajectory if metric in (r.get("held_out") or {})
    ]
    if not points or samples < points[0][0] or samples > points[-1][0]:
        return None
    xs, ys = zip(*points)
    return float(np.interp(samples, xs, ys))
