"""The MAE task: the loss is the paper's, masking is the paper's, and the export is a timm encoder."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import scipy.stats
import torch
from timm.models.vision_transformer import VisionTransformer

from prunepipe.pipelines.data.batch import Batch
from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pipelines.tasks.mae import (
    ENCODER_CONFIG,
    ENCODER_WEIGHTS,
    MAEConfig,
    MAETask,
    hidden_share,
    load_exported_encoder,
    sincos_pos_embed,
)

IMAGE, CHANNELS = 32, 3


def make_task(**overrides) -> MAETask:
    torch.manual_seed(0)
    return MAETask(MAEConfig(**overrides), image_size=IMAGE, channels=CHANNELS)


def random_batch(n: int = 6, first_id: int = 0) -> Batch:
    images = torch.rand(n, CHANNELS, IMAGE, IMAGE, generator=torch.Generator().manual_seed(first_id + 1)) * 2 - 1
    ids = torch.arange(first_id, first_id + n)
    return Batch(ids, torch.ones(n), images, torch.full((n,), -1))


def paper_batch_loss(model, images, pred, mask, norm_pix_loss: bool) -> torch.Tensor:
    """The MAE reference forward_loss, written out independently of the model's own loss code."""
    p = model.patch_size
    n, c, h, w = images.shape
    target = images.unfold(2, p, p).unfold(3, p, p)  # [N, C, h/p, w/p, p, p]
    target = target.permute(0, 2, 3, 4, 5, 1).reshape(n, (h // p) * (w // p), p * p * c)
    if norm_pix_loss:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    loss = ((pred - target) ** 2).mean(dim=-1)  # [N, L]
    return (loss * mask).sum() / mask.sum()


@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_per_sample_losses_average_to_the_papers_batch_loss(norm_pix_loss):
    task = make_task(norm_pix_loss=norm_pix_loss)
    batch = random_batch()
    losses = task.per_sample(task.model, batch, torch.Generator().manual_seed(7)).loss
    assert losses.shape == (6,) and losses.dtype == torch.float32

    # the same mask noise, drawn the way per_sample draws it
    noise = torch.rand(6, task.num_patches, generator=torch.Generator().manual_seed(7))
    latent, mask, ids_restore = task.model.forward_encoder(batch.images, noise)
    pred = task.model.forward_decoder(latent, ids_restore)
    reference = paper_batch_loss(task.model, batch.images, pred, mask, norm_pix_loss)
    torch.testing.assert_close(losses.mean(), reference, rtol=1e-5, atol=1e-6)


def test_patchify_lays_out_each_patch_as_its_image_crop_and_unpatchify_inverts_it():
    model = make_task().model
    images = random_batch(2).images
    patches = model.patchify(images)  # [2, 64, 48]
    p, grid = model.patch_size, IMAGE // model.patch_size
    i, j = 3, 5
    crop = images[1, :, i * p : (i + 1) * p, j * p : (j + 1) * p].permute(1, 2, 0).reshape(-1)
    torch.testing.assert_close(patches[1, i * grid + j], crop)
    torch.testing.assert_close(model.unpatchify(patches), images)


def test_masking_keeps_exactly_the_unmasked_fraction_with_the_smallest_noise():
    task = make_task(mask_ratio=0.75)
    length = task.num_patches
    keep = int(length * (1 - 0.75))
    x = torch.arange(length, dtype=torch.float32).expand(3, length).unsqueeze(-1)  # token value = index
    noise = torch.rand(3, length, generator=torch.Generator().manual_seed(0))
    kept, mask, ids_restore = task.model.random_masking(x, noise)
    assert kept.shape == (3, keep, 1)
    assert (mask.sum(dim=1) == length - keep).all()
    smallest = torch.argsort(noise, dim=1)[:, :keep]
    assert torch.equal(kept[..., 0].long(), smallest)  # kept in order of increasing noise
    assert (mask.gather(1, smallest) == 0).all()
    # the encoder sees the class token plus exactly the kept patches
    latent, _, _ = task.model.forward_encoder(random_batch(3).images, noise)
    assert latent.shape == (3, 1 + keep, task.cfg.embed_dim)


def test_gradients_reach_encoder_and_decoder_but_not_the_fixed_positions():
    task = make_task()
    task.per_sample(task.model, random_batch(), torch.Generator().manual_seed(0)).loss.mean().backward()
    named = dict(task.model.named_parameters())
    for frozen in ("encoder.pos_embed", "decoder_pos_embed"):
        assert not named[frozen].requires_grad and named[frozen].grad is None
    for name, param in named.items():
        if param.requires_grad:
            assert param.grad is not None and torch.isfinite(param.grad).all(), name
    for name in (
        "encoder.patch_embed.proj.weight",
        "encoder.cls_token",
        "encoder.blocks.0.attn.qkv.weight",
        "mask_token",
        "decoder_pred.weight",
    ):
        assert named[name].grad.abs().sum() > 0, name


def test_positions_are_the_fixed_sincos_table():
    model = make_task().model
    torch.testing.assert_close(model.encoder.pos_embed.data, sincos_pos_embed(IMAGE // 4, 64))
    assert torch.equal(model.encoder.pos_embed[0, 0], torch.zeros(64))  # the class token's row


def test_unmasked_mae_encoder_path_is_timms_forward_features():
    """With nothing masked and patches in order, the MAE path equals timm's: the export sees what MAE trained."""
    task = make_task()
    task.model.mask_ratio = 0.0  # the loss needs masked patches, this check needs none
    images = random_batch(2).images
    in_order = torch.arange(task.num_patches, dtype=torch.float32).expand(2, -1)
    latent, mask, _ = task.model.forward_encoder(images, in_order)
    assert mask.sum() == 0
    torch.testing.assert_close(latent, task.model.encoder.forward_features(images))


def test_per_sample_takes_randomness_only_from_the_callers_generator():
    task = make_task()
    batch = random_batch()
    state = torch.random.get_rng_state()
    first = task.per_sample(task.model, batch, torch.Generator().manual_seed(3)).loss
    again = task.per_sample(task.model, batch, torch.Generator().manual_seed(3)).loss
    other = task.per_sample(task.model, batch, torch.Generator().manual_seed(4)).loss
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.random.get_rng_state(), state)


class PerSampleMaskNoise:
    """SampleDraws (just `rand`) where each sample id has its own generator, as the trainer's."""

    def __init__(self, ids: torch.Tensor):
        self.generators = [torch.Generator().manual_seed(int(i)) for i in ids]

    def rand(self, *shape):
        return torch.stack([torch.rand(shape, generator=g) for g in self.generators])


def test_with_per_sample_draws_a_samples_loss_does_not_depend_on_its_batch_mates():
    task = make_task()
    batch = random_batch(4)
    together = task.per_sample(task.model, batch, PerSampleMaskNoise(batch.ids)).loss
    alone = Batch(batch.ids[1:2], batch.weights[1:2], batch.images[1:2], batch.labels[1:2])
    torch.testing.assert_close(task.per_sample(task.model, alone, PerSampleMaskNoise(alone.ids)).loss[0], together[1])


def train_steps(task: MAETask, batches, steps: int) -> None:
    optimizer = torch.optim.AdamW([p for p in task.model.parameters() if p.requires_grad], lr=2e-3)
    generator = torch.Generator().manual_seed(0)
    for _, batch in zip(range(steps), batches):
        optimizer.zero_grad()
        (task.per_sample(task.model, batch, generator).loss * batch.weights).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("use_ema", [False, True])
def test_exported_encoder_loads_strictly_into_timm_with_the_same_features(tmp_path, use_ema):
    task = make_task()
    train_steps(task, [random_batch(8, 8 * k) for k in range(2)], 2)
    ema = None
    if use_ema:
        ema = copy.deepcopy(task.model)
        with torch.no_grad():
            for p in ema.parameters():
                p.mul_(0.9)  # distinguishable from the live weights
    written = task.export(task.model, ema, str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == sorted([ENCODER_WEIGHTS, ENCODER_CONFIG])

    encoder = load_exported_encoder(str(tmp_path))  # load_state_dict(strict=True) inside
    assert isinstance(encoder, VisionTransformer)
    fresh_keys = set(VisionTransformer(**task.model.encoder_kwargs).state_dict())
    assert set(encoder.state_dict()) == fresh_keys
    source = ema if use_ema else task.model
    images = random_batch(2, 100).images
    encoder.eval()
    source.eval()
    with torch.no_grad():
        torch.testing.assert_close(encoder.forward_features(images), source.encoder.forward_features(images))
        assert encoder(images).shape == (2, 64)  # pooled class-token features, no head


def test_export_takes_ema_weights_from_a_diffusers_ema_model(tmp_path):
    from diffusers.training_utils import EMAModel

    task = make_task()
    ema = EMAModel(task.model.parameters(), decay=0.5)
    for k in range(2):  # EMAModel copies the weights at its first step and averages from the second
        train_steps(task, [random_batch(8, 8 * k)], 1)
        ema.step(task.model.parameters())
    task.export(task.model, ema, str(tmp_path))
    expected = copy.deepcopy(task.model)
    ema.copy_to(expected.parameters())
    exported = load_exported_encoder(str(tmp_path)).state_dict()
    for key, value in expected.encoder.state_dict().items():
        assert torch.equal(exported[key], value), key
    live = task.model.encoder.blocks[0].attn.qkv.weight
    assert (exported["blocks.0.attn.qkv.weight"] - live).abs().max() > 1e-4  # the EMA, not the live weights


def val_batches(digits_shards: str, batch_size: int = 36) -> list[Batch]:
    stream = ShardStream(
        ShardIndex.load(os.path.join(digits_shards, "val")),
        batch_size=batch_size,
        decoder=SampleDecoder(resolution=IMAGE),
        shuffle_buffer=0,
    )
    return list(stream.pass_loader(0))


def test_held_out_is_deterministic_and_moves_after_a_few_steps_on_digits(digits_shards, digits_train):
    task = make_task()
    val = val_batches(digits_shards)
    first = task.held_out(task.model, val, seed=0)
    assert first == task.held_out(task.model, val, seed=0)
    assert first["num_samples"] == sum(len(b) for b in val)
    assert task.model.training  # restored
    # the mask depends on (seed, id) only, not on how samples are batched
    regrouped = task.held_out(task.model, val_batches(digits_shards, batch_size=20), seed=0)
    assert regrouped["num_samples"] == first["num_samples"]
    assert regrouped["masked_mse"] == pytest.approx(first["masked_mse"], rel=1e-5)
    assert task.held_out(task.model, val, seed=1) != first

    stream = ShardStream(ShardIndex.load(digits_train), batch_size=32, decoder=SampleDecoder(resolution=IMAGE))
    train_steps(task, stream.pass_loader(0), 8)
    after = task.held_out(task.model, val, seed=0)
    assert after["masked_mse"] < first["masked_mse"]


def test_held_out_ignores_padding():
    task = make_task()
    real = random_batch(4)
    padded = Batch(
        torch.cat([real.ids, torch.tensor([-1, -1])]),
        torch.cat([real.weights, torch.zeros(2)]),
        torch.cat([real.images, torch.full((2, CHANNELS, IMAGE, IMAGE), 5.0)]),
        torch.cat([real.labels, torch.tensor([-1, -1])]),
    )
    assert task.held_out(task.model, [padded]) == task.held_out(task.model, [real])


def test_presets_are_the_papers_sizes():
    base = MAEConfig(preset="vit_base").resolved()
    assert (base.patch_size, base.embed_dim, base.depth, base.num_heads) == (16, 768, 12, 12)
    huge = MAEConfig(preset="vit_huge").resolved()
    assert (huge.patch_size, huge.embed_dim, huge.depth, huge.num_heads) == (14, 1280, 32, 16)
    large = MAEConfig(preset="vit_large").resolved()
    assert (large.embed_dim, large.depth, large.decoder_embed_dim, large.decoder_depth) == (1024, 24, 512, 8)


def test_config_mistakes_name_the_field():
    with pytest.raises(ValueError, match=r"mae\.preset.*vit_base, vit_large, vit_huge"):
        MAETask(MAEConfig(preset="vit_giant"), image_size=IMAGE, channels=CHANNELS)
    with pytest.raises(ValueError, match=r"mae\.patch_size=5"):
        MAETask(MAEConfig(patch_size=5), image_size=IMAGE, channels=CHANNELS)
    with pytest.raises(ValueError, match=r"mae\.mask_ratio"):
        MAETask(MAEConfig(mask_ratio=1.0), image_size=IMAGE, channels=CHANNELS)


def test_the_stratum_is_the_share_of_variation_the_models_own_mask_hid():
    task = make_task()
    assert task.num_strata == 0 and task.per_sample(task.model, random_batch(2), torch.Generator()).stratum is None
    batch = random_batch(4)
    noise = torch.rand(4, task.num_patches, generator=torch.Generator().manual_seed(3))
    _, mask, _ = task.model.forward_encoder(batch.images, noise)
    patches = task.model.patchify(batch.images)
    variation = (patches - patches.mean(dim=(1, 2), keepdim=True)).pow(2).mean(dim=2)
    expected = (variation * mask).sum(1) / variation.sum(1)
    torch.testing.assert_close(hidden_share(patches, noise, task.cfg.mask_ratio), expected)
    flat = torch.zeros_like(patches)
    assert hidden_share(flat, noise, 0.75).tolist() == [0.75] * 4


def test_stratum_normalised_mae_scores_forget_which_patches_the_mask_hid():
    """Images whose left half is busy and right half flat, and a model that has learnt only the flat
    background (it predicts 0 everywhere): how much of the busy half a mask hides moves the raw loss
    of one image from draw to draw; its score normalised within the hidden share moves much less
    with it, and still ranks the images as their mean raw loss does."""
    from prunepipe.pruning import ScoreNormaliser

    torch.manual_seed(0)
    task = MAETask(MAEConfig(), image_size=IMAGE, channels=CHANNELS, strata=True)
    with torch.no_grad():
        task.model.decoder_pred.weight.zero_()
        task.model.decoder_pred.bias.zero_()
    n, draws = 32, 40
    g = torch.Generator().manual_seed(0)
    images = torch.zeros(n, CHANNELS, IMAGE, IMAGE)
    images[..., : IMAGE // 2] = torch.rand(n, CHANNELS, IMAGE, IMAGE // 2, generator=g)
    images *= torch.linspace(0.5, 1.5, n).view(n, 1, 1, 1)  # samples of graded difficulty
    batch = Batch(torch.arange(n), torch.ones(n), images, torch.full((n,), -1))
    normaliser = ScoreNormaliser("stratum_mean", task.num_strata, buckets=20, momentum=0.9)
    raw, normalised, shares = np.zeros((draws, n)), np.zeros((draws, n)), np.zeros((draws, n))
    with torch.no_grad():
        for draw in range(draws):
            out = task.per_sample(task.model, batch, torch.Generator().manual_seed(100 + draw))
            normalised[draw] = normaliser(batch.ids.numpy(), out.loss.numpy(), out.stratum.numpy())
            raw[draw], shares[draw] = out.loss.numpy(), out.stratum.numpy()
    settled = slice(10, None)  # once the bucket means have settled
    per_image = lambda scores: np.mean(
        [
            scipy.stats.spearmanr(shares[settled, i], scores[settled, i])[0]  # noqa: E731
            for i in range(n)
        ]
    )
    with_raw, with_normalised = per_image(raw), per_image(normalised)
    assert with_raw > 0.5 and abs(with_normalised) < with_raw / 2, (with_raw, with_normalised)
    ranking = scipy.stats.spearmanr(raw[settled].mean(0), normalised[settled].mean(0))[0]
    assert ranking > 0.9, ranking


def test_a_run_reports_mask_strata_only_when_it_normalises_scores(digits_shards):
    from prunepipe.pipelines.config import load_config
    from prunepipe.pipelines.tasks.build import build_task

    base = ["task=mae", f"data.train={digits_shards}/train", "data.resolution=16", "mae.patch_size=4"]
    assert build_task(load_config(None, base)).num_strata == 0
    assert build_task(load_config(None, [*base, "score.normalise=stratum_mean"])).num_strata == 100
    assert build_task(load_config(None, base), strata=True).num_strata == 100
