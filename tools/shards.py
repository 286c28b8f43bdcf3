"""`prunepipe shards write | index | inspect`: make WebDataset shards, index shards written
elsewhere, and look at what a shard folder holds.

Layout written: OUT/train/shard-000000.tar ... + OUT/train/index.json, and the same for val (and, for
the redundant source, val_mix: held-out data drawn from the train mix; val is clean).
"""

from __future__ import annotations

import glob
import io
import os
from collections import Counter

import numpy as np
import webdataset as wds
from braceexpand import braceexpand
from PIL import Image

from pipelines.data.shards import ShardIndex, count_samples, read_shard
from pipelines.progress import tracked
from tools.sources import load_source, redundant_splits

SPLITS = ("train", "val")


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def write_shards(
    source: str,
    out: str,
    *,
    size: int = 32,
    shard_size: int = 500,
    val_fraction: float = 0.1,
    seed: int = 0,
    folder: str | None = None,
    crops_per_photo: int = 250,
    redundant_fraction: float = 0.5,
    redundant_originals: int = 64,
) -> dict[str, str]:
    """Write the splits of `source` (train and val; `redundant` also val_mix and train_dedup) with webdataset's
    ShardWriter; returns index paths."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if source == "redundant":
        splits = redundant_splits(size, fraction=redundant_fraction, originals=redundant_originals,
                                  val_fraction=val_fraction, crops_per_photo=crops_per_photo, seed=seed)
        meta = {"redundant_fraction": redundant_fraction, "redundant_originals": redundant_originals}
    else:
        items = list(load_source(source, size=size, folder=folder, seed=seed, crops_per_photo=crops_per_photo))
        # A fixed permutation decides the split, so val holds every class in proportion.
        is_val = np.zeros(len(items), dtype=bool)
        is_val[np.random.default_rng(seed).permutation(len(items))[: int(round(val_fraction * len(items)))]] = True
        splits = {split: [item for item, v in zip(items, is_val) if v == (split == "val")] for split in SPLITS}
        meta = {}
    return {split: write_split(os.path.join(out, split), chosen, source=source, size=size, shard_size=shard_size,
                               desc=f"{source}/{split}", **meta)
            for split, chosen in splits.items() if chosen}


def write_split(folder: str, items: list, *, source: str, size: int, shard_size: int, desc: str, **meta) -> str:
    """(key, image, label) items as PNG shards in `folder` with their index.json; returns its path."""
    os.makedirs(folder, exist_ok=True)
    for stale in glob.glob(os.path.join(folder, "shard-*.tar")):
        os.remove(stale)
    entries: list[tuple[str, int]] = []
    pattern = os.path.join(folder, "shard-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0) as writer:
        writer.post = lambda fname: entries.append((fname, writer.count))
        for key, image, label in tracked(items, desc=desc, unit="img"):
            sample = {"__key__": key, "png": png_bytes(image)}
            if label >= 0:
                sample["cls"] = str(label)
            writer.write(sample)
    return ShardIndex.write(folder, entries, source=source, size=size, keys=["png", "cls"], **meta)


def shard_urls(sources: list[str]) -> list[str]:
    """Expand folders (their *.tar), globs and brace patterns into a sorted list of shard urls."""
    urls: list[str] = []
    for source in sources:
        for pattern in braceexpand(source):
            if os.path.isdir(pattern):
                urls += sorted(glob.glob(os.path.join(pattern, "*.tar")))
            elif any(c in pattern for c in "*?[") and "://" not in pattern:
                urls += sorted(glob.glob(pattern))
            else:
                urls.append(pattern)
    if not urls:
        raise FileNotFoundError(f"no shards found in {sources}")
    return urls


def index_shards(sources: list[str], out: str) -> str:
    """Read each shard once and write `out`/index.json (img2dataset and plain-tar layouts)."""
    entries, keys = [], set()
    for url in tracked(shard_urls(sources), desc="indexing", unit="shard"):
        count, fields = count_samples(url)
        entries.append((url, count))
        keys.update(fields)
    os.makedirs(out, exist_ok=True)
    return ShardIndex.write(out, entries, keys=sorted(keys))


def inspect_shards(location: str, grid_path: str | None = None, grid_count: int = 64) -> dict:
    """Counts, fields and labels of an indexed shard folder; optionally a PNG grid of images."""
    from pipelines.data.decode import SampleDecoder

    index = ShardIndex.load(location)
    fields, labels = Counter(), Counter()
    images = []
    decoder = SampleDecoder(resolution=int(index.meta.get("size", 32)))
    for url in index.urls:
        for _, sample in read_shard(url):
            fields.update(k for k in sample if not k.startswith("__"))
            if "cls" in sample:
                labels[int(sample["cls"])] += 1
            if grid_path and len(images) < grid_count:
                images.append(decoder(sample, 0, 0)[0])
    report = {
        "index": index.path,
        "shards": len(index),
        "samples": index.num_samples,
        "fields": dict(fields),
        "labels": dict(sorted(labels.items())),
    }
    if grid_path and images:
        import torch
        from torchvision.utils import save_image

        save_image((torch.stack(images) + 1) / 2, grid_path, nrow=int(np.ceil(np.sqrt(len(images)))))
        report["grid"] = grid_path
    return report
