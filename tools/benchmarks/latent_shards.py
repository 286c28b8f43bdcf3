"""Random latent shards in the layout `prunepipe latents encode` writes: stand-ins for encoded images
where only the shape matters (throughput), so that no VAE has to be at hand."""

from __future__ import annotations

import os

import numpy as np
import webdataset as wds

from prunepipe.pipelines.checkpoint.manifest import file_crc32
from prunepipe.pipelines.data.shards import ShardEntry, ShardIndex
from prunepipe.tools.commands.latents import LATENT_FIELD, npy_bytes


def write_random_latents(folder: str, count: int, shape: tuple[int, ...], shard_size: int = 512, seed: int = 0) -> str:
    """`count` standard-normal float32 latents of `shape` in shards of `shard_size`; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards = []
    for first in range(0, count, shard_size):
        path = os.path.join(folder, f"shard-{first // shard_size:06d}.tar")
        n = min(shard_size, count - first)
        with wds.TarWriter(path) as sink:
            for i in range(first, first + n):
                latent = rng.standard_normal(shape).astype(np.float32)
                sink.write({"__key__": f"latent{i:07d}", LATENT_FIELD: npy_bytes(latent)})
        shards.append(ShardEntry(path, n, os.path.getsize(path), file_crc32(path)))
    ShardIndex.write(folder, shards, latent_shape=list(shape))
    return folder
