"""Augmentations as a specification: the flip is a coin of its own, independent of every pruner's
keep coin, so that an up-weighted kept sample is flipped as often as any other (issue 21).

Statistical claims use fixed seeds and state their tolerance: rates within 4.5 standard errors
(0.5 / sqrt(n)) of one half.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.data.decode import SampleDecoder
from pruning import build_pruner

NUM_SAMPLES = 100_000
SIGMAS = 4.5


def flipped_by_decoder(seed: int, epoch: int, ids: np.ndarray) -> np.ndarray:
    """bool per id: did the training decoder mirror it? Each sample is a 1x2 image [0, 255], so its
    flipped version reads [255, 0]."""
    stacked = torch.tensor([0, 255], dtype=torch.uint8).repeat(len(ids), 1, 1, 1)  # [B, 1, 1, 2]
    images = SampleDecoder(resolution=2, channels=1, hflip=True, seed=seed).finish(stacked, ids, epoch)
    return (images[:, 0, 0, 0] > images[:, 0, 0, 1]).numpy()


def assert_half(flips: np.ndarray, what: str) -> None:
    n = len(flips)
    assert n > 1000, f"{what}: too few samples ({n}) to say anything"
    rate = flips.mean()
    assert abs(rate - 0.5) < SIGMAS * 0.5 / np.sqrt(n), f"{what}: flip rate {rate:.4f} over {n} samples"


def pruned_plan(name: str, seed: int, epoch: int, **hparams):
    """A pruner planned at `epoch` on an exponential score table seen twice (so TED scores too)."""
    pruner = build_pruner(name, NUM_SAMPLES, 40, seed=seed, **hparams)
    rng = np.random.default_rng(11)
    ids = np.arange(NUM_SAMPLES)
    first = rng.exponential(1.0, NUM_SAMPLES).astype(np.float32)
    second = (first * rng.uniform(0.2, 1.0, NUM_SAMPLES)).astype(np.float32)
    for scores in (first, second):
        for start in range(0, NUM_SAMPLES, 4096):
            pruner.update(ids[start:start + 4096], scores[start:start + 4096])
        pruner.on_step(0.5)
    pruner.plan(epoch)
    return pruner.weights(ids)


@pytest.mark.parametrize("name, hparams", [
    ("random", {"keep": 0.5}), ("infobatch", {"prune_ratio": 0.5}), ("ted", {"ramp": 0.1}), ("importance", {}),
])
def test_the_flip_is_independent_of_every_pruners_keep_coin(name, hparams):
    seed, epoch = 3, 5
    weights = pruned_plan(name, seed, epoch, **hparams)
    kept, up_weighted = weights > 0, weights > 1
    assert 0 < kept.sum() < NUM_SAMPLES and up_weighted.sum() > 0, "the plan prunes and up-weights"
    flips = flipped_by_decoder(seed, epoch, np.arange(NUM_SAMPLES))
    assert_half(flips[kept], f"{name}: kept samples")
    assert_half(flips[up_weighted], f"{name}: kept samples of weight > 1")
    assert_half(flips[~kept], f"{name}: skipped samples (had they been decoded)")
    # independence: the share flipped among kept equals the share among skipped, within both errors
    gap = flips[kept].mean() - flips[~kept].mean()
    assert abs(gap) < SIGMAS * 0.5 * np.sqrt(1 / kept.sum() + 1 / (~kept).sum()), f"{name}: flip depends on keep"


def test_the_flip_is_a_pure_function_of_seed_pass_and_id():
    ids = np.arange(1000, 3000)
    flips = flipped_by_decoder(1, 2, ids)
    order = np.random.default_rng(0).permutation(len(ids))
    np.testing.assert_array_equal(flipped_by_decoder(1, 2, ids[order]), flips[order])
    assert (flipped_by_decoder(1, 3, ids) != flips).mean() > 0.4, "another pass, other flips"
    assert (flipped_by_decoder(2, 2, ids) != flips).mean() > 0.4, "another seed, other flips"
