"""The replication evaluator as a specification: a "model" that returns training images under a little
noise is reported, sample by sample with the right train ids; one that returns digits it never saw
scores like the held-out baseline; the Evaluator records the numbers for UNet and DiT runs and reuses
FID's samples; bad input stops with a message that names what is wrong. Real digits, CPU, seconds."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import webdataset as wds
from eval_runs import ROOT, TINY_LDM, one_torch_thread
from PIL import Image
from test_evaluate_ranks import join_group, leave, results_of, run_ranks

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.evaluation.fid import to_uint8
from prunepipe.pipelines.evaluation.replication import NearestTrain, measure_replication, save_pairs_picture
from prunepipe.pipelines.evaluation.runner import Evaluator
from prunepipe.pipelines.tasks.build import build_task
from prunepipe.tools.commands.perceptual_hash import PerceptualHash

HELD_OUT = 90  # the first 90 val digits are the baseline; the other 90 are what a non-copying model draws
COPIED = np.arange(0, 1600, 40)  # the 40 train ids the copying model reproduces


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def images_of(folder: str, count: int = 0) -> torch.Tensor:
    """The first `count` images of a split (0 = all) as float [N, 3, 32, 32] in [0, 1]."""
    return torch.cat([(b.images + 1) / 2 for b in read_split(folder, resolution=32, channels=3, max_samples=count)])


def phash(images: torch.Tensor) -> np.ndarray:
    """pHash rows of float 32-px images in [0, 1]: the model-free feature for this small domain."""
    return PerceptualHash()(to_uint8(images))


@pytest.fixture(scope="module")
def splits(digits_shards):
    return f"{digits_shards}/train", f"{digits_shards}/val"


def copied_samples(train: str) -> torch.Tensor:
    """What a model that memorised draws: the COPIED train images under Gaussian noise of 2% of the range."""
    originals = images_of(train)[COPIED]
    noise = torch.randn(originals.shape, generator=torch.Generator().manual_seed(0))
    return (originals + 0.02 * noise).clamp(0, 1)


@pytest.fixture(scope="module")
def copying(splits):
    train, val = splits
    return measure_replication(
        copied_samples(train), train, val, feature=phash, held_out_samples=HELD_OUT, picture_pairs=8
    )


@pytest.fixture(scope="module")
def new_digits(splits):
    """A model that generalises: it returns real digits it never saw (the second half of val)."""
    train, val = splits
    return measure_replication(images_of(val)[HELD_OUT:], train, val, feature=phash, held_out_samples=HELD_OUT)


def test_a_model_that_copies_training_images_is_reported_with_their_train_ids(copying):
    numbers = copying.numbers
    assert numbers["replication_rate"] == 1.0 and numbers["replication_flagged"] == len(COPIED)
    assert numbers["replication_rate_held_out"] == 0.0  # no real digit is that close to another
    np.testing.assert_array_equal(copying.nearest_train, COPIED)
    assert sorted((f.sample, f.train_id) for f in copying.flagged) == list(enumerate(COPIED.tolist()))
    assert max(f.ratio for f in copying.flagged) <= 0.2 < numbers["replication_ratio_held_out_q01"]
    # both measures put every copy beyond the held-out images' 99th percentile
    assert numbers["replication_closer_than_held_out_p99"] == 1.0
    assert numbers["replication_feature_above_held_out_p99"] == 1.0
    assert np.mean(copying.similar_train == COPIED) >= 0.9  # pHash ties may name an identical-hash twin
    assert numbers["replication_train_samples"] == 1617 and numbers["replication_held_out_samples"] == HELD_OUT
    assert numbers["replication_neighbours"] == 50 and numbers["replication_pixel_size"] == 32


def test_a_model_that_draws_new_images_scores_like_held_out_images(new_digits, copying):
    numbers = new_digits.numbers
    assert numbers["replication_rate"] == numbers["replication_rate_held_out"] == 0.0
    assert not new_digits.flagged
    # by construction ~5% / ~1% of new images lie beyond the held-out 95th / 99th percentile; 90 samples
    # (and pHash's ties, similarities in steps of 1/32) leave room around that
    assert numbers["replication_closer_than_held_out_p95"] <= 0.15
    assert numbers["replication_closer_than_held_out_p99"] <= 0.05
    assert numbers["replication_feature_above_held_out_p95"] <= 0.25
    assert numbers["replication_ratio_q50"] == pytest.approx(numbers["replication_ratio_held_out_q50"], abs=0.05)
    assert copying.numbers["replication_rate"] - numbers["replication_rate"] == 1.0


def test_noise_is_no_copy_of_anything(splits):
    train, val = splits
    noise = torch.rand(20, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    found = measure_replication(noise, train, val, held_out_samples=HELD_OUT, max_train=500)
    assert found.numbers["replication_rate"] == 0.0 and found.numbers["replication_ratio_q01"] > 0.9
    assert found.similarities is None and "replication_similarity_q50" not in found.numbers


def test_a_model_that_copies_some_images_is_reported_for_exactly_those(splits):
    train, val = splits
    new, originals = images_of(val)[HELD_OUT : HELD_OUT + 30], images_of(train, 300)
    samples = new.clone()
    copies = {3: 17, 11: 250, 12: 0, 29: 299}  # sample index -> the train id it reproduces
    for index, train_id in copies.items():
        samples[index] = (originals[train_id] + 1 / 255).clamp(0, 1)  # a shade brighter
    found = measure_replication(samples, train, val, held_out_samples=HELD_OUT, max_train=300, neighbours=20)
    assert {f.sample: f.train_id for f in found.flagged} == copies
    assert found.numbers["replication_rate"] == pytest.approx(4 / 30)
    assert found.numbers["replication_neighbours"] == 20 and found.numbers["replication_train_samples"] == 300


def test_the_pairs_picture_shows_each_flagged_sample_beside_its_train_image(copying, tmp_path):
    path = save_pairs_picture(copying, str(tmp_path / "pairs.png"))
    with Image.open(path) as picture:
        assert picture.size == (4 * 33 + 1, 4 * 33 + 1)  # 8 pairs, 2 a row, 32 px and 1 px padding
    pairs = copying.pairs
    assert pairs.shape == (8, 2, 3, 32, 32)
    assert float((pairs[:, 0] - pairs[:, 1]).abs().mean()) < 0.03  # sample and train image nearly equal


def test_a_share_of_the_samples_is_measured_as_among_all_of_them(splits, copying):
    # what a rank holds (every other sample, indices 1, 3, ...) gets the numbers those samples get among all
    train, val = splits
    odd = measure_replication(
        copied_samples(train)[1::2], train, val, sample_ids=np.arange(1, len(COPIED), 2), held_out_samples=HELD_OUT
    )
    np.testing.assert_array_equal(odd.sample_ids, np.arange(1, len(COPIED), 2))
    np.testing.assert_array_equal(odd.nearest_train, COPIED[1::2])
    # faiss sums squared distances in float32 by another route for fewer queries: equal to ~1e-5
    np.testing.assert_allclose(odd.ratios, copying.ratios[1::2], rtol=1e-4)


def _replicate_on_ranks(rank, world, init_file, splits, out):
    join_group(rank, world, init_file)
    train, val = splits
    mine = copied_samples(train)[rank::world]  # rank r holds samples r, r + world, ...
    found = measure_replication(
        mine,
        train,
        val,
        feature=phash,
        sample_ids=np.arange(rank, len(COPIED), world),
        held_out_samples=HELD_OUT,
        max_train=1000,
        picture_pairs=8,
    )
    dist.destroy_process_group()
    leave(
        rank,
        out,
        {
            "numbers": found.numbers,
            "flagged": [[f.sample, f.train_id] for f in found.flagged],
            "ratios": found.ratios.tolist(),
            "similar": found.similar_train.tolist(),
            "pairs": found.pairs.flatten().tolist(),
        },
    )


@pytest.mark.slow  # ~20 s on a loaded 2-core machine: two spawned processes import torch and faiss
def test_two_ranks_find_what_one_process_finds(splits, tmp_path):
    # each rank holds half the samples and reads half of each split; the k nearest merged over ranks
    train, val = splits
    run_ranks(_replicate_on_ranks, 2, str(tmp_path / "init"), splits, str(tmp_path))
    one = measure_replication(
        copied_samples(train), train, val, feature=phash, held_out_samples=HELD_OUT, max_train=1000, picture_pairs=8
    )
    for rank in results_of(str(tmp_path), 2):
        assert rank["flagged"] == [[f.sample, f.train_id] for f in one.flagged]
        assert rank["similar"] == one.similar_train.tolist()
        np.testing.assert_allclose(rank["ratios"], one.ratios, rtol=1e-4)
        np.testing.assert_allclose(rank["pairs"], one.pairs.flatten().numpy(), atol=1e-6)
        assert rank["numbers"].keys() == one.numbers.keys()
        for key, value in one.numbers.items():
            assert rank["numbers"][key] == pytest.approx(value, rel=1e-4), key


# ----------------------------------------------------------------------------- through the Evaluator
def tiny_features(weights=None) -> nn.Module:
    """A fixed random conv net, float [0, 1] images -> [N, 8]: a stand-in feature network for FID."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def untrained(digits_shards, tmp_path, config: str, extra=()):
    """(run config, task) of a tiny diffusion run's initial model: it draws noise, copies nothing."""
    cfg = load_config(
        os.path.join(ROOT, "configs", config),
        [
            f"data.train={digits_shards}/train",
            f"data.val={digits_shards}/val",
            f"runs_dir={tmp_path}",
            "name=replication",
            *extra,
        ],
    )
    torch.manual_seed(0)
    return cfg, build_task(cfg)


