"""The latent-diffusion task: a diffusers UNet2DModel or DiTTransformer2DModel (pipelines/tasks/dit.py),
or for text conditioning a PixArtTransformer2DModel reading a frozen text encoder's features
(pipelines/tasks/pixart.py, text.py), trained with DDPMScheduler (epsilon or v) or flow matching (pipelines/tasks/flow.py), in pixel space,
on precomputed latents, or on latents of a frozen AutoencoderKL; a per-sample loss, a low-variance
held-out loss, an export diffusers loads, and a sampler for it (pipelines/tasks/sampler.py).
Nothing here knows about shards, pruners, optimizers or torch.distributed; it never downloads.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch
import torch.nn as nn
from diffusers import (AutoencoderKL, DDPMPipeline, DDPMScheduler, DiTTransformer2DModel,
                       FlowMatchEulerDiscreteScheduler, PixArtTransformer2DModel, UNet2DModel)
from huggingface_hub import constants as hub_constants

from pipelines.data.batch import real_samples
from pipelines.tasks.dit import DIT_PRESETS, build_dit, dit_null_label
from pipelines.tasks.flow import FLOW_WEIGHTINGS, HELD_OUT_S, draw_s, interpolate, s_stratum
from pipelines.tasks.pixart import build_text_dit
from pipelines.tasks.randomness import SampleDraws, batch_draws, per_sample_seeded
from pipelines.tasks.sample_losses import SampleLosses
from pipelines.tasks.sampler import FLOW_SCHEDULER, Condition, denoise, predict, sampling_scheduler
from pipelines.tasks.text import (PRECOMPUTED_TEXT, PrecomputedText, TextCondition, TextEncoder, caption_dropped,
                                  identity_key)
from pipelines.tasks.timesteps import TIMESTEP_SAMPLING, LossSecondMomentSampler
from pipelines.tasks.wrappers import unwrap, weights_module

BACKBONES = ("unet", "dit")
OBJECTIVES = ("ddpm", "flow")
PREDICTION_TYPES = ("epsilon", "v_prediction")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid")
PIXEL_SPACE, PRECOMPUTED = "identity", "latents"
CONDITIONINGS = ("none", "class", "text")
AUTOENCODER_INFO = "autoencoder.json"
TEXT_ENCODER_INFO = "text_encoder.json"  # the export's reference to its text encoder (not a copy)
HELD_OUT_TIMESTEPS = 10
MODEL_FOLDERS = {"unet": "unet", "dit": "transformer"}  # export subfolders, as diffusers pipelines name them


@dataclass
class DiffusionConfig:
    """Backbone, objective, noise schedule, loss and autoencoder settings (0 = derive from the data)."""

    backbone: str = "unet"  # unet (the fields below) | dit (DiTTransformer2DModel, the dit* fields)
    objective: str = "ddpm"  # ddpm (DDPMScheduler, prediction_type) | flow (v = noise - x0, flow_* fields)
    sample_size: int = 0  # UNet input size; 0 = image size, or image size / VAE downsampling
    in_channels: int = 0  # 0 = image channels, or the VAE's latent channels
    block_out_channels: list[int] = field(default_factory=lambda: [32, 64])
    layers_per_block: int = 1
    down_block_types: list[str] = field(default_factory=lambda: ["DownBlock2D", "AttnDownBlock2D"])
    up_block_types: list[str] = field(default_factory=lambda: ["AttnUpBlock2D", "UpBlock2D"])
    norm_num_groups: int = 8
    # DiT: a preset (DiT-S/2, B/2, L/2, XL/2; /4 and /8 too); the dit_* numbers override it when > 0
    dit: str = "DiT-S/2"
    dit_depth: int = 0
    dit_width: int = 0
    dit_heads: int = 0
    dit_patch_size: int = 0
    num_classes: int = 0  # > 0: class-conditional; label -1 maps to an extra "null" class (index num_classes)
    label_dropout: float = 0.1  # class-conditional: share of samples trained on the null label (guidance)
    # none | class | text; "" = class when num_classes > 0, else none (what num_classes alone meant before)
    conditioning: str = ""
    # text: the local folder of a transformers CLIP text model or T5 encoder (frozen; never downloaded),
    # or "precomputed" (the shards hold its features: `prunepipe latents encode --text-encoder`), its
    # tokenizer's folder ("" = the same folder), tokens per caption (CLIP 77; PixArt-alpha's T5 120),
    # and the share of samples trained on the empty caption's features (guidance; PixArt, Sana: 0.1)
    text_encoder: str = ""
    tokenizer: str = ""
    text_max_length: int = 77
    caption_dropout: float = 0.1
    # flow: the density of s (compute_density_for_timestep_sampling's): logit_normal | uniform | mode
    flow_weighting: str = "logit_normal"
    flow_logit_mean: float = 0.0
    flow_logit_std: float = 1.0
    flow_mode_scale: float = 1.29
    num_train_timesteps: int = 1000
    beta_schedule: str = "squaredcos_cap_v2"
    prediction_type: str = "epsilon"  # "epsilon" | "v_prediction"
    min_snr_gamma: float = 0.0  # 0 = off; 5.0 is the paper's choice
    # uniform | loss_second_moment: importance-sample t by sqrt(E[loss_t^2]), loss weighted 1/(T p_t)
    # (improved-diffusion's LossSecondMomentResampler; pipelines/tasks/timesteps.py)
    timestep_sampling: str = "uniform"
    # "identity" (pixel space) | "latents" (shards hold scaled latents) | a local folder or hub
    # repo id of a diffusers AutoencoderKL, loaded with local_files_only=True
    autoencoder: str = PIXEL_SPACE
    vae_subfolder: str = ""  # e.g. "vae" inside a Stable Diffusion repo
    scaling_factor: float = 0.0  # 0 = the VAE's config.scaling_factor (1.0 in pixel space)
    cache_dir: str = ""  # hub cache holding `autoencoder`; "" = HF_HUB_CACHE as read at import


def load_autoencoder(
    name: str, subfolder: str = "", cache_dir: str = "", *, setting: str = "ldm.autoencoder"
) -> AutoencoderKL:
    """A frozen AutoencoderKL in eval mode from a local folder or the hub cache; never downloads.
    `setting` names where `name` came from, for the error message."""
    path = os.path.expanduser(name)
    is_path = os.path.isdir(path) or name.startswith(("/", ".", "~")) or name.count("/") != 1
    problem = None
    if is_path and not os.path.isdir(path):
        problem = "the folder does not exist"
    else:
        try:
            with warnings.catch_warnings():
                # diffusers 0.42 still passes an argument that current huggingface_hub deprecates
                warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*")
                vae = AutoencoderKL.from_pretrained(
                    path, subfolder=subfolder or None, local_files_only=True, cache_dir=cache_dir or None
                )
        except (OSError, ValueError) as e:
            problem = str(e).splitlines()[0].rstrip(".")
    if problem is not None:
        where = f"the folder {path!r}" if is_path else f"the hub cache {cache_dir or hub_constants.HF_HUB_CACHE!r}"
        raise FileNotFoundError(
            f"{setting}={name!r} (subfolder {subfolder!r}): no diffusers AutoencoderKL "
            f"(config.json + diffusion_pytorch_model.safetensors) in {where}: {problem}. Accepted: a local "
            f"folder or a hub repo id already in the cache (ldm.autoencoder also takes "
            f"'{PIXEL_SPACE}' or '{PRECOMPUTED}'). "
            f"This machine never downloads: on a connected machine run `hf download REPO_ID` (e.g. "
            f"stabilityai/sd-vae-ft-mse), copy the folder it prints here and set {setting} to it, "
            f"or copy the whole hub cache and set the cache dir (ldm.cache_dir or HF_HUB_CACHE)"
        )
    return vae.eval().requires_grad_(False)


def check_conditioning(cfg: DiffusionConfig) -> str:
    """ldm.conditioning resolved ("" -> class or none by ldm.num_classes) and checked against the
    settings it needs; the error names the fields."""
    conditioning = cfg.conditioning or ("class" if cfg.num_classes else "none")
    if conditioning not in CONDITIONINGS:
        raise ValueError(f"ldm.conditioning: got {cfg.conditioning!r}, accepted: {', '.join(CONDITIONINGS)} "
                         f"(or empty: class when ldm.num_classes > 0, else none)")
    if (conditioning == "class") != (cfg.num_classes > 0):
        raise ValueError(f"ldm.conditioning={conditioning} with ldm.num_classes={cfg.num_classes}: class "
                         f"conditioning needs ldm.num_classes > 0, and the others ldm.num_classes=0")
    if conditioning == "text":
        if cfg.backbone != "dit":
            raise ValueError(f"ldm.conditioning=text trains a cross-attention DiT (PixArtTransformer2DModel): set "
                             f"ldm.backbone=dit (got {cfg.backbone!r})")
        if not cfg.text_encoder:
            raise ValueError("ldm.conditioning=text needs ldm.text_encoder: the local folder of a transformers CLIP "
                             "text model or T5 encoder")
        if not 0.0 <= cfg.caption_dropout < 1.0:
            raise ValueError(f"ldm.caption_dropout must be in [0, 1), got {cfg.caption_dropout}")
        if cfg.text_max_length < 1:
            raise ValueError(f"ldm.text_max_length must be >= 1, got {cfg.text_max_length}")
    elif cfg.text_encoder:
        raise ValueError(f"ldm.text_encoder={cfg.text_encoder!r} is read with ldm.conditioning=text only "
                         f"(conditioning is {conditioning})")
    return conditioning


def precomputed_text(cfg: DiffusionConfig, shards: str) -> PrecomputedText:
    """The text features stored with the shards at `shards`, checked against the config."""
    if not shards:
        raise ValueError(f"ldm.text_encoder={PRECOMPUTED_TEXT} reads the features stored with the train shards "
                         f"(data.train)")
    text = PrecomputedText(shards)
    if cfg.tokenizer:
        raise ValueError(f"ldm.tokenizer={cfg.tokenizer!r}: with ldm.text_encoder={PRECOMPUTED_TEXT} the shards "
                         f"hold features; no tokenizer runs")
    if cfg.text_max_length != text.max_length:
        raise ValueError(f"ldm.text_max_length={cfg.text_max_length}, but {text.index_path} holds features of up to "
                         f"{text.max_length} tokens (`latents encode --text-max-length`): set "
                         f"ldm.text_max_length={text.max_length}")
    return text


class DiffusionTask:
    """What the training loop needs from latent diffusion: the model, a per-sample loss, evaluation and export."""

    def __init__(self, cfg: DiffusionConfig, *, image_size: int, channels: int, text_shards: str = ""):
        """`image_size` and `channels` describe the decoded images. With autoencoder='latents' the
        shards hold latents: set cfg.sample_size and cfg.in_channels to their shape (index.json
        records `latent_shape`), or pass that shape here. With ldm.text_encoder=precomputed,
        `text_shards` is the train split whose shards hold the text features."""
        self.cfg = cfg
        for name, value, accepted in (("backbone", cfg.backbone, BACKBONES), ("objective", cfg.objective, OBJECTIVES),
                                      ("flow_weighting", cfg.flow_weighting, FLOW_WEIGHTINGS),
                                      ("dit", cfg.dit, DIT_PRESETS)):
            if value not in accepted:
                raise ValueError(f"ldm.{name}: got {value!r}, accepted: {', '.join(accepted)}")
        if not 0.0 <= cfg.label_dropout < 1.0:
            raise ValueError(f"ldm.label_dropout must be in [0, 1), got {cfg.label_dropout}")
        if cfg.objective == "flow" and (cfg.min_snr_gamma or cfg.timestep_sampling != "uniform"):
            raise ValueError(f"ldm.objective='flow' draws s from ldm.flow_weighting: it takes no ldm.min_snr_gamma "
                             f"(got {cfg.min_snr_gamma}) and ldm.timestep_sampling='uniform' only "
                             f"(got {cfg.timestep_sampling!r})")
        if cfg.prediction_type not in PREDICTION_TYPES:
            raise ValueError(
                f"ldm.prediction_type: got {cfg.prediction_type!r}, accepted: {', '.join(PREDICTION_TYPES)}"
            )
        if cfg.beta_schedule not in BETA_SCHEDULES:
            raise ValueError(
                f"ldm.beta_schedule: got {cfg.beta_schedule!r}, accepted: {', '.join(BETA_SCHEDULES)}"
            )
        if cfg.min_snr_gamma < 0:
            raise ValueError(f"ldm.min_snr_gamma must be >= 0 (0 = off), got {cfg.min_snr_gamma}")
        if cfg.timestep_sampling not in TIMESTEP_SAMPLING:
            raise ValueError(f"ldm.timestep_sampling: got {cfg.timestep_sampling!r}, accepted: "
                             f"{', '.join(TIMESTEP_SAMPLING)}")
        self.timestep_sampler = (LossSecondMomentSampler(cfg.num_train_timesteps)
                                 if cfg.timestep_sampling == "loss_second_moment" else None)
        if cfg.num_classes < 0:
            raise ValueError(f"ldm.num_classes must be >= 0 (0 = unconditional), got {cfg.num_classes}")
        self.conditioning = check_conditioning(cfg)
        bad_groups = [c for c in cfg.block_out_channels if c % cfg.norm_num_groups]
        if bad_groups and cfg.backbone == "unet":
            raise ValueError(
                f"ldm.norm_num_groups={cfg.norm_num_groups} must divide every ldm.block_out_channels "
                f"entry; it does not divide {bad_groups}"
            )

        # ---------------------------------------------------------------- the space we denoise in
        self.autoencoder: AutoencoderKL | None = None
        self.shift_factor = 0.0
        if cfg.autoencoder == PIXEL_SPACE:
            size, latent_channels = image_size, channels
            self.scaling_factor = cfg.scaling_factor or 1.0
        elif cfg.autoencoder == PRECOMPUTED:
            # the shards already hold (z - shift) * scale; the factor is only needed to decode samples
            size, latent_channels = image_size, channels
            self.scaling_factor = cfg.scaling_factor or None
        else:
            vae = self.autoencoder = load_autoencoder(cfg.autoencoder, cfg.vae_subfolder, cfg.cache_dir)
            if vae.config.in_channels != channels:
                raise ValueError(
                    f"ldm.autoencoder={cfg.autoencoder!r} encodes {vae.config.in_channels}-channel "
                    f"images but the data decodes to {channels} channels (data.channels)"
                )
            size = image_size // 2 ** (len(vae.config.block_out_channels) - 1)
            latent_channels = vae.config.latent_channels
            self.scaling_factor = cfg.scaling_factor or float(vae.config.scaling_factor)
            self.shift_factor = float(getattr(vae.config, "shift_factor", None) or 0.0)
        self.sample_size = cfg.sample_size or size
        self.in_channels = cfg.in_channels or latent_channels
        downsampling = 2 ** (len(cfg.block_out_channels) - 1)
        if self.sample_size % downsampling and cfg.backbone == "unet":
            raise ValueError(
                f"ldm.sample_size={self.sample_size} must be a multiple of {downsampling} "
                f"(2 ** (len(ldm.block_out_channels) - 1))"
            )

        # ---------------------------------------------------------------- model and schedule
        self.text_encoder: TextEncoder | PrecomputedText | None = None
        if self.conditioning == "text" and cfg.text_encoder == PRECOMPUTED_TEXT:
            self.text_encoder = precomputed_text(cfg, text_shards)
        elif self.conditioning == "text":
            self.text_encoder = TextEncoder(cfg.text_encoder, cfg.tokenizer, cfg.text_max_length)
        self.model = build_text_dit(
            cfg.dit, sample_size=self.sample_size, in_channels=self.in_channels,
            caption_channels=self.text_encoder.hidden_size, depth=cfg.dit_depth, width=cfg.dit_width,
            heads=cfg.dit_heads, patch_size=cfg.dit_patch_size,
        ) if self.text_encoder is not None else build_dit(
            cfg.dit, sample_size=self.sample_size, in_channels=self.in_channels, num_classes=cfg.num_classes,
            depth=cfg.dit_depth, width=cfg.dit_width, heads=cfg.dit_heads, patch_size=cfg.dit_patch_size,
        ) if cfg.backbone == "dit" else UNet2DModel(
            sample_size=self.sample_size,
            in_channels=self.in_channels,
            out_channels=self.in_channels,
            block_out_channels=tuple(cfg.block_out_channels),
            layers_per_block=cfg.layers_per_block,
            down_block_types=tuple(cfg.down_block_types),
            up_block_types=tuple(cfg.up_block_types),
            norm_num_groups=cfg.norm_num_groups,
            num_class_embeds=cfg.num_classes + 1 if cfg.num_classes else None,  # +1: the null class
        )
        # flow: the scheduler only records how to sample (timestep = s * T, as in training)
        self.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=cfg.num_train_timesteps) \
            if cfg.objective == "flow" else DDPMScheduler(
            num_train_timesteps=cfg.num_train_timesteps,
            beta_schedule=cfg.beta_schedule,
            prediction_type=cfg.prediction_type,
            # x0 clipping to [-1, 1] suits pixels only; scaled latents are not bounded by 1
            clip_sample=cfg.autoencoder == PIXEL_SPACE,
        )

    # ---------------------------------------------------------------- latents
    @torch.no_grad()
    def encode(self, images: torch.Tensor, draws: SampleDraws | None = None) -> torch.Tensor:
        """Images [B, C, H, W] in [-1, 1] -> what the UNet denoises: (z - shift) * scale, z a VAE
        posterior sample mean + std * draws.randn (the mean when no draws); images as they are otherwise."""
        if self.autoencoder is None:
            return images * self.scaling_factor if self.cfg.autoencoder == PIXEL_SPACE else images
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
    def reads_captions(self) -> bool:
        """Whether batches must carry captions (the `txt` field) for the encoder; the stream's decoder reads them."""
        return isinstance(self.text_encoder, TextEncoder)

    @property
    def text_features(self) -> tuple[int, int]:
        """(width, max tokens) of the precomputed text features batches must carry (text.npy), else (0, 0)."""
        if isinstance(self.text_encoder, PrecomputedText):
            return self.text_encoder.width, self.text_encoder.max_length
        return 0, 0

    @property
    def text_identity(self) -> str:
        """The text encoder's files and caption length (whoever ran it), "" without text: every rank
        must hold the same, and a resume checks it is unchanged."""
        return identity_key(self.text_encoder.identity()) if self.text_encoder is not None else ""

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
        each caption replaced by the empty caption's features with probability ldm.caption_dropout, once
        per sample from its draws, here at train time (never when features are precomputed: that would
        fix which samples are unconditional for good and make a pruner's scores incomparable)."""
        if self.text_encoder is None:
            return self.training_labels(batch.labels.to(device), draws), None
        if self.cfg.caption_dropout <= 0:
            return self._text_condition(batch, device, None), None
        dropped = caption_dropped(draws, self.cfg.caption_dropout, device)
        return self._text_condition(batch, device, dropped), dropped

    def class_labels(self, labels: torch.Tensor) -> torch.Tensor | None:
        """Labels for the model: None when unconditional (a DiT then gets the null label); -1 (no
        label) becomes the null class. Labels on the host are range-checked here; labels on a device
        were checked by the stream's decoder (reading them back would make the step wait)."""
        if not self.cfg.num_classes:
            return None
        if labels.device.type == "cpu" and bool((labels >= self.cfg.num_classes).any()):
            raise ValueError(
                f"label {int(labels.max())} is out of range for ldm.num_classes={self.cfg.num_classes}"
            )
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
        gamma = self.cfg.min_snr_gamma
        if self.cfg.prediction_type == "epsilon":
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
        return self.text_encoder is not None and self.cfg.caption_dropout > 0

    def _stratum(self, timestep_stratum: torch.Tensor, dropped: torch.Tensor | None) -> torch.Tensor:
        if dropped is None:
            return timestep_stratum
        return timestep_stratum + dropped.long() * self.cfg.num_train_timesteps

    def per_sample_loss(self, model: nn.Module, batch, generator: torch.Generator | SampleDraws) -> torch.Tensor:
        """`per_sample(...).loss`."""
        return self.per_sample(model, batch, generator).loss

    def per_sample(self, model: nn.Module, batch, generator: torch.Generator | SampleDraws) -> SampleLosses:
        """[B] float32 denoising MSE over all non-batch dims, min-SNR weighted when configured, with
        each sample's timestep as its stratum. With importance-sampled timesteps the loss is also
        weighted 1 / (T p_t) and the score (what the pruner and the sampler see) is the loss without it.
        Flow: the velocity MSE at the sample's s, its bucket of s as the stratum.

        Draws from `generator` (a torch.Generator, or per-sample draws such as
        pipelines.tasks.randomness.SampleRandomness) in this order: the VAE posterior noise (VAE runs
        only), the noise [B, C, h, w], the timesteps or s [B], the label or caption drop [B]
        (class-conditional with label_dropout > 0, text-conditional with caption_dropout > 0). `model` may be a DDP/accelerate wrapper: always call the one passed.
        """
        draws = batch_draws(generator, len(batch.images))
        x0 = self.encode(batch.images, draws)
        if x0.shape[1] != self.in_channels:
            raise ValueError(
                f"the batch holds {x0.shape[1]}-channel inputs but the UNet takes {self.in_channels} "
                f"(ldm.in_channels); with autoencoder='{PRECOMPUTED}' set ldm.in_channels and "
                f"ldm.sample_size to the latent_shape recorded in the latent shards' index.json"
            )
        device = x0.device
        noise = draws.randn(*x0.shape[1:]).to(device)
        cfg = self.cfg
        if cfg.objective == "flow":
            s = draw_s(draws, cfg.flow_weighting, logit_mean=cfg.flow_logit_mean, logit_std=cfg.flow_logit_std,
                       mode_scale=cfg.flow_mode_scale, device=device)
            condition, dropped = self.training_condition(batch, draws, device)
            losses = self._flow_mse(model, x0, noise, s, condition)
            return SampleLosses(losses, self._stratum(s_stratum(s, cfg.num_train_timesteps), dropped))
        if self.timestep_sampler is None:
            timesteps, importance = draws.randint(cfg.num_train_timesteps).to(device), None
        else:
            timesteps, importance = self.timestep_sampler.draw(draws.rand().to(device))
        condition, dropped = self.training_condition(batch, draws, device)
        losses = self._denoising_mse(model, x0, noise, timesteps, condition)
        if self.cfg.min_snr_gamma > 0:
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
        if self.cfg.prediction_type == "epsilon":
            target = noise
        else:
            target = self.scheduler.get_velocity(x0, noise, timesteps)
        return _mse(predict(model, noisy, timesteps, labels), target)

    def _flow_mse(self, model, x0, noise, s, labels) -> torch.Tensor:
        """Velocity MSE [B] at s [B]; the model sees timestep s * T, as the Euler sampler feeds it."""
        x_s, velocity = interpolate(x0, noise, s)
        return _mse(predict(model, x_s, s * self.cfg.num_train_timesteps, labels), velocity)

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
    def export(self, model: nn.Module, ema_model, out_dir: str) -> list[str]:
        """Write unet/ (DiT: transformer/), and unet_ema/ (transformer_ema/) when an EMA is given,
        with save_pretrained; scheduler/ (DDPMScheduler, or FlowMatchEulerDiscreteScheduler for flow);
        autoencoder.json: how samples map back to images (a reference to the VAE, not a copy)."""
        os.makedirs(out_dir, exist_ok=True)
        written = []
        name = MODEL_FOLDERS[self.cfg.backbone]
        model_dir = os.path.join(out_dir, name)
        unwrap(model).save_pretrained(model_dir)
        written.append(model_dir)
        if ema_model is not None:
            ema_dir = os.path.join(out_dir, f"{name}_ema")
            weights_module(ema_model, model).save_pretrained(ema_dir)
            written.append(ema_dir)
        scheduler_dir = os.path.join(out_dir, "scheduler")
        self.scheduler.save_pretrained(scheduler_dir)
        written.append(scheduler_dir)
        info = {
            "autoencoder": self.cfg.autoencoder,
            "vae_subfolder": self.cfg.vae_subfolder,
            "cache_dir": self.cfg.cache_dir,
            "scaling_factor": self.scaling_factor,
            "shift_factor": self.shift_factor,
        }
        info_path = os.path.join(out_dir, AUTOENCODER_INFO)
        with open(info_path, "w") as f:
            json.dump(info, f, indent=1)
        written.append(info_path)
        if self.text_encoder is not None:
            text_path = os.path.join(out_dir, TEXT_ENCODER_INFO)
            with open(text_path, "w") as f:
                json.dump(self.text_encoder.identity(), f, indent=1)
            written.append(text_path)
        return written


def _mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B] float32 MSE over all non-batch dims."""
    return (pred.float() - target.float()).pow(2).flatten(1).mean(dim=1)


# -------------------------------------------------------------------- sampling from an export
def _load_model(export_dir: str, ema: bool) -> UNet2DModel | DiTTransformer2DModel | PixArtTransformer2DModel:
    """The export's unet/ or transformer/ (their _ema/ twins with `ema`): a transformer/ is a DiT, or a
    PixArt transformer where text_encoder.json says the run was text-conditional."""
    dit = os.path.isdir(os.path.join(export_dir, MODEL_FOLDERS["dit"] + ("_ema" if ema else "")))
    subfolder = MODEL_FOLDERS["dit" if dit else "unet"] + ("_ema" if ema else "")
    if not os.path.isdir(os.path.join(export_dir, subfolder)):
        raise FileNotFoundError(
            f"{export_dir}: no {subfolder}/ (written by DiffusionTask.export"
            + ("; the run kept no EMA, pass ema=False)" if ema else ")")
        )
    text = os.path.exists(os.path.join(export_dir, TEXT_ENCODER_INFO))
    model_class = (PixArtTransformer2DModel if text else DiTTransformer2DModel) if dit else UNet2DModel
    return model_class.from_pretrained(export_dir, subfolder=subfolder)


def _null_label(model: UNet2DModel | DiTTransformer2DModel) -> int | None:
    """The null label of a class-conditional model, None for an unconditional UNet."""
    if isinstance(model, PixArtTransformer2DModel):
        return None
    if isinstance(model, DiTTransformer2DModel):
        return dit_null_label(model)
    return model.config.num_class_embeds - 1 if model.config.num_class_embeds else None


def load_pipeline(export_dir: str, ema: bool = True) -> DDPMPipeline:
    """A diffusers DDPMPipeline for an unconditional pixel-space export; `sample` covers the rest."""
    with open(os.path.join(export_dir, AUTOENCODER_INFO)) as f:
        info = json.load(f)
    unet = _load_model(export_dir, ema)
    if not isinstance(unet, UNet2DModel):
        raise ValueError(f"{export_dir}: holds a DiT (transformer/); DDPMPipeline samples UNets: use sample()")
    if info["autoencoder"] != PIXEL_SPACE or unet.config.num_class_embeds:
        raise ValueError(
            f"{export_dir}: DDPMPipeline samples unconditional pixel-space models only; this export has "
            f"autoencoder={info['autoencoder']!r}, num_class_embeds={unet.config.num_class_embeds}: use sample()"
        )
    return DDPMPipeline(unet=unet, scheduler=DDPMScheduler.from_pretrained(export_dir, subfolder="scheduler"))


@torch.no_grad()
def sample(
    export_dir: str,
    num_images: int,
    steps: int,
    generator: torch.Generator,
    *,
    ema: bool = True,
    class_labels: torch.Tensor | None = None,
    vae: str | None = None,
    vae_subfolder: str = "",
    guidance_scale: float = 1.0,
    prompts: list[str] | None = None,
    text_encoder: str | None = None,
) -> torch.Tensor:
    """[num_images, C, H, W] float images in [0, 1] from an export: DDIM (eta 0), or Euler for flow,
    over `steps` steps from torch.randn(generator), then the VAE decoder for latent runs. Runs on
    generator.device. The same loop as the FID evaluator's (pipelines/tasks/sampler.py).

    class_labels [N] for class-conditional models (default: the null class), with classifier-free
    guidance when guidance_scale != 1. Text-conditional models take `prompts` (one per image; the
    empty caption when None), guided against the empty caption's features, encoded by the encoder
    text_encoder.json records or by `text_encoder` (a folder; its tokenizer beside it). `vae` overrides the
    autoencoder recorded in autoencoder.json (with `vae_subfolder`); runs on precomputed latents
    must pass it (the latent shards' index.json records "vae" and "subfolder").
    """
    with open(os.path.join(export_dir, AUTOENCODER_INFO)) as f:
        info = json.load(f)
    device = generator.device
    model = _load_model(export_dir, ema).to(device)
    config = DDPMScheduler.load_config(export_dir, subfolder="scheduler")
    scheduler = sampling_scheduler(config.get("_class_name", ""), config)
    labels, null = None, _null_label(model)
    if isinstance(model, PixArtTransformer2DModel):
        encoder = load_text_encoder(export_dir, text_encoder)
        labels = encoder.encode([""] * num_images if prompts is None else list(prompts), device)
        if len(labels) != num_images:
            raise ValueError(f"prompts: {len(labels)} given for num_images={num_images}")
        null = encoder.null(device)
    elif null is not None and (null > 0 or isinstance(model, UNet2DModel)):  # a DiT of 0 classes is unconditional
        labels = torch.full((num_images,), null, dtype=torch.long) if class_labels is None else class_labels.long()
        labels = torch.where(labels < 0, torch.full_like(labels, null), labels).to(device)
    size = model.config.sample_size
    shape = (num_images, model.config.in_channels, *((size, size) if isinstance(size, int) else size))
    x = torch.randn(shape, generator=generator, device=device)
    x = denoise(model, x, scheduler, steps, labels, null_label=null, guidance_scale=guidance_scale)

    autoencoder = _export_autoencoder(export_dir, info, vae, vae_subfolder)
    if autoencoder is None:
        images = x / (info["scaling_factor"] or 1.0)
    else:
        autoencoder.to(device)
        scale = info["scaling_factor"] or float(autoencoder.config.scaling_factor)
        shift = float(info.get("shift_factor") or getattr(autoencoder.config, "shift_factor", None) or 0.0)
        images = autoencoder.decode(x / scale + shift).sample
    return (images / 2 + 0.5).clamp(0, 1).float()


def _export_autoencoder(export_dir: str, info: dict, vae: str | None, vae_subfolder: str) -> AutoencoderKL | None:
    """The VAE that decodes an export's samples: autoencoder.json's (`info`) or `vae` (with
    `vae_subfolder`); None in pixel space. Runs on precomputed latents must name it."""
    name = vae or info["autoencoder"]
    if name == PIXEL_SPACE:
        return None
    if name == PRECOMPUTED:
        raise ValueError(
            f"{export_dir}: this run trained on precomputed latents; pass vae= (the folder or repo id "
            f"that encoded them, recorded as 'vae' in the latent shards' index.json) to decode samples"
        )
    return load_autoencoder(name, info["vae_subfolder"] if vae is None else vae_subfolder, info.get("cache_dir", ""))


def pixart_pipeline(export_dir: str, *, ema: bool = True, vae: str | None = None, vae_subfolder: str = "",
                    text_encoder: str | None = None):
    """diffusers' PixArtAlphaPipeline assembled from a text-conditional DDPM export: its transformer,
    the text encoder and tokenizer text_encoder.json records (digest checked), the VAE (autoencoder.json's,
    or `vae` for runs on precomputed latents) and a DDIM scheduler from its scheduler/. Call it with
    `max_sequence_length=` the run's text length, `use_resolution_binning=False` and `clean_caption=False`
    (the run saw the captions as written). Flow exports are refused: the pipeline calls the scheduler's
    scale_model_input, which FlowMatchEulerDiscreteScheduler lacks; `sample()` samples them."""
    from diffusers import DDIMScheduler, PixArtAlphaPipeline

    class CaptionsAsWritten(PixArtAlphaPipeline):
        """PixArtAlphaPipeline lowercases every prompt, clean_caption=False included (diffusers 0.42), and
        T5's tokenizer is case-sensitive: the run trained on captions as written, stripped only."""

        def _text_preprocessing(self, text, clean_caption=False):
            if clean_caption:
                return super()._text_preprocessing(text, clean_caption)
            return [t.strip() for t in (text if isinstance(text, (tuple, list)) else [text])]

    if not os.path.exists(os.path.join(export_dir, TEXT_ENCODER_INFO)):
        raise ValueError(f"{export_dir}: no {TEXT_ENCODER_INFO}: PixArtAlphaPipeline loads text-conditional runs only")
    config = DDPMScheduler.load_config(export_dir, subfolder="scheduler")
    if config.get("_class_name") == FLOW_SCHEDULER:
        raise ValueError(f"{export_dir}: a flow-matching run; PixArtAlphaPipeline calls scheduler.scale_model_input, "
                         f"which {FLOW_SCHEDULER} does not have: sample it with prunepipe's sample()")
    with open(os.path.join(export_dir, AUTOENCODER_INFO)) as f:
        info = json.load(f)
    autoencoder = _export_autoencoder(export_dir, info, vae, vae_subfolder)
    if autoencoder is None:
        raise ValueError(f"{export_dir}: PixArtAlphaPipeline decodes latents with a VAE; this run trained in pixel "
                         f"space")
    if float(getattr(autoencoder.config, "shift_factor", None) or 0.0) or (
            info["scaling_factor"] and info["scaling_factor"] != autoencoder.config.scaling_factor):
        raise ValueError(f"{export_dir}: the pipeline decodes latents / vae.config.scaling_factor; this run's latents "
                         f"were scaled otherwise (scaling {info['scaling_factor']}, shift {info['shift_factor']})")
    encoder = load_text_encoder(export_dir, text_encoder)
    return CaptionsAsWritten(tokenizer=encoder.tokenizer, text_encoder=encoder.model, vae=autoencoder,
                               transformer=_load_model(export_dir, ema),
                               scheduler=DDIMScheduler.from_config(config))


def load_text_encoder(export_dir: str, path: str | None = None) -> TextEncoder:
    """The text encoder text_encoder.json records (or the folder `path`, its tokenizer beside it), refused
    when its files differ from the run's (the digest of TextEncoder.identity): other features, other images."""
    with open(os.path.join(export_dir, TEXT_ENCODER_INFO)) as f:
        info = json.load(f)
    encoder = TextEncoder(path or info["text_encoder"], "" if path else info["tokenizer"], info["max_length"],
                          setting=f"{TEXT_ENCODER_INFO} text_encoder" if path is None else "text_encoder")
    found = encoder.identity()["digest"]
    if found != info["digest"]:
        raise ValueError(f"{export_dir}/{TEXT_ENCODER_INFO}: the run's text encoder had digest {info['digest']}, "
                         f"the one at {encoder.path!r} has {found} (another model or tokenizer): pass "
                         f"text_encoder= the folder the run used")
    return encoder
