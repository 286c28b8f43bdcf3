"""Latent shards: encoding image shards keeps every id, key, label and per-shard count, and the
result streams through ShardStream as float latents a latent-space DiffusionTask trains on; with
`--flip` a data.hflip run reads the mirrored image's own latent where the flip coin says."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from eval_runs import tiny_vae

from prunepipe.pipelines.config import ConfigError, check_data, load_config
from prunepipe.pipelines.data.augment import flip_coin
from prunepipe.pipelines.data.decode import FLIPPED_LATENT_FIELD, SampleDecoder
from prunepipe.pipelines.data.shards import ShardIndex, read_shard
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pipelines.tasks.diffusion.config import DiffusionConfig
from prunepipe.pipelines.tasks.diffusion.from_export import sample
from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask
from prunepipe.tools.commands.latents import LATENT_FIELD, encode_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE = 32


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory) -> str:
    """A tiny random AutoencoderKL: 32x32x3 images -> 16x16x4 latents."""
    vae = tiny_vae(3, IMAGE)
    folder = str(tmp_path_factory.mktemp("tiny-vae"))
    vae.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def latent_val(digits_shards, vae_folder, tmp_path_factory) -> str:
    """The digits val split (180 samples in shards of 150 and 30) encoded to float32 latents."""
    out = str(tmp_path_factory.mktemp("latents") / "val")
    encode_shards(os.path.join(digits_shards, "val"), vae_folder, out, resolution=IMAGE, batch_size=64, dtype="float32")
    return out


def samples(folder: str) -> list[dict]:
    return [sample for url in ShardIndex.load(folder).urls for _, sample in read_shard(url)]


def test_latent_shards_keep_counts_keys_and_labels_in_order(digits_shards, latent_val, vae_folder):
    images_folder = os.path.join(digits_shards, "val")
    source, latent = ShardIndex.load(images_folder), ShardIndex.load(latent_val)
    assert latent.counts.tolist() == source.counts.tolist() == [150, 30]  # so ids are identical
    before, after = samples(images_folder), samples(latent_val)
    assert [s["__key__"] for s in after] == [s["__key__"] for s in before]
    assert [s["cls"] for s in after] == [s["cls"] for s in before]
    assert all("png" not in s and LATENT_FIELD in s for s in after)
    for url, count in zip(latent.urls, latent.counts):  # each shard's stats, as shards write leaves them
        with open(url[: -len(".tar")] + "_stats.json") as f:
            stats = json.load(f)
        assert stats["successes"] == stats["count"] == count and stats["tar_bytes"] == os.path.getsize(url)

    with open(latent.path) as f:
        meta = json.load(f)
    vae = AutoencoderKL.from_pretrained(vae_folder)
    assert meta["latent_shape"] == [4, 16, 16]
    assert meta["scaling_factor"] == vae.config.scaling_factor
    assert meta["vae"] == os.path.abspath(vae_folder)

    # each latent is the posterior mean times the scaling factor, of the decoded image
    decoder = SampleDecoder(resolution=IMAGE)
    for k in (0, 151):
        image, _ = decoder(before[k], k, 0)
        with torch.no_grad():
            expected = vae.encode(image[None]).latent_dist.mean[0] * vae.config.scaling_factor
        stored, _ = decoder(after[k], k, 0)
        torch.testing.assert_close(stored, expected, rtol=1e-4, atol=1e-5)


def test_latent_shards_stream_as_float_tensors_a_latent_task_trains_on(digits_shards, latent_val, vae_folder, tmp_path):
    stream = ShardStream(ShardIndex.load(latent_val), batch_size=16, decoder=SampleDecoder(), seed=3)
    batch = next(iter(stream.pass_loader(0)))
    assert batch.images.shape == (16, 4, 16, 16) and batch.images.dtype == torch.float32
    labels_by_id = [int(s["cls"]) for s in samples(os.path.join(digits_shards, "val"))]
    assert batch.labels.tolist() == [labels_by_id[i] for i in batch.ids.tolist()]

    # the trainer passes the image resolution and channels; the latent shape comes from the config
    mistaken = DiffusionTask(DiffusionConfig(space="latents"), image_size=IMAGE, channels=3)
    with pytest.raises(ValueError, match=r"ldm\.in_channels.*latent_shape"):
        mistaken.per_sample(mistaken.model, batch, torch.Generator())
    latent_cfg = DiffusionConfig(space="latents", sample_size=16, in_channels=4)
    task = DiffusionTask(latent_cfg, image_size=IMAGE, channels=3)
    assert task.autoencoder is None and task.model.config.in_channels == 4 and task.model.config.sample_size == 16
    losses = task.per_sample(task.model, batch, torch.Generator().manual_seed(0)).loss
    assert losses.shape == (16,) and torch.isfinite(losses).all()

    # samples of a latent run decode with the VAE that encoded the shards, named explicitly
    task.export(task.model, None, str(tmp_path))
    with pytest.raises(ValueError, match="pass vae="):
        sample(str(tmp_path), 2, 2, torch.Generator().manual_seed(0), ema=False)
    images = sample(str(tmp_path), 2, 2, torch.Generator().manual_seed(0), ema=False, vae=vae_folder)
    assert images.shape == (2, 3, IMAGE, IMAGE)


def test_float16_latents_halve_the_bytes(digits_shards, vae_folder, latent_val, tmp_path):
    out = str(tmp_path / "half")
    encode_shards(os.path.join(digits_shards, "val"), vae_folder, out, resolution=IMAGE, batch_size=64)
    half = np.load(io.BytesIO(samples(out)[0][LATENT_FIELD]))
    full = np.load(io.BytesIO(samples(latent_val)[0][LATENT_FIELD]))
    assert half.dtype == np.float16 and full.dtype == np.float32
    np.testing.assert_allclose(half.astype(np.float32), full, rtol=1e-2, atol=1e-3)


def test_refuses_to_write_over_the_image_shards(digits_shards, vae_folder):
    images_folder = os.path.join(digits_shards, "val")
    with pytest.raises(ValueError, match="image shard folder"):
        encode_shards(images_folder, vae_folder, images_folder, resolution=IMAGE)


@pytest.fixture(scope="module")
def latent_val_with_flips(digits_shards, vae_folder, tmp_path_factory) -> str:
    """The digits val split encoded with `--flip`: each sample also holds its mirrored image's latent."""
    out = str(tmp_path_factory.mktemp("latents_flip") / "val")
    encode_shards(
        os.path.join(digits_shards, "val"), vae_folder, out, resolution=IMAGE, batch_size=64, dtype="float32", flip=True
    )
    return out


