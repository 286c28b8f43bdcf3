"""The task factory: a run config's `task` -> its Task (model, per-sample loss, held-out metrics,
export). Shared by the training loop and the evaluators, so neither imports the other for it.
"""

from __future__ import annotations

import os

from prunepipe.pipelines.data.mixture import Mixture, first_path, source_paths
from prunepipe.pipelines.data.shards import ShardIndex, index_file


def build_task(cfg, *, strata: bool | None = None, mixture: Mixture | None = None):
    """The task of `cfg.task` (a RunConfig): mae -> MAETask, ldm -> DiffusionTask. `strata`: report
    each draw's stratum (default: when the run normalises scores within strata); diffusion always
    does, its timestep costs nothing. `mixture`: data.train as the loop loaded it, whose index the task
    reads instead of loading the shards' index.json again (at a billion samples, seconds a load)."""
    if cfg.task == "mae":
        from prunepipe.pipelines.tasks.mae import MAETask

        wanted = cfg.score.normalise != "none" if strata is None else strata
        return MAETask(cfg.mae, image_size=cfg.data.resolution, channels=cfg.data.channels, strata=wanted)
    from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask

    size, channels = cfg.data.resolution, cfg.data.channels
    meta = None if mixture is None else dict(mixture.index.meta)  # the first source's, buckets merged
    if cfg.ldm.space == "latents":  # the shards say what `prunepipe latents encode` wrote
        # a mixture's sources agree on it (pipelines/data/mixture.py)
        shape = (ShardIndex.load(first_path(cfg.data.train)).meta if meta is None else meta).get("latent_shape")
        if shape:
            channels, size = int(shape[0]), int(shape[-1])
    return DiffusionTask(
        cfg.ldm,
        image_size=size,
        channels=channels,
        shards=first_path(cfg.data.train),
        buckets=train_buckets(cfg.data.train) if mixture is None else mixture.index.bucket_table,
        train_meta=meta,
    )


def train_buckets(train) -> list[dict] | None:
    """The aspect-ratio buckets of `data.train` (index.json's `buckets`; a mixture's sources' tables
    merged by shape, as its stream batches them): [] when not bucketed, None when an index is not here
    (the task then reads the first source's, if any)."""
    paths = source_paths(train)
    if not paths or not all(os.path.exists(index_file(path)) for path in paths):
        return None
    return Mixture.load(train).index.bucket_table


def text_reading(task) -> dict:
    """read_split's (and SampleDecoder's) keywords for the text a task's batches carry: captions,
    precomputed features, or none."""
    text = task.text
    width, max_length = text.features if text is not None else (0, 0)
    return {"captions": text is not None and text.captions, "text_width": width, "text_max_length": max_length}
