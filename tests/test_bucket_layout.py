"""Aspect-ratio buckets as a specification: a batch holds samples of one bucket (one latent shape), every
rank takes the same number of steps, each kept sample is delivered at most once and all but a bounded
tail are, buckets interleave across steps, pruned samples are never decoded, and a pass resumed
mid-way (undecodable samples skipped with the batches they were read for) goes on with exactly the
rest; on real latent shards, one bucket a shard."""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import webdataset as wds
from test_data import CountingDecoder

from prunepipe.pipelines.checkpoint.position import TrainingPosition
from prunepipe.pipelines.data.batch import Batch, real_samples
from prunepipe.pipelines.data.layout import SliceOfShard, pass_layout
from prunepipe.pipelines.data.mixture import Mixture, PassUnits
from prunepipe.pipelines.data.shards import ShardEntry, ShardIndex
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pipelines.training.bad_input import BadInputTally, undecodable_of_rank
from prunepipe.pruning.base import FrozenPlan
from prunepipe.pruning.pass_plan import PassPlan

BATCH = 8
SHAPES = {"32x48": [4, 4, 6], "48x32": [4, 6, 4], "40x40": [4, 5, 5]}


def table(names) -> list[dict]:
    return [{"name": n, "image": [8 * s[1], 8 * s[2]], "shape": s} for n, s in ((n, SHAPES[n]) for n in names)]


def write_bucketed(folder, shards: list[tuple[int, int]], names, *, first_id: int = 0, corrupt=()) -> str:
    """Shards of (bucket, samples) each, the buckets `names` (keys of SHAPES); sample i's latent is its
    bucket's shape filled with first_id + i. Positions (shard, position) in `corrupt` hold bytes that
    are not a .npy. Indexed with sizes, CRC-32s and buckets; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    entries, sample_id = [], first_id
    buckets = table(names)
    for s, (bucket, count) in enumerate(shards):
        path = os.path.join(folder, f"{s:03d}.tar")
        with wds.TarWriter(path) as sink:
            for position in range(count):
                latent = np.full(buckets[bucket]["shape"], float(sample_id), dtype=np.float32)
                raw = io.BytesIO()
                np.save(raw, latent)
                data = b"not a npy" if (s, position) in corrupt else raw.getvalue()
                sink.write({"__key__": f"{s:03d}_{position:04d}", "latent.npy": data})
                sample_id += 1
        with open(path, "rb") as f:
            crc = zlib.crc32(f.read())
        entries.append(ShardEntry(path, count, os.path.getsize(path), crc, bucket))
    ShardIndex.write(str(folder), entries, buckets=buckets, latent_shape=[4, 5, 5])
    return str(folder)


# three buckets, skewed: 160, 60 and 13 samples, shards interleaved in index order
SKEWED = [(0, 40), (1, 30), (0, 40), (2, 13), (0, 40), (1, 30), (0, 40)]
# for resuming: bucket 1 larger, every seventh of its samples undecodable
RESUMED = [(0, 40), (1, 60), (0, 40), (2, 24), (1, 60)]
CORRUPT = {(s, p) for s in (1, 4) for p in range(3, 60, 7)}


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory) -> str:
    return write_bucketed(tmp_path_factory.mktemp("bucketed"), SKEWED, ["32x48", "48x32", "40x40"])


@pytest.fixture(scope="module")
def bucketed_corrupt(tmp_path_factory) -> str:
    return write_bucketed(tmp_path_factory.mktemp("corrupt"), RESUMED, ["32x48", "48x32", "40x40"], corrupt=CORRUPT)


def half_plan(index: ShardIndex, pass_index: int) -> PassPlan:
    """Drops a deterministic pseudo-random half before decoding, weights the rest by 2."""
    return PassPlan(pass_index, FrozenPlan(77, pass_index, index.num_samples, 0.5, None))


def bucket_of_ids(index: ShardIndex, ids: np.ndarray) -> np.ndarray:
    return index.buckets[np.searchsorted(index.first_ids, ids, side="right") - 1]


def run_pass(
    index, pass_index, plan=None, *, world, workers, seed=0, skip=0, undecodable=None, shuffle_buffer=32, **kw
):
    """Every rank's batches of one pass, ranks one after the other in this process."""
    per_rank = []
    for rank in range(world):
        stream = ShardStream(
            index, batch_size=BATCH, seed=seed, rank=rank, world_size=world, shuffle_buffer=shuffle_buffer, **kw
        )
        loader = stream.pass_loader(
            pass_index,
            plan,
            num_workers=workers,
            skip_batches=skip,
            skip_undecodable=None if undecodable is None else undecodable[rank],
        )
        per_rank.append(list(loader))
        assert len(per_rank[-1]) == len(loader)
        stream.close()
    return per_rank, loader.layout


