"""FID as a specification: it is the Frechet distance of the feature statistics (checked against an
independent numpy/scipy computation), small between two halves of the real digits and large against
noise, its reference statistics are computed once and cached, splitting over ranks changes nothing,
and Inception-v3 is read from a local weights file (a randomly initialised one here) — never downloaded."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import scipy.linalg
import torch
from eval_runs import feature_net, one_torch_thread, session_dir
from test_evaluate_ranks import run_ranks

from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.evaluation.config import FIDConfig
from prunepipe.pipelines.evaluation.fid import FIDEvaluator, feature_net_from_config, reference_cache_path

HALF = 800  # the digits train split has 1617 images: the first 800 are the reference half


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def shards(digits_shards, tmp_path_factory) -> str:
    """A private copy of the digits shards: the FID cache is written beside them."""
    out = tmp_path_factory.mktemp("fid_shards")
    for split in ("train", "val"):
        shutil.copytree(os.path.join(digits_shards, split), out / split)
    return str(out)


@pytest.fixture(scope="module")
def classifier(digits_shards, tmp_path_factory) -> str:
    return feature_net(digits_shards, os.path.join(session_dir(tmp_path_factory, "eval_nets"), "digits.safetensors"))


@pytest.fixture(scope="module")
def real_images(shards) -> torch.Tensor:
    return torch.cat([(b.images + 1) / 2 for b in read_split(f"{shards}/train", resolution=32, channels=3)])


def frechet_distance(x: np.ndarray, y: np.ndarray) -> float:
    """||mu_x - mu_y||^2 + Tr(S_x + S_y - 2 (S_x S_y)^(1/2)) with scipy's matrix square root."""
    mu_x, mu_y = x.mean(axis=0), y.mean(axis=0)
    s_x, s_y = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    root = scipy.linalg.sqrtm(s_x @ s_y).real
    return float(((mu_x - mu_y) ** 2).sum() + np.trace(s_x + s_y - 2 * root))


def batches(images: torch.Tensor, size: int = 64):
    return [images[i : i + size] for i in range(0, len(images), size)]


def evaluator(shards, classifier, tmp_path, count=HALF, **kw) -> FIDEvaluator:
    cfg = FIDConfig(feature="classifier", weights=classifier, reference_samples=count, **kw)
    return FIDEvaluator.from_config(cfg, f"{shards}/train", resolution=32, channels=3)


def test_fid_equals_an_independent_frechet_distance_of_the_same_features(shards, classifier, real_images, tmp_path):
    fid = evaluator(shards, classifier, tmp_path)
    other = real_images[HALF:]
    ours = fid.score(batches(other))
    net = fid.net.feature
    with torch.no_grad():
        reference = net(fid.net.prepare(real_images[:HALF])).double().numpy()
        generated = net(fid.net.prepare(other)).double().numpy()
    expected = frechet_distance(reference, generated)
    assert ours["fid_samples"] == len(other) and ours["fid_reference_samples"] == HALF
    assert ours["fid"] == pytest.approx(expected, rel=1e-4)


