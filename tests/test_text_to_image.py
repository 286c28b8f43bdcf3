"""Text-to-image latent diffusion as a specification: a tiny PixArt-style DiT conditioned on a
tiny random CLIP text model (saved and loaded by path, as a real encoder is) trains from img2dataset-
format shards (jpg + txt + json, written here with webdataset): its held-out flow loss falls, a run
stopped at a checkpoint resumes bitwise, 2 ranks of batch B train what 1 rank of 2B does, captions are
dropped once per sample at the configured rate to the empty caption's features, guidance acts through
the text only, and the export reloads in diffusers and samples the same images."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
import webdataset as wds
from eval_runs import one_torch_thread
from PIL import Image
from test_distributed import (
    assert_held_out_flow_loss_fell,
    passes_of,
    trained_from_its_first_model,
    two_ranks_of_32_and_one_of_64,
)
from test_trainer import ROOT, assert_states_equal, straight_and_resumed

from prunepipe.pipelines.config import ConfigError, load_config
from prunepipe.pipelines.data.batch import Batch
from prunepipe.pipelines.data.shards import BadInputError
from prunepipe.pipelines.tasks.build import build_task
from prunepipe.pipelines.tasks.diffusion.export import TEXT_ENCODER_INFO
from prunepipe.pipelines.tasks.diffusion.from_export import sample
from prunepipe.pipelines.tasks.diffusion.sampler import denoise
from prunepipe.pipelines.tasks.diffusion.text import caption_dropped
from prunepipe.pipelines.tasks.randomness import SampleRandomness
from prunepipe.pipelines.training.loop import train
from prunepipe.tools.commands.captioned import digit_caption
from prunepipe.tools.commands.shards import index_shards
from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_text_encoder

CONFIG = os.path.join(ROOT, "configs", "ldm_t2i_tiny.yaml")
PROMPTS = ["a handwritten digit three", "a handwritten digit eight"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def write_img2dataset_shards(
    folder, images, labels, *, per_shard: int, first_key: int = 0, no_caption: tuple[int, ...] = ()
) -> str:
    """Shards as img2dataset lays them out: NNNNN.tar of KEY.jpg, KEY.txt, KEY.json, and NNNNN_stats.json
    beside each; the samples at positions `no_caption` have no txt. Indexed; returns the folder."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    for shard, start in enumerate(range(0, len(images), per_shard)):
        count = min(per_shard, len(images) - start)
        with wds.TarWriter(os.path.join(folder, f"{shard:05d}.tar")) as sink:
            for i in range(start, start + count):
                key = f"{first_key + i:09d}"
                buffer = io.BytesIO()
                Image.fromarray(images[i]).convert("RGB").save(buffer, format="JPEG", quality=95)
                record = {"key": key, "status": "success", "width": 8, "height": 8}
                sample = {"__key__": key, "jpg": buffer.getvalue(), "json": json.dumps(record)}
                if i not in no_caption:
                    sample["txt"] = digit_caption(int(labels[i]))
                sink.write(sample)
        with open(os.path.join(folder, f"{shard:05d}_stats.json"), "w") as f:
            json.dump({"successes": count}, f)
    index_shards([folder], folder, workers=1)
    return folder


