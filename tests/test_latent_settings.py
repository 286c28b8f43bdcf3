"""On precomputed latents (ldm.space=latents) a run trains at the latent shards' shape, so
data.resolution and data.channels go unused: values that name neither the latents nor the images
they were encoded from are said plainly, once, at the run's start."""

from __future__ import annotations

import os

import pytest
from eval_runs import tiny_vae

from prunepipe.pipelines.config import latent_shard_notes, load_config
from prunepipe.pipelines.training.loop import train
from prunepipe.tools.commands.latents import encode_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "ldm_tiny_full.yaml")


@pytest.fixture(scope="module")
def latents(digits_shards, tmp_path_factory) -> str:
    """The digits val split (180 images, 32 px, RGB) encoded by a tiny VAE to 4x16x16 latents."""
    root = tmp_path_factory.mktemp("latent_settings")
    vae = str(root / "vae")
    tiny_vae(3, 32).save_pretrained(vae)
    out = str(root / "latents")
    encode_shards(os.path.join(digits_shards, "val"), vae, out, resolution=32, batch_size=64, dtype="float32")
    return out


def config(latents, tmp_path, *extra):
    return load_config(
        CONFIG,
        [
            f"data.train={latents}",
            "data.val=",
            f"runs_dir={tmp_path}",
            "name=latents",
            "ldm.space=latents",
            "ldm.unet.block_out_channels=[16,32]",
            *extra,
        ],
    )


@pytest.mark.parametrize(
    "settings",
    [["data.resolution=32"], ["data.resolution=16"], ["data.resolution=32", "data.channels=4"]],
    ids=["the images' side", "the latents' side", "the latents' channels"],
)
def test_settings_that_name_the_latents_or_their_images_say_nothing(latents, tmp_path, settings):
    assert latent_shard_notes(config(latents, tmp_path, *settings)) == []


def test_a_recipe_for_other_latents_is_told_what_it_trains_on(latents, tmp_path):
    [note] = latent_shard_notes(config(latents, tmp_path, "data.resolution=256"))
    assert note.startswith(
        f"data.resolution=256 is not what this run trains on: data.train={latents!r} holds "
        f"4x16x16 latents, encoded from 32 px images by "
    )
    assert "--resolution 256" in note and note.endswith("set data.resolution=32 or data.resolution=16")
    [note] = latent_shard_notes(config(latents, tmp_path, "data.resolution=32", "data.channels=1"))
    assert note.startswith("data.channels=1 is unused on precomputed latents") and "3-channel images" in note
    assert note.endswith("set data.channels=3 (the images') or 4 (the latents')")
    # images in pixel space, or latents a VAE encodes in the loop: data.resolution is what is trained on
    assert latent_shard_notes(load_config(CONFIG, [f"data.train={latents}", "data.val=", "data.resolution=256"])) == []


def test_the_run_says_it_once_at_its_start(latents, tmp_path, capsys):
    train(config(latents, tmp_path, "data.resolution=256", "data.channels=1", "max_steps=2", "data.batch_size=16"))
    out = capsys.readouterr().out
    assert out.count("prunepipe: note: data.resolution=256 is not what this run trains on") == 1
    assert out.count("prunepipe: note: data.channels=1 is unused") == 1
