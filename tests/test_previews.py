"""Previews while training and the trackers, as a specification: a class-conditional DiT, a
text-to-image DiT and an MAE each draw their grid at the configured steps into RUN/previews/ and
TensorBoard, with a validation loss beside it; a run stopped at a checkpoint and resumed draws the very
same PNG at the same step, and drawing changes nothing of training; W&B in offline mode writes its run
folder; a preview setting the task cannot draw is one config line."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import torch
from eval_runs import one_torch_thread
from PIL import Image
from test_text_to_image import captioned, encoder, tiny  # noqa: F401 (module fixtures)
from test_trainer import ROOT, final_state, straight_and_resumed

from prunepipe.pipelines.config import ConfigError, load_config
from prunepipe.pipelines.training.loop import train
from prunepipe.pipelines.training.previews import preview_path

EVERY = 10  # steps between previews; the runs stop at 10 and resume to 20


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def previews_of(run_dir) -> dict[int, dict]:
    """The preview records of metrics.jsonl by step."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["optimizer_steps"]: r for r in records if r["kind"] == "preview"}


def tensorboard_previews(run_dir) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    """({step: the preview picture}, {step: preview/val_loss}) read back from the run's TensorBoard events."""
    import io

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = glob.glob(os.path.join(run_dir, "tensorboard", "*"))
    events = EventAccumulator(folder, size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    pictures = {e.step: np.asarray(Image.open(io.BytesIO(e.encoded_image_string))) for e in events.Images("preview")}
    return pictures, {e.step: e.value for e in events.Scalars("preview/val_loss")}


def assert_previews_resume_bitwise(config, shards, tmp_path, base, *, expected_size=None):
    """Straight to step 20 and stopped at 10 then resumed to 20, previews every 10: the same PNG bytes at
    both steps, a validation loss in metrics.jsonl and the pictures and losses in TensorBoard."""
    base = [*base, "checkpoint.every_steps=10", f"eval.preview.every_steps={EVERY}", "eval.preview.num_steps=3"]
    straight_and_resumed(config, shards, tmp_path, base, stop_at=10, end_at=20)
    for step in (10, 20):
        with (
            open(preview_path(tmp_path / "straight", step), "rb") as a,
            open(preview_path(tmp_path / "resumed", step), "rb") as b,
        ):
            assert a.read() == b.read(), f"the preview at step {step} differs after the resume"
    records = previews_of(tmp_path / "straight")
    assert sorted(records) == [10, 20]
    assert all(np.isfinite(r["val_loss"]) and r["val"]["num_samples"] > 0 for r in records.values())
    assert records[10]["val_loss"] == previews_of(tmp_path / "resumed")[10]["val_loss"]
    pictures, losses = tensorboard_previews(tmp_path / "straight")
    assert sorted(pictures) == [10, 20] and sorted(losses) == [10, 20]
    on_disk = np.asarray(Image.open(preview_path(tmp_path / "straight", 20)).convert("RGB"))
    assert np.array_equal(pictures[20][..., :3], on_disk), "TensorBoard holds the picture written to previews/"
    assert losses[20] == pytest.approx(records[20]["val_loss"], rel=1e-6)
    if expected_size is not None:
        assert on_disk.shape[:2] == expected_size
    resumed, _ = tensorboard_previews(tmp_path / "resumed")  # the resumed process's own events, both steps
    assert sorted(resumed) == [10, 20] and np.array_equal(resumed[20], pictures[20])
    return records


def test_a_class_conditional_dit_draws_its_classes_at_the_configured_steps_and_again_after_a_resume(
    digits_shards, tmp_path
):
    config = os.path.join(ROOT, "configs", "ldm_dit_tiny_full.yaml")
    base = ["data.batch_size=64", "data.val_batches=1", "eval.preview.classes=[0,1,2,3]", "eval.preview.val_samples=32"]
    records = assert_previews_resume_bitwise(
        config, digits_shards, tmp_path, base, expected_size=(2 + 2 * 18, 2 + 2 * 18)
    )
    assert records[20]["val"]["num_samples"] == 32 and "flow_mse_s005" in records[20]["val"]


def test_a_text_to_image_dit_draws_its_prompts_at_the_configured_steps_and_again_after_a_resume(
    captioned,  # noqa: F811
    encoder,  # noqa: F811
    tmp_path,
):
    config = os.path.join(ROOT, "configs", "ldm_t2i_tiny.yaml")
    prompts = '["a handwritten digit three","a handwritten digit eight"]'
    base = [*tiny(encoder), f"eval.preview.prompts={prompts}", "eval.preview.val_samples=16"]
    records = assert_previews_resume_bitwise(config, captioned, tmp_path, base)
    assert records[20]["prompts"] == ["a handwritten digit three", "a handwritten digit eight"]


def test_a_text_to_image_dit_without_prompts_draws_held_out_captions(captioned, encoder, tmp_path):  # noqa: F811
    cfg = load_config(
        os.path.join(ROOT, "configs", "ldm_t2i_tiny.yaml"),
        [
            f"data.train={captioned}/train",
            f"data.val={captioned}/val",
            f"runs_dir={tmp_path}",
            "name=captions",
            *tiny(encoder),
            "max_steps=2",
            "eval.preview.every_steps=2",
            "eval.preview.num_images=3",
            "eval.preview.num_steps=2",
            "eval.preview.val_samples=0",
            "log_with=[]",
        ],
    )
    train(cfg)
    record = previews_of(cfg.run_dir)[2]
    assert len(record["prompts"]) == 3 and all(p.startswith("a handwritten digit") for p in record["prompts"])
    assert "val_loss" not in record and os.path.exists(preview_path(cfg.run_dir, 2))
    assert not os.path.exists(os.path.join(cfg.run_dir, "tensorboard")), "log_with=[] starts no tracker"


def test_an_mae_shows_original_masked_and_reconstruction_and_drawing_them_changes_no_weight(digits_shards, tmp_path):
    config = os.path.join(ROOT, "configs", "mae_tiny_full.yaml")
    small = ["mae.embed_dim=32", "mae.depth=1", "mae.decoder_depth=1", "data.batch_size=64", "data.val_batches=1"]
    base = [*small, "eval.preview.num_images=4", "eval.preview.val_samples=32"]
    records = assert_previews_resume_bitwise(config, digits_shards, tmp_path, base)
    assert set(records[20]["val"]) == {"masked_mse", "num_samples"}
    picture = np.asarray(Image.open(preview_path(tmp_path / "straight", 20)).convert("RGB"))
    assert picture.shape[:2] == (2 + 4 * 34, 2 + 3 * 34)  # 4 images a row each: original, masked, reconstruction
    # the same run without previews reaches the same weights: the EMA copied in and out, nothing drawn from RNG
    train(
        load_config(
            config,
            [
                f"data.train={digits_shards}/train",
                f"data.val={digits_shards}/val",
                f"runs_dir={tmp_path}",
                "name=without",
                *small,
                "max_steps=20",
                "checkpoint.every_steps=10",
                "log_with=[]",
            ],
        )
    )
    _, with_previews, _ = final_state(tmp_path / "straight")
    _, without, _ = final_state(tmp_path / "without")
    assert all(torch.equal(with_previews[k], without[k]) for k in without)


def test_wandb_offline_writes_a_run_folder_with_the_scalars_and_previews(digits_shards, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [
            f"data.train={digits_shards}/train",
            f"data.val={digits_shards}/val",
            f"runs_dir={tmp_path}",
            "name=wandb_offline",
            "mae.depth=1",
            "mae.decoder_depth=1",
            "max_steps=4",
            "log_every=2",
            "log_with=[tensorboard,wandb]",
            "eval.preview.every_steps=4",
            "eval.preview.num_images=2",
            "eval.preview.val_samples=8",
        ],
    )
    train(cfg)
    (run,) = glob.glob(os.path.join(cfg.run_dir, "wandb", "offline-run-*"))
    with open(os.path.join(cfg.run_dir, "wandb_run_id")) as f:
        assert f.read().strip() in os.path.basename(run)
    assert glob.glob(os.path.join(run, "*.wandb")), "the offline run's record, for `wandb sync`"
    assert glob.glob(os.path.join(run, "files", "media", "images", "preview_*.png")), "the preview went to W&B"
    assert glob.glob(os.path.join(cfg.run_dir, "tensorboard", "*", "events.out.tfevents.*"))


@pytest.mark.parametrize(
    ("config", "setting", "named"),
    [
        ("mae_tiny_full.yaml", "eval.preview.classes=[1]", "eval.preview.classes"),
        ("ldm_dit_tiny_full.yaml", "eval.preview.classes=[10]", "ldm.num_classes-1 = 9"),
        ("ldm_dit_tiny_full.yaml", "eval.preview.prompts=[a cat]", "eval.preview.prompts"),
        ("mae_tiny_full.yaml", "data.val=", "MAE's preview reconstructs held-out images"),
        ("mae_tiny_full.yaml", "eval.preview.num_steps=0", "eval.preview.num_steps must be >= 1"),
        ("mae_tiny_full.yaml", "log_with=[tensorbord]", "log_with='tensorbord' is not accepted"),
    ],
)
def test_a_preview_or_tracker_setting_the_run_cannot_honour_is_one_config_line(config, setting, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("(", r"\(")):
        load_config(os.path.join(ROOT, "configs", config), ["eval.preview.every_steps=5", setting])


def test_a_tracker_that_is_not_installed_is_named_with_how_to_install_it(monkeypatch):
    import accelerate.tracking

    from prunepipe.pipelines.training.trackers import accelerator_logging

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    cfg = load_config(os.path.join(ROOT, "configs", "mae_tiny_full.yaml"), ["log_with=[tensorboard,wandb]"])
    with pytest.raises(ValueError, match=r"wandb is not installed here .*prunepipe\[wandb\]"):
        accelerator_logging(cfg)


def test_under_fsdp_the_sharded_model_draws_what_ddp_draws_with_the_ema_copied_into_its_shards(digits_shards, tmp_path):
    # one process: FSDP2's units and DTensor shards on a mesh of one (tests/test_sharded.py has the ranks)
    config = os.path.join(ROOT, "configs", "ldm_dit_tiny_full.yaml")
    common = [
        f"data.train={digits_shards}/train",
        f"data.val={digits_shards}/val",
        f"runs_dir={tmp_path}",
        "data.val_batches=1",
        "max_steps=4",
        "eval.preview.every_steps=2",
        "eval.preview.num_steps=3",
        "eval.preview.num_images=4",
        "eval.preview.val_samples=16",
        "log_with=[]",
    ]
    try:
        for name, extra in (("ddp", []), ("fsdp", ["parallel.strategy=fsdp"])):
            train(load_config(config, [*common, f"name={name}", *extra]))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    for step in (2, 4):
        ddp, fsdp = (np.asarray(Image.open(preview_path(tmp_path / n, step)), dtype=np.int16) for n in ("ddp", "fsdp"))
        assert np.abs(ddp - fsdp).max() <= 1, f"step {step}: the sharded model drew another picture"
    losses = [previews_of(tmp_path / n)[4]["val_loss"] for n in ("ddp", "fsdp")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    _, ddp_weights, _ = final_state(tmp_path / "ddp")
    _, fsdp_weights, _ = final_state(tmp_path / "fsdp")
    assert all(torch.allclose(fsdp_weights[k], ddp_weights[k], rtol=1e-5, atol=1e-7) for k in ddp_weights)


@pytest.mark.slow  # two launches of two ranks
def test_two_ranks_under_fsdp_draw_every_preview_together_and_the_picture_ddps_ranks_draw(digits_shards, tmp_path):
    from test_sharded import finished, torchrun

    config = os.path.join(ROOT, "configs", "ldm_dit_tiny_full.yaml")
    common = [
        f"data.train={digits_shards}/train",
        f"data.val={digits_shards}/val",
        f"runs_dir={tmp_path}",
        "data.batch_size=32",
        "data.val_batches=1",
        "max_steps=4",
        "eval.preview.every_steps=2",
        "eval.preview.num_steps=3",
        "eval.preview.num_images=4",
        "eval.preview.val_samples=16",
    ]
    for name, extra in (("ddp", []), ("fsdp", ["parallel.strategy=fsdp"])):
        finished(torchrun(2, config, [*common, f"name={name}", *extra]))  # a rank left waiting would time out
    for step in (2, 4):
        ddp, fsdp = (np.asarray(Image.open(preview_path(tmp_path / n, step)), dtype=np.int16) for n in ("ddp", "fsdp"))
        assert np.abs(ddp - fsdp).max() <= 1
    assert sorted(previews_of(tmp_path / "fsdp")) == [2, 4], "rank 0 alone writes, once a step"


def test_on_precomputed_text_features_held_out_captions_or_prompts_through_the_recorded_encoder(
    captioned,  # noqa: F811
    encoder,  # noqa: F811
    tmp_path,
):
    """PixArt's way (latents and text features precomputed, no encoder in the loop): without prompts the
    held-out captions' stored features are drawn; prompts are encoded by the encoder the features record,
    and where that folder is gone the run stops at its start saying what it needs."""
    import shutil

    from eval_runs import tiny_vae

    from prunepipe.pipelines.evaluation.previews import Preview
    from prunepipe.pipelines.tasks.build import build_task
    from prunepipe.tools.commands.latents import encode_shards

    vae, copied = str(tmp_path / "vae"), str(tmp_path / "encoder")
    tiny_vae(1, 8).save_pretrained(vae)
    shutil.copytree(encoder, copied)
    for split in ("train", "val"):
        encode_shards(
            f"{captioned}/{split}", vae, str(tmp_path / split), resolution=8, batch_size=64, text_encoder=copied
        )
    cfg = load_config(
        os.path.join(ROOT, "configs", "ldm_t2i_tiny_latents.yaml"),
        [
            f"data.train={tmp_path}/train",
            f"data.val={tmp_path}/val",
            f"runs_dir={tmp_path}",
            *tiny(encoder)[:-3],  # sizes, not the encoder: none runs in the loop
            "ldm.text.max_length=8",
            "data.resolution=8",
            "eval.preview.every_steps=1",
            "eval.preview.num_images=2",
            "eval.preview.num_steps=2",
        ],
    )
    task = build_task(cfg)
    held_out = Preview(cfg, task, torch.device("cpu"))
    assert len(held_out.captions) == 2 and held_out.prompts[0].shape[1] == task.text.features[0]
    assert held_out.picture(task.model).shape == (2 + 10, 2 + 2 * 10, 3)  # two 4x4 latents, decoded to 8 px, in a row
    assert held_out.validation_loss(task.model)["num_samples"] == 64  # val_samples, the held-out split's 64
    cfg.eval.preview.prompts = ["a handwritten digit three", "a handwritten digit eight"]
    given = Preview(cfg, task, torch.device("cpu"))
    given.encode_prompts()
    assert given.captions == cfg.eval.preview.prompts and len(given.prompts) == 2
    assert given.picture(task.model).shape == held_out.picture(task.model).shape
    shutil.rmtree(copied)
    with pytest.raises(ValueError, match="leave eval.preview.prompts empty to draw the held-out captions"):
        Preview(cfg, task, torch.device("cpu")).encode_prompts()
