"""Augmentations as a specification: the flip is a coin of its own, independent of every pruner's
keep coin, so that an up-weighted kept sample is flipped as often as any other; MAE's
random resized crop is torchvision's, drawn per (seed, pass, id), and never touches held-out data
or latents.

Statistical claims use fixed seeds and state their tolerance: rates within 4.5 standard errors
(0.5 / sqrt(n)) of one half.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import scipy.stats
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode, RandomResizedCrop
from torchvision.transforms.functional import pil_to_tensor
from torchvision.transforms.v2.functional import resized_crop as tensor_resized_crop

from prunepipe.pipelines.config import ConfigError, check_data, load_config
from prunepipe.pipelines.data.augment import CROP_RATIO, crop_uniforms, random_resized_crop_box
from prunepipe.pipelines.data.batch import PADDING_ID, Batch
from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.shards import ShardIndex, read_shard
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pruning import build_pruner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NUM_SAMPLES = 100_000
SIGMAS = 4.5


def flipped_by_decoder(seed: int, pass_index: int, ids: np.ndarray) -> np.ndarray:
    """bool per id: did the training decoder mirror it? Each sample is a 1x2 image [0, 255], so its
    flipped version reads [255, 0]."""
    stacked = torch.tensor([0, 255], dtype=torch.uint8).repeat(len(ids), 1, 1, 1)  # [B, 1, 1, 2]
    images = SampleDecoder(resolution=2, channels=1, hflip=True, seed=seed).finish(stacked, ids, pass_index)
    return (images[:, 0, 0, 0] > images[:, 0, 0, 1]).numpy()


def assert_half(flips: np.ndarray, what: str) -> None:
    n = len(flips)
    assert n > 1000, f"{what}: too few samples ({n}) to say anything"
    rate = flips.mean()
    assert abs(rate - 0.5) < SIGMAS * 0.5 / np.sqrt(n), f"{what}: flip rate {rate:.4f} over {n} samples"


def pruned_plan(name: str, seed: int, pass_index: int, **hparams):
    """A pruner planned at `pass_index` on an exponential score table seen twice (so TED scores too)."""
    pruner = build_pruner(name, NUM_SAMPLES, 40, seed=seed, **hparams)
    rng = np.random.default_rng(11)
    ids = np.arange(NUM_SAMPLES)
    first = rng.exponential(1.0, NUM_SAMPLES).astype(np.float32)
    second = (first * rng.uniform(0.2, 1.0, NUM_SAMPLES)).astype(np.float32)
    for scores in (first, second):
        for start in range(0, NUM_SAMPLES, 4096):
            pruner.update(ids[start : start + 4096], scores[start : start + 4096])
        pruner.on_step(0.5)
    pruner.plan(pass_index)
    return pruner.weights(ids)


@pytest.mark.parametrize(
    "name, hparams",
    [
        ("random", {"keep": 0.5}),
        ("infobatch", {"prune_ratio": 0.5}),
        ("ted", {"ramp": 0.1}),
        ("importance", {}),
    ],
)
def test_the_flip_is_independent_of_every_pruners_keep_coin(name, hparams):
    seed, pass_index = 3, 5
    weights = pruned_plan(name, seed, pass_index, **hparams)
    kept, up_weighted = weights > 0, weights > 1
    assert 0 < kept.sum() < NUM_SAMPLES and up_weighted.sum() > 0, "the plan prunes and up-weights"
    flips = flipped_by_decoder(seed, pass_index, np.arange(NUM_SAMPLES))
    assert_half(flips[kept], f"{name}: kept samples")
    assert_half(flips[up_weighted], f"{name}: kept samples of weight > 1")
    assert_half(flips[~kept], f"{name}: skipped samples (had they been decoded)")
    # independence: the share flipped among kept equals the share among skipped, within both errors
    gap = flips[kept].mean() - flips[~kept].mean()
    assert abs(gap) < SIGMAS * 0.5 * np.sqrt(1 / kept.sum() + 1 / (~kept).sum()), f"{name}: flip depends on keep"


def test_the_flip_is_a_pure_function_of_seed_pass_and_id():
    ids = np.arange(1000, 3000)
    flips = flipped_by_decoder(1, 2, ids)
    order = np.random.default_rng(0).permutation(len(ids))
    np.testing.assert_array_equal(flipped_by_decoder(1, 2, ids[order]), flips[order])
    assert (flipped_by_decoder(1, 3, ids) != flips).mean() > 0.4, "another pass, other flips"
    assert (flipped_by_decoder(2, 2, ids) != flips).mean() > 0.4, "another seed, other flips"


# ----------------------------------------------------------------------------------------------
# MAE's random resized crop
# ----------------------------------------------------------------------------------------------


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth RGB gradient with noise: every crop of it looks different."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    array = np.stack([x * 255 / width, y * 255 / height, rng.uniform(0, 255, (height, width))], axis=-1)
    return Image.fromarray(array.astype(np.uint8))


def png(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def test_crop_boxes_follow_torchvisions_random_resized_crop():
    """Area share and aspect ratio of the boxes, against torchvision's own get_params on the same
    image (two-sample Kolmogorov-Smirnov at alpha 1e-3), inside the image and the stated ranges."""
    width, height, scale = 160, 120, (0.2, 1.0)
    ours = np.array([random_resized_crop_box(width, height, scale, crop_uniforms(0, 1, i)) for i in range(3000)])
    torch.manual_seed(0)
    theirs = np.array(
        [RandomResizedCrop.get_params(photo(width, height), list(scale), list(CROP_RATIO)) for _ in range(3000)]
    )
    for boxes in (ours, theirs):
        top, left, h, w = boxes.T
        assert (top >= 0).all() and (left >= 0).all() and (top + h <= height).all() and (left + w <= width).all()
    share = lambda b: b[:, 2] * b[:, 3] / (width * height)  # noqa: E731
    aspect = lambda b: b[:, 3] / b[:, 2]  # noqa: E731
    assert share(ours).min() >= 0.19 and aspect(ours).min() > 0.7 and aspect(ours).max() < 1.4
    assert scipy.stats.ks_2samp(share(ours), share(theirs)).pvalue > 1e-3
    assert scipy.stats.ks_2samp(aspect(ours), aspect(theirs)).pvalue > 1e-3
    assert scipy.stats.ks_2samp(ours[:, 1], theirs[:, 1]).pvalue > 1e-3  # where the box sits


def test_the_crop_is_cut_from_the_original_image_and_resized_bicubic_on_the_uint8_tensor():
    """The box is torchvision's (above), cut from the image as decoded and resized as torchvision's
    `resized_crop` (transforms.v2) resizes a uint8 tensor (bicubic, antialiased): bit for bit."""
    img = photo(64, 48)
    sample = {"__key__": "k", "__url__": "a.tar", "png": png(img)}
    decoder = SampleDecoder(resolution=24, crop="random_resized", seed=7)
    pixels, _ = decoder.decode(sample, 42, 3)
    top, left, h, w = random_resized_crop_box(64, 48, (0.2, 1.0), crop_uniforms(7, 3, 42))
    expected = tensor_resized_crop(
        pil_to_tensor(img), top, left, h, w, [24, 24], InterpolationMode.BICUBIC, antialias=True
    )
    torch.testing.assert_close(pixels, expected, rtol=0, atol=0)
    assert not torch.equal(pixels, decoder.decode(sample, 42, 4)[0]), "another pass, another crop"
    centre = SampleDecoder(resolution=24).decode(sample, 42, 3)[0]
    assert not torch.equal(pixels, centre)


def test_tensor_crop_pixels_stay_within_a_stated_bound_of_pils():
    """MAE's crop at 224 px of photographs as img2dataset stores them (JPEG quality 90, about 500 x 375),
    against the same box resized by PIL (bicubic, the pixels before the tensor path): measured 0.037
    levels apart on average, 0.012% of values more than 1 apart, median PSNR 72.7 dB (docs/data.md).
    Bounds: mean below 0.1 level, below 0.5% of values more than 1 apart, median PSNR above 60 dB."""
    from prunepipe.pipelines.data.decode import _fast_rgb
    from prunepipe.pipelines.data.resize import resize_crop
    from prunepipe.tools.commands.sources import bundled_photos

    decoder = SampleDecoder(resolution=224, crop="random_resized", seed=3)
    rng = np.random.default_rng(0)
    photos = [p for _, _, p in bundled_photos()]
    gaps, psnrs, far, values = [], [], 0, 0
    for i in range(45):
        img = photos[i % len(photos)]
        width, height = min(500, img.width), min(375, img.height)
        left, top = int(rng.integers(0, img.width - width + 1)), int(rng.integers(0, img.height - height + 1))
        buffer = io.BytesIO()
        img.crop((left, top, left + width, top + height)).save(buffer, format="JPEG", quality=90)
        sample = {"__key__": f"p{i}", "__url__": "photos.tar", "jpg": buffer.getvalue()}
        ours = decoder.decode(sample, i, 0)[0].float()
        decoded = Image.fromarray(_fast_rgb(sample["jpg"]).permute(1, 2, 0).numpy())
        box = random_resized_crop_box(width, height, (0.2, 1.0), crop_uniforms(3, 0, i))
        theirs = pil_to_tensor(resize_crop(decoded, 224, box)).float()
        gap = (ours - theirs).abs()
        gaps.append(float(gap.mean()))
        far, values = far + int((gap > 1).sum()), values + gap.numel()
        psnrs.append(10 * np.log10(255**2 / max(float(gap.pow(2).mean()), 1e-12)))
    assert np.mean(gaps) < 0.1, f"mean difference {np.mean(gaps):.3f} levels"
    assert far / values < 0.005, f"{far / values:.4%} of values more than 1 level apart"
    assert np.median(psnrs) > 60, f"median PSNR {np.median(psnrs):.1f} dB"


def test_pixels_left_for_the_device_become_the_hosts_floats_with_the_same_flips(digits_train):
    """data on the device (the training stream): uint8 batches and their flip coins, which Batch.to
    turns into exactly the floats the host path gives, same crops, same mirrors, padding zero."""
    index = ShardIndex.load(digits_train)
    host = SampleDecoder(resolution=24, crop="random_resized", hflip=True, seed=4)
    device = SampleDecoder(resolution=24, crop="random_resized", hflip=True, seed=4, pixels_on_device=True)
    on_host = images_by_id(index, host, world=1, workers=0)
    raw = {}
    stream = ShardStream(index, batch_size=16, decoder=device, seed=4, shuffle_buffer=32)
    for batch in stream.pass_loader(2, num_workers=2):
        assert batch.images.dtype == torch.uint8 and batch.flips is not None
        moved = batch.to("cpu")
        assert moved.images.dtype == torch.float32 and moved.flips is None
        raw.update(zip(batch.ids.tolist(), moved.images))
    stream.close()
    padded = Batch(
        torch.tensor([3, PADDING_ID]),
        torch.ones(2),
        torch.full((2, 1, 1, 2), 255, dtype=torch.uint8),
        torch.zeros(2, dtype=torch.int64),
        flips=torch.tensor([True, False]),
    ).to("cpu")
    assert padded.images[1].abs().sum() == 0, "padding is zeros, as on the host"
    shared = sorted(set(raw) & set(on_host))  # the worker layouts drop other tails
    assert len(shared) > 0.8 * index.num_samples
    for sample_id in shared:
        assert torch.equal(raw[sample_id], on_host[sample_id]), f"sample {sample_id}"


def images_by_id(index, decoder, *, world: int, workers: int, pass_index: int = 2) -> dict[int, torch.Tensor]:
    found = {}
    for rank in range(world):
        stream = ShardStream(
            index, batch_size=16, decoder=decoder, seed=4, rank=rank, world_size=world, shuffle_buffer=32
        )
        for batch in stream.pass_loader(pass_index, num_workers=workers):
            found.update(zip(batch.ids.tolist(), batch.images))
        stream.close()
    return found


def test_crops_and_flips_are_the_same_in_any_worker_layout(digits_train):
    index = ShardIndex.load(digits_train)
    decoder = SampleDecoder(resolution=24, crop="random_resized", hflip=True, seed=4)
    one = images_by_id(index, decoder, world=1, workers=0)
    many = images_by_id(index, decoder, world=2, workers=2)
    shared = sorted(set(one) & set(many))
    assert len(shared) > 0.8 * index.num_samples
    for sample_id in shared:
        assert torch.equal(one[sample_id], many[sample_id]), f"sample {sample_id} augmented differently"


def test_held_out_reading_stays_centre_cropped(digits_shards):
    val = os.path.join(digits_shards, "val")
    batch = next(read_split(val, resolution=24, channels=3, batch_size=8))
    samples = [s for _, s in read_shard(ShardIndex.load(val).urls[0])][:8]
    centre = SampleDecoder(resolution=24)
    expected = centre.finish(torch.stack([centre.decode(s, i)[0] for i, s in enumerate(samples)]), np.arange(8), 0)
    torch.testing.assert_close(batch.images, expected, rtol=0, atol=0)


def test_latents_cannot_be_cropped_and_the_error_names_shard_key_or_field(tmp_path, digits_shards):
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((4, 8, 8), np.float32))
    sample = {"__key__": "lat7", "__url__": "latents.tar", "latent.npy": buffer.getvalue()}
    with pytest.raises(ValueError, match=r"shard latents\.tar key 'lat7': data\.crop=random_resized"):
        SampleDecoder(crop="random_resized").decode(sample, 7, 0)

    with pytest.raises(ConfigError, match=r"data\.crop=random_resized.*ldm\.space=latents"):
        load_config(
            os.path.join(ROOT, "configs", "ldm_dit_full.yaml"),
            [f"data.train={digits_shards}/train", "data.crop=random_resized"],
        )
    # where only the index knows: shards written by `prunepipe latents encode` record latent_shape
    folder = tmp_path / "latents"
    folder.mkdir()
    ShardIndex.write(str(folder), [("shard-000000.tar", 1)], latent_shape=[4, 8, 8])
    with pytest.raises(ConfigError, match=r"data check: data\.crop=random_resized.*holds latents.*latent_shape"):
        check_data(
            load_config(
                os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
                [f"data.train={folder}", "data.val=", "data.crop=random_resized"],
            )
        )
    with pytest.raises(ConfigError, match=r"data\.crop_scale=\[0\.0, 1\.0\]"):
        load_config(
            os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
            [f"data.train={digits_shards}/train", "data.crop_scale=[0.0,1.0]"],
        )


def test_mae_training_on_jpeg_shards_keeps_the_boxes_and_coins_within_the_stated_pixel_bound(tmp_path):
    """The training stream on img2dataset-style JPEG shards, uint8 path finished on the device, against
    the path before it (PIL's resize, floats flipped on the host), sample by sample: the same samples,
    the same mirror (each image closer to the old one than to its mirror), and pixels within the bound
    of `test_tensor_crop_pixels_stay_within_a_stated_bound_of_pils` (mean below 0.1 level)."""
    from prunepipe.tools.benchmarks.datapath import _PILCropDecoder, write_bundled_jpegs

    index = ShardIndex.load(write_bundled_jpegs(str(tmp_path / "jpegs"), count=48, shard_size=16))
    settings = dict(crop="random_resized", hflip=True, seed=5)
    now = SampleDecoder(224, pixels_on_device=True, **settings)
    before = _PILCropDecoder(224, **settings)
    images = []
    for decoder in (now, before):
        stream = ShardStream(index, batch_size=8, decoder=decoder, seed=5, shuffle_buffer=16)
        images.append({i: im for b in stream.pass_loader(1) for i, im in zip(b.ids.tolist(), b.to("cpu").images)})
        stream.close()
    assert images[0].keys() == images[1].keys() and len(images[0]) == 48
    gaps = []
    for sample_id, image in images[0].items():
        old = images[1][sample_id]
        gap = float((image - old).abs().mean()) * 127.5
        assert gap < float((image - old.flip(-1)).abs().mean()) * 127.5, f"sample {sample_id} mirrored otherwise"
        gaps.append(gap)
    assert np.mean(gaps) < 0.1, f"mean difference {np.mean(gaps):.3f} levels"
