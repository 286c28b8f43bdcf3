"""MAE evaluation as a specification: PSNR and SSIM are torchmetrics' on the reconstructed images,
the reconstruction keeps visible patches and its masked MSE is the training log's held-out loss,
every number repeats exactly on a second call, and `prunepipe eval` writes them to eval/*.json.

The linear probe tells a pretrained encoder from its own random initialisation: an MAE trained for
40 passes (about 40 s on 2 cores) scores well above it with 10 labels per class and above it with all
labels (docs/evaluation.md has the measurements behind the margins)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from eval_runs import one_torch_thread, session_dir, tiny_run, trained_task
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from prunepipe.launch.cli import main as cli_main
from prunepipe.pipelines.checkpoint.store import latest_checkpoint, load_checkpoint_states
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.evaluation.config import ProbeConfig
from prunepipe.pipelines.evaluation.probe import encoder_features, fit_probe
from prunepipe.pipelines.evaluation.reconstruction import fixed_mask_noise, reconstruct, reconstruction_metrics
from prunepipe.pipelines.trained import evaluate_checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def linear_probe(encoder, train_batches, val_batches, cfg: ProbeConfig, seed: int = 0) -> dict:
    """The probe in one process: `fit_probe` on `encoder_features` of both splits, as the runner
    (pipelines/evaluation/runner.py) runs it with the features gathered from every rank."""
    _, train_x, train_y = encoder_features(encoder, train_batches, cfg.pool)
    _, val_x, val_y = encoder_features(encoder, val_batches, cfg.pool)
    return fit_probe(train_x, train_y, val_x, val_y, cfg, seed)


@pytest.fixture(scope="module")
def run_dir(digits_shards, tmp_path_factory) -> str:
    return tiny_run(
        digits_shards, session_dir(tmp_path_factory, "eval_runs"), "mae_tiny_full.yaml", "mae_full", ("num_passes=2",)
    )


@pytest.fixture(scope="module")
def trained(run_dir):
    return trained_task(run_dir)


def val_batches(cfg, batch_size=50):
    return list(read_split(cfg.data.val, resolution=32, channels=3, batch_size=batch_size))


def test_psnr_and_ssim_are_torchmetrics_on_the_reconstructed_images(trained):
    task, model, cfg = trained
    batches = val_batches(cfg)
    ours = reconstruction_metrics(task, model, batches, seed=0)
    recon, target = [], []
    for batch in batches:
        images, _, _ = reconstruct(model, batch.images, fixed_mask_noise(batch.ids.numpy(), task.num_patches, 0))
        recon.append(((images + 1) / 2).clamp(0, 1))
        target.append((batch.images + 1) / 2)
    recon, target = torch.cat(recon), torch.cat(target)
    psnr = peak_signal_noise_ratio(recon, target, data_range=1.0, reduction="none", dim=(1, 2, 3))
    ssim = structural_similarity_index_measure(recon, target, data_range=1.0, reduction="none")
    assert ours["num_samples"] == len(target) == 180
    assert ours["psnr"] == pytest.approx(float(psnr.double().mean()), rel=1e-6)
    assert ours["ssim"] == pytest.approx(float(ssim.double().mean()), rel=1e-6)
    # and PSNR is what its definition says: 10 log10(1 / MSE) per image, then the mean
    mse = (recon.double() - target.double()).pow(2).flatten(1).mean(1)
    assert ours["psnr"] == pytest.approx(float((10 * torch.log10(1 / mse)).mean()), rel=1e-5)


def test_reconstruction_keeps_visible_patches_and_its_masked_mse_is_the_training_held_out_loss(trained):
    task, model, cfg = trained
    batches = val_batches(cfg)
    held = task.held_out(model, batches, seed=0)
    total = 0.0
    for batch in batches:
        recon, mask, masked_mse = reconstruct(
            model, batch.images, fixed_mask_noise(batch.ids.numpy(), task.num_patches, 0)
        )
        visible = (1 - mask).bool()
        assert torch.equal(model.patchify(recon)[visible], model.patchify(batch.images)[visible])
        total += float(masked_mse.double().sum())
    assert total / held["num_samples"] == pytest.approx(held["masked_mse"], rel=1e-6)
    assert reconstruction_metrics(task, model, batches)["masked_mse"] == pytest.approx(held["masked_mse"], rel=1e-9)


def test_mae_evaluation_repeats_exactly_and_cli_writes_eval_json(run_dir):
    first = evaluate_checkpoint(run_dir, write=False)
    second = evaluate_checkpoint(run_dir, write=False)
    assert first["metrics"] == second["metrics"]
    assert set(first["metrics"]) == {"masked_mse", "psnr", "ssim", "probe_accuracy"}
    assert 0.0 < first["metrics"]["masked_mse"] < 1.0 and first["details"]["probe_val_samples"] == 180

    # key=value settings go right after RUN, options anywhere
    assert cli_main(["eval", run_dir, "probe.enabled=false", "--weights", "raw"]) == 0
    written = json.load(open(os.path.join(run_dir, "eval", f"step_{first['optimizer_steps']:06d}_raw.json")))
    assert written["weights"] == "raw" and set(written["metrics"]) == {"masked_mse", "psnr", "ssim"}
    assert written["samples_forwarded"] == first["samples_forwarded"] > 0
    assert written["metrics"]["masked_mse"] != first["metrics"]["masked_mse"]  # raw weights are not the EMA's
    assert cli_main(["eval", run_dir, "probe.pool=median"]) == 2  # a bad value is one error line, not a trace


def test_probe_is_deterministic_and_scores_the_trained_encoder_far_above_chance(trained, run_dir):
    task, model, cfg = trained
    train = list(read_split(cfg.data.train, resolution=32, channels=3, batch_size=256))
    val = val_batches(cfg)
    first = linear_probe(model.encoder, train, val, ProbeConfig(), seed=0)
    assert first == linear_probe(model.encoder, train, val, ProbeConfig(), seed=0)
    assert first["probe_accuracy"] > 0.6  # ten classes: chance is 0.1; measured 0.85-0.89
    few = linear_probe(model.encoder, train, val, ProbeConfig(per_class=5), seed=0)
    assert few["probe_train_samples"] == 50 and few["probe_accuracy"] > 0.3


@pytest.fixture(scope="module")
def pretrained_run(digits_shards, tmp_path_factory) -> str:
    """An MAE trained until its held-out loss flattens: width 64, depth 2, 40 passes (~1,000 steps)."""
    return tiny_run(
        digits_shards,
        session_dir(tmp_path_factory, "eval_runs"),
        "mae_tiny_full.yaml",
        "mae_probe",
        (
            "num_passes=40",
            "mae.embed_dim=64",
            "mae.depth=2",
            "mae.num_heads=4",
            "mae.decoder_embed_dim=64",
            "checkpoint.every_steps=100000",
            "checkpoint.keep=1",
            "log_every=1000",
        ),
    )


def test_probe_scores_a_pretrained_encoder_well_above_its_random_initialisation(pretrained_run):
    from prunepipe.pipelines.tasks.build import build_task

    _, model, cfg = trained_task(pretrained_run)
    torch.manual_seed(cfg.seed)  # what the trainer does before building the model: its initial weights
    initial = build_task(cfg).model.eval()
    assert not torch.equal(initial.encoder.patch_embed.proj.weight, model.encoder.patch_embed.proj.weight)
    train = list(read_split(cfg.data.train, resolution=32, channels=3, batch_size=256))
    val = val_batches(cfg)

    def gain(pool, per_class):
        probe = ProbeConfig(pool=pool, per_class=per_class)
        return (
            linear_probe(model.encoder, train, val, probe, seed=0)["probe_accuracy"]
            - linear_probe(initial.encoder, train, val, probe, seed=0)["probe_accuracy"]
        )

    # Measured over run seeds 0-2 (trained minus random, in points): mean patch token with 10 labels
    # per class +17 to +22 (random 0.50-0.54), class token +5 to +19; all labels +4 to +7 for both
    # pools (random 0.88-0.92).
    assert gain("avg", 10) > 0.12
    assert gain("token", 10) > 0.0
    assert gain("avg", 0) > 0.02 and gain("token", 0) > 0.02


def test_periodic_evaluation_from_a_training_loop_matches_evaluating_the_checkpoint(run_dir, trained):
    """What the trainer calls every E passes (Evaluator + weights_for_eval on the live model and its
    EMAModel) gives the numbers `prunepipe eval` gives for the checkpoint saved at that moment."""
    from diffusers.training_utils import EMAModel

    from prunepipe.pipelines.evaluation.runner import Evaluator, weights_for_eval

    task, model, cfg = trained
    states = load_checkpoint_states(latest_checkpoint(run_dir))
    ema = EMAModel(model.parameters())
    ema.load_state_dict(states["ema"])
    live = weights_for_eval(model, ema, "ema")
    assert live is not model  # the trained weights are left alone
    record = Evaluator(cfg, run_dir=run_dir).evaluate(task, live, at={"optimizer_steps": 1}, write=False)
    assert record["metrics"] == evaluate_checkpoint(run_dir, write=False)["metrics"]
    assert weights_for_eval(model, ema, "raw") is model


def test_eval_of_unlabelled_shards_skips_the_probe_and_writes_the_rest(tmp_path, capsys):
    # Most web data: an image folder without class subfolders, so the shards carry no labels.
    from eval_runs import TINY_MAE
    from PIL import Image

    from prunepipe.tools.commands.shards import write_shards
    from prunepipe.tools.commands.sources import digits

    folder = tmp_path / "images"
    folder.mkdir()
    for key, image, _ in list(digits(32))[:240]:
        image.save(folder / f"{key}.png")
    shards = tmp_path / "shards"
    write_shards("folder", str(shards), folder=str(folder), size=32, shard_size=100)
    assert Image.open(next(folder.iterdir())).size == (32, 32)
    config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "mae_tiny_full.yaml")
    assert (
        cli_main(
            [
                "train",
                config,
                f"data.train={shards}/train",
                f"data.val={shards}/val",
                "num_passes=1",
                f"runs_dir={tmp_path / 'runs'}",
                "name=unlabelled",
                *TINY_MAE,
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert cli_main(["eval", str(tmp_path / "runs" / "unlabelled"), "--weights", "raw", "probe.per_class=10"]) == 0
    out = capsys.readouterr().out
    [path] = (tmp_path / "runs" / "unlabelled" / "eval").glob("*_raw.json")
    record = json.load(open(path))
    assert set(record["metrics"]) == {"masked_mse", "psnr", "ssim"}  # reconstruction written, no probe
    assert "0 class(es)" in record["details"]["probe_skipped"]
    assert "probe skipped: the train shards carry 0 class(es)" in out
    assert "evaluated the raw weights of" in out
