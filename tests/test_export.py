"""A diffusion run's export is a diffusers pipeline folder, as a specification: `prunepipe export RUN`
writes a tiny text-conditional run (precomputed latents and text features) that
`PixArtAlphaPipeline.from_pretrained(export)` loads alone and that draws the images `prunepipe sample`
draws; its paths are relative, `--copy` makes it self-contained, a class-conditional latent DiT loads as
a DiTPipeline, flow-matching runs load as DiTPipeline and PixArtSigmaPipeline stepped by
DPMSolverMultistepScheduler, whose first order is the Euler step prunepipe samples with, and an export
no pipeline samples says why."""

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
from prunepipe.pipelines.tasks.diffusion.sampler import flow_sampler
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
        features16, tmp_path_factory.mktemp("runs"), "t2i", *tiny(encoder), *PRECOMPUTED, *DDPM, "num_passes=1"
    )
    train(cfg)
    return cfg


@pytest.fixture(scope="module")
def flow_text_run(features16, encoder, tmp_path_factory):  # noqa: F811
    """The same run trained with flow matching, as configs/ldm_t2i_*.yaml train."""
    cfg = latent_config(
        features16, tmp_path_factory.mktemp("runs"), "t2i_flow", *tiny(encoder), *PRECOMPUTED, "num_passes=1"
    )
    assert cfg.ldm.objective == "flow"
    train(cfg)
    return cfg


def perturbed(task: DiffusionTask) -> DiffusionTask:
    with torch.no_grad():  # the paper's init zeroes the last layer: a fresh DiT predicts nothing
        for parameter in task.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    return task


def kept_an_ema(export) -> bool:
    return any("non_ema" in name for name in os.listdir(os.path.join(export, "transformer")))


def pipeline_and_sample(pipe, export: str, *, steps: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PROMPTS drawn by a loaded text pipeline and by `sample()`, from the same generator seed."""
    images = pipe(
        PROMPTS,
        num_inference_steps=steps,
        guidance_scale=scale,
        generator=torch.Generator().manual_seed(7),
        use_resolution_binning=False,
        max_sequence_length=8,
        output_type="pt",
    ).images
    ours = sample(
        export,
        2,
        steps,
        torch.Generator().manual_seed(7),
        ema=kept_an_ema(export),
        prompts=PROMPTS,
        guidance_scale=scale,
    )
    return images, ours


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
    images, ours = pipeline_and_sample(pipe, export, steps=4, scale=2.0)
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
    links = [os.path.join(root, name) for root, dirs, files in os.walk(moved) for name in dirs + files]
    assert not [path for path in links if os.path.islink(path)], "a copied export holds no link"
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
    cfg = diffusion_config(
        backbone="dit", num_classes=10, dit__depth=1, dit__width=32, dit__heads=2, space="vae", vae=vae
    )
    task = perturbed(DiffusionTask(cfg, image_size=16, channels=3))
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


def test_the_flow_sampler_at_first_order_is_the_euler_step_on_the_straight_path():
    """DPMSolverMultistepScheduler in flow mode, solver_order=1: x <- x + (s' - s) v at every step, the
    last into s' = 0, over s_k = (1 - 1/T)(1 - k/N) with the model fed floor(s_k T)."""
    for steps in (1, 2, 5, 50):
        scheduler = flow_sampler(1000)
        scheduler.set_timesteps(steps)
        s = scheduler.sigmas
        expected = torch.tensor([(1 - 1 / 1000) * (1 - k / steps) for k in range(steps)] + [0.0])
        torch.testing.assert_close(s, expected, rtol=0, atol=1e-6)
        assert scheduler.timesteps.tolist() == [int(v * 1000) for v in s[:-1].tolist()]
        x = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(steps))
        for k, t in enumerate(scheduler.timesteps):
            v = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + k))
            stepped = scheduler.step(v, t, x).prev_sample
            torch.testing.assert_close(stepped, x + (s[k + 1] - s[k]) * v, rtol=0, atol=1e-5)
            x = stepped


