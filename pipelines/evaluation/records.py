"""What evaluation leaves in a run folder and what a comparison reads back: eval/step_XXXXXX[_raw].json
records, written atomically, and the metrics `prunepipe compare` judges. No model, no torch.
"""

from __future__ import annotations

import os

from prunepipe.pipelines.atomic_write import atomic_write_json

EVAL_DIR = "eval"

# Metrics `prunepipe compare` judges, and whether higher is better; the rest is detail.
PRIMARY_METRICS = {
    "masked_mse": False,
    "psnr": True,
    "ssim": True,
    "probe_accuracy": True,
    "denoise_mse": False,
    "fid": False,
    "clip_score": True,
}


def lower_is_better(metric: str) -> bool:
    """Whether a lower value of `metric` is better, from the one table (PRIMARY_METRICS: True where
    higher is better); `fid@...`, a metric read at a setting, is its metric's."""
    name = metric.split("@")[0]
    if name not in PRIMARY_METRICS:
        raise ValueError(f"metric {metric!r}: accepted: {', '.join(PRIMARY_METRICS)}")
    return not PRIMARY_METRICS[name]


def record_path(run_dir: str, record: dict, ending: str = ".json") -> str:
    """RUN/eval/step_XXXXXX[_raw]`ending`: the record's file, or a file that goes with it."""
    suffix = "" if record.get("weights", "ema") == "ema" else f"_{record['weights']}"
    return os.path.join(run_dir, EVAL_DIR, f"step_{int(record.get('optimizer_steps', 0)):06d}{suffix}{ending}")


def write_record(run_dir: str, record: dict) -> str:
    """eval/step_XXXXXX[_raw].json, written atomically."""
    path = record_path(run_dir, record)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_json(path, record, indent=1)
    return path


def resolve_run_dir(run: str, runs_dir: str = "runs") -> str:
    """A run folder (holding config.yaml) from a path or a run name under `runs_dir`."""
    for candidate in (run, os.path.join(runs_dir, run)):
        if os.path.isfile(os.path.join(candidate, "config.yaml")):
            return candidate
    raise FileNotFoundError(
        f"run {run!r}: neither {run}/config.yaml nor {os.path.join(runs_dir, run)}/config.yaml exists"
    )