def test_flip_encoding_stores_the_latent_of_the_mirrored_image(digits_shards, latent_val_with_flips, vae_folder):
    before, after = samples(os.path.join(digits_shards, "val")), samples(latent_val_with_flips)
    assert all(LATENT_FIELD in s and FLIPPED_LATENT_FIELD in s for s in after)
    meta = ShardIndex.load(latent_val_with_flips).meta
    assert meta["flip"] is True and FLIPPED_LATENT_FIELD in meta["keys"]
    vae = AutoencoderKL.from_pretrained(vae_folder)
    image, _ = SampleDecoder(resolution=IMAGE)(before[3], 3, 0)
    with torch.no_grad():
        expected = vae.encode(image.flip(-1)[None]).latent_dist.mean[0] * vae.config.scaling_factor
    stored = torch.from_numpy(np.load(io.BytesIO(after[3][FLIPPED_LATENT_FIELD])))
    torch.testing.assert_close(stored, expected, rtol=1e-4, atol=1e-5)


def test_an_hflip_run_reads_the_mirrored_latent_where_the_flip_coin_says(latent_val_with_flips):
    by_id = {i: s for i, s in enumerate(samples(latent_val_with_flips))}
    decoder = SampleDecoder(hflip=True, seed=9)
    stream = ShardStream(ShardIndex.load(latent_val_with_flips), batch_size=16, decoder=decoder, seed=9)
    seen_flipped = []
    for batch in stream.pass_loader(2):
        flips = flip_coin(9, 2, batch.ids.numpy())
        for sample_id, latent, flipped in zip(batch.ids.tolist(), batch.images, flips):
            field = FLIPPED_LATENT_FIELD if flipped else LATENT_FIELD
            torch.testing.assert_close(
                latent, torch.from_numpy(np.load(io.BytesIO(by_id[sample_id][field]))), rtol=0, atol=0
            )
            seen_flipped.append(bool(flipped))
    assert 0.3 < np.mean(seen_flipped) < 0.7, "about half the latents are the mirrored image's"


def test_hflip_on_latents_without_mirrored_ones_is_refused_naming_shard_key_or_index(latent_val, digits_shards):
    sample = samples(latent_val)[0]
    with pytest.raises(ValueError, match=rf"shard .*key '{sample['__key__']}': data\.hflip=true .*--flip"):
        SampleDecoder(hflip=True).decode(sample, 0, 0)
    with pytest.raises(ConfigError, match=r"data check: data\.hflip=true.*hold no latents of mirrored images.*--flip"):
        check_data(
            load_config(
                os.path.join(ROOT, "configs", "ldm_dit_full.yaml"), [f"data.train={latent_val}", "data.hflip=true"]
            )
        )
