"""The latent-diffusion task: the loss is F.mse_loss on the scheduler's targets, min-SNR weights are
Hang et al.'s, VAEs load offline from a folder or the hub cache, and exports sample with diffusers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMPipeline, UNet2DModel
from eval_runs import diffusion_config
from eval_runs import tiny_vae as tiny_vae_of

from prunepipe.pipelines.data.batch import Batch
from prunepipe.pipelines.tasks.diffusion.from_export import load_pipeline, sample
from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask

IMAGE, CHANNELS, T = 32, 3, 1000


def make_task(**overrides) -> DiffusionTask:
    torch.manual_seed(0)
    return DiffusionTask(diffusion_config(**overrides), image_size=IMAGE, channels=CHANNELS)


def random_batch(n: int = 4, first_id: int = 0, labels=None) -> Batch:
    images = torch.rand(n, CHANNELS, IMAGE, IMAGE, generator=torch.Generator().manual_seed(first_id + 1)) * 2 - 1
    labels = torch.full((n,), -1) if labels is None else torch.tensor(labels)
    return Batch(torch.arange(first_id, first_id + n), torch.ones(n), images, labels)


def tiny_vae() -> AutoencoderKL:
    return tiny_vae_of(CHANNELS, IMAGE)


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-vae"))
    tiny_vae().save_pretrained(folder)
    return folder


def reference_targets(task, x0, generator, prediction_type):
    """Noise and timesteps drawn in the documented order, noisy input, and the target, by the formulas."""
    noise = torch.randn(x0.shape, generator=generator)
    timesteps = torch.randint(0, T, (len(x0),), generator=generator)
    alpha_bar = task.scheduler.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
    noisy = alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise
    velocity = alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * x0  # Salimans & Ho 2022
    return noisy, timesteps, noise if prediction_type == "epsilon" else velocity


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_per_sample_losses_average_to_F_mse_loss(prediction_type):
    task = make_task(ddpm__prediction_type=prediction_type)
    batch = random_batch()
    losses = task.per_sample(task.model, batch, torch.Generator().manual_seed(5)).loss
    assert losses.shape == (4,) and losses.dtype == torch.float32

    noisy, timesteps, target = reference_targets(task, batch.images, torch.Generator().manual_seed(5), prediction_type)
    pred = task.model(noisy, timesteps).sample
    torch.testing.assert_close(losses.mean(), F.mse_loss(pred, target), rtol=1e-5, atol=1e-6)


class PerSampleDraws:
    """SampleDraws where each sample id has its own generator, as the trainer's per-sample randomness."""

    def __init__(self, ids: torch.Tensor, seed: int = 0):
        self.generators = [torch.Generator().manual_seed(seed * 100_003 + int(i)) for i in ids]

    def rand(self, *shape):
        return torch.stack([torch.rand(shape, generator=g) for g in self.generators])

    def randn(self, *shape):
        return torch.stack([torch.randn(shape, generator=g) for g in self.generators])

    def randint(self, high):
        return torch.cat([torch.randint(high, (1,), generator=g) for g in self.generators])


def test_with_per_sample_draws_a_samples_loss_does_not_depend_on_its_batch_mates(vae_folder):
    for task in (make_task(), make_task(space="vae", vae=vae_folder)):
        batch = random_batch(4)
        together = task.per_sample(task.model, batch, PerSampleDraws(batch.ids)).loss
        alone = Batch(batch.ids[2:3], batch.weights[2:3], batch.images[2:3], batch.labels[2:3])
        torch.testing.assert_close(task.per_sample(task.model, alone, PerSampleDraws(alone.ids)).loss[0], together[2])


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_are_in_0_1_and_one_where_snr_is_below_gamma(prediction_type):
    gamma = 5.0
    task = make_task(ddpm__prediction_type=prediction_type, ddpm__min_snr_gamma=gamma)
    timesteps = torch.arange(T)
    weights = task.min_snr_weights(timesteps)
    alpha_bar = task.scheduler.alphas_cumprod.double()
    snr = alpha_bar / (1 - alpha_bar)
    assert ((weights > 0) & (weights <= 1)).all()
    if prediction_type == "epsilon":
        low = snr <= gamma
        assert low.any() and (~low).any()  # both regimes are exercised
        assert (weights[low] == 1).all()
        torch.testing.assert_close(weights[~low].double(), gamma / snr[~low], rtol=1e-6, atol=0)
    else:
        torch.testing.assert_close(weights.double(), torch.clamp(snr, max=gamma) / (snr + 1), rtol=1e-6, atol=0)

    # the weighted per-sample loss is the unweighted one times the weight of its timestep
    batch = random_batch()
    weighted = task.per_sample(task.model, batch, torch.Generator().manual_seed(1)).loss
    task.cfg.ddpm.min_snr_gamma = 0.0
    plain = task.per_sample(task.model, batch, torch.Generator().manual_seed(1)).loss
    _, drawn, _ = reference_targets(task, batch.images, torch.Generator().manual_seed(1), prediction_type)
    torch.testing.assert_close(weighted, plain * weights[drawn])


