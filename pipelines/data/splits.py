"""Every sample of a split, in index order, for the evaluators: no pruning, no shuffling, no
augmentation and no dropped tail (the training stream drops partial batches; an evaluation must
not). Never skips a bad sample silently: it stops, naming shard and key.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from prunepipe.pipelines.data.batch import Batch, text_fields
from prunepipe.pipelines.data.decode import SampleDecoder, caption, text_features
from prunepipe.pipelines.data.shards import ShardIndex, read_shard
from prunepipe.pipelines.progress import progress


def read_split(
    folder: str | ShardIndex,
    *,
    resolution: int,
    channels: int,
    batch_size: int = 64,
    max_samples: int = 0,
    rank: int = 0,
    world_size: int = 1,
    desc: str = "",
    captions: bool = False,
    text_width: int = 0,
    text_max_length: int = 0,
) -> Iterator[Batch]:
    """Batches of the first `max_samples` samples (0 = all) of the shards in `folder` (or of an index
    read already), in index order.

    With `world_size` > 1 this rank gets the samples whose id (their position in that order) is
    congruent to `rank`: the others' bytes are skipped in the tar reader (seeked past on a local file),
    so a rank reads and decodes about its share, not the whole split. Weights are 1. With `captions`
    each batch carries the samples' captions, with `text_width` their precomputed text features (a
    sample without them stops the read, naming it).

    A bucketed split (aspect-ratio buckets, `ShardIndex.buckets`) yields batches of one bucket each: a
    pending batch per bucket, yielded when full, the partial ones at the end in bucket order; nothing is
    dropped and the order is a function of the index alone. There `max_samples` takes samples evenly
    spaced over the split (`chosen_ids`), not its first ones: each input shard's samples are grouped
    by bucket, widest first, so a prefix would hold the wide buckets only. Rank r then takes the chosen
    samples r, r + world, ... in index order.

    A rank opens only the shards that hold its own samples (`own_ids`) and stops reading each after its
    last one there.
    """
    index = folder if isinstance(folder, ShardIndex) else ShardIndex.load(folder)
    total = index.num_samples if max_samples <= 0 else min(max_samples, index.num_samples)
    decoder = SampleDecoder(
        resolution, channels, captions=captions, text_width=text_width, text_max_length=text_max_length
    )
    pending: dict[int, tuple[list, list, list, list]] = {}  # per bucket (-1: unbucketed): ids, images, labels, texts
    taken = chosen_ids(index, total)  # ordinal in the split of each chosen id
    mine = own_ids(index, total, rank, world_size, taken)
    # Only the shards holding this rank's ids are opened, each read up to its last wanted sample: at 512
    # ranks a rank's few held-out ids sit in a few shards, not in every shard the split's ids touch.
    shards, ends = np.unique(index.shard_of(mine), return_index=True)
    last_of = dict(zip(shards.tolist(), mine[np.r_[ends[1:], len(mine)] - 1].tolist())) if len(mine) else {}
    wanted = set(mine.tolist())
    found = 0
    bar = progress(len(mine), desc=desc or f"reading {index.path}", unit="img", disable=rank != 0)
    for shard in sorted(last_of):
        url, first = index.urls[shard], int(index.first_ids[shard])
        last = last_of[shard] - first
        bucket = -1 if index.buckets is None else int(index.buckets[shard])
        reader = read_shard(url, lambda p, first=first: first + p in wanted, expected=index.expected(shard))
        for position, sample in reader:
            if sample is not None:
                found += 1
                ids, images, labels, texts = pending.setdefault(bucket, ([], [], [], []))
                texts.append(decoder.text(sample))
                image, label = decoder.decode(sample, first + position)
                ids.append(first + position)
                images.append(image)
                labels.append(label)
                if len(ids) == batch_size:
                    yield _batch(decoder, ids, images, labels, texts, bucket)
                    del pending[bucket]
            if position >= last:
                reader.close()  # the rest of the shard is other ranks' or not held out
                break
        bar.update(found - bar.n)
    bar.close()
    if found < len(mine):
        raise ValueError(
            f"{index.path}: lists {index.num_samples} samples but its shards held only {found} of rank "
            f"{rank}'s {len(mine)} held-out samples (a shard holds fewer samples than the index says)"
        )
    for bucket in sorted(pending):
        yield _batch(decoder, *pending[bucket], bucket)


def own_ids(index: ShardIndex, total: int, rank: int, world: int, taken: dict[int, int] | None) -> np.ndarray:
    """int64, sorted: the ids rank `rank` of `world` reads of the split's first `total` (or of `taken`'s
    chosen ones): those whose ordinal is congruent to `rank`."""
    if taken is None:
        return np.arange(rank, total, world, dtype=np.int64)
    return np.array(sorted(i for i, ordinal in taken.items() if ordinal % world == rank), dtype=np.int64)


def chosen_ids(index: ShardIndex, total: int) -> dict[int, int] | None:
    """{id: its ordinal} of the `total` samples a bucketed split's reader takes, evenly spaced in index
    order (every bucket of every input shard in proportion); None where the split is read from its
    start (unbucketed, or all of it)."""
    if index.buckets is None or total >= index.num_samples:
        return None
    ids = (np.arange(total, dtype=np.int64) * index.num_samples) // total
    return {int(i): k for k, i in enumerate(ids)}


def read_captions(folder: str, max_samples: int = 0) -> list[str]:
    """The captions (`txt`) of the first `max_samples` samples (0 = all) of `folder`, in index order,
    without decoding an image: the held-out prompts a text-conditional model is sampled from. A
    sample without a caption stops the read, naming its shard and key."""
    index = ShardIndex.load(folder)
    total = index.num_samples if max_samples <= 0 else min(max_samples, index.num_samples)
    texts: list[str] = []
    for shard, url in enumerate(index.urls):
        for _, sample in read_shard(url, expected=index.expected(shard)):
            if len(texts) == total:
                return texts
            texts.append(caption(sample))
    if len(texts) < total:
        raise ValueError(f"{index.path}: lists {index.num_samples} samples but its shards held only {len(texts)}")
    return texts


def read_text_features(folder: str, ids, width: int, max_length: int) -> dict[int, np.ndarray]:
    """{id: its precomputed text features [n, width]} for the sample ids `ids` (positions in index
    order) of `folder`: the held-out prompts of a run on precomputed features, each rank reading its
    own; the other samples' bytes are seeked past. A sample without them stops the read, naming it."""
    index = ShardIndex.load(folder)
    wanted = {int(i) for i in ids}
    if wanted and max(wanted) >= index.num_samples:
        raise ValueError(f"{index.path}: lists {index.num_samples} samples; sample {max(wanted)} was asked for")
    found: dict[int, np.ndarray] = {}
    holding = set(index.shard_of(sorted(wanted)).tolist())
    for shard, url in enumerate(index.urls):
        first = int(index.first_ids[shard])
        if shard not in holding:
            continue
        expected = index.expected(shard)
        last = max(i for i in wanted if first <= i < first + int(index.counts[shard])) - first
        reader = read_shard(url, lambda p, first=first: first + p in wanted, expected=expected)
        for position, sample in reader:
            if sample is not None:
                found[first + position] = text_features(sample, width, max_length)
            if position >= last:  # the rest of the shard is other ranks'
                reader.close()
                break
    missing = sorted(wanted - found.keys())
    if missing:
        raise ValueError(
            f"{index.path}: lists {index.num_samples} samples, but its shards held no sample "
            f"{missing[0]} ({len(missing)} of the {len(wanted)} asked for missing)"
        )
    return found


def _batch(decoder: SampleDecoder, ids, images, labels, texts, bucket: int = -1) -> Batch:
    return Batch(
        torch.tensor(ids, dtype=torch.int64),
        torch.ones(len(ids)),
        decoder.finish(torch.stack(images), np.array(ids, dtype=np.int64), 0),
        torch.tensor(labels, dtype=torch.int64),
        **text_fields(texts, captions=decoder.captions, width=decoder.text_width),
        bucket=bucket,
    )
