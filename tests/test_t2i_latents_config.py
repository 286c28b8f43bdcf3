"""configs/ldm_t2i_tiny_latents.yaml: the tiny text-to-image DiT trains on latent shards that hold
their captions' features (`latents encode --text-encoder`), given only where the shards are: no VAE
and no text encoder is loaded by the run."""

from __future__ import annotations

import math
import os

from eval_runs import tiny_vae
from test_text_to_image import captioned  # noqa: F401 (fixture)

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.tasks.build import build_task
from prunepipe.pipelines.tasks.diffusion.text import PrecomputedText
from prunepipe.pipelines.training.loop import train
from prunepipe.tools.commands.captioned import digit_caption
from prunepipe.tools.commands.latents import encode_shards
from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_text_encoder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "ldm_t2i_tiny_latents.yaml")


def test_the_tiny_t2i_latents_config_trains_on_latent_and_text_feature_shards(captioned, tmp_path):  # noqa: F811
    # as the config's comment makes them: the tiny encoder at its default length, a VAE folder
    encoder = write_tiny_text_encoder(str(tmp_path / "encoder"), [digit_caption(label) for label in range(10)])
    vae = str(tmp_path / "vae")
    tiny_vae(1, 8).save_pretrained(vae)
    for split in ("train", "val"):
        encode_shards(
            f"{captioned}/{split}",
            vae,
            str(tmp_path / "latents" / split),
            resolution=8,
            batch_size=64,
            text_encoder=encoder,
        )
    cfg = load_config(
        CONFIG,
        [
            f"data.train={tmp_path}/latents/train",
            f"data.val={tmp_path}/latents/val",
            f"runs_dir={tmp_path}/runs",
            "num_passes=1",
            "data.batch_size=256",
        ],
    )  # 512 pairs: 2 steps
    assert (cfg.ldm.space, cfg.ldm.text.features, cfg.ldm.text.encoder, cfg.ldm.backbone) == (
        "latents",
        "precomputed",
        "",
        "dit",
    )
    task = build_task(cfg)
    assert isinstance(task.text_encoder, PrecomputedText) and not task.text.captions
    assert task.model.__class__.__name__ == "PixArtTransformer2DModel" and task.autoencoder is None

    summary = train(cfg)
    assert summary["optimizer_steps"] == 2 and summary["bad_samples"] == 0
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["held_out"]["denoise_mse"])
    assert os.path.isdir(os.path.join(cfg.run_dir, "export"))