def check_batches_of_one_bucket(index: ShardIndex, batches) -> None:
    shapes = index.bucket_shapes
    for batch in batches:
        assert batch.bucket >= 0
        assert tuple(batch.images.shape) == (BATCH, *shapes[batch.bucket]), "a batch of one bucket's shape"
        real = batch.ids >= 0
        ids = batch.ids[real].numpy()
        assert (bucket_of_ids(index, ids) == batch.bucket).all(), "a sample of another bucket in the batch"
        # each latent is filled with its id: the tensor is the sample the id names
        assert torch.equal(batch.images[real][:, 0, 0, 0], batch.ids[real].float())
        assert (batch.images[~real] == 0).all()


# ----------------------------------------------------------------------------- the layout, as a property


def reference_unbucketed(index, kept_per_shard, seed, pass_index, world, workers, batch):
    """The unbucketed layout as it was before buckets (its slices and batch counts), kept verbatim."""
    workers = max(1, workers)
    order = np.random.default_rng([seed, pass_index]).permutation(len(index)).astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(kept_per_shard[order])])
    total = int(cum[-1])
    slots = world * workers
    bounds = [t * total // slots for t in range(slots + 1)]
    slices = []
    for t in range(slots):
        lo, hi, mine = bounds[t], bounds[t + 1], []
        j = int(np.searchsorted(cum, lo, side="right")) - 1
        while j < len(order) and cum[j] < hi:
            start, end = max(lo, cum[j]) - cum[j], min(hi, cum[j + 1]) - cum[j]
            if end > start:
                mine.append(SliceOfShard(int(order[j]), int(start), int(end), bool(end == cum[j + 1] - cum[j])))
            j += 1
        slices.append(tuple(mine))
    batches = np.diff(bounds).reshape(world, workers) // batch
    steps = int(batches.sum(axis=1).min())
    for rank in range(world):
        while batches[rank].sum() > steps:
            batches[rank, int(np.argmax(batches[rank]))] -= 1
    return tuple(slices), batches


def random_index(rng, *, bucketed: bool) -> ShardIndex:
    shards = int(rng.integers(1, 14))
    counts = rng.integers(0, 90, shards).astype(np.int64)
    counts[0] = max(counts[0], 1)
    if not bucketed:
        return ShardIndex(tuple(f"s{i}.tar" for i in range(shards)), counts)
    num_buckets = int(rng.integers(1, 5))
    skew = rng.dirichlet(np.full(num_buckets, 0.4))  # some buckets far larger than others, some empty
    buckets = rng.choice(num_buckets, shards, p=skew).astype(np.int64)
    meta = {"buckets": table(list(SHAPES)[:1] * num_buckets)}
    return ShardIndex(tuple(f"s{i}.tar" for i in range(shards)), counts, meta=meta, buckets=buckets)


def check_bucketed_layout(index, layout, unit_shard, unit_copy, unit_kept, world, workers) -> None:
    workers = max(1, workers)
    slots = world * workers
    num_buckets = index.num_buckets
    assert layout.batches.sum(axis=1).tolist() == [layout.steps] * world, "every rank the same steps"
    assert layout.bucket_batches.shape == (slots, num_buckets)
    assert np.array_equal(layout.bucket_batches.sum(axis=1).reshape(world, workers), layout.batches)
    unit_bucket = index.buckets[unit_shard]
    kept_per_bucket = np.bincount(unit_bucket, weights=unit_kept, minlength=num_buckets).astype(np.int64)
    assert layout.kept_per_bucket.tolist() == kept_per_bucket.tolist() and layout.kept == kept_per_bucket.sum()
    # the pieces partition every unit's kept samples: each kept sample belongs to one slot
    covered = {u: np.zeros(int(k), dtype=np.int64) for u, k in enumerate(unit_kept)}
    where = {(int(s), int(c)): u for u, (s, c) in enumerate(zip(unit_shard, unit_copy))}
    # where each unit's kept samples start in its bucket's run (its units in the pass's order)
    run_start = {}
    for b in range(num_buckets):
        mine = [int(u) for u in layout.shard_order if unit_bucket[u] == b]
        for u, start in zip(mine, np.concatenate([[0], np.cumsum(unit_kept[mine])])):
            run_start[u] = int(start)
    for slot, pieces in enumerate(layout.slices):
        for b in range(num_buckets):
            mine = [p for p in pieces if index.buckets[p.shard] == b]
            size = sum(p.kept_end - p.kept_start for p in mine)
            assert size >= layout.bucket_batches[slot, b] * BATCH, "a slot reads at least its batches"
            # one contiguous run of the bucket's kept samples in the pass's order
            spans = [(run_start[where[p.shard, p.copy]] + p.kept_start, p.kept_end - p.kept_start) for p in mine]
            for (a, n), (c, _) in zip(spans, spans[1:]):
                assert c == a + n, "a slot's share of a bucket with a gap, or out of order"
        for p in pieces:
            u = where[p.shard, p.copy]
            covered[u][p.kept_start : p.kept_end] += 1
            assert p.to_shard_end == (p.kept_end == unit_kept[u])
    assert all((c == 1).all() for c in covered.values()), "a kept sample in no slot or in two"
    # the tail: each bucket's partial batch, and at most one batch trimmed from each rank but one
    assert 0 <= layout.tail == layout.kept - layout.steps * world * BATCH
    assert layout.tail <= num_buckets * (BATCH - 1) + (world - 1) * BATCH
    assert layout.tail >= int((kept_per_bucket % BATCH).sum())


def test_bucketed_layouts_give_every_rank_the_same_steps_and_a_bounded_tail():
    rng = np.random.default_rng(0)
    for trial in range(30):
        index = random_index(rng, bucketed=True)
        pruned = trial % 2 == 1
        kept = (rng.random(index.num_samples) < 0.6) if pruned else np.ones(index.num_samples, dtype=bool)
        kept_per_shard = np.array([kept[a : a + n].sum() for a, n in zip(index.first_ids, index.counts)])
        unit = np.arange(len(index))
        for world in range(1, 5):
            for workers in range(4):
                seed = int(rng.integers(1000))
                layout = pass_layout(
                    index,
                    kept_per_shard if pruned else None,
                    seed=seed,
                    pass_index=trial,
                    world_size=world,
                    num_workers=workers,
                    batch_size=BATCH,
                )
                check_bucketed_layout(index, layout, unit, np.zeros_like(unit), kept_per_shard, world, workers)


def test_bucketed_layouts_of_a_mixtures_walks():
    """A mixture's units walk some shards twice and some in part: a unit's bucket is its shard's."""
    rng = np.random.default_rng(1)
    for trial in range(12):
        index = random_index(rng, bucketed=True)
        copies = rng.integers(1, 4, len(index))
        shard = np.repeat(np.arange(len(index)), copies)
        copy = np.concatenate([np.arange(c) for c in copies])
        kept = np.array([int(rng.integers(0, index.counts[s] + 1)) for s in shard], dtype=np.int64)
        units = PassUnits(shard, copy, kept)
        for world, workers in ((1, 0), (2, 3), (3, 1), (4, 2)):
            layout = pass_layout(
                index,
                None,
                seed=trial,
                pass_index=2,
                world_size=world,
                num_workers=workers,
                batch_size=BATCH,
                units=units,
            )
            check_bucketed_layout(index, layout, shard, copy, kept, world, workers)


def test_an_unbucketed_layout_is_what_it_was():
    rng = np.random.default_rng(2)
    for trial in range(20):
        index = random_index(rng, bucketed=False)
        kept = np.array([int(rng.integers(0, n + 1)) for n in index.counts], dtype=np.int64)
        for world, workers in ((1, 0), (2, 2), (3, 3), (4, 1)):
            layout = pass_layout(
                index, kept, seed=trial, pass_index=1, world_size=world, num_workers=workers, batch_size=BATCH
            )
            slices, batches = reference_unbucketed(index, kept, trial, 1, world, workers, BATCH)
            assert layout.slices == slices and np.array_equal(layout.batches, batches)
            assert layout.bucket_batches is None and layout.kept_per_bucket is None


# ----------------------------------------------------------------------------- the stream on real shards


@pytest.mark.parametrize("pruned", [False, True], ids=["full", "half-dropped"])
def test_batches_of_one_bucket_cover_the_kept_samples_once_with_equal_steps(bucketed, pruned):
    index = ShardIndex.load(bucketed)
    assert index.num_buckets == 3
    interleaved = False
    for world in (1, 2, 3):
        for pass_index in range(2):
            plan = half_plan(index, pass_index) if pruned else None
            per_rank, layout = run_pass(index, pass_index, plan, world=world, workers=0, seed=pass_index)
            assert {len(b) for b in per_rank} == {layout.steps}, "every rank the same steps"
            for batches in per_rank:
                check_batches_of_one_bucket(index, batches)
                order = [b.bucket for b in batches]
                runs = 1 + sum(a != b for a, b in zip(order, order[1:]))  # runs of one bucket
                interleaved |= runs > len(set(order))  # some bucket's batches not all together
            seen = np.concatenate([b.ids.numpy() for r in per_rank for b in r])
            assert (seen >= 0).all(), "no padding without bad input"
            assert len(np.unique(seen)) == len(seen), "a sample delivered twice in one pass"
            kept = np.arange(index.num_samples) if plan is None else np.flatnonzero(plan.kept_mask())
            assert set(seen.tolist()) <= set(kept.tolist()), "a pruned sample reached a batch"
            assert len(kept) - len(seen) == layout.tail <= 3 * (BATCH - 1) + (world - 1) * BATCH
            assert layout.kept_per_bucket.tolist() == np.bincount(bucket_of_ids(index, kept), minlength=3).tolist()
            if plan is not None:
                assert all(bool((b.weights == 2.0).all()) for r in per_rank for b in r)
    assert interleaved, "batches of different buckets interleave across steps (not all of one bucket first)"


def test_pruned_samples_are_never_decoded_and_only_batched_ones_are(bucketed):
    index = ShardIndex.load(bucketed)
    plan = half_plan(index, 0)
    decoder = CountingDecoder()
    per_rank, layout = run_pass(index, 0, plan, world=1, workers=0, decoder=decoder)
    decoded = np.array(decoder.decoded)
    assert plan.kept_mask()[decoded].all(), "a pruned sample was decoded"
    assert len(decoded) == layout.steps * BATCH, "the tail is read, never decoded"
    np.testing.assert_array_equal(np.sort(decoded), np.sort(np.concatenate([b.ids.numpy() for b in per_rank[0]])))


def tallies(index, per_rank, skip: int, world: int, workers: int) -> np.ndarray:
    """The checkpoint's undecodable table after each rank's first `skip` batches: each rank's tally of
    what it trained, laid end to end as BadInputTally.sum_over_ranks lays them."""
    cfg = SimpleNamespace(data=SimpleNamespace(max_bad_samples=-1))
    rows = []
    for rank, batches in enumerate(per_rank):
        tally = BadInputTally(cfg)
        tally.begin_pass(TrainingPosition(), rank, world, workers, buckets=index.num_buckets)
        for batch in batches[:skip]:
            tally.saw(batch, TrainingPosition())
        rows.append(tally.undecodable)
    return np.concatenate(rows)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_resumed_mid_way_yields_exactly_the_rest(bucketed_corrupt, workers):
    index = ShardIndex.load(bucketed_corrupt)
    world, buckets = 2, index.num_buckets
    plan = half_plan(index, 1) if workers else None
    full, layout = run_pass(index, 1, plan, world=world, workers=workers, on_bad_sample="skip")
    for batches in full:
        check_batches_of_one_bucket(index, batches)
    skip = layout.steps // 2 + 1
    table = tallies(index, full, skip, world, workers)
    assert len(table) == world * max(1, workers) * buckets
    assert table.sum() > 0, "undecodable samples met before the stop: the resume must skip them too"
    assert table.reshape(-1, buckets)[:, [0, 2]].sum() == 0, "only bucket 1 holds bad samples"
    position = TrainingPosition(pass_index=1, batch_in_pass=skip, world_size=world, num_workers=workers)
    position.load_state_dict(position.state_dict() | {"undecodable": [int(v) for v in table]})  # as a checkpoint
    undecodable = [undecodable_of_rank(position, r, world, max(1, workers), buckets) for r in range(world)]
    resumed, _ = run_pass(
        index, 1, plan, world=world, workers=workers, skip=skip, undecodable=undecodable, on_bad_sample="skip"
    )
    for rank in range(world):
        rest = full[rank][skip:]
        assert len(resumed[rank]) == len(rest) == layout.steps - skip
        for a, b in zip(rest, resumed[rank]):
            assert a.bucket == b.bucket and a.worker == b.worker
            assert torch.equal(a.ids, b.ids) and torch.equal(a.images, b.images) and torch.equal(a.weights, b.weights)
    # without the undecodable counts the resumed order would be off: the test can fail
    blind, _ = run_pass(index, 1, plan, world=world, workers=workers, skip=skip, on_bad_sample="skip")
    assert any(not torch.equal(a.ids, b.ids) for rank in range(world) for a, b in zip(full[rank][skip:], blind[rank]))


def test_padding_is_shaped_like_its_bucket_even_before_anything_of_it_was_decoded(tmp_path):
    """A bucket whose only shard is mostly bad: its batches are padded, shaped by the bucket's shape."""
    folder = write_bucketed(
        tmp_path / "s", [(0, 24), (1, 16)], ["32x48", "48x32"], corrupt={(1, p) for p in range(1, 16)}
    )
    index = ShardIndex.load(folder)
    per_rank, layout = run_pass(index, 0, world=1, workers=0, on_bad_sample="skip", shuffle_buffer=1)
    check_batches_of_one_bucket(index, per_rank[0])
    ones = [b for b in per_rank[0] if b.bucket == 1]
    assert len(ones) == 2 and sum(int((b.ids >= 0).sum()) for b in ones) == 1
    assert sum(b.undecodable() for b in ones) == 15
    # resumed past the one decodable sample of bucket 1, with nothing of bucket 1 decoded since
    order = [b.bucket for b in per_rank[0]]
    first_one = order.index(1)
    skip = first_one + 1
    table = tallies(index, per_rank, skip, 1, 0)
    resumed, _ = run_pass(
        index, 0, world=1, workers=0, skip=skip, undecodable=[table], on_bad_sample="skip", shuffle_buffer=1
    )
    for a, b in zip(per_rank[0][skip:], resumed[0]):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.images, b.images) and a.bucket == b.bucket