def test_fid_is_small_between_real_halves_and_large_against_noise(shards, classifier, real_images, tmp_path):
    fid = evaluator(shards, classifier, tmp_path)
    halves = fid.score(batches(real_images[HALF:]))["fid"]
    noise = torch.rand(len(real_images) - HALF, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    against_noise = fid.score(batches(noise))["fid"]
    assert 0 <= halves < 2.0  # measured 0.30 with the 64-feature digits classifier
    assert against_noise > 50 * max(halves, 0.1)  # measured ~150


def test_reference_statistics_are_computed_once_and_cached_beside_the_shards(shards, classifier, real_images):
    first = evaluator(shards, classifier, None, count=300)
    net = feature_net_from_config(FIDConfig(feature="classifier", weights=classifier))
    path = reference_cache_path(f"{shards}/train", net, 32, 300)
    assert first.cache_path == path and os.path.dirname(path) == os.path.join(shards, "train", "fid_stats")
    assert os.path.isfile(path) and not first.cached
    second = evaluator(shards, classifier, None, count=300)
    assert second.cached and second.cache_path == path
    assert torch.equal(first.reference.cov_sum, second.reference.cov_sum)
    assert first.score([real_images[:64]])["fid"] == second.score([real_images[:64]])["fid"]
    # another count, resolution or network is another file
    assert evaluator(shards, classifier, None, count=301).cache_path != path
    assert reference_cache_path(f"{shards}/train", net, 16, 300) != path


def _rank_main(rank, world, init_file, shards, classifier, stats_dir, images, out):
    torch.set_num_threads(1)  # two processes on a 2-core machine
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = FIDConfig(feature="classifier", weights=classifier, reference_samples=HALF, stats_dir=stats_dir)
        fid = FIDEvaluator.from_config(cfg, f"{shards}/train", resolution=32, channels=3)
        result = fid.score(batches(images[rank::world], 50))  # this rank's share only
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({**result, "cached": fid.cached}, f)
    finally:
        torch.distributed.destroy_process_group()


def test_fid_split_over_two_ranks_equals_one_process(shards, classifier, real_images, tmp_path):
    images = real_images[HALF : HALF + 300]
    single = evaluator(shards, classifier, tmp_path, stats_dir=str(tmp_path / "single")).score(batches(images))
    stats_dir = str(tmp_path / "split")  # an empty cache: the two ranks compute the reference together
    run_ranks(_rank_main, 2, str(tmp_path / "init"), shards, classifier, stats_dir, images, str(tmp_path))
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for result in results:
        assert result["fid"] == pytest.approx(single["fid"], rel=1e-5)
        assert result["fid_samples"] == 300 and result["fid_reference_samples"] == HALF and not result["cached"]
    # the statistics the two ranks wrote are the single process's
    with np.load(results[0]["fid_reference_cache"]) as split, np.load(single["fid_reference_cache"]) as one:
        np.testing.assert_allclose(split["cov_sum"], one["cov_sum"], rtol=1e-9)
        assert int(split["num_samples"]) == HALF


def random_inception_weights(path: str) -> dict:
    """torch-fidelity's Inception-v3 with random weights, saved as the pt file FID loads, without
    any download: the constructor is given an empty state dict and loads nothing."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class Unloaded(FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, strict=True, assign=False):  # keep the random initialisation
            return None

    empty = path + ".empty"
    torch.save({}, empty)
    torch.manual_seed(0)
    state = Unloaded("inception-v3-compat", ["64"], feature_extractor_weights_path=empty).state_dict()
    torch.save(state, path)
    return state


def test_inception_fid_reads_a_local_weights_file_and_never_downloads(shards, real_images, tmp_path):
    path = str(tmp_path / "weights-inception-2015-12-05-6726825d.pth")
    saved = random_inception_weights(path)
    cfg = FIDConfig(feature="inception", weights=path, inception_dim=64, reference_samples=12, batch_size=6)
    fid = FIDEvaluator.from_config(cfg, f"{shards}/val", resolution=32, channels=3)
    loaded = fid.metric.inception.state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)  # the file's weights, not others
    assert fid.net.identity.startswith("inception64-tf1-") and not fid.net.antialias
    with torch.no_grad():
        reference = fid.metric.inception(
            fid.net.prepare(
                torch.cat(
                    [(b.images + 1) / 2 for b in read_split(f"{shards}/val", resolution=32, channels=3, max_samples=12)]
                )
            )
        )
    np.testing.assert_allclose(fid.reference.features_sum.numpy(), reference.double().sum(0).numpy(), rtol=1e-6)
    result = fid.score([real_images[:12]])
    assert np.isfinite(result["fid"]) and result["fid"] >= 0 and result["fid_samples"] == 12
    assert feature_net_from_config(FIDConfig(weights=path, resize="antialias")).identity.startswith(
        "inception2048-antialias-"
    )


def test_missing_inception_weights_name_the_field_and_where_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"fid\.weights=.*weights-inception-2015-12-05-6726825d\.pth"):
        feature_net_from_config(FIDConfig(feature="inception", weights=str(tmp_path / "missing.pth")))
    with pytest.raises(FileNotFoundError, match=r"python -m prunepipe\.tools\.commands\.feature_net"):
        feature_net_from_config(FIDConfig(feature="classifier"), shards_root=str(tmp_path))
