"""A run's trained model from one of its checkpoints: the run config, the task built from it, the
weights and the EMA loaded strictly. What `prunepipe eval` judges (`evaluate_checkpoint`, with the
evaluators of pipelines/evaluation/) and `prunepipe export` writes out. Never trains; only an
evaluation's collectives touch the process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from diffusers.training_utils import EMAModel

from prunepipe.pipelines.checkpoint.store import checked, load_checkpoint_states, newest_intact
from prunepipe.pipelines.config import RunConfig, load_config
from prunepipe.pipelines.data.mixture import first_path
from prunepipe.pipelines.evaluation.config import EvalConfig, load_eval_config
from prunepipe.pipelines.evaluation.needs import plan_evaluation
from prunepipe.pipelines.evaluation.records import resolve_run_dir
from prunepipe.pipelines.evaluation.runner import Evaluator, check_text_identity, eval_config_of, refuse_to_overwrite
from prunepipe.pipelines.progress import position_label
from prunepipe.pipelines.ranks import decided_on_rank0
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


def evaluate_checkpoint(
    run: str,
    checkpoint: str = "latest",
    eval_cfg: EvalConfig | None = None,
    *,
    config_path: str | None = None,
    overrides: list[str] = (),
    runs_dir: str = "runs",
    device: str | None = None,
    write: bool = True,
    overwrite: bool = True,
) -> dict:
    """Evaluate one checkpoint of a run (a folder, or a name under `runs_dir`; `latest` = its newest
    intact checkpoint) and write RUN/eval/step_XXXXXX.json; returns the record. Without `eval_cfg`
    the settings are the run config's `eval:` section (or the defaults) <- `config_path` <- `overrides`.
    `overwrite=False` (what `prunepipe eval` does without --overwrite) refuses, before evaluating, to
    replace a record already written for these weights at this step: the run's own evaluation, or an
    earlier one at other settings, is what `prunepipe compare` reads."""
    trained = load_trained(run, checkpoint, runs_dir=runs_dir)
    run_dir, run_cfg, folder, task, model = (
        trained.run_dir,
        trained.cfg,
        trained.checkpoint,
        trained.task,
        trained.model,
    )
    eval_cfg = eval_cfg or load_eval_config(eval_config_of(run_cfg), config_path, list(overrides))
    if write and not overwrite:
        # rank 0 decides: a record written between two ranks' checks would send them different ways
        steps = trained.position.get("optimizer_steps", 0)
        decided_on_rank0(lambda: refuse_to_overwrite(run_dir, steps, eval_cfg.weights))
    # every missing piece at once, before anything is evaluated (`prunepipe eval` checks before the load too)
    decided_on_rank0(lambda: plan_evaluation(run_cfg, eval_cfg))
    check_text_identity(
        folder,
        trained.position.get("text_identity", ""),
        task,
        eval_cfg.val or first_path(run_cfg.data.val, "data.val"),
    )
    if eval_cfg.weights == "ema":
        if trained.ema is None:
            raise ValueError(f"{folder}: holds no EMA state; evaluate the raw weights with weights=raw")
        trained.ema.copy_to(model.parameters())
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(dev)
    position = trained.position
    at = {
        key: position[key]
        for key in ("pass_index", "optimizer_steps", "samples_forwarded", "wall_seconds")
        if key in position
    }
    if "pass_index" in position:
        # between passes a checkpoint's pass_index counts the passes done; the record names the pass its
        # weights finished (0-based), as the training loop's own eval record of the same step does
        inside = position.get("batch_in_pass", 0) > 0 or position["pass_index"] == 0
        at["pass_index"] = position["pass_index"] if inside else position["pass_index"] - 1
        at["pass"] = position_label(position["pass_index"], position.get("batch_in_pass", 0), run_cfg.num_passes)
    at["checkpoint"] = os.path.abspath(folder)
    return Evaluator(run_cfg, eval_cfg, run_dir=run_dir, device=dev).evaluate(task, model, at=at, write=write)