def test_a_mixture_of_two_bucketed_sources_batches_by_shape(tmp_path):
    a = write_bucketed(tmp_path / "a", [(0, 30), (1, 26), (0, 21)], ["32x48", "40x40"])
    b = write_bucketed(tmp_path / "b", [(0, 19), (1, 33)], ["40x40", "48x32"], first_id=77)
    mixture = Mixture.load([{"name": "a", "path": a, "repeat": 1.0}, {"name": "b", "path": b, "repeat": 1.5}])
    index = mixture.index
    assert [tuple(s) for s in index.bucket_shapes] == [(4, 4, 6), (4, 5, 5), (4, 6, 4)], "merged by shape"
    world = 2
    streams = [
        ShardStream(index, batch_size=BATCH, rank=r, world_size=world, mixture=mixture, shuffle_buffer=16)
        for r in range(world)
    ]
    per_rank = [list(s.pass_loader(0, None, num_workers=0)) for s in streams]
    layout = streams[0].layout(0, None, 0)
    assert {len(r) for r in per_rank} == {layout.steps}
    for batches in per_rank:
        check_batches_of_one_bucket(index, batches)
    seen = np.concatenate([x.ids.numpy() for r in per_rank for x in r])
    counts = np.bincount(seen, minlength=index.num_samples)
    walks = np.where(mixture.source_of(np.arange(index.num_samples)) == 0, 1, 2)
    assert (counts <= walks).all(), "a sample delivered more often than its source is walked"
    drawn = mixture.draw(0, 0).drawn
    assert layout.kept_per_source.tolist() == drawn.tolist() and layout.kept_per_bucket.sum() == drawn.sum()
    assert drawn.sum() - len(seen) == layout.tail <= 3 * (BATCH - 1) + (world - 1) * BATCH


