"""A tiny class-conditional DiT with flow matching trained by the one loop, as a specification: its
held-out flow loss falls, 2 ranks of batch B train what 1 rank of 2B does, a run stopped at a
checkpoint resumes bitwise (killed by SIGKILL: test_trainer.py), and the FID evaluator samples it."""

from __future__ import annotations

import os

import pytest
import torch
from eval_runs import digit_shards, feature_net, one_torch_thread, session_dir
from test_distributed import assert_held_out_flow_loss_fell, launch, passes_of, trained_from_its_first_model
from test_trainer import ROOT, assert_states_equal, straight_and_resumed

from prunepipe.pipelines.checkpoint.store import latest_checkpoint, load_checkpoint_states
from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.tasks.diffusion.from_export import sample
from prunepipe.pipelines.trained import evaluate_checkpoint

CONFIG = os.path.join(ROOT, "configs", "ldm_dit_tiny_infobatch.yaml")
TINY_DIT = ["data.batch_size=64", "data.val_batches=1", "log_every=5"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def trained_run(digits_shards, tmp_path_factory):
    """(config, held-out of the initial model, the run's pass records): 4 passes of InfoBatch."""
    runs = session_dir(tmp_path_factory, "dit_runs")
    cfg = load_config(
        CONFIG,
        [
            f"data.train={digits_shards}/train",
            f"data.val={digits_shards}/val",
            f"runs_dir={runs}",
            "name=dit_falls",
            "num_passes=4",
            *TINY_DIT,
        ],
    )
    return (cfg, *trained_from_its_first_model(cfg))


def test_tiny_dit_flow_trains_and_its_held_out_flow_loss_falls(trained_run):
    cfg, before, records = trained_run
    after = assert_held_out_flow_loss_fell(before, records)
    falls = [k for k in before if k.startswith("flow_mse_s")]
    assert len(falls) == 10 and all(after[k] < before[k] for k in falls)
    assert records[1]["kept_fraction"] < 1.0, "InfoBatch pruned on the flow scores"


def test_fid_evaluator_samples_the_trained_dit_with_guidance(trained_run, digits_shards, tmp_path_factory):
    cfg, _, _ = trained_run
    classifier = feature_net(
        digits_shards, os.path.join(session_dir(tmp_path_factory, "eval_nets"), "digits.safetensors")
    )
    results = {}
    for scale in (1.0, 3.0):
        eval_cfg = load_eval_config(
            overrides=[
                "fid.feature=classifier",
                f"fid.weights={classifier}",
                "weights=raw",
                "fid.num_samples=20",
                "fid.sampler_steps=4",
                "fid.reference=val",
                f"fid.guidance_scale={scale}",
                "val_samples=20",
                f"fid.stats_dir={tmp_path_factory.mktemp('stats')}",
            ]
        )
        record = evaluate_checkpoint(cfg.run_dir, eval_cfg=eval_cfg, write=False)
        results[scale] = record["details"]
        assert record["details"]["fid_samples"] == 20 and record["details"]["fid_guidance_scale"] == scale
    assert results[1.0]["fid"] != results[3.0]["fid"]
    # the run's export samples with the project's sampler, on the classes asked for
    images = sample(
        os.path.join(cfg.run_dir, "export"),
        2,
        3,
        torch.Generator().manual_seed(0),
        class_labels=torch.tensor([3, 8]),
        guidance_scale=2.0,
    )
    assert images.shape == (2, 1, 16, 16)


def test_a_dit_flow_run_stopped_at_a_checkpoint_resumes_bitwise(digits_shards, tmp_path):
    # in-process, for the default suite; the SIGKILL form is test_trainer's (slow: three interpreter starts)
    base = [*TINY_DIT, "num_passes=2", "checkpoint.every_steps=10"]
    (_, straight, straight_pruner), (_, resumed, resumed_pruner) = straight_and_resumed(
        CONFIG, digits_shards, tmp_path, base, stop_at=20, end_at=35
    )
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert_states_equal(straight_pruner, resumed_pruner)


@pytest.mark.slow
def test_two_ranks_of_batch_b_train_the_dit_like_one_rank_of_batch_2b(digits_shards, tmp_path):
    # 64 samples: every step sees the whole set on 2 x 32 or 1 x 64; noise, s and label drops are
    # keyed by sample id, so the averaged gradients agree
    small = digit_shards(digits_shards, tmp_path / "small", shards=1, per_shard=64)
    common = [
        f"data.train={small}",
        "data.val=''",
        f"runs_dir={tmp_path}",
        "num_passes=3",
        "optim.warmup_passes=0",
        "data.val_batches=1",
    ]
    config = "ldm_dit_tiny_full.yaml"
    launch(2, config, common + ["name=two", "data.batch_size=32"])
    launch(1, config, common + ["name=one", "data.batch_size=64"])
    two = load_checkpoint_states(latest_checkpoint(str(tmp_path / "two")))["model"]
    one = load_checkpoint_states(latest_checkpoint(str(tmp_path / "one")))["model"]
    assert passes_of(str(tmp_path / "two"))[-1]["optimizer_steps"] == 3
    moved = 0
    for key in one:
        if key.endswith("attn1.to_k.bias"):
            continue  # shifts a softmax row equally: zero true gradient, Adam-amplified float noise
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
        moved += 1
    assert moved > 10
