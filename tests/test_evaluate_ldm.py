"""Diffusion evaluation as a specification: the held-out denoising loss is the task's fixed-grid,
fixed-noise loss and repeats exactly, generated samples do not depend on how they are split over
ranks or batches, and `evaluate_checkpoint` samples the EMA UNet with DDIM and writes FID (in the
digits classifier's features) to eval/*.json."""

from __future__ import annotations

import json
import os

import pytest
import torch
from eval_runs import feature_net, one_torch_thread, session_dir, tiny_run, trained_task

from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.evaluation.sampling import generate_images
from prunepipe.pipelines.trained import evaluate_checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def run_dir(digits_shards, tmp_path_factory) -> str:
    return tiny_run(
        digits_shards, session_dir(tmp_path_factory, "eval_runs"), "ldm_tiny_full.yaml", "ldm_full", ("num_passes=1",)
    )


@pytest.fixture(scope="module")
def trained(run_dir):
    return trained_task(run_dir)


def test_denoising_loss_is_the_tasks_fixed_grid_loss_and_repeats_exactly(trained):
    task, model, cfg = trained
    batches = list(read_split(cfg.data.val, resolution=16, channels=3, batch_size=60, max_samples=60))
    first = task.held_out(model, batches, seed=0)
    rebatched = list(read_split(cfg.data.val, resolution=16, channels=3, batch_size=40, max_samples=60))
    assert first == task.held_out(model, batches, seed=0)
    assert task.held_out(model, rebatched, seed=0)["denoise_mse"] == pytest.approx(first["denoise_mse"], rel=1e-6)
    assert first["num_samples"] == 60 and len([k for k in first if k.startswith("denoise_mse_t")]) == 10


def test_generated_images_do_not_depend_on_world_size_or_batch_size(trained):
    task, model, _ = trained
    one = torch.cat(list(generate_images(task, model, num_images=6, steps=3, seed=1, batch_size=4)))
    shares = [
        torch.cat(list(generate_images(task, model, num_images=6, steps=3, seed=1, batch_size=2, rank=r, world_size=2)))
        for r in range(2)
    ]
    assert one.shape == (6, 3, 16, 16) and 0 <= float(one.min()) and float(one.max()) <= 1
    torch.testing.assert_close(one[0::2], shares[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(one[1::2], shares[1], atol=1e-5, rtol=0)
    other_seed = torch.cat(list(generate_images(task, model, num_images=2, steps=3, seed=2)))
    assert not torch.allclose(one[:2], other_seed)


def test_evaluate_checkpoint_writes_fid_of_ema_samples(run_dir, digits_shards, tmp_path_factory):
    classifier = feature_net(
        digits_shards, os.path.join(session_dir(tmp_path_factory, "eval_nets"), "digits.safetensors")
    )
    eval_cfg = load_eval_config(
        overrides=[
            "fid.feature=classifier",
            f"fid.weights={classifier}",
            "fid.num_samples=48",
            "fid.sampler_steps=4",
            "fid.reference=val",
            f"fid.stats_dir={tmp_path_factory.mktemp('stats')}",
            "val_samples=60",
        ]
    )
    record = evaluate_checkpoint(run_dir, eval_cfg=eval_cfg)
    metrics, details = record["metrics"], record["details"]
    assert set(metrics) == {"denoise_mse", "fid"} and record["weights"] == "ema"
    assert details["fid_samples"] == 48 and details["fid_reference_samples"] == 180
    assert details["fid_feature"].startswith("classifier-") and details["num_samples"] == 60
    assert metrics["fid"] > 1.0  # one pass of a tiny UNet draws blobs, not digits
    written = json.load(open(record["path"]))
    assert written["metrics"] == metrics and written["optimizer_steps"] == record["optimizer_steps"] > 0
