"""Exports that a stock diffusers pipeline draws from as their README writes it, as a specification: every
bucket of the shipped tables passes PixArt's own size check; the README's call of a tiny bucketed run, run
as written, draws, and draws every bucket it lists; a tiny random T5-encoder export draws with a plain
`pipe(prompt)`, which its README and `prunepipe sample` say, while a CLIP-style export names the arguments
that the pipeline's defaults need."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from eval_runs import ROOT, diffusion_config, one_torch_thread
from test_bucket_training import CONFIG, bucketed, overrides  # noqa: F401 (fixture)

from prunepipe.launch.cli import main
from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.tasks.diffusion.stock_call import stock_call
from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask
from prunepipe.pipelines.training.loop import train
from prunepipe.tools.commands.aspect_buckets import NAMED_TABLES, load_buckets
from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_t5_encoder
from prunepipe.tools.fixtures.tiny_vae import write_tiny_vae

PROMPTS = ["a photograph of a red kite", "a photograph of the sea"]
SHIPPED_TABLES = [os.path.join(ROOT, "configs", "buckets_tiny.txt"), *NAMED_TABLES]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def readme_code(export: str) -> str:
    """The python block of the export's README, pointed at `export`."""
    with open(os.path.join(export, "README.md")) as f:
        [code] = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    return code.replace('"EXPORT"', repr(export))


@pytest.mark.parametrize("table", SHIPPED_TABLES, ids=os.path.basename)
def test_every_bucket_of_the_shipped_tables_passes_the_stock_pipelines_size_check(table):
    from diffusers import PixArtSigmaPipeline

    for height, width in load_buckets(table).sizes:  # the pipeline's own check, on each bucket's image size
        PixArtSigmaPipeline.check_inputs(None, "a prompt", height, width, None, 1)


def test_the_readme_call_of_a_bucketed_export_draws_as_written_and_at_every_bucket(bucketed, tmp_path):  # noqa: F811
    cfg = load_config(CONFIG, overrides(bucketed, str(tmp_path), "buckets", "num_passes=1"))
    train(cfg)
    export = os.path.join(cfg.run_dir, "export")
    with open(os.path.join(export, "README.md")) as f:
        readme = f.read()
    assert "`pipe(prompt)` alone does not draw from it" in readme
    assert "`use_resolution_binning`, `max_sequence_length`" in readme, "a CLIP-style encoder: both named"
    listed = re.search(r"`use_resolution_binning=False`: (.*) \(height x width\)", readme).group(1)
    buckets = [tuple(map(int, size.split("x"))) for size in listed.split(", ")]
    assert sorted(buckets) == sorted(load_buckets(os.path.join(ROOT, "configs", "buckets_tiny.txt")).sizes)
    assert "It refuses the buckets" not in readme

    code = readme_code(export)
    scope: dict = {}
    exec(code, scope)  # as written: the plain call, prunepipe's samples and a bucket's
    assert scope["images"][0].size == (buckets[-1][1], buckets[-1][0])
    pipe, bucket_call = scope["pipe"], code.strip().splitlines()[-1]
    for height, width in buckets:
        line = bucket_call.replace(f"height={buckets[-1][0]}", f"height={height}")
        line = line.replace(f"width={buckets[-1][1]}", f"width={width}")
        drawn = {"pipe": pipe, "prompt": PROMPTS[0]}
        exec(line, drawn)
        assert drawn["images"][0].size == (width, height), (height, width)


def test_a_plain_pipe_prompt_draws_from_a_tiny_t5_encoder_export(tmp_path, capsys):
    from diffusers import DiffusionPipeline, PixArtSigmaPipeline

    encoder = write_tiny_t5_encoder(str(tmp_path / "t5"), PROMPTS, d_model=16, layers=1, max_length=8)
    vae = write_tiny_vae(str(tmp_path / "vae"), attention=False)  # 2x: 64 px images, 32 latents a side
    settings = dict(backbone="dit", objective="flow", dit__depth=1, dit__width=32, dit__heads=2, dit__patch_size=8)
    config = diffusion_config(
        **settings, conditioning="text", text__encoder=encoder, text__max_length=8, space="vae", vae=vae
    )
    task = DiffusionTask(config, image_size=64, channels=3)
    assert task.sample_size == 32, "a size resolution binning knows (PixArt's 256 px table)"
    export = str(tmp_path / "export")
    task.export(task.model, None, export)

    call = stock_call(export)
    assert call.plain and call.call() == "pipe(prompt)" and call.binned_side == 256 and call.side == 64
    pipe = DiffusionPipeline.from_pretrained(export)
    assert isinstance(pipe, PixArtSigmaPipeline)
    images = pipe(PROMPTS[0], num_inference_steps=2, output_type="np").images  # the defaults: binning, 300 tokens
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()
    with open(os.path.join(export, "README.md")) as f:
        readme = f.read()
    assert "`pipe(prompt)` draws from it with the pipeline's defaults" in readme
    assert "images = pipe(prompt).images" in readme

    assert (
        main(["sample", export, "--prompt", PROMPTS[0], "--steps", "2", "--raw", "--out", str(tmp_path / "png")]) == 0
    )
    assert f"PixArtSigmaPipeline.from_pretrained({export!r}), then pipe(prompt)" in capsys.readouterr().out
    with torch.no_grad():  # the export's text encoder is a T5: captions of any length
        assert pipe.text_encoder(torch.ones(1, 300, dtype=torch.long)).last_hidden_state.shape == (1, 300, 16)
