"""The shard stream as a specification: coverage per pass, equal steps per rank, determinism,
skip-before-decode and exact resume, on real shards written by `prunepipe shards write`."""

from __future__ import annotations

import multiprocessing
import os
import pickle

import numpy as np
import pytest
import torch

from prunepipe.pipelines.data.batch import Batch
from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.layout import batches_taken_per_worker, pass_layout
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pruning.base import FrozenPlan
from prunepipe.pruning.pass_plan import PassPlan
from prunepipe.pruning.splitmix import uniform_coin

BATCH = 16


def half_dropping_plan(index: ShardIndex, pass_index: int) -> PassPlan:
    """A pre-decode stage that drops a deterministic pseudo-random half and weights the rest by 2."""
    return PassPlan(pass_index, FrozenPlan(1234, pass_index, index.num_samples, 0.5, None))  # every sample a candidate


class CountingDecoder(SampleDecoder):
    """The real decoder, counting which ids it decoded."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.decoded: list[int] = []

    def decode(self, sample, sample_id, pass_index=0):
        self.decoded.append(sample_id)
        return super().decode(sample, sample_id, pass_index)


def run_pass(index, pass_index, plan=None, *, world=2, workers=2, seed=0, skip=0, decoder=None):
    """Every rank's batches of one pass (ranks run one after the other in this process)."""
    per_rank = []
    for rank in range(world):
        stream = ShardStream(
            index, batch_size=BATCH, seed=seed, rank=rank, world_size=world, decoder=decoder, shuffle_buffer=64
        )
        loader = stream.pass_loader(pass_index, plan, num_workers=workers, skip_batches=skip)
        batches = list(loader)
        assert len(batches) == len(loader)
        per_rank.append(batches)
    return per_rank, loader.layout


def ids_of(batches) -> np.ndarray:
    return np.concatenate([b.ids.numpy() for b in batches]) if batches else np.zeros(0, np.int64)


@pytest.mark.parametrize("pruned", [False, True], ids=["full", "half-dropped"])
def test_each_pass_covers_every_kept_id_once_with_equal_steps_per_rank(digits_train, pruned):
    index = ShardIndex.load(digits_train)
    orders = []
    for pass_index in range(3):
        plan = half_dropping_plan(index, pass_index) if pruned else None
        per_rank, layout = run_pass(index, pass_index, plan)
        steps = {len(b) for b in per_rank}
        assert steps == {layout.steps}, "every rank must take the same number of steps"
        seen = np.concatenate([ids_of(b) for b in per_rank])
        assert len(np.unique(seen)) == len(seen), "an id appeared twice in one pass"
        kept = np.arange(index.num_samples) if plan is None else np.flatnonzero(plan.kept_mask())
        assert set(seen) <= set(kept), "a pruned sample reached a batch"
        missing = len(kept) - len(seen)
        assert missing == layout.tail
        assert layout.tail < 2 * (2 * (2 + 1)) * BATCH  # stated bound: world * (workers + 1) * batch, x2 margin
        if plan is not None:
            weights = np.concatenate([b.weights.numpy() for r in per_rank for b in r])
            assert np.all(weights == 2.0)
        orders.append(seen)
    assert not np.array_equal(orders[0][:100], orders[1][:100]), "passes must be ordered differently"
    again, _ = run_pass(index, 1, half_dropping_plan(index, 1) if pruned else None)
    np.testing.assert_array_equal(np.concatenate([ids_of(b) for b in again]), orders[1])


def test_pruned_samples_are_never_decoded(digits_train):
    index = ShardIndex.load(digits_train)
    plan = half_dropping_plan(index, 0)
    decoder = CountingDecoder(resolution=32)
    per_rank, layout = run_pass(index, 0, plan, world=1, workers=0, decoder=decoder)
    decoded = np.array(decoder.decoded)
    assert plan.kept_mask()[decoded].all(), "a pruned sample was decoded"
    assert len(decoded) == layout.steps * BATCH, "only samples that go into batches are decoded"
    np.testing.assert_array_equal(np.sort(decoded), np.sort(ids_of(per_rank[0])))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_n_batches_yields_exactly_the_rest(digits_train, workers):
    index = ShardIndex.load(digits_train)
    plan = half_dropping_plan(index, 2)
    full, layout = run_pass(index, 2, plan, world=2, workers=workers)
    skip = layout.steps // 2 + 1
    decoder = CountingDecoder(resolution=32)
    resumed, _ = run_pass(index, 2, plan, world=2, workers=workers, skip=skip, decoder=decoder)
    for rank in range(2):
        assert len(resumed[rank]) == layout.steps - skip
        for a, b in zip(full[rank][skip:], resumed[rank]):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.images, b.images)
            assert torch.equal(a.weights, b.weights) and torch.equal(a.labels, b.labels)
    if workers == 0:  # the decoder runs in this process only without workers
        assert len(decoder.decoded) == 2 * (layout.steps - skip) * BATCH


