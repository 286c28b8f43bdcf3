"""A run's trained model from one of its checkpoints: the run config, the task built from it, the
weights and the EMA loaded strictly. What `prunepipe eval` judges and `prunepipe export` writes out.
Never trains; touches no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from diffusers.training_utils import EMAModel

from prunepipe.pipelines.checkpoint.store import checked, load_checkpoint_states, newest_intact
from prunepipe.pipelines.config import RunConfig, load_config
from prunepipe.pipelines.evaluation.records import resolve_run_dir
from prunepipe.pipelines.tasks.build import build_task


@dataclass
class Trained:
    run_dir: str
    checkpoint: str  # the checkpoint folder read
    cfg: RunConfig
    task: object
    model: nn.Module  # the live weights
    ema: EMAModel | None  # None when the run kept no EMA
    position: dict  # the checkpoint's position record (pass, steps, samples, text identity)


def load_trained(run: str, checkpoint: str = "latest", *, runs_dir: str = "runs", doing: str = "evaluating") -> Trained:
    """`run` (a folder, or a name under `runs_dir`) at `checkpoint` (`latest` = its newest intact one)."""
    run_dir = resolve_run_dir(run, runs_dir)
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    folder = newest_intact(run_dir, doing=doing) if checkpoint == "latest" else checkpoint
    if folder is None or not os.path.isdir(folder):
        raise FileNotFoundError(
            f"run {run_dir}: no checkpoint {'folder ' + checkpoint if folder else 'yet'} "
            f"(checkpoints are written every checkpoint.every_steps and at the end of training)"
        )
    if checkpoint != "latest":
        checked(folder, "--checkpoint")
    states = load_checkpoint_states(folder)
    with torch.random.fork_rng(devices=[]):  # building the model draws an initialisation we overwrite
        task = build_task(cfg)
    task.model.load_state_dict(states["model"], strict=True)
    ema = None
    if states["ema"] is not None:
        ema = EMAModel(task.model.parameters())
        ema.load_state_dict(states["ema"])
    return Trained(run_dir, folder, cfg, task, task.model, ema, states["position"] or {})


def export_run(
    run: str, checkpoint: str = "latest", *, out: str = "", runs_dir: str = "runs", copy: bool = False
) -> tuple[str, list[str]]:
    """Write the export of `run` at `checkpoint` into `out` (default RUN/export, what the run writes at its
    end); returns (the folder, the paths written)."""
    trained = load_trained(run, checkpoint, runs_dir=runs_dir, doing="exporting")
    out = out or os.path.join(trained.run_dir, "export")
    keywords = {"copy": copy} if trained.cfg.task == "ldm" else {}
    return out, trained.task.export(trained.model, trained.ema, out, **keywords)
