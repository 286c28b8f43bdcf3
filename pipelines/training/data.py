"""The data a run trains and is judged on, as the loop reads it: the training stream over the mixture
(pre-decode pruning, decode with the augmentations, batches with the text the task reads) and each
held-out source's batches, decoded once. Which samples a pass keeps is the pruner's plan, never decided here.
"""

from __future__ import annotations

from prunepipe.pipelines.config import RunConfig
from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.description import DataDescription
from prunepipe.pipelines.data.mixture import Mixture, parse_sources
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pipelines.tasks.build import text_reading
from prunepipe.pipelines.tasks.protocol import Task


def train_stream(cfg: RunConfig, mixture: Mixture, task: Task, rank: int, world: int) -> ShardStream:
    """The stream of data.train for this rank: its loader workers live for the run, each pass posted to them."""
    decoder = SampleDecoder(
        cfg.data.resolution,
        cfg.data.channels,
        hflip=cfg.data.hflip,
        seed=cfg.seed,
        num_classes=task.label_classes,
        crop=cfg.data.crop,
        crop_scale=tuple(cfg.data.crop_scale),
        pixels_on_device=True,  # the loop's Batch.to finishes them on its device
        **text_reading(task),
    )
    return ShardStream(
        mixture.index,
        batch_size=cfg.data.batch_size,
        seed=cfg.seed,
        rank=rank,
        world_size=world,
        decoder=decoder,
        shuffle_buffer=cfg.data.shuffle_buffer,
        on_bad_sample=cfg.data.on_bad_sample,
        retry=cfg.data.remote,
        mixture=mixture,
    )


def load_held_out(
    cfg: RunConfig, task: Task, rank: int = 0, world: int = 1, data: DataDescription | None = None
) -> dict[str, list] | None:
    """Per held-out source (data.val: one folder, or a list of sources), this rank's share of the first
    `data.val_batches` batches of its shards in index order, decoded once (possibly empty), with the text
    `task` reads for a text-conditional run; None when the run has no val shards. `data`: the run's data
    description, whose held-out indexes are read already."""
    if data is not None:
        held_out = list(data.val)
    else:
        held_out = [(source, source.path) for source in parse_sources(cfg.data.val, "data.val", rules=False)]
    if not held_out:
        return None
    return {
        source.name: list(
            read_split(
                index,
                resolution=cfg.data.resolution,
                channels=cfg.data.channels,
                batch_size=cfg.data.batch_size,
                max_samples=cfg.data.val_batches * cfg.data.batch_size,
                rank=rank,
                world_size=world,
                desc=f"held-out samples{' of ' + source.name if len(held_out) > 1 else ''}",
                **text_reading(task),
            )
        )
        for source, index in held_out
    }