@pytest.fixture(scope="module")
def captioned(tmp_path_factory) -> str:
    """scikit-learn's digits at their own 8x8, as captioned img2dataset shards: train/ (512, 4 shards), val/ (64)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    root = tmp_path_factory.mktemp("captioned")
    write_img2dataset_shards(root / "train", pixels[:512], digits.target[:512], per_shard=128)
    write_img2dataset_shards(root / "val", pixels[512:576], digits.target[512:576], per_shard=64, first_key=512)
    return str(root)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> str:
    """A tiny random CLIP text model and a word-level tokenizer of the digit captions, saved by path."""
    captions = [digit_caption(label) for label in range(10)]
    return write_tiny_text_encoder(
        str(tmp_path_factory.mktemp("encoder")), captions, hidden_size=16, layers=1, max_length=8
    )


def tiny(encoder: str) -> list[str]:
    return [
        "data.resolution=8",
        "data.batch_size=32",
        "data.val_batches=2",
        "data.shuffle_buffer=64",
        "ldm.dit.width=32",
        f"ldm.text.encoder={encoder}",
        "ldm.text.max_length=8",
        "log_every=4",
    ]


def config(captioned, encoder, tmp_path, name, *extra):
    return load_config(
        CONFIG,
        [
            f"data.train={captioned}/train",
            f"data.val={captioned}/val",
            f"runs_dir={tmp_path}",
            f"name={name}",
            *tiny(encoder),
            *extra,
        ],
    )


def text_task(captioned, encoder, tmp_path, *extra):
    """The config's task with every weight drawn at random: the PixArt init zeroes the cross-attention
    outputs and the final layer, so a fresh model ignores its text (and its input)."""
    cfg = config(captioned, encoder, tmp_path, "task", *extra)
    task = build_task(cfg)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in task.model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return task


def digit_batch(count: int, captions: list[str], first_id: int = 0) -> Batch:
    images = torch.randn(count, 1, 8, 8, generator=torch.Generator().manual_seed(count)).clamp(-1, 1)
    return Batch(
        torch.arange(first_id, first_id + count),
        torch.ones(count),
        images,
        torch.full((count,), -1),
        captions=tuple(captions),
    )


# ----------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def trained_run(captioned, encoder, tmp_path_factory):
    cfg = config(
        captioned,
        encoder,
        tmp_path_factory.mktemp("runs"),
        "t2i",
        "num_passes=8",
        "pruner.name=infobatch",
        "score.normalise=stratum_mean",
    )
    return (cfg, *trained_from_its_first_model(cfg))


def test_a_tiny_text_conditional_dit_trains_from_img2dataset_shards_and_its_held_out_loss_falls(trained_run):
    cfg, before, records = trained_run
    after = assert_held_out_flow_loss_fell(before, records)
    assert records[-1]["bad_samples"] == 0 and records[-1]["samples_forwarded"] > 0
    with open(os.path.join(cfg.run_dir, "export", "transformer", "config.json")) as f:
        assert json.load(f)["_class_name"] == "PixArtTransformer2DModel"
    with open(os.path.join(cfg.run_dir, "export", TEXT_ENCODER_INFO)) as f:
        recorded = json.load(f)["text_encoder"]  # relative to the export
    assert os.path.realpath(os.path.join(cfg.run_dir, "export", recorded)) == os.path.realpath(cfg.ldm.text.encoder)


def test_a_text_run_stopped_at_a_checkpoint_resumes_bitwise(captioned, encoder, tmp_path):
    # InfoBatch on scores normalised within strata that tell dropped captions from kept ones
    base = [
        *tiny(encoder),
        "num_passes=3",
        "checkpoint.every_steps=5",
        "pruner.name=infobatch",
        "score.normalise=stratum_mean",
    ]
    (_, straight, straight_pruner), (_, resumed, resumed_pruner) = straight_and_resumed(
        CONFIG, captioned, tmp_path, base, stop_at=20, end_at=35
    )  # step 20 is inside pass 2 (16 a pass)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert_states_equal(straight_pruner, resumed_pruner)


def test_two_ranks_of_batch_b_train_the_text_dit_like_one_rank_of_batch_2b(captioned, encoder, tmp_path):
    # 64 samples: every step sees the whole set on 2 x 32 or 1 x 64; noise, s and caption drops are keyed
    # by sample id, and captions are padded to a fixed length, so the averaged gradients agree
    common = [
        f"data.train={captioned}/val",
        "data.val=",
        f"runs_dir={tmp_path}",
        "num_passes=3",
        "optim.warmup_passes=0",
        *tiny(encoder),
    ]
    two, one = two_ranks_of_32_and_one_of_64("ldm_t2i_tiny.yaml", common, tmp_path)
    moved = 0
    for key in one:
        if key.endswith(("attn1.to_k.bias", "attn2.to_k.bias")):
            continue  # shifts a softmax row equally: zero true gradient, Adam-amplified float noise
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
        moved += 1
    assert moved > 10


# ----------------------------------------------------------------------------- caption dropout
def test_captions_are_dropped_once_per_sample_at_the_configured_rate():
    ids = torch.arange(20_000)
    rate = 0.1
    dropped = caption_dropped(SampleRandomness(0, 3, ids), rate, "cpu")
    # 3 sigma of a binomial share over 20,000 samples is 0.0064
    assert abs(float(dropped.float().mean()) - rate) < 0.0064
    # the coin is the sample's, whatever its batch and its batch-mates; another pass draws anew
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))[:500]
    assert torch.equal(caption_dropped(SampleRandomness(0, 3, ids[order]), rate, "cpu"), dropped[order])
    assert not torch.equal(caption_dropped(SampleRandomness(0, 4, ids), rate, "cpu"), dropped)


def test_a_dropped_caption_trains_on_the_empty_captions_features_and_its_stratum_says_so(captioned, encoder, tmp_path):
    task = text_task(captioned, encoder, tmp_path, "ldm.text.caption_dropout=0.25")
    count, T = 400, task.cfg.num_train_timesteps
    ones = digit_batch(count, [digit_caption(1)] * count)
    sevens = digit_batch(count, [digit_caption(7)] * count)
    with torch.no_grad():
        a = task.per_sample(task.model, ones, SampleRandomness(0, 0, ones.ids))
        b = task.per_sample(task.model, sevens, SampleRandomness(0, 0, sevens.ids))
    dropped = a.stratum >= T  # the second half of the strata holds the samples trained on the null caption
    assert torch.equal(a.stratum, b.stratum) and task.num_strata == 2 * T
    # a dropped sample's loss does not depend on its caption; a kept one's does
    assert torch.equal(a.loss[dropped], b.loss[dropped])
    assert bool((a.loss[~dropped] != b.loss[~dropped]).all())
    assert abs(float(dropped.float().mean()) - 0.25) < 3 * (0.25 * 0.75 / count) ** 0.5
    # no dropout: one stratum per timestep bucket, no null-caption half
    assert text_task(captioned, encoder, tmp_path, "ldm.text.caption_dropout=0").num_strata == T


def test_a_sample_without_a_caption_follows_on_bad_sample_and_is_counted(encoder, tmp_path):
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images[:64] * (255.0 / 16.0)).astype(np.uint8)
    data = write_img2dataset_shards(
        tmp_path / "data" / "train", pixels, digits.target[:64], per_shard=64, no_caption=(5,)
    )
    common = [f"data.train={data}", "data.val=", f"runs_dir={tmp_path}", "num_passes=1", *tiny(encoder)]
    with pytest.raises(BadInputError, match=r"key '000000005': no caption \(field 'txt'"):
        train(load_config(CONFIG, [*common, "name=stops"]))
    train(load_config(CONFIG, [*common, "name=skips", "data.on_bad_sample=skip"]))
    assert passes_of(str(tmp_path / "skips"))[-1]["bad_samples"] == 1


# ----------------------------------------------------------------------------- guidance and export
def guided_and_unguided(task, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = task.text_encoder.encode(PROMPTS)
    null = task.text_encoder.null()
    start = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (
            denoise(task.model, start, task.sampler(), 4, prompts, null_label=null, guidance_scale=scale),
            denoise(task.model, start, task.sampler(), 4, prompts, null_label=null, guidance_scale=1.0),
        )


def test_guidance_changes_samples_and_a_model_that_ignores_text_is_not_guided(captioned, encoder, tmp_path):
    task = text_task(captioned, encoder, tmp_path)
    guided, unguided = guided_and_unguided(task, 3.0)
    assert (guided - unguided).abs().max() > 1e-2
    with torch.no_grad():  # cross-attention outputs zero: the text reaches nothing
        for block in task.model.transformer_blocks:
            block.attn2.to_out[0].weight.zero_()
            block.attn2.to_out[0].bias.zero_()
    guided, unguided = guided_and_unguided(task, 3.0)
    # equal up to float noise: the guided forward runs a batch of 4, the unguided one of 2
    torch.testing.assert_close(guided, unguided, rtol=1e-4, atol=1e-4)


def test_the_export_reloads_in_diffusers_and_samples_the_same_images(captioned, encoder, tmp_path):
    from diffusers import PixArtTransformer2DModel

    task = text_task(captioned, encoder, tmp_path)
    export = str(tmp_path / "export")
    task.export(task.model, None, export)
    reloaded = PixArtTransformer2DModel.from_pretrained(export, subfolder="transformer")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), task.model.state_dict().values()))

    start = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = denoise(
            task.model,
            start,
            task.sampler(),
            4,
            task.text_encoder.encode(PROMPTS),
            null_label=task.text_encoder.null(),
            guidance_scale=2.0,
        )
    images = sample(export, 2, 4, torch.Generator().manual_seed(7), ema=False, prompts=PROMPTS, guidance_scale=2.0)
    torch.testing.assert_close(images, (expected / task.scaling_factor / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-6)
    other = sample(export, 2, 4, torch.Generator().manual_seed(7), ema=False, prompts=PROMPTS[::-1], guidance_scale=2.0)
    assert not torch.equal(images, other), "the prompt chooses the image"


def test_an_export_refuses_a_text_encoder_other_than_its_runs(captioned, encoder, tmp_path):
    task = text_task(captioned, encoder, tmp_path)
    task.export(task.model, None, str(tmp_path / "export"))
    other = write_tiny_text_encoder(
        str(tmp_path / "other"), ["a different vocabulary"], hidden_size=16, layers=1, max_length=8
    )
    with pytest.raises(ValueError, match="another model or tokenizer"):
        sample(str(tmp_path / "export"), 1, 2, torch.Generator(), ema=False, text_encoder=other)


# ----------------------------------------------------------------------------- configuration and data
@pytest.mark.parametrize(
    "setting, named",
    [
        ("ldm.backbone=unet", "ldm.backbone=dit"),
        ("ldm.text.encoder=", "needs ldm.text.encoder"),
        ("ldm.num_classes=10", "ldm.num_classes=10"),
        ("ldm.text.caption_dropout=1.0", "ldm.text.caption_dropout"),
        ("ldm.conditioning=words", "accepted: none, class, text"),
    ],
)
def test_a_text_config_mistake_names_its_field(captioned, encoder, tmp_path, setting, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        config(captioned, encoder, tmp_path, "bad", setting)


def test_shards_write_captions_writes_img2dataset_pairs_captioned_from_what_is_known(tmp_path):
    from prunepipe.pipelines.data.shards import ShardIndex, read_shard
    from prunepipe.tools.commands.shards import write_shards

    paths = write_shards("photos", str(tmp_path), size=16, shard_size=50, crops_per_photo=2, captions=True)
    index = ShardIndex.load(paths["train"])
    assert index.meta["keys"] == ["jpg", "json", "txt"]
    samples = [sample for url in index.urls for _, sample in read_shard(url)]
    assert len(samples) == index.num_samples > 0
    for sample in samples:
        caption, record = sample["txt"].decode(), json.loads(sample["json"])
        assert record["caption"] == caption and record["key"] == sample["__key__"]
        assert f"the {record['photograph'].replace('_', ' ')} photograph" in caption
        assert len(record["crop"]) == 4 and Image.open(io.BytesIO(sample["jpg"])).format == "JPEG"


def test_captions_travel_with_latents_and_a_text_run_trains_on_latent_shards(captioned, encoder, tmp_path):
    """`prunepipe latents encode` keeps each sample's caption beside its latent, so the real recipe
    (a text DiT on precomputed VAE latents) reads the same txt it would read from the images."""
    from eval_runs import tiny_vae

    from prunepipe.pipelines.data.shards import ShardIndex, read_shard
    from prunepipe.tools.commands.latents import encode_shards

    vae = str(tmp_path / "vae")
    tiny_vae(1, 8).save_pretrained(vae)
    for split in ("train", "val"):
        encode_shards(f"{captioned}/{split}", vae, str(tmp_path / "latents" / split), resolution=8, batch_size=64)
    index = ShardIndex.load(str(tmp_path / "latents" / "train"))
    assert "txt" in index.meta["keys"]
    originals = {key: s["txt"] for url in ShardIndex.load(f"{captioned}/train").urls for key, s in read_shard(url)}
    encoded = {key: s["txt"] for url in index.urls for key, s in read_shard(url)}
    assert encoded == originals
    cfg = load_config(
        CONFIG,
        [
            f"data.train={tmp_path}/latents/train",
            f"data.val={tmp_path}/latents/val",
            f"runs_dir={tmp_path}",
            "name=on_latents",
            *tiny(encoder),
            "num_passes=2",
            "ldm.space=latents",
        ],
    )
    train(cfg)
    records = passes_of(cfg.run_dir)
    assert records[-1]["bad_samples"] == 0 and np.isfinite(records[-1]["held_out"]["denoise_mse"])
