"""The run's trackers (log_with: tensorboard, wandb, ...), through accelerate's: `log_with` given to the
Accelerator, `init_trackers` with the run's config on rank 0, `accelerator.log` for every number of a
metrics.jsonl record, each tracker's `log_images` for the previews. metrics.jsonl stays the record that
reports read; trackers are for watching a run. TensorBoard writes RUN/tensorboard/PROJECT/, W&B RUN/wandb/.

A resumed run trains again the steps between its checkpoint and where the stopped process got to:
TensorBoard purges the stopped process's points past the checkpoint (`purge_step`); W&B continues the
same run (its id kept in RUN/wandb_run_id) and keeps what it has for steps it already saw.
"""

from __future__ import annotations

import json
import math
import os
import uuid

from omegaconf import OmegaConf

from prunepipe.pipelines.config import RunConfig

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
EXTRA = {"wandb": "pip install 'prunepipe[wandb]'", "tensorboard": "pip install tensorboard"}  # how to get one


def accelerator_logging(cfg: RunConfig) -> dict:
    """The Accelerator's keyword arguments for the run's trackers; a tracker not installed stops the run
    here, on every rank alike, naming how to install it (accelerate would leave it out silently)."""
    if not cfg.log_with:
        return {}
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import ProjectConfiguration

    available = {str(t) for t in get_available_trackers()}
    missing = [name for name in cfg.log_with if name not in available]
    if missing:
        how = "; ".join(EXTRA.get(name, f"pip install {name}") for name in missing)
        raise ValueError(
            f"log_with={list(cfg.log_with)}: {', '.join(missing)} is not installed here ({how}), or leave it out "
            f"of log_with"
        )
    project = ProjectConfiguration(project_dir=cfg.run_dir, logging_dir=os.path.join(cfg.run_dir, TENSORBOARD_DIR))
    return {"log_with": list(cfg.log_with), "project_config": project}


def start_trackers(accelerator, cfg: RunConfig, resumed_from_step: int | None) -> None:
    """init_trackers on rank 0 (accelerate runs it there only) with the run's config as flat `a.b: value` pairs."""
    if not cfg.log_with or not accelerator.is_main_process:
        return
    init: dict = {}
    if resumed_from_step is not None:
        init["tensorboard"] = {"purge_step": resumed_from_step + 1}  # the stopped process's later points go
    if "wandb" in cfg.log_with:
        init["wandb"] = {"name": cfg.name, "dir": cfg.run_dir, "id": wandb_run_id(cfg.run_dir, resumed_from_step)}
        init["wandb"]["resume"] = "allow"
    accelerator.init_trackers(cfg.tracker_project, config=flat_config(cfg), init_kwargs=init)


def wandb_run_id(run_dir: str, resumed_from_step: int | None) -> str:
    """The W&B run id of this run folder: kept in RUN/wandb_run_id by its first start, read on a resume."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if resumed_from_step is not None and os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    run_id = uuid.uuid4().hex[:8]  # as wandb.util.generate_id's: 8 characters of [0-9a-z]
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id


def flat_config(cfg: RunConfig) -> dict:
    """The run config as {"optim.lr": 0.001, ...}: what TensorBoard's hparams and W&B's config accept
    (lists and mappings as JSON text, nothing as "")."""
    flat: dict = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                walk(value, name + ".")
            elif value is None:
                flat[name] = ""
            elif isinstance(value, (bool, int, float, str)):
                flat[name] = value
            else:
                flat[name] = json.dumps(value)

    walk(OmegaConf.to_container(OmegaConf.structured(cfg)), "")
    return flat


def scalars(record: dict) -> dict:
    """A metrics.jsonl record's numbers as tracker scalars, `KIND/key` (nested: `KIND/held_out/denoise_mse`),
    the step and flags left out."""
    kind = record.get("kind", "train")
    found: dict = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/")
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                found[f"{prefix}{key}"] = value

    walk({k: v for k, v in record.items() if k != "optimizer_steps"}, f"{kind}/")
    return found


def log_record(accelerator, record: dict) -> None:
    """Every number of `record` to every tracker, at its optimizer step (rank 0 only, as accelerate logs)."""
    if accelerator is None or not accelerator.trackers:
        return
    values = scalars(record)
    if values:
        accelerator.log(values, step=int(record.get("optimizer_steps", 0)))


def log_picture(accelerator, key: str, picture, step: int) -> None:
    """A uint8 [H, W, 3] picture to every tracker that takes images, at `step` (rank 0 only)."""
    if accelerator is None or not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({key: picture[None]}, step=step, dataformats="NHWC")
            tracker.writer.flush()
        elif hasattr(tracker, "log_images"):
            tracker.log_images({key: [picture]}, step=step)
