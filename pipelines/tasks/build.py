"""The task factory: a run config's `task` -> its Task (model, per-sample loss, held-out metrics, export),
by name from TASKS, as pruners are by name from pruning/registry.py. Shared by the training loop and the
evaluators, so neither imports the other for it. A new task is a builder and one entry in TASKS.
"""

from __future__ import annotations

import os
from typing import Callable

from prunepipe.pipelines.data.description import DataDescription, SplitRecords
from prunepipe.pipelines.data.mixture import source_paths
from prunepipe.pipelines.data.shards import ShardIndex, index_file
from prunepipe.pipelines.tasks.protocol import Task


def build_mae(cfg, data: DataDescription | None, strata: bool | None) -> Task:
    """MAETask of the mae: section, at the decoded images' size; strata when the run normalises scores within them."""
    from prunepipe.pipelines.tasks.mae import MAETask

    wanted = cfg.score.normalise != "none" if strata is None else strata
    return MAETask(cfg.mae, image_size=cfg.data.resolution, channels=cfg.data.channels, strata=wanted)


def build_diffusion(cfg, data: DataDescription | None, strata: bool | None) -> Task:
    """DiffusionTask of the ldm: section, from the train split's records; its timestep is always its stratum."""
    from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask

    records = data.records if data is not None else train_records(cfg)
    size, channels = cfg.data.resolution, cfg.data.channels
    if cfg.ldm.space == "latents" and records.latent_shape:  # what `prunepipe latents encode` wrote
        channels, size = records.latent_shape[0], records.latent_shape[-1]
    return DiffusionTask(cfg.ldm, image_size=size, channels=channels, records=records)


# a config's `task` -> its builder: (the run config, its data description or None, strata or None) -> the Task
TASKS: dict[str, Callable[..., Task]] = {"mae": build_mae, "ldm": build_diffusion}


def build_task(cfg, *, data: DataDescription | None = None, strata: bool | None = None) -> Task:
    """The task of `cfg.task` (a RunConfig). `data`: the run's data description, whose records the task
    is built from (a run reads each index.json once); None reads data.train's here, where it is (eval,
    export, a benchmark). `strata`: report each draw's stratum (default: when the run normalises scores
    within strata); diffusion always does, its timestep costs nothing."""
    builder = TASKS.get(cfg.task)
    if builder is None:
        raise ValueError(f"task={cfg.task!r}: no such task; accepted: {', '.join(TASKS)}")
    return builder(cfg, data, strata)


def train_records(cfg) -> SplitRecords:
    """data.train's records read here: every source's (their bucket tables merged, as the stream batches
    them) where all their indexes are here, the first source's where only it is, else none."""
    paths = source_paths(cfg.data.train)
    present = [os.path.exists(index_file(path)) for path in paths]
    if paths and all(present):
        return DataDescription.load(cfg.data, val=False).records
    if paths and present[0]:
        return SplitRecords.of(ShardIndex.load(paths[0]))
    return SplitRecords()


def text_reading(task: Task) -> dict:
    """read_split's (and SampleDecoder's) keywords for the text a task's batches carry: captions,
    precomputed features, or none."""
    text = task.text
    width, max_length = text.features if text is not None else (0, 0)
    return {"captions": text is not None and text.captions, "text_width": width, "text_max_length": max_length}
