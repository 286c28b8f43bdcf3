"""The shard readers a loader worker holds in a bucketed pass: each bucket's stream reads a batch at a
time and closes its shard in between, so a worker whose part spans every bucket of pixart512's 33
holds at most one reader open (never one per bucket), and a resumed part yields exactly the rest.
A bucketed held-out read at 512 ranks opens only the shards holding the rank's own ids."""

from __future__ import annotations

import contextlib
import io
import os

import numpy as np
import pytest
import webdataset as wds

import prunepipe.pipelines.data.stream as stream_module
from prunepipe.pipelines.data.shards import ShardEntry, ShardIndex
from prunepipe.pipelines.data.stream import PartOfPass, ShardStream

BUCKETS = 33  # diffusers' PixArt 512 table
RANKS, WORKERS = 64, 8
SHARDS_PER_BUCKET, PER_SHARD = 4, 256  # 1024 samples a bucket: two batches of each bucket for every slot
MAX_OPEN = 4


@pytest.fixture(scope="module")
def bucketed_33(tmp_path_factory) -> ShardIndex:
    """33 buckets of tiny latents, a tar per (input shard, bucket) as `latents encode --buckets` writes."""
    folder = tmp_path_factory.mktemp("buckets33")
    table = [{"name": f"{8 + b}x16", "image": [8 + b, 16], "shape": [1, 1, 1 + b % 4]} for b in range(BUCKETS)]
    entries = []
    for shard in range(SHARDS_PER_BUCKET):
        for bucket in range(BUCKETS):
            path = os.path.join(folder, f"{shard:03d}_{bucket:02d}.tar")
            with wds.TarWriter(path) as sink:
                for position in range(PER_SHARD):
                    raw = io.BytesIO()
                    np.save(raw, np.full(table[bucket]["shape"], position, dtype=np.float16))
                    sink.write({"__key__": f"{shard:03d}_{bucket:02d}_{position:04d}", "latent.npy": raw.getvalue()})
            entries.append(ShardEntry(path, PER_SHARD, os.path.getsize(path), None, bucket))
    ShardIndex.write(str(folder), entries, buckets=table, latent_shape=[1, 1, 1])
    return ShardIndex.load(str(folder))


@contextlib.contextmanager
def counted_readers(monkeypatch):
    """[readers open now, the most open at once, the urls opened in turn] over every shard read of the stream."""
    counts = [0, 0, []]
    real = stream_module.read_shard

    def counting(*args, **kwargs):
        counts[2].append(args[0])
        counts[0] += 1
        counts[1] = max(counts[1], counts[0])
        try:
            yield from real(*args, **kwargs)
        finally:
            counts[0] -= 1

    monkeypatch.setattr(stream_module, "read_shard", counting)
    yield counts


def part_batches(stream: ShardStream, rank: int, worker: int, skip: int = 0) -> list:
    """The batches loader worker `worker` of rank `rank` yields in pass 0 of a 64 x 8 layout, in this process."""
    layout = stream.layout(0, None, WORKERS)
    slot = rank * WORKERS + worker
    part = PartOfPass(
        1,
        0,
        None,
        None,
        worker,
        layout.slices[slot],
        int(layout.batches[rank][worker]),
        skip,
        (0,) * BUCKETS,
        tuple(int(v) for v in layout.bucket_batches[slot]),
    )
    stream._reader._in_process = part
    return list(iter(stream._reader))


@pytest.mark.parametrize("rank, worker", [(0, 0), (37, 5)])
def test_a_worker_spanning_33_buckets_holds_at_most_four_shard_readers(bucketed_33, monkeypatch, rank, worker):
    stream = ShardStream(bucketed_33, batch_size=1, seed=3, rank=rank, world_size=RANKS, shuffle_buffer=64)
    with counted_readers(monkeypatch) as counts:
        batches = part_batches(stream, rank, worker)
    assert len({b.bucket for b in batches}) == BUCKETS, "the part reads every bucket, in turns"
    assert counts[0] == 0, "every reader is closed at the part's end"
    assert counts[1] <= MAX_OPEN, f"{counts[1]} shard readers open at once"


def test_a_resumed_bucketed_part_yields_exactly_the_rest(bucketed_33):
    stream = ShardStream(bucketed_33, batch_size=1, seed=3, rank=5, world_size=RANKS, shuffle_buffer=64)
    whole = [(b.bucket, b.ids.tolist()) for b in part_batches(stream, 5, 2)]
    for skip in (1, 17):
        rest = [(b.bucket, b.ids.tolist()) for b in part_batches(stream, 5, 2, skip=skip)]
        assert rest == whole[skip:], f"resumed after {skip} batches"


def test_a_bucketed_held_out_read_at_512_ranks_opens_only_the_shards_holding_a_ranks_ids(bucketed_33, monkeypatch):
    import prunepipe.pipelines.data.splits as splits

    world, held_out = 512, 4096
    chosen = splits.chosen_ids(bucketed_33, held_out)
    assert chosen is not None, "a bucketed split's held-out samples are spread over it"
    real = splits.read_shard
    opened: dict[str, int] = {}  # url -> the last position read

    def recording(url, *args, **kwargs):
        opened[url] = -1
        for position, sample in real(url, *args, **kwargs):
            opened[url] = position
            yield position, sample

    monkeypatch.setattr(splits, "read_shard", recording)
    for rank in (0, 1, 300, 511):
        opened.clear()
        batches = list(
            splits.read_split(
                bucketed_33.path,
                resolution=8,
                channels=1,
                batch_size=4,
                max_samples=held_out,
                rank=rank,
                world_size=world,
            )
        )
        mine = sorted(i for i, ordinal in chosen.items() if ordinal % world == rank)
        assert sorted(i for b in batches for i in b.ids.tolist()) == mine
        holding = {bucketed_33.urls[s] for s in bucketed_33.shard_of(mine).tolist()}
        assert set(opened) == holding, f"rank {rank} opened {len(opened)} shards, {len(holding)} hold its ids"
        assert len(opened) <= len(mine) == held_out // world
        for url, last in opened.items():
            shard = bucketed_33.urls.index(url)
            first = int(bucketed_33.first_ids[shard])
            assert last == max(i for i in mine if bucketed_33.shard_of([i])[0] == shard) - first, (
                "stopped after its last"
            )


def test_a_bucketed_part_over_pipe_shards_reads_each_whole_once_and_yields_the_same(bucketed_33, monkeypatch):
    """A `pipe:` shard cannot be opened at a byte: its stream reads it once, at its first turn, up to its
    last sample for the slot, and holds the selected samples; the batches are the local ones."""
    import dataclasses

    piped = dataclasses.replace(bucketed_33, urls=tuple(f"pipe:cat {url}" for url in bucketed_33.urls))
    local = ShardStream(bucketed_33, batch_size=1, seed=3, rank=9, world_size=RANKS, shuffle_buffer=64)
    remote = ShardStream(piped, batch_size=1, seed=3, rank=9, world_size=RANKS, shuffle_buffer=64)
    expected = [(b.bucket, b.ids.tolist()) for b in part_batches(local, 9, 4)]
    with counted_readers(monkeypatch) as counts:
        got = [(b.bucket, b.ids.tolist()) for b in part_batches(remote, 9, 4)]
    assert got == expected
    assert counts[1] <= MAX_OPEN
    assert len(counts[2]) == len(set(counts[2])), "each pipe: shard is run once"