def test_class_conditional_maps_missing_labels_to_the_null_class():
    task = make_task(num_classes=10)
    assert task.model.config.num_class_embeds == 11
    assert task.class_labels(torch.tensor([-1, 3, 9])).tolist() == [10, 3, 9]
    losses = task.per_sample(task.model, random_batch(labels=[-1, 3, 9, 0]), torch.Generator().manual_seed(0)).loss
    assert torch.isfinite(losses).all()
    with pytest.raises(ValueError, match=r"ldm\.num_classes=10"):
        task.per_sample(task.model, random_batch(labels=[10, 0, 0, 0]), torch.Generator())
    assert make_task().class_labels(torch.tensor([3])) is None  # unconditional ignores labels


def test_class_conditional_export_samples_given_classes(tmp_path):
    task = make_task(num_classes=10)
    task.export(task.model, None, str(tmp_path))
    with pytest.raises(ValueError, match="use sample"):
        load_pipeline(str(tmp_path), ema=False)
    labels = torch.tensor([1, 7, -1])  # -1: the null class
    images = sample(str(tmp_path), 3, 2, torch.Generator().manual_seed(0), ema=False, class_labels=labels)
    assert images.shape == (3, CHANNELS, IMAGE, IMAGE)


def test_held_out_is_deterministic_per_timestep_and_ignores_padding_and_batching():
    task = make_task()
    batches = [random_batch(2, 0), random_batch(2, 2)]
    first = task.held_out(task.model, batches, seed=0)
    assert first == task.held_out(task.model, batches, seed=0)
    per_t = {k: v for k, v in first.items() if k.startswith("denoise_mse_t")}
    assert len(per_t) == 10 and "denoise_mse_t0000" in per_t and "denoise_mse_t0999" in per_t
    assert first["denoise_mse"] == pytest.approx(sum(per_t.values()) / 10)
    assert first["num_samples"] == 4 and task.model.training

    whole = random_batch(4, 0)  # the same samples, one batch, plus padding
    whole.images[2:] = batches[1].images
    padded = Batch(
        torch.cat([whole.ids, torch.tensor([-1])]),
        torch.cat([whole.weights, torch.zeros(1)]),
        torch.cat([whole.images, torch.zeros(1, CHANNELS, IMAGE, IMAGE)]),
        torch.cat([whole.labels, torch.tensor([-1])]),
    )
    again = task.held_out(task.model, [padded], seed=0)
    assert again["num_samples"] == 4
    assert again["denoise_mse"] == pytest.approx(first["denoise_mse"], rel=1e-5)
    assert task.held_out(task.model, batches, seed=1) != first


