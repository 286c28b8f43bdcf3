"""Plans without dense weights: the packed plan gives exactly the weights, kept counts and step
counts of a dense float32-per-sample plan (the reference built here), a position's packed bits load
as bitmaps, a plan of another sample count is refused, and spawn-started workers map the plan's
bitmaps instead of receiving a copy."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from prunepipe.pipelines.checkpoint.position import TrainingPosition
from prunepipe.pipelines.data.layout import pass_layout
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pruning import PRUNERS, FrozenPlan, build_pruner, uniform_coin
from prunepipe.pruning.bitmap import Bitmap
from prunepipe.pruning.infobatch import float32_strictly_below
from prunepipe.pruning.pass_plan import PassPlan
from prunepipe.pruning.ted import SCORED

N = 5003  # not a multiple of 8: the last byte of every bitmap is partly padding


def dense_candidates(pruner) -> np.ndarray | None:
    """The candidate mask computed densely (one bool per sample): the reference."""
    if pruner.name == "infobatch" and pruner._threshold is not None:
        return (pruner._score < float32_strictly_below(pruner._threshold)) & pruner._seen.view(bool)
    if pruner.name == "ted" and pruner._pruned_set:
        scored = pruner._visits == SCORED
        scores = pruner._score[scored]
        count, num_scored = pruner._pruned_set, len(scores)
        lowest = np.partition(scores, num_scored - count)[num_scored - count]
        selected = scored & (pruner._score > lowest)
        missing = count - int(selected.sum())
        if missing > 0:
            tied = np.flatnonzero(scored & (pruner._score == lowest))
            coin = uniform_coin(pruner.seed ^ 0x7ED_71E5, pruner.pass_index, tied)
            selected[tied[np.argpartition(coin, missing - 1)[:missing]]] = True
        return selected
    return None


def dense_weights(plan: FrozenPlan, candidates: np.ndarray | None) -> np.ndarray:
    """float32 [N], a weight per sample: the dense reference of the packed plan."""
    ids = np.arange(plan.num_samples)
    coin = uniform_coin(plan.seed, plan.pass_index, ids)
    if plan.keep_probs is not None:
        return np.where(
            coin < plan.keep_probs, np.float32(1) / plan.keep_probs if plan.rescale else np.float32(1), np.float32(0)
        ).astype(np.float32)
    if plan.keep_prob >= 1.0:
        return np.ones(plan.num_samples, np.float32)
    mask = np.ones(plan.num_samples, bool) if candidates is None else candidates
    weights = np.ones(plan.num_samples, np.float32)
    weights[mask] = np.where(coin[mask] < plan.keep_prob, plan.candidate_weight, np.float32(0))
    return weights


@pytest.mark.parametrize("name", sorted(PRUNERS))
def test_packed_plans_give_the_dense_weights_kept_counts_and_steps_of_before(name):
    pruner = build_pruner(name, N, 12, seed=4)
    index = ShardIndex(tuple(f"s{i}.tar" for i in range(7)), np.array([1000, 3, 800, 1200, 0, 1000, 1000]))
    rng = np.random.default_rng(0)
    ids = np.arange(N)
    for pass_index in range(8):
        pruner.plan(pass_index)
        plan = PassPlan.from_pruner(pruner)
        reference = dense_weights(pruner.frozen_plan, dense_candidates(pruner))
        np.testing.assert_array_equal(plan.weights(ids), reference)
        np.testing.assert_array_equal(plan.weights_between(100, 4100), reference[100:4100])
        kept = reference > 0
        cum = np.concatenate([[0], np.cumsum(kept)])
        dense_per_shard = cum[index.first_ids + index.counts] - cum[index.first_ids]
        np.testing.assert_array_equal(plan.kept_per_shard(index.first_ids, index.counts), dense_per_shard)
        assert pruner.stats()["skipped_this_pass"] == N - kept.sum()
        for world, workers in ((2, 3), (64 * 8, 1)):
            packed = pass_layout(
                index,
                plan.kept_per_shard(index.first_ids, index.counts),
                seed=4,
                pass_index=pass_index,
                world_size=world,
                num_workers=workers,
                batch_size=4,
            )
            dense = pass_layout(
                index,
                dense_per_shard,
                seed=4,
                pass_index=pass_index,
                world_size=world,
                num_workers=workers,
                batch_size=4,
            )
            assert packed.steps == dense.steps and packed.slices == dense.slices
        visit = rng.permutation(N)[: N * 3 // 4]  # not every sample each pass: unseen ones stay unseen
        pruner.update(visit, rng.exponential(1.0, len(visit)).astype(np.float32))
        pruner.on_step(0.1)
    assert name in ("full",) or pruner.stats()["pruned_so_far"] > 0, "the comparison covered pruned passes"


def test_ted_ties_at_the_threshold_are_broken_as_before():
    ted = build_pruner("ted", N, 12, seed=1, target=0.5, ramp=0.0)
    ids = np.arange(N)
    for visit, loss in enumerate((2.0, 1.0)):  # every sample falls by exactly the same amount: one big tie
        ted.update(ids, np.full(N, loss, np.float32))
        ted.on_step(0.5)
    ted.plan(1)
    reference = dense_weights(ted.frozen_plan, dense_candidates(ted))
    np.testing.assert_array_equal(ted.weights(ids), reference)
    assert 0 < (reference != 1).sum() < N


def test_a_plan_of_another_sample_count_is_refused():
    pruner = build_pruner("infobatch", N, 12, seed=2)
    pruner.update(np.arange(N), np.random.default_rng(1).exponential(1.0, N).astype(np.float32))
    pruner.plan(1)
    state = pruner.state_dict()
    state["plan"]["candidate_bits"] = torch.zeros((N + 7) // 8 - 1, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"plan candidate_bits have shape \(625,\), expected \(626,\) for 5003 samples"
    ):
        build_pruner("infobatch", N, 12, seed=2).load_state_dict(state)


def test_bitmap_agrees_with_a_bool_array():
    rng = np.random.default_rng(3)
    flags = rng.random(N) < 0.3
    bitmap = Bitmap.from_bools(flags)
    assert bitmap.packed.nbytes == (N + 7) // 8 and bitmap.count() == flags.sum()
    np.testing.assert_array_equal(bitmap.test(np.arange(N)), flags)
    np.testing.assert_array_equal(bitmap.between(13, 4999), flags[13:4999])
    more = rng.integers(0, N, 700)
    bitmap.set(np.concatenate([more, more]))  # repeats within one call
    flags[more] = True
    assert bitmap == Bitmap.from_bools(flags)
    assert np.count_nonzero(bitmap.test(np.arange(N)) & Bitmap.from_bools(~flags).test(np.arange(N))) == 0
    assert Bitmap.from_chunks(N, lambda a, b: flags[a:b]) == bitmap


def test_consumed_flags_are_bits_in_memory_and_load_from_checkpoints_of_before():
    flags = np.random.default_rng(4).random(N) < 0.5
    old_state = {
        "pass_index": 2,
        "consumed": torch.from_numpy(np.packbits(flags)),
        "consumed_len": N,
    }  # as a checkpoint holds it
    position = TrainingPosition()
    position.load_state_dict(old_state)
    assert isinstance(position.consumed, Bitmap) and position.consumed.packed.nbytes == (N + 7) // 8
    np.testing.assert_array_equal(position.consumed.test(np.arange(N)), flags)
    again = TrainingPosition()
    again.load_state_dict(position.state_dict())
    assert again.consumed == position.consumed and again.excluded is None


def weights_in_child(plan: PassPlan, ids: np.ndarray, out) -> None:
    out.put((plan.weights(ids), plan.frozen.candidates.packed.is_shared))


def test_spawned_processes_map_the_shared_plan_instead_of_receiving_a_copy():
    num_samples = 8_000_000
    flags = uniform_coin(9, 0, np.arange(num_samples)) < 0.5
    plan = PassPlan(3, FrozenPlan(9, 3, num_samples, 0.5, Bitmap.from_bools(flags)))
    shared = plan.share()
    assert len(ForkingPickler.dumps(plan)) > num_samples // 8  # a plain plan pickles its bitmap
    assert len(ForkingPickler.dumps(shared)) < 10_000  # a shared one pickles a handle
    ids = np.random.default_rng(5).integers(0, num_samples, 1000)
    context = mp.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=weights_in_child, args=(shared, ids, out))
    child.start()
    weights, is_shared = out.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0 and is_shared
    np.testing.assert_array_equal(weights, plan.weights(ids))


def test_spawn_started_loader_workers_yield_the_batches_of_the_main_process(digits_train):
    index = ShardIndex.load(digits_train)
    pruner = build_pruner("random", index.num_samples, 4, seed=0, keep=0.5)
    pruner.plan(0)
    plan = PassPlan.from_pruner(pruner)
    batches = {}
    for workers, context in ((0, None), (2, "spawn")):
        stream = ShardStream(index, batch_size=16, seed=0, shuffle_buffer=64)
        loader = stream.pass_loader(0, plan, num_workers=workers, start_method=context)
        batches[workers] = sorted(int(i) for b in loader for i in b.ids)
    assert len(batches[2]) > 0
    assert set(batches[2]) <= set(np.flatnonzero(plan.kept_mask()))
    assert len(batches[2]) == len(batches[0])