def test_a_class_conditional_flow_dit_loads_as_a_dit_pipeline_and_draws_prunepipes_images(tmp_path):
    from diffusers import DiffusionPipeline, DiTPipeline, DPMSolverMultistepScheduler
    from eval_runs import tiny_vae

    vae = str(tmp_path / "vae")
    tiny_vae(3, 16).save_pretrained(vae)
    cfg = diffusion_config(
        backbone="dit",
        objective="flow",
        num_classes=10,
        dit__depth=1,
        dit__width=32,
        dit__heads=2,
        space="vae",
        vae=vae,
    )
    task = perturbed(DiffusionTask(cfg, image_size=16, channels=3))
    export = str(tmp_path / "export")
    task.export(task.model, None, export)
    with open(os.path.join(export, "README.md")) as f:
        assert "DiTPipeline.from_pretrained" in f.read()
    pipe = DiffusionPipeline.from_pretrained(export)
    assert isinstance(pipe, DiTPipeline) and isinstance(pipe.scheduler, DPMSolverMultistepScheduler)
    for steps in (1, 3):
        drawn = pipe(
            class_labels=[1, 7],
            num_inference_steps=steps,
            guidance_scale=1.0,
            generator=torch.Generator().manual_seed(3),
            output_type="np",
        ).images
        ours = sample(export, 2, steps, torch.Generator().manual_seed(3), ema=False, class_labels=torch.tensor([1, 7]))
        np.testing.assert_allclose(drawn, ours.permute(0, 2, 3, 1).numpy(), rtol=0, atol=1e-5)


def test_a_text_to_image_flow_run_loads_as_pixart_sigma_and_draws_prunepipes_images(flow_text_run, tmp_path, capsys):
    from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler, PixArtSigmaPipeline

    export = str(tmp_path / "export")
    assert main(["export", flow_text_run.run_dir, "--out", export]) == 0
    assert "PixArtSigmaPipeline.from_pretrained" in capsys.readouterr().out
    pipe = DiffusionPipeline.from_pretrained(export)
    assert isinstance(pipe, PixArtSigmaPipeline) and isinstance(pipe.scheduler, DPMSolverMultistepScheduler)
    assert pipe.scheduler.config.solver_order == 1 and pipe.scheduler.config.prediction_type == "flow_prediction"
    for steps, scale in ((1, 1.0), (4, 2.0)):
        images, ours = pipeline_and_sample(pipe, export, steps=steps, scale=scale)
        torch.testing.assert_close(images, ours, rtol=0, atol=1e-5)
    assert not torch.equal(ours[0], ours[1]), "the prompt chooses the image"
    assert isinstance(load_pipeline(export), PixArtSigmaPipeline)  # reading prompts as written
    out = tmp_path / "samples"  # `prunepipe sample` on the run's own export
    argv = ["sample", flow_text_run.run_dir, "--prompt", PROMPTS[0], "--steps", "2", "--out", str(out)]
    assert main([*argv, "--device", "cpu"]) == 0 and len(list(out.glob("*.png"))) == 1


def test_an_unconditional_pixel_space_flow_unet_loads_as_a_ddpm_pipeline_and_draws_prunepipes_images(tmp_path):
    from diffusers import DDPMPipeline
    from test_diffusion import make_task

    task = make_task(objective="flow")
    with torch.no_grad():  # a fresh UNet's output is near zero: move it off
        for parameter in task.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    export = str(tmp_path / "export")
    task.export(task.model, None, export)
    pipe = load_pipeline(export)
    assert isinstance(pipe, DDPMPipeline)
    drawn = pipe(batch_size=2, num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="np")
    ours = sample(export, 2, 3, torch.Generator().manual_seed(0), ema=False)
    np.testing.assert_allclose(drawn.images, ours.permute(0, 2, 3, 1).numpy(), rtol=0, atol=1e-5)


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
        assert "this run trained in pixel space" in f.read()
    with pytest.raises(ValueError, match="pixel space.*use sample"):
        load_pipeline(export)
    assert sample(export, 1, 2, torch.Generator().manual_seed(0), ema=False).shape == (1, 1, 8, 8)