def test_a_bucketed_held_out_split_reads_every_sample_in_batches_of_one_bucket(bucketed):
    index = ShardIndex.load(bucketed)
    for world in (1, 2):
        seen = []
        for rank in range(world):
            batches = list(
                read_split(bucketed, resolution=32, channels=4, batch_size=BATCH, rank=rank, world_size=world)
            )
            again = list(read_split(bucketed, resolution=32, channels=4, batch_size=BATCH, rank=rank, world_size=world))
            assert [x.ids.tolist() for x in batches] == [x.ids.tolist() for x in again], "a deterministic order"
            for batch in batches:
                assert len(batch) <= BATCH
                assert tuple(batch.images.shape[1:]) == tuple(index.bucket_shapes[batch.bucket])
                assert (bucket_of_ids(index, batch.ids.numpy()) == batch.bucket).all()
                assert torch.equal(batch.images[:, 0, 0, 0], batch.ids.float())
            assert sum(len(x) < BATCH for x in batches) <= 3, "at most one partial batch per bucket"
            seen.append(np.concatenate([x.ids.numpy() for x in batches]))
        seen = np.concatenate(seen)
        assert np.array_equal(np.sort(seen), np.arange(index.num_samples)), "nothing dropped, nothing twice"


def test_a_batch_keeps_its_bucket_through_pickling_and_dropping_padding():
    batch = Batch(
        torch.tensor([3, -1, 5]), torch.ones(3), torch.rand(3, 4, 6, 4), torch.full((3,), -1), (), 1, bucket=2
    )
    again = pickle.loads(pickle.dumps(batch))
    assert again.bucket == 2 and again.worker == 1 and torch.equal(again.images, batch.images)
    (real,) = list(real_samples([again]))
    assert real.bucket == 2 and real.ids.tolist() == [3, 5]
    assert Batch(torch.arange(2), torch.ones(2), torch.rand(2, 1), torch.zeros(2)).bucket == -1


