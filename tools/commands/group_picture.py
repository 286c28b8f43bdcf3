"""A PNG of near-duplicate groups side by side, one group a row (the largest groups, then a few drawn at
random), decoded from the shards by sample id: people check duplicates by eye."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.shards import BadInputError, ShardIndex, read_shard

LABEL_WIDTH = 150


def chosen_groups(groups: np.ndarray, largest: int, random_groups: int, seed: int = 0) -> list[int]:
    """Group ids (first sample ids) of the `largest` biggest groups with copies, then `random_groups` others."""
    sizes = np.bincount(groups, minlength=len(groups))
    with_copies = np.flatnonzero(sizes > 1)
    biggest = with_copies[np.argsort(-sizes[with_copies], kind="stable")[:largest]]
    rest = np.setdiff1d(with_copies, biggest)
    drawn = np.random.default_rng(seed).choice(rest, min(random_groups, len(rest)), replace=False) if len(rest) else []
    return [int(g) for g in biggest] + sorted(int(g) for g in drawn)


def thumbnails(index: ShardIndex, ids: list[int], side: int) -> dict[int, Image.Image]:
    """The images of `ids`, decoded at `side` px, read shard by shard (other samples are seeked past);
    an id that cannot be read is left out."""
    decoder = SampleDecoder(resolution=side)
    first_ids = index.first_ids
    shard_of = index.shard_of(ids)
    images: dict[int, Image.Image] = {}
    for shard in np.unique(shard_of):
        wanted = {int(i) - int(first_ids[shard]) for i in np.asarray(ids)[shard_of == shard]}
        try:
            for position, sample in read_shard(
                index.urls[shard], lambda p: p in wanted, expected=index.expected(int(shard))
            ):
                if sample is not None and position in wanted:
                    pixels, _ = decoder.decode(sample, int(first_ids[shard]) + position)
                    images[int(first_ids[shard]) + position] = Image.fromarray(pixels.permute(1, 2, 0).numpy())
        except BadInputError:
            continue  # the picture shows what can be read; the tile stays grey
    return images


def draw_groups(
    shards_dir: str,
    groups: np.ndarray,
    path: str,
    *,
    largest: int = 4,
    random_groups: int = 4,
    per_group: int = 8,
    side: int = 64,
    seed: int = 0,
) -> list[int]:
    """Write the PNG at `path`: a row per chosen group, its first `per_group` members in id order, the
    group's first id and size on the left. Returns the group ids drawn (none: nothing is written)."""
    chosen = chosen_groups(groups, largest, random_groups, seed)
    if not chosen:
        return []
    sizes = np.bincount(groups, minlength=len(groups))
    members = {g: np.flatnonzero(groups == g)[:per_group].tolist() for g in chosen}
    images = thumbnails(ShardIndex.load(shards_dir), sorted(i for m in members.values() for i in m), side)
    gap = 4
    canvas = Image.new("RGB", (LABEL_WIDTH + per_group * (side + gap), len(chosen) * (side + gap) + gap), "white")
    draw = ImageDraw.Draw(canvas)
    for row, g in enumerate(chosen):
        top = gap + row * (side + gap)
        kind = "largest" if row < min(largest, len(chosen)) else "random"
        draw.text((4, top + 4), f"group {g}\n{sizes[g]} samples\n({kind})", fill="black")
        for column, sample_id in enumerate(members[g]):
            tile = images.get(sample_id, Image.new("RGB", (side, side), "grey"))
            canvas.paste(tile, (LABEL_WIDTH + column * (side + gap), top))
    canvas.save(path)
    return chosen