def test_export_loads_with_diffusers_and_samples_with_ddpm_pipeline(tmp_path):
    from diffusers.training_utils import EMAModel

    task = make_task()
    ema = EMAModel(task.model.parameters(), decay=0.5)
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=1e-3)
    for step in range(2):  # EMAModel copies the weights at its first step and averages from the second
        optimizer.zero_grad()
        task.per_sample(task.model, random_batch(), torch.Generator().manual_seed(step)).loss.mean().backward()
        optimizer.step()
        ema.step(task.model.parameters())

    written = task.export(task.model, ema, str(tmp_path))
    assert {os.path.basename(p) for p in written} == {
        "unet",
        "scheduler",
        "autoencoder.json",
        "model_index.json",
        "README.md",
    }
    unet = UNet2DModel.from_pretrained(str(tmp_path), subfolder="unet")  # what a pipeline samples: the EMA
    live = UNet2DModel.from_pretrained(str(tmp_path), subfolder="unet", variant="non_ema")
    for (name, weights), loaded in zip(task.model.named_parameters(), live.parameters()):
        assert torch.equal(weights, loaded), name
    for loaded, shadow in zip(unet.parameters(), ema.shadow_params):
        assert torch.equal(loaded, shadow)
    assert not torch.equal(unet.conv_in.weight, live.conv_in.weight)  # the EMA is not the live model

    loaded = DDPMPipeline.from_pretrained(str(tmp_path))  # the export is a pipeline folder
    assert all(torch.equal(a, b) for a, b in zip(loaded.unet.parameters(), ema.shadow_params))
    pipe = load_pipeline(str(tmp_path))
    assert isinstance(pipe, DDPMPipeline)
    generator = torch.Generator().manual_seed(0)
    images = pipe(batch_size=2, num_inference_steps=2, generator=generator, output_type="pt").images
    assert tuple(images.shape) == (2, CHANNELS, IMAGE, IMAGE) and torch.isfinite(torch.as_tensor(images)).all()
    drawn = sample(str(tmp_path), 2, 2, torch.Generator().manual_seed(0))
    assert drawn.shape == (2, CHANNELS, IMAGE, IMAGE) and 0 <= drawn.min() and drawn.max() <= 1


def test_vae_from_a_local_folder_sets_the_latent_space_and_encodes_in_the_loss(vae_folder, tmp_path):
    task = make_task(space="vae", vae=vae_folder)
    vae = task.autoencoder
    assert (task.in_channels, task.sample_size) == (4, IMAGE // 2)
    assert task.scaling_factor == vae.config.scaling_factor
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    assert not any(p is q for p in task.model.parameters() for q in vae.parameters())  # only the UNet trains

    batch = random_batch()
    losses = task.per_sample(task.model, batch, torch.Generator().manual_seed(2)).loss
    generator = torch.Generator().manual_seed(2)  # posterior sample first, then noise and timesteps
    with torch.no_grad():
        x0 = vae.encode(batch.images).latent_dist.sample(generator) * vae.config.scaling_factor
    noisy, timesteps, target = reference_targets(task, x0, generator, "epsilon")
    reference = F.mse_loss(task.model(noisy, timesteps).sample, target)
    torch.testing.assert_close(losses.mean(), reference, rtol=1e-5, atol=1e-6)

    task.export(task.model, None, str(tmp_path))
    assert not any("non_ema" in name for name in os.listdir(tmp_path / "unet"))
    with pytest.raises(ValueError, match="use sample"):
        load_pipeline(str(tmp_path), ema=False)
    images = sample(str(tmp_path), 2, 2, torch.Generator().manual_seed(0), ema=False)
    assert images.shape == (2, CHANNELS, IMAGE, IMAGE)  # decoded back to pixels


def test_vae_by_repo_id_from_the_hub_cache_offline(vae_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub's cache layout: models--{org}--{name}/snapshots/{commit}/ and refs/main -> commit
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--local--tiny-vae"
    shutil.copytree(vae_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    task = make_task(space="vae", vae="local/tiny-vae", cache_dir=str(tmp_path / "hub"))
    expected = AutoencoderKL.from_pretrained(vae_folder)
    for loaded, saved in zip(task.autoencoder.parameters(), expected.parameters()):
        assert torch.equal(loaded, saved)
    assert torch.isfinite(task.per_sample(task.model, random_batch(), torch.Generator()).loss).all()

    with pytest.raises(FileNotFoundError, match=r"ldm\.vae='local/other'.*hub cache.*hf download"):
        make_task(space="vae", vae="local/other", cache_dir=str(tmp_path / "hub"))


def test_config_mistakes_name_the_field_and_accepted_values(tmp_path):
    with pytest.raises(ValueError, match=r"ldm\.ddpm\.prediction_type.*epsilon, v_prediction"):
        make_task(ddpm__prediction_type="sample")
    with pytest.raises(ValueError, match=r"ldm\.ddpm\.beta_schedule.*squaredcos_cap_v2"):
        make_task(ddpm__beta_schedule="cosine")
    with pytest.raises(FileNotFoundError, match=r"ldm\.vae=.*does not exist.*hf download"):
        make_task(space="vae", vae=str(tmp_path / "missing-vae"))
    with pytest.raises(ValueError, match=r"ldm\.unet\.norm_num_groups=8"):
        make_task(unet__block_out_channels=[12, 24])