REPLICATION = [
    "fid.sampler_steps=2",
    "val_samples=16",
    "replication.enabled=true",
    "replication.num_samples=6",
    "replication.max_train=300",
    "replication.held_out_samples=60",
]


@pytest.mark.parametrize(
    "config,extra", [("ldm_tiny_full.yaml", TINY_LDM), ("ldm_dit_tiny_full.yaml", ())], ids=["unet", "dit"]
)
def test_the_evaluator_records_replication_of_a_diffusion_run(digits_shards, tmp_path, config, extra):
    cfg, task = untrained(digits_shards, tmp_path, config, extra)
    eval_cfg = load_eval_config(overrides=["fid.enabled=false", *REPLICATION])
    record = Evaluator(cfg, eval_cfg, run_dir=str(tmp_path)).evaluate(task, task.model, at={"optimizer_steps": 0})
    details = record["details"]
    assert details["replication_rate"] == 0.0 and details["replication_flagged_samples"] == []
    assert details["replication_samples"] == 6 and details["replication_train_samples"] == 300
    assert details["replication_held_out_samples"] == 60 and details["replication_pixel_size"] == 16
    assert details["replication_feature"] == "pixels only" and details["replication_reused_fid_samples"] is False
    assert "replication_picture" not in details  # nothing flagged, nothing to look at
    assert "replication_rate" not in record["metrics"]  # a detail: compare judges quality, not copies
    written = json.load(open(record["path"]))
    assert written["details"]["replication_rate"] == 0.0
    assert written["eval_config"]["replication"]["enabled"] is True


