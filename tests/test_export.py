"""A diffusion run's export is a diffusers pipeline folder, as a specification: `prunepipe export RUN`
writes a tiny text-conditional run (precomputed latents and text features) that
`PixArtAlphaPipeline.from_pretrained(export)` loads alone and that draws the images `prunepipe sample`
draws; its paths are relative, `--copy` makes it self-contained, a class-conditional latent DiT loads as
a DiTPipeline, and an export no pipeline samples says why."""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pytest
import torch
from eval_runs import diffusion_config
from PIL import Image
from test_text_features import PRECOMPUTED, features16, latent_config  # noqa: F401 (fixture)
from test_text_to_image import PROMPTS, captioned, encoder, tiny  # noqa: F401 (fixtures)

from prunepipe.launch.cli import main
from prunepipe.pipelines.tasks.diffusion.from_export import load_pipeline, sample
from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask
from prunepipe.pipelines.training.loop import train

DDPM = [
    "ldm.objective=ddpm",
    "ldm.ddpm.prediction_type=epsilon",
    "ldm.ddpm.timestep_sampling=uniform",
    "ldm.flow.weighting=uniform",
]


@pytest.fixture(scope="module")
def text_run(features16, encoder, tmp_path_factory):  # noqa: F811
    """One pass of the tiny PixArt DiT (DDPM) on latent shards holding their captions' features."""
    cfg = latent_config(
        features16, tmp_path_factory.mktemp("runs"), "t2i", *tiny(encoder), PRECOMPUTED, *DDPM, "passes=1"
    )
    train(cfg)
    return cfg


def kept_an_ema(export) -> bool:
    return any("non_ema" in name for name in os.listdir(os.path.join(export, "transformer")))


def test_prunepipe_export_writes_a_folder_pixart_alpha_pipeline_loads_alone_and_it_draws_prunepipes_images(
    text_run, tmp_path, capsys
):
    from diffusers import PixArtAlphaPipeline

    export = str(tmp_path / "export")
    assert main(["export", text_run.run_dir, "--out", export]) == 0
    assert "PixArtAlphaPipeline.from_pretrained" in capsys.readouterr().out  # the README, printed
    with open(os.path.join(export, "model_index.json")) as f:
        assert json.load(f)["_class_name"] == "PixArtAlphaPipeline"
    pipe = PixArtAlphaPipeline.from_pretrained(export)
    images = pipe(
        PROMPTS,
        num_inference_steps=4,
        guidance_scale=2.0,
        generator=torch.Generator().manual_seed(7),
        use_resolution_binning=False,
        max_sequence_length=8,
        output_type="pt",
    ).images
    ours = sample(
        export, 2, 4, torch.Generator().manual_seed(7), ema=kept_an_ema(export), prompts=PROMPTS, guidance_scale=2.0
    )
    torch.testing.assert_close(images, ours, rtol=0, atol=1e-5)
    assert not torch.equal(ours[0], ours[1]), "the prompt chooses the image"

    # nothing in it names this machine's folders: links and records are relative to the export
    for name in ("vae", "text_encoder", "tokenizer"):
        assert os.path.islink(os.path.join(export, name)) and not os.readlink(os.path.join(export, name)).startswith(
            "/"
        )
    for path in glob.glob(os.path.join(export, "*.json")):
        with open(path) as f:
            assert str(tmp_path.parent) not in f.read(), path


def test_a_copied_export_moves_anywhere_and_still_loads(text_run, tmp_path):
    from diffusers import PixArtAlphaPipeline

    assert main(["export", text_run.run_dir, "--out", str(tmp_path / "export"), "--copy"]) == 0
    moved = str(tmp_path / "elsewhere" / "model")
    shutil.move(str(tmp_path / "export"), moved)
    assert not any(os.path.islink(os.path.join(moved, name)) for name in ("vae", "text_encoder"))
    pipe = PixArtAlphaPipeline.from_pretrained(moved)
    assert pipe.transformer.config.sample_size == 4 and pipe.vae.config.latent_channels == 4
    images = sample(moved, 1, 2, torch.Generator().manual_seed(0), ema=kept_an_ema(moved), prompts=PROMPTS[:1])
    assert images.shape == (1, 1, 8, 8)


def test_prunepipe_sample_writes_the_pngs_of_the_exports_images(text_run, tmp_path, capsys):
    out = tmp_path / "samples"
    assert (
        main(
            [
                "sample",
                text_run.run_dir,
                "--prompt",
                PROMPTS[0],
                "--prompt",
                PROMPTS[1],
                "--steps",
                "4",
                "--guidance-scale",
                "2",
                "--seed",
                "7",
                "--out",
                str(out),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    written = sorted(out.glob("*.png"))
    assert len(written) == 2 and all(repr(prompt) in printed for prompt in PROMPTS)
    export = os.path.join(text_run.run_dir, "export")  # the one the run wrote at its end
    expected = sample(
        export, 2, 4, torch.Generator().manual_seed(7), ema=kept_an_ema(export), prompts=PROMPTS, guidance_scale=2.0
    )
    for path, image in zip(written, expected):
        assert np.array_equal(np.asarray(Image.open(path)), (image[0].numpy() * 255).round().astype(np.uint8))


def test_prunepipe_sample_says_what_to_run_when_a_run_has_no_export(text_run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(text_run.run_dir, copy, ignore=shutil.ignore_patterns("export"))
    assert main(["sample", str(copy), "--prompt", PROMPTS[0]]) == 2
    assert f"prunepipe export {copy}" in capsys.readouterr().err


def test_a_class_conditional_latent_dit_loads_as_a_dit_pipeline_and_draws_prunepipes_images(tmp_path):
    from diffusers import DiTPipeline
    from eval_runs import tiny_vae

    vae = str(tmp_path / "vae")
    tiny_vae(3, 16).save_pretrained(vae)
    cfg = diffusion_config(backbone="dit", num_classes=10, dit__depth=1, dit__width=32, dit__heads=2, autoencoder=vae)
    task = DiffusionTask(cfg, image_size=16, channels=3)
    with torch.no_grad():  # the paper's init zeroes the last layer: a fresh DiT predicts nothing
        for parameter in task.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    export = str(tmp_path / "export")
    task.export(task.model, None, export)
    pipe = DiTPipeline.from_pretrained(export)
    drawn = pipe(
        class_labels=[1, 7],
        num_inference_steps=3,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    ).images
    ours = sample(export, 2, 3, torch.Generator().manual_seed(3), ema=False, class_labels=torch.tensor([1, 7]))
    np.testing.assert_allclose(drawn, ours.permute(0, 2, 3, 1).numpy(), rtol=0, atol=1e-5)


def test_an_export_no_pipeline_samples_says_why_in_its_readme_and_its_error(tmp_path):
    task = DiffusionTask(
        diffusion_config(backbone="dit", objective="flow", dit__depth=1, dit__width=32, dit__heads=2),
        image_size=8,
        channels=1,
    )
    export = str(tmp_path / "export")
    task.export(task.model, None, export)
    assert not os.path.exists(os.path.join(export, "model_index.json"))
    with open(os.path.join(export, "README.md")) as f:
        assert "scale_model_input" in f.read()
    with pytest.raises(ValueError, match="flow-matching run.*use sample"):
        load_pipeline(export)
    assert sample(export, 1, 2, torch.Generator().manual_seed(0), ema=False).shape == (1, 1, 8, 8)