def test_an_unbucketed_position_keeps_its_meaning():
    """One undecodable count per (rank, worker part), as position files held before buckets."""
    position = TrainingPosition(batch_in_pass=3, world_size=2, num_workers=2)
    position.load_state_dict({**position.state_dict(), "undecodable": [1, 2, 3, 4]})
    assert undecodable_of_rank(position, 1, 2, 2).tolist() == [3, 4]
    assert undecodable_of_rank(position, 1, 2, 2, buckets=0).tolist() == [3, 4]
    # bucketed: (rank * workers + worker) * buckets + bucket
    position.undecodable = np.arange(12)
    assert undecodable_of_rank(position, 1, 2, 2, buckets=3).tolist() == [6, 7, 8, 9, 10, 11]
    assert undecodable_of_rank(position, 1, 2, 2, buckets=2).tolist() == [0, 0, 0, 0], "another layout: zeros"


def test_the_bucket_that_absorbs_the_trim_changes_from_pass_to_pass():
    """Five equal buckets on 8 ranks: the ranks above the smallest total each drop a batch, all of one
    or two buckets; the pass's own bucket order moves that loss to another bucket pass after pass,
    instead of under-training one bucket all run long."""
    shapes = [[4, 4, 4 + k] for k in range(5)]
    buckets = [{"name": f"b{k}", "image": [32, 32 + 8 * k], "shape": s} for k, s in enumerate(shapes)]
    index = ShardIndex(
        tuple(f"s{i}.tar" for i in range(20)),
        np.full(20, 1000, dtype=np.int64),
        meta={"buckets": buckets},
        buckets=np.repeat(np.arange(5), 4).astype(np.int64),
    )
    most_short = []
    for pass_index in range(8):
        layout = pass_layout(index, None, seed=3, pass_index=pass_index, world_size=8, num_workers=2, batch_size=16)
        short = layout.kept_per_bucket - layout.bucket_batches.sum(axis=0) * 16
        most_short.append(int(np.argmax(short)))
    assert len(set(most_short)) >= 3, f"the same bucket loses the trim every pass: {most_short}"