def test_the_evaluator_draws_the_flagged_pairs_beside_its_record(digits_shards, tmp_path):
    cfg, task = untrained(digits_shards, tmp_path, "ldm_tiny_full.yaml", TINY_LDM)
    # d_1 / mean(d_1..d_k) <= 1 always: a threshold just below 1 flags every sample, so there are pairs to draw
    eval_cfg = load_eval_config(
        overrides=["fid.enabled=false", *REPLICATION, "replication.threshold=0.999", "replication.picture_pairs=4"]
    )
    record = Evaluator(cfg, eval_cfg, run_dir=str(tmp_path)).evaluate(task, task.model, at={"optimizer_steps": 7})
    details = record["details"]
    assert details["replication_picture"] == str(tmp_path / "eval" / "step_000007_replication.png")
    assert len(details["replication_flagged_samples"]) == details["replication_flagged"] > 0
    with Image.open(details["replication_picture"]) as picture:
        assert picture.size == (4 * 17 + 1, 2 * 17 + 1)  # 4 pairs of 16 px images, 2 pairs a row
    assert json.load(open(record["path"]))["details"]["replication_picture"] == details["replication_picture"]


def test_the_evaluator_reuses_fid_samples_for_replication(digits_shards, tmp_path):
    cfg, task = untrained(digits_shards, tmp_path, "ldm_tiny_full.yaml", TINY_LDM)
    apart = load_eval_config(
        overrides=["fid.enabled=false", *REPLICATION, "replication.feature=module:test_replication:tiny_features"]
    )
    shared = load_eval_config(
        overrides=[
            *REPLICATION,
            "fid.feature=module:test_replication:tiny_features",
            "fid.num_samples=8",
            "fid.reference=val",
            "fid.reference_samples=60",
            f"fid.stats_dir={tmp_path / 'stats'}",
            "replication.feature=module:test_replication:tiny_features",
        ]
    )
    alone = Evaluator(cfg, apart, run_dir=str(tmp_path)).evaluate(task, task.model, write=False)["details"]
    with_fid = Evaluator(cfg, shared, run_dir=str(tmp_path)).evaluate(task, task.model, write=False)["details"]
    assert with_fid["replication_reused_fid_samples"] is True and with_fid["fid_samples"] == 8
    # FID's first 6 samples are the 6 replication draws alone: the same numbers, feature ones included
    numbers = {k: v for k, v in alone.items() if k.startswith("replication_") and k != "replication_reused_fid_samples"}
    assert numbers and {k: with_fid[k] for k in numbers} == numbers
    assert alone["replication_feature"].startswith("module-test_replication.tiny_features")
    assert "replication_similarity_held_out_q95" in alone