class PidLabels(SampleDecoder):
    """The real decoder, labelling each sample with the process that decoded it."""

    def decode(self, sample, sample_id, pass_index=0):
        return super().decode(sample, sample_id, pass_index)[0], os.getpid()


def test_loader_workers_persist_across_passes_and_serve_each_the_latest_pass(digits_train):
    index = ShardIndex.load(digits_train)

    def fresh(pass_index):  # what a new stream (new workers) delivers for this pass
        stream = ShardStream(index, batch_size=BATCH, shuffle_buffer=64)
        return list(stream.pass_loader(pass_index, half_dropping_plan(index, pass_index), num_workers=2))

    stream = ShardStream(index, batch_size=BATCH, decoder=PidLabels(resolution=32), shuffle_buffer=64)
    decoded_by = set()
    for pass_index in range(3):
        batches = list(stream.pass_loader(pass_index, half_dropping_plan(index, pass_index), num_workers=2))
        expected = fresh(pass_index)
        assert len(batches) == len(expected)
        for a, b in zip(batches, expected):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.images, b.images) and torch.equal(a.weights, b.weights)
        decoded_by |= set(torch.cat([b.labels for b in batches]).tolist())
    assert len(decoded_by) == 2 and os.getpid() not in decoded_by, "the same two worker processes decode every pass"
    # A pass left unread, then one abandoned after a batch: the next pass is served whole and alone.
    stream.pass_loader(3, half_dropping_plan(index, 3), num_workers=2)
    abandoned = iter(stream.pass_loader(4, half_dropping_plan(index, 4), num_workers=2))
    next(abandoned)
    del abandoned
    batches = list(stream.pass_loader(5, half_dropping_plan(index, 5), num_workers=2))
    np.testing.assert_array_equal(ids_of(batches), ids_of(fresh(5)))
    stream.close()
    assert not decoded_by & {p.pid for p in multiprocessing.active_children()}, "close() stops the workers"


def test_round_robin_replay_matches_dataloader_order():
    # Workers with 1, 3 and 2 batches: the DataLoader alternates, passing over exhausted ones.
    batches = np.array([1, 3, 2])
    taken = lambda n: (batches_taken_per_worker(batches, n)[0].tolist(), batches_taken_per_worker(batches, n)[1])  # noqa: E731
    assert taken(0) == ([0, 0, 0], 0)
    assert taken(2) == ([1, 1, 0], 2)
    assert taken(3) == ([1, 1, 1], 0)
    assert taken(4) == ([1, 2, 1], 2)
    assert taken(5) == ([1, 2, 2], 0)
    with pytest.raises(ValueError, match="only 6"):
        batches_taken_per_worker(batches, 7)


def test_layout_balances_kept_samples_over_ranks_and_workers():
    index = ShardIndex(tuple(f"s{i}.tar" for i in range(5)), np.array([100, 37, 250, 80, 3]))
    kept = uniform_coin(0, 0, np.arange(index.num_samples)) < 0.3
    kept_per_shard = np.add.reduceat(kept, index.first_ids)
    layout = pass_layout(index, kept_per_shard, seed=0, pass_index=0, world_size=2, num_workers=3, batch_size=8)
    sizes = [sum(p.kept_end - p.kept_start for p in slot) for slot in layout.slices]
    assert sum(sizes) == kept.sum() and max(sizes) - min(sizes) <= 1
    assert layout.batches.sum(axis=1).tolist() == [layout.steps, layout.steps]
    assert (layout.batches * 8 <= np.array(sizes).reshape(2, 3)).all()


def test_a_batch_pickles_to_equal_tensors_on_the_host():
    batch = Batch(torch.arange(4), torch.ones(4) * 2, torch.rand(4, 3, 8, 8), torch.tensor([1, -1, 2, 3]), (), 1)
    again = pickle.loads(pickle.dumps(batch))
    for field in ("ids", "weights", "images", "labels"):
        assert torch.equal(getattr(again, field), getattr(batch, field)), field
        assert getattr(again, field).dtype == getattr(batch, field).dtype
    assert again.worker == 1
