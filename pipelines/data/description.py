"""What a run's data is, read once: every source of `data.train` and `data.val` through its index.json, at
a run's start on every rank, then handed to the data check (pipelines/config.py), the task and the stream.
A task is built from the train split's records here (latent shape, bucket table, text features, VAE),
never from a shard path. Reads index.json files only (shards.py's one reader); never a shard, never a model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator

from prunepipe.pipelines.data.mixture import Mixture, Source, parse_sources
from prunepipe.pipelines.data.shards import TEXT_NULL_FILE, ShardIndex


@dataclass(frozen=True)
class VaeRecord:
    """The VAE a split's latents were encoded with, as `prunepipe latents encode` names it in index.json."""

    name: str  # a folder or a hub id
    subfolder: str = ""
    scaling_factor: float | None = None  # the latents hold (z - shift) * scale
    shift_factor: float | None = None


@dataclass(frozen=True)
class TextFeatureRecord:
    """The text features `latents encode --text-encoder` stored with a split: the encoder's identity as it
    recorded it (index.json's `text_encoder`), the features' width (`text_width`), and the empty caption's
    features beside the index (text_null.npy)."""

    encoder: dict  # TextEncoder.identity() at encoding time: files' digest, max_length, ...
    width: int
    index_path: str  # the index.json that records them, for messages

    @property
    def max_length(self) -> int:
        return int(self.encoder["max_length"])

    @property
    def null_path(self) -> str:
        return os.path.join(os.path.dirname(self.index_path), TEXT_NULL_FILE)


@dataclass(frozen=True)
class SplitRecords:
    """What a split's index.json says its samples are, beyond the shard list: what a task is built from.
    Empty (the default) where there is no index to read: a task built away from its data."""

    meta: dict = field(default_factory=dict)  # every key as stored (source, keys, resolution, ...)
    index_path: str = ""  # for messages, and where text_null.npy lies
    buckets: list[dict] = field(default_factory=list)  # {"name", "image", "shape"} each; [] when not bucketed

    @classmethod
    def of(cls, index: ShardIndex) -> SplitRecords:
        return cls(dict(index.meta), index.path, index.bucket_table)

    @property
    def latent_shape(self) -> tuple[int, ...] | None:
        """[C, h, w] of the latents `latents encode` stored (a bucketed split's base shape); None for images."""
        shape = self.meta.get("latent_shape")
        return tuple(int(v) for v in shape) if shape else None

    @property
    def resolution(self) -> int | None:
        """The side of the images the latents were encoded from, where recorded."""
        resolution = self.meta.get("resolution")
        return resolution if isinstance(resolution, int) and not isinstance(resolution, bool) else None

    @property
    def vae(self) -> VaeRecord | None:
        """The VAE the latents were encoded with; None where the index names none."""
        name = self.meta.get("vae")
        if not name:
            return None
        return VaeRecord(
            str(name), self.meta.get("subfolder") or "", self.meta.get("scaling_factor"), self.meta.get("shift_factor")
        )

    @property
    def text_features(self) -> TextFeatureRecord | None:
        """The stored text features' record; None where the index records none."""
        encoder, width = self.meta.get("text_encoder"), self.meta.get("text_width")
        if not isinstance(encoder, dict) or width is None:
            return None
        return TextFeatureRecord(dict(encoder), int(width), self.index_path)


@dataclass(frozen=True)
class DataDescription:
    """The sources of a run's splits and their indexes: data.train as one Mixture (ids laid end to end)
    beside each source's own index, and each held-out source of data.val."""

    train: Mixture
    train_indexes: tuple[ShardIndex, ...]  # one per source of `train`, in its order
    val: tuple[tuple[Source, ShardIndex], ...] = ()

    @classmethod
    def load(cls, data, *, val: bool = True) -> DataDescription:
        """Every source's index.json of `data` (a run config's data section: train, val, samples_per_pass),
        each read once; data.train's alone with `val` false."""
        sources = parse_sources(data.train, "data.train")
        if not sources:
            raise ValueError("data.train: no shards to train on")
        read: dict[str, ShardIndex] = {}  # a folder named twice (a train source judged as held out) read once

        def index(path: str) -> ShardIndex:
            if path not in read:
                read[path] = ShardIndex.load(path)
            return read[path]

        indexes = [index(source.path) for source in sources]
        train = Mixture.of(sources, indexes, samples_per_pass=data.samples_per_pass)
        held_out = parse_sources(data.val, "data.val", rules=False) if val else ()
        return cls(train, tuple(indexes), tuple((source, index(source.path)) for source in held_out))

    @property
    def records(self) -> SplitRecords:
        """The train split's records: its first source's keys (a mixture's sources agree on what a sample
        is: mixture.AGREED_META), the sources' bucket tables merged as the stream batches them."""
        return SplitRecords(dict(self.train.index.meta), self.train_indexes[0].path, self.train.index.bucket_table)

    def indexes(self) -> Iterator[tuple[str, Source, ShardIndex]]:
        """(its setting, the source, its index) for every source, data.train's then data.val's."""
        for source, index in zip(self.train.sources, self.train_indexes):
            yield "data.train", source, index
        for source, index in self.val:
            yield "data.val", source, index