# ----------------------------------------------------------------------------- bad input
def test_an_empty_train_split_is_an_error_naming_it(splits, tmp_path):
    _, val = splits
    empty = tmp_path / "empty"
    empty.mkdir()
    with wds.TarWriter(str(empty / "0.tar")):
        pass
    ShardIndex.write(str(empty), [(str(empty / "0.tar"), 0)])
    with pytest.raises(ValueError, match=rf"train split {empty} gave 0 images"):
        measure_replication(torch.rand(2, 3, 32, 32), str(empty), val)


@pytest.mark.parametrize(
    "images,message",
    [
        (torch.rand(2, 3, 32, 16), r"generated samples: images are 32x16"),
        (torch.rand(2, 2, 32, 32), r"generated samples: images have 2 channels; accepted: 1 \(grey\) or 3 \(RGB\)"),
        (torch.rand(3, 32, 32), r"generated samples: expected images \[N, C, H, W\], got .* \[3, 32, 32\]"),
        (torch.rand(2, 3, 32, 32) * 2 - 1, r"generated samples: expected float images in \[0, 1\].*\(x \+ 1\) / 2"),
    ],
    ids=["not-square", "channels", "not-a-batch", "range"],
)
def test_samples_of_the_wrong_shape_or_range_are_errors_naming_the_fault(splits, images, message):
    train, val = splits
    with pytest.raises(ValueError, match=message):
        measure_replication(images, train, val)


def test_train_rows_of_another_size_than_the_samples_are_an_error():
    search = NearestTrain(np.zeros((2, 3 * 16 * 16), np.float32), None, k=5)
    with pytest.raises(
        ValueError,
        match=r"train rows have 3072 pixel values, the queries 768: train and generated "
        r"images differ in size or channels",
    ):
        search.add(np.arange(4), np.zeros((4, 3 * 32 * 32), np.float32), None)


def test_the_train_split_as_its_own_baseline_is_an_error(splits):
    train, _ = splits
    with pytest.raises(ValueError, match="held-out split .* is the train split"):
        measure_replication(torch.rand(2, 3, 32, 32), train, train + "/")


@pytest.mark.parametrize(
    "override,message",
    [
        ("replication.feature=inception", r"replication.feature='inception' is not accepted"),
        ("replication.threshold=1.5", r"replication.threshold must be in \(0, 1\), got 1.5 \(a ratio of distances\)"),
        ("replication.neighbours=1", r"replication.neighbours must be >= 2"),
        ("replication.num_samples=0", r"replication.num_samples must be >= 1"),
    ],
)
def test_bad_replication_settings_are_errors_naming_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        load_eval_config(overrides=[override])


def test_replication_of_an_mae_run_is_an_error(digits_shards, tmp_path):
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [f"data.train={digits_shards}/train", f"data.val={digits_shards}/val", f"runs_dir={tmp_path}"],
    )
    eval_cfg = load_eval_config(overrides=["replication.enabled=true"])
    with pytest.raises(ValueError, match="replication.enabled measures copies among diffusion samples; .* mae run"):
        Evaluator(cfg, eval_cfg, run_dir=str(tmp_path)).evaluate(None, nn.Linear(1, 1))