def test_a_bucketed_held_out_subset_spreads_over_every_bucket(bucketed):
    """A prefix of a bucketed split would hold its first buckets only: the subset is evenly spaced."""
    index = ShardIndex.load(bucketed)
    read = {}
    for world in (1, 2):
        ids = []
        for rank in range(world):
            for batch in read_split(
                bucketed, resolution=32, channels=4, batch_size=BATCH, max_samples=24, rank=rank, world_size=world
            ):
                assert (bucket_of_ids(index, batch.ids.numpy()) == batch.bucket).all()
                ids += batch.ids.tolist()
        read[world] = sorted(ids)
    assert len(read[1]) == 24 and read[1] == read[2], "the same 24 samples on any number of ranks"
    assert set(bucket_of_ids(index, np.array(read[1])).tolist()) == {0, 1, 2}
    assert read[1][-1] > index.num_samples * 0.9, "taken over the whole split, not its start"


def test_a_resume_on_latents_of_another_bucket_table_is_refused(bucketed, tmp_path):
    from prunepipe.pipelines.training.resume import check_same_buckets

    mixture = Mixture.load(bucketed)
    position = TrainingPosition()
    check_same_buckets(position, mixture, None)  # a fresh start records the table
    assert json.loads(position.buckets) == [["32x48", [4, 4, 6]], ["48x32", [4, 6, 4]], ["40x40", [4, 5, 5]]]
    assert position.forwarded_by_bucket.tolist() == [0, 0, 0]
    check_same_buckets(position, mixture, "runs/x/checkpoints/step_000010")  # the same table resumes
    other = write_bucketed(tmp_path / "other", SKEWED, ["40x40", "48x32", "32x48"])  # as many buckets, reordered
    with pytest.raises(ValueError, match=r"another --buckets table"):
        check_same_buckets(position, Mixture.load(other), "runs/x/checkpoints/step_000010")
    with pytest.raises(ValueError, match=r"trained on aspect-ratio buckets none"):
        check_same_buckets(TrainingPosition(), mixture, "runs/x/checkpoints/step_000010")
