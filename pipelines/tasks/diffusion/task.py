"""The latent-diffusion task: a backbone by name (backbones.py: a diffusers UNet2DModel, a DiT, or for text
conditioning a PixArtTransformer2DModel reading a frozen text encoder's features, text.py), trained with DDPMScheduler (epsilon or v) or flow matching (flow.py), in pixel
space, on precomputed latents, or on latents of a frozen AutoencoderKL (autoencoder.py); a per-sample
loss and a low-variance held-out loss. The export is export.py's; sampling an export, from_export.py's.
Any size: every batch is trained and evaluated at its own height and width (aspect-ratio buckets, one
bucket a batch), which the bucket table of the train split lists and the task checks against the
backbone at build; sampling stays at the square base size, `sample_size`.
Nothing here knows about shards, pruners, optimizers or torch.distributed: the train split comes as its
records (pipelines/data/description.py), never as a path; it never downloads.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.nn as nn
from diffusers import AutoencoderKL, DDPMScheduler, FlowMatchEulerDiscreteScheduler

from prunepipe.pipelines.data.batch import real_samples
from prunepipe.pipelines.data.description import SplitRecords
from prunepipe.pipelines.tasks.diffusion.autoencoder import load_autoencoder, vae_factor
from prunepipe.pipelines.tasks.diffusion.backbones import BackboneInput, build_backbone
from prunepipe.pipelines.tasks.diffusion.config import DiffusionConfig, check_config
from prunepipe.pipelines.tasks.diffusion.dit import dit_shape
from prunepipe.pipelines.tasks.diffusion.flow import HELD_OUT_S, draw_s, interpolate, s_stratum
from prunepipe.pipelines.tasks.diffusion.pixart import SizeConditions
from prunepipe.pipelines.tasks.diffusion.sampler import Condition, predict, sampling_scheduler
from prunepipe.pipelines.tasks.diffusion.text import (
    PrecomputedText,
    TextCondition,
    TextEncoder,
    caption_dropped,
    identity_key,
    load_text_encoder,
)
from prunepipe.pipelines.tasks.diffusion.timesteps import LossSecondMomentSampler
from prunepipe.pipelines.tasks.protocol import TextReading
from prunepipe.pipelines.tasks.randomness import SampleDraws, batch_draws, per_sample_seeded
from prunepipe.pipelines.tasks.sample_losses import SampleLosses
from prunepipe.pipelines.tasks.wrappers import unwrap

HELD_OUT_TIMESTEPS = 10


class DiffusionTask:
    """What the training loop needs from latent diffusion: the model, a per-sample loss, evaluation and export."""

    def __init__(self, cfg: DiffusionConfig, *, image_size: int, channels: int, records: SplitRecords | None = None):
        """`image_size` and `channels` describe the decoded images. With ldm.space=latents the
        shards hold latents: set cfg.sample_size and cfg.in_channels to their shape (index.json
        records `latent_shape`), or pass that shape here. `records`: what the train split's index.json
        records (pipelines/data/description.py): its aspect-ratio buckets ({"name", "image", "shape"}
        each; a mixture's merged table), each checked against the backbone here and kept as
        `bucket_table`; the text features (ldm.text.features=precomputed); the VAE of its latents."""
        self.cfg = cfg
        self.records = records if records is not None else SplitRecords()
        self.conditioning = check_config(cfg)
        self.timestep_sampler = (
            LossSecondMomentSampler(cfg.num_train_timesteps)
            if cfg.ddpm.timestep_sampling == "loss_second_moment"
            else None
        )
        self.autoencoder: AutoencoderKL | None = None
        self.shift_factor = 0.0
        size, latent_channels = self._denoised_space(image_size, channels)
        # the base size: the square the model is built at, samples for FID and the export are drawn at
        self.sample_size = cfg.sample_size or size
        self.in_channels = cfg.in_channels or latent_channels
        downsampling = 2 ** (len(cfg.unet.block_out_channels) - 1)
        if self.sample_size % downsampling and cfg.backbone == "unet":
            raise ValueError(
                f"ldm.sample_size={self.sample_size} must be a multiple of {downsampling} "
                f"(2 ** (len(ldm.unet.block_out_channels) - 1))"
            )
        # ---------------------------------------------------------------- sizes: buckets, image pixels
        self.bucket_table: list[dict] = list(self.records.buckets)
        # image pixels per pixel of the model's input: 1 in pixel space, the VAE's downsampling otherwise
        self.downsampling = self._downsampling()
        # latent (h, w) -> the image (H, W) its bucket lists: a batch's image size (size conditions)
        self.bucket_sizes = self._check_buckets()
        self.size_conditions = self._size_conditions()
        # ---------------------------------------------------------------- model and schedule
        self.text_encoder: TextEncoder | PrecomputedText | None = (
            load_text_encoder(cfg, self.records) if self.conditioning == "text" else None
        )
        width = self.text_encoder.hidden_size if self.text_encoder is not None else 0
        self.model = build_backbone(
            cfg, BackboneInput(self.sample_size, self.in_channels, width), self.text_encoder is not None
        )
        self.scheduler = training_scheduler(cfg)

    def _denoised_space(self, image_size: int, channels: int) -> tuple[int, int]:
        """(side, channels) of what is denoised: the images themselves in pixel space and on precomputed
        latents, else the latents of the VAE loaded here; sets the scaling (and shift) factor."""
        cfg = self.cfg
        if cfg.space == "pixel":
            self.scaling_factor = cfg.scaling_factor or 1.0
            return image_size, channels
        if cfg.space == "latents":
            # the shards already hold (z - shift) * scale; the factor is only needed to decode samples
            self.scaling_factor = cfg.scaling_factor or None
            return image_size, channels
        vae = self.autoencoder = load_autoencoder(cfg.vae, cfg.vae_subfolder, cfg.cache_dir)
        if vae.config.in_channels != channels:
            raise ValueError(
                f"ldm.vae={cfg.vae!r} encodes {vae.config.in_channels}-channel "
                f"images but the data decodes to {channels} channels (data.channels)"
            )
        self.scaling_factor = cfg.scaling_factor or float(vae.config.scaling_factor)
        self.shift_factor = float(getattr(vae.config, "shift_factor", None) or 0.0)
        return image_size // vae_factor(vae), vae.config.latent_channels

    def _size_conditions(self) -> SizeConditions | None:
        """PixArt's size conditions of each bucket's image size (ldm.dit.size_conditions), or None."""
        if not self.cfg.dit.size_conditions:
            return None
        if self.downsampling is None:
            raise ValueError(
                f"ldm.dit.size_conditions embeds each batch's image size, but the latent shards at "
                f"{self.records.index_path or '(none given)'} record neither the resolution they were encoded "
                f"at nor their buckets' image sizes (index.json's resolution, latent_shape, buckets)"
            )
        return SizeConditions(self.downsampling, self.bucket_sizes)

    def _downsampling(self) -> int | None:
        """Image pixels per pixel of the model's input: 1 in pixel space, the VAE's factor (space=vae), or
        for precomputed latents index.json's resolution over its latent side (else a bucket's image over
        its latent); None where the latent shards record neither."""
        cfg = self.cfg
        if cfg.space == "pixel":
            return 1
        if cfg.space == "vae":
            return vae_factor(self.autoencoder)
        shape, resolution = self.records.latent_shape, self.records.resolution
        if shape and resolution is not None and resolution % shape[-1] == 0:
            return resolution // shape[-1]
        for bucket in self.bucket_table:
            image, stored = bucket.get("image"), bucket["shape"]
            if image and int(image[-1]) % int(stored[-1]) == 0:
                return int(image[-1]) // int(stored[-1])
        return None

    def _check_buckets(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Every bucket's model input (h, w) checked against the backbone: multiples of the DiT patch size,
        or of the UNet's downsampling, and for space=vae of the VAE's; returns {(h, w): image (H, W)}."""
        cfg, sizes = self.cfg, {}
        if cfg.backbone == "dit":
            multiple = dit_shape(cfg.dit.preset, cfg.dit.depth, cfg.dit.width, cfg.dit.heads, cfg.dit.patch_size)[
                "patch_size"
            ]
            setting = f"the DiT patch size {multiple} (ldm.dit.preset={cfg.dit.preset!r}, ldm.dit.patch_size)"
        else:
            multiple = 2 ** (len(cfg.unet.block_out_channels) - 1)
            setting = f"the UNet's downsampling {multiple} (2 ** (len(ldm.unet.block_out_channels) - 1))"
        vae = self.downsampling if cfg.space == "vae" else 1
        for bucket in self.bucket_table:
            shape = [int(v) for v in bucket["shape"]]
            name = f"data.train's bucket {bucket['name']!r} (shape {shape})"
            if cfg.space == "latents" and shape[0] != self.in_channels:
                raise ValueError(
                    f"{name} holds {shape[0]}-channel latents; the model takes {self.in_channels} "
                    f"(index.json's latent_shape, ldm.in_channels)"
                )
            if shape[-2] % vae or shape[-1] % vae:
                raise ValueError(
                    f"{name}: its images' sides {shape[-2]}x{shape[-1]} must be multiples of the VAE's "
                    f"downsampling {vae} (ldm.vae)"
                )
            height, width = shape[-2] // vae, shape[-1] // vae
            if height % multiple or width % multiple:
                raise ValueError(
                    f"{name}: the model's input {height}x{width} must have sides that are multiples of "
                    f"{setting}; encode the buckets at other sizes, or choose a smaller one"
                )
            image = bucket.get("image")
            pixels = self.downsampling or 1
            sizes[(height, width)] = (int(image[-2]), int(image[-1])) if image else (height * pixels, width * pixels)
        return sizes

    # ---------------------------------------------------------------- latents
    @torch.no_grad()
    def encode(self, images: torch.Tensor, draws: SampleDraws | None = None) -> torch.Tensor:
        """Images [B, C, H, W] in [-1, 1] -> what the UNet denoises: (z - shift) * scale, z a VAE
        posterior sample mean + std * draws.randn (the mean when no draws); images as they are otherwise."""
        if self.autoencoder is None:
            return images * self.scaling_factor if self.cfg.space == "pixel" else images
        if self.autoencoder.device != images.device:
            self.autoencoder.to(images.device)  # the loop moves only the UNet
        posterior = self.autoencoder.encode(images).latent_dist
        z = posterior.mean
        if draws is not None:  # DiagonalGaussianDistribution.sample, with the caller's randomness
            z = z + posterior.std * draws.randn(*z.shape[1:]).to(z.device, z.dtype)
        return ((z - self.shift_factor) * self.scaling_factor).float()  # autocast may have run the VAE in bf16

    @property
    def label_classes(self) -> int:
        """Classes a training label must be below (0: labels unused); the stream's decoder checks."""
        return self.cfg.num_classes

    @property
    def text_conditional(self) -> bool:
        return self.text_encoder is not None

    @property
    def text(self) -> TextReading | None:
        """The text batches carry: captions for the encoder run here (the `txt` field), or the
        precomputed features' (width, max tokens) (text.npy); the encoder's identity (its files and
        caption length, whoever ran it), which every rank must hold alike and a resume must not change."""
        if self.text_encoder is None:
            return None
        info = self.text_encoder.identity()
        precomputed = isinstance(self.text_encoder, PrecomputedText)
        return TextReading(
            captions=not precomputed,
            features=(self.text_encoder.width, self.text_encoder.max_length) if precomputed else (0, 0),
            identity=identity_key(info),
            encoder=str(info["text_encoder"]),
        )

    def condition(self, batch, device) -> Condition:
        """What the model is conditioned on, nothing dropped: the captions' features (text), the class
        labels (class), or None."""
        if self.text_encoder is not None:
            return self._text_condition(batch, device, None)
        labels = self.class_labels(batch.labels)
        return None if labels is None else labels.to(device)

    def _text_condition(self, batch, device, dropped: torch.Tensor | None) -> TextCondition:
        """The batch's caption features, encoded here or its precomputed ones padded on `device`, with
        the empty caption's where `dropped` [B] says, and at padding samples (which hold no tokens; an
        encoded padding caption is the empty one already)."""
        if isinstance(self.text_encoder, TextEncoder):
            features = self.text_encoder.encode(batch.captions, device)
        else:
            features = self.text_encoder.of_batch(batch.text_tokens.to(device), batch.text_lengths.to(device))
            padding = batch.ids.to(device) < 0
            dropped = padding if dropped is None else dropped | padding
        return features if dropped is None else features.where(dropped, self.text_encoder.null(device))

    def training_condition(self, batch, draws: SampleDraws, device) -> tuple[Condition, torch.Tensor | None]:
        """(condition with the per-sample drops applied, bool [B] of dropped captions or None). Text:
        each caption replaced by the empty caption's features with probability ldm.text.caption_dropout, once
        per sample from its draws, here at train time (never when features are precomputed: that would
        fix which samples are unconditional for good and make a pruner's scores incomparable)."""
        if self.text_encoder is None:
            return self.training_labels(batch.labels.to(device), draws), None
        if self.cfg.text.caption_dropout <= 0:
            return self._text_condition(batch, device, None), None
        dropped = caption_dropped(draws, self.cfg.text.caption_dropout, device)
        return self._text_condition(batch, device, dropped), dropped

    def class_labels(self, labels: torch.Tensor) -> torch.Tensor | None:
        """Labels for the model: None when unconditional (a DiT then gets the null label); -1 (no
        label) becomes the null class. Labels on the host are range-checked here; labels on a device
        were checked by the stream's decoder (reading them back would make the step wait)."""
        if not self.cfg.num_classes:
            return None
        if labels.device.type == "cpu" and bool((labels >= self.cfg.num_classes).any()):
            raise ValueError(f"label {int(labels.max())} is out of range for ldm.num_classes={self.cfg.num_classes}")
        return torch.where(labels < 0, torch.full_like(labels, self.cfg.num_classes), labels)

    def training_labels(self, labels: torch.Tensor, draws: SampleDraws) -> torch.Tensor | None:
        """class_labels, each replaced by the null label with probability ldm.label_dropout, once per
        sample from its own draws (so the drop is fixed by (seed, pass, id), whatever the batch)."""
        mapped = self.class_labels(labels)
        if mapped is None or self.cfg.label_dropout <= 0:
            return mapped
        dropped = draws.rand().to(mapped.device) < self.cfg.label_dropout
        return torch.where(dropped, torch.full_like(mapped, self.cfg.num_classes), mapped)

    # ---------------------------------------------------------------- loss
    def min_snr_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Min-SNR-gamma loss weights [B] (Hang et al. 2023, arXiv 2303.09556, Eq. 9 and its
        v-prediction form): min(snr, gamma) / snr for epsilon, min(snr, gamma) / (snr + 1) for v."""
        alpha_bar = self.scheduler.alphas_cumprod.to(timesteps.device)[timesteps].double()
        snr = alpha_bar / (1.0 - alpha_bar)
        gamma = self.cfg.ddpm.min_snr_gamma
        if self.cfg.ddpm.prediction_type == "epsilon":
            weights = torch.where(snr <= gamma, torch.ones_like(snr), gamma / snr)  # no 0/0 at snr -> 0
        else:
            weights = torch.clamp(snr, max=gamma) / (snr + 1.0)
        return weights.float()

    @property
    def num_strata(self) -> int:
        """Per-sample strata: the timesteps, 0..T-1 (flow: s in T equal buckets); with caption dropout,
        T more for the samples trained on the null caption (their loss is not comparable with a
        captioned one's), so score.buckets splits into halves: kept captions, then dropped ones."""
        return self.cfg.num_train_timesteps * (2 if self._drops_captions else 1)

    @property
    def _drops_captions(self) -> bool:
        return self.text_encoder is not None and self.cfg.text.caption_dropout > 0

    def _stratum(self, timestep_stratum: torch.Tensor, dropped: torch.Tensor | None) -> torch.Tensor:
        if dropped is None:
            return timestep_stratum
        return timestep_stratum + dropped.long() * self.cfg.num_train_timesteps

    def per_sample(self, model: nn.Module, batch, generator: torch.Generator | SampleDraws) -> SampleLosses:
        """[B] float32 denoising MSE over all non-batch dims, min-SNR weighted when configured, with
        each sample's timestep as its stratum. With importance-sampled timesteps the loss is also
        weighted 1 / (T p_t) and the score (what the pruner and the sampler see) is the loss without it.
        Flow: the velocity MSE at the sample's s, its bucket of s as the stratum.

        Draws from `generator` (a torch.Generator, or per-sample draws such as
        prunepipe.pipelines.tasks.randomness.SampleRandomness) in this order: the VAE posterior noise (VAE runs
        only), the noise [B, C, h, w], the timesteps or s [B], the label or caption drop [B]
        (class-conditional with label_dropout > 0, text-conditional with caption_dropout > 0). `model` may be a DDP/accelerate wrapper: always call the one passed.
        """
        draws = batch_draws(generator, len(batch.images))
        x0 = self.encode(batch.images, draws)
        if x0.shape[1] != self.in_channels:
            raise ValueError(
                f"the batch holds {x0.shape[1]}-channel inputs but the {type(unwrap(model)).__name__} takes "
                f"{self.in_channels} "
                f"(ldm.in_channels); with ldm.space=latents set ldm.in_channels and "
                f"ldm.sample_size to the latent_shape recorded in the latent shards' index.json"
            )
        device = x0.device
        noise = draws.randn(*x0.shape[1:]).to(device)
        cfg = self.cfg
        if cfg.objective == "flow":
            s = draw_s(
                draws,
                cfg.flow.weighting,
                logit_mean=cfg.flow.logit_mean,
                logit_std=cfg.flow.logit_std,
                mode_scale=cfg.flow.mode_scale,
                device=device,
            )
            condition, dropped = self.training_condition(batch, draws, device)
            losses = self._flow_mse(model, x0, noise, s, condition)
            return SampleLosses(losses, self._stratum(s_stratum(s, cfg.num_train_timesteps), dropped))
        if self.timestep_sampler is None:
            timesteps, importance = draws.randint(cfg.num_train_timesteps).to(device), None
        else:
            timesteps, importance = self.timestep_sampler.draw(draws.rand().to(device))
        condition, dropped = self.training_condition(batch, draws, device)
        losses = self._denoising_mse(model, x0, noise, timesteps, condition)
        if self.cfg.ddpm.min_snr_gamma > 0:
            losses = losses * self.min_snr_weights(timesteps)
        stratum = self._stratum(timesteps, dropped)
        if importance is None:
            return SampleLosses(losses, stratum)
        return SampleLosses(losses * importance, stratum, score=losses.detach())

    def observe(self, ids: np.ndarray, strata: np.ndarray | None, scores: np.ndarray) -> None:
        """After each step, the gathered batch's (timesteps, unweighted losses) feed the timestep sampler."""
        if self.timestep_sampler is not None:
            self.timestep_sampler.update(ids, strata, scores)

    def _denoising_mse(self, model, x0, noise, timesteps, labels) -> torch.Tensor:
        """`labels` as `condition` returns them (None, class indices or caption features)."""
        noisy = self.scheduler.add_noise(x0, noise, timesteps)
        if self.cfg.ddpm.prediction_type == "epsilon":
            target = noise
        else:
            target = self.scheduler.get_velocity(x0, noise, timesteps)
        return _mse(predict(model, noisy, timesteps, labels, self.size_conditions), target)

    def _flow_mse(self, model, x0, noise, s, labels) -> torch.Tensor:
        """Velocity MSE [B] at s [B]; the model sees timestep s * T, as the Euler sampler feeds it."""
        x_s, velocity = interpolate(x0, noise, s)
        return _mse(predict(model, x_s, s * self.cfg.num_train_timesteps, labels, self.size_conditions), velocity)

    # ---------------------------------------------------------------- evaluation
    def sampler(self):
        """A fresh sampling scheduler: Euler for flow, DDIM (eta 0) for DDPM."""
        return sampling_scheduler(type(self.scheduler).__name__, self.scheduler.config)

    def held_out_grid(self) -> list[tuple[str, torch.Tensor]]:
        """(metric key, timestep or s) of the fixed held-out grid of this objective."""
        if self.cfg.objective == "flow":
            return [(f"flow_mse_s{round(s * 100):03d}", torch.tensor(s)) for s in HELD_OUT_S]
        return [(f"denoise_mse_t{t:04d}", torch.tensor(t)) for t in self.held_out_timesteps()]

    def held_out_timesteps(self) -> list[int]:
        """The fixed grid: HELD_OUT_TIMESTEPS evenly spaced timesteps from 0 to T-1."""
        grid = np.linspace(0, self.cfg.num_train_timesteps - 1, HELD_OUT_TIMESTEPS)
        return sorted({int(round(t)) for t in grid})

    @torch.no_grad()
    def held_out(self, model: nn.Module, batches: Iterable, seed: int = 0) -> dict:
        """Unweighted denoising MSE at a fixed grid of timesteps with each sample's noise fixed by
        (seed, id), and the VAE posterior mean: the same inputs every call, so changes are the
        model's. Keys: denoise_mse (grid mean), denoise_mse_t{t:04d}, num_samples. Flow: the velocity
        MSE at s = 0.05, 0.15, .., 0.95 (flow_mse_s{100 s:03d}); denoise_mse is then their mean, the
        objective's own held-out loss. Padding (id < 0) is ignored; evaluate the unwrapped or EMA model
        when only one rank runs this."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        grid = self.held_out_grid()
        mse = self._flow_mse if self.cfg.objective == "flow" else self._denoising_mse
        sums = np.zeros(len(grid))
        count = 0
        try:
            for batch in real_samples(batches):
                ids = batch.ids.cpu().numpy()
                x0 = self.encode(batch.images.to(device))
                labels = self.condition(batch, device)
                noise = per_sample_seeded(tuple(x0.shape[1:]), ids, seed, normal=True).to(device)
                for k, (_, t) in enumerate(grid):
                    sums[k] += float(mse(model, x0, noise, t.to(device).expand(len(ids)), labels).double().sum())
                count += len(ids)
        finally:
            model.train(was_training)
        per_t = sums / max(count, 1)
        result = {key: float(v) for (key, _), v in zip(grid, per_t)}
        return {"denoise_mse": float(per_t.mean()), **result, "num_samples": count}

    # ---------------------------------------------------------------- export
    def export(self, model: nn.Module, ema_model, out_dir: str, *, copy: bool = False) -> list[str]:
        """A diffusers pipeline folder (export.py): the weights to sample (the EMA when given), the
        scheduler, the VAE and text encoder linked (or copied with `copy`). Returns what it wrote."""
        from prunepipe.pipelines.tasks.diffusion.export import export_diffusion

        return export_diffusion(self, model, ema_model, out_dir, copy=copy)


def _mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B] float32 MSE over all non-batch dims."""
    return (pred.float() - target.float()).pow(2).flatten(1).mean(dim=1)


def training_scheduler(cfg: DiffusionConfig) -> DDPMScheduler | FlowMatchEulerDiscreteScheduler:
    """The noise schedule trained with; for flow it only records how to sample (timestep = s * T, as in training)."""
    if cfg.objective == "flow":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=cfg.num_train_timesteps)
    return DDPMScheduler(
        num_train_timesteps=cfg.num_train_timesteps,
        beta_schedule=cfg.ddpm.beta_schedule,
        prediction_type=cfg.ddpm.prediction_type,
        # x0 clipping to [-1, 1] suits pixels only; scaled latents are not bounded by 1
        clip_sample=cfg.space == "pixel",
    )
