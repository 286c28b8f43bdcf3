"""The `ldm:` section: backbone, objective, conditioning, noise schedule, loss and autoencoder settings,
and the one check of them (`check_config`), run by the run config and by the task alike. Reads no file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from prunepipe.pipelines.config_schema import ConfigError, check_choices, check_ranges


@dataclass
class UNetSettings:
    """ldm.unet: the UNet2DModel of backbone=unet."""

    block_out_channels: list[int] = field(default_factory=lambda: [32, 64])
    layers_per_block: int = 1
    down_block_types: list[str] = field(default_factory=lambda: ["DownBlock2D", "AttnDownBlock2D"])
    up_block_types: list[str] = field(default_factory=lambda: ["AttnUpBlock2D", "UpBlock2D"])
    norm_num_groups: int = 8


@dataclass
class DiTSettings:
    """ldm.dit.preset: the DiT of backbone=dit, a preset (DiT-S/2, B/2, L/2, XL/2; /4 and /8 too) whose numbers
    the others override when > 0."""

    # dit.py's DIT_PRESETS: S, B, L, XL (Table 1 of the paper) and 8B (~8.2 B parameters) at patch 2, 4 or 8
    preset: Literal[
        "DiT-S/2", "DiT-S/4", "DiT-S/8", "DiT-B/2", "DiT-B/4", "DiT-B/8",
        "DiT-L/2", "DiT-L/4", "DiT-L/8", "DiT-XL/2", "DiT-XL/4", "DiT-XL/8",
        "DiT-8B/2", "DiT-8B/4", "DiT-8B/8",
    ] = "DiT-S/2"  # fmt: skip
    depth: int = 0
    width: int = 0
    heads: int = 0
    patch_size: int = 0
    # conditioning=text: PixArt-alpha's size conditions, each batch's image (H, W) and H / W embedded beside
    # the timestep (use_additional_conditions; pixart.py's SizeConditions); the width must be a multiple of 3
    size_conditions: bool = False


@dataclass
class TextSettings:
    """ldm.text: the text encoder of conditioning=text."""

    # encoder: each caption encoded in the loop by ldm.text.encoder | precomputed: the shards hold its
    # features (`prunepipe latents encode --text-encoder`); no encoder is loaded
    features: Literal["encoder", "precomputed"] = "encoder"
    # features=encoder: the local folder of a transformers CLIP text model or T5 encoder (frozen; never downloaded)
    encoder: str = ""
    tokenizer: str = ""  # its tokenizer's folder; "" = the encoder's
    max_length: int = 77  # tokens per caption (CLIP 77; PixArt-alpha's T5 120)
    # the encoder's weights: auto = bfloat16 on CUDA (T5-XXL 9.5 GB on every GPU instead of 19), float32 on a CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    caption_dropout: float = 0.1  # share of samples trained on the empty caption's features (PixArt, Sana)


@dataclass
class FlowSettings:
    """ldm.flow: objective=flow's density of s (diffusers' compute_density_for_timestep_sampling)."""

    weighting: Literal["logit_normal", "uniform", "mode"] = "logit_normal"  # flow.py's FLOW_WEIGHTINGS
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29


@dataclass
class DDPMSettings:
    """ldm.ddpm: objective=ddpm's noise schedule, target and loss weighting."""

    beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid"] = "squaredcos_cap_v2"
    prediction_type: Literal["epsilon", "v_prediction"] = "epsilon"
    min_snr_gamma: float = 0.0  # 0 = off; 5.0 is the paper's choice
    # uniform | loss_second_moment: importance-sample t by sqrt(E[loss_t^2]), loss weighted 1/(T p_t)
    # (improved-diffusion's LossSecondMomentResampler; timesteps.py)
    timestep_sampling: Literal["uniform", "loss_second_moment"] = "uniform"


@dataclass
class DiffusionConfig:
    """The ldm: section. The backbone, objective and conditioning choose which group is read; 0 = derive
    from the data."""

    backbone: Literal["unet", "dit"] = "unet"  # unet (ldm.unet) | dit (DiTTransformer2DModel, ldm.dit.preset)
    objective: Literal["ddpm", "flow"] = "ddpm"  # ddpm (DDPMScheduler, ldm.ddpm) | flow (v = noise - x0, ldm.flow)
    # text: ldm.text; "" = class when num_classes > 0, else none
    conditioning: Literal["none", "class", "text", ""] = ""
    num_classes: int = 0  # > 0: class-conditional; label -1 maps to an extra "null" class (index num_classes)
    label_dropout: float = 0.1  # class-conditional: share of samples trained on the null label (guidance)
    sample_size: int = 0  # the model's input size; 0 = image size, or image size / VAE downsampling
    in_channels: int = 0  # 0 = image channels, or the VAE's latent channels
    num_train_timesteps: int = 1000  # T (flow: the timestep the model sees is s * T)
    # pixel: denoise the images | latents: the shards hold scaled latents (`prunepipe latents encode`) |
    # vae: the images encoded in the loop by the AutoencoderKL at ldm.vae
    space: Literal["pixel", "latents", "vae"] = "pixel"
    vae: str = ""  # space=vae: a local folder or hub repo id of a diffusers AutoencoderKL (local_files_only=True)
    vae_subfolder: str = ""  # e.g. "vae" inside a Stable Diffusion repo
    scaling_factor: float = 0.0  # 0 = the VAE's config.scaling_factor (1.0 in pixel space)
    cache_dir: str = ""  # hub cache holding ldm.vae; "" = HF_HUB_CACHE as read at import
    unet: UNetSettings = field(default_factory=UNetSettings)
    dit: DiTSettings = field(default_factory=DiTSettings)
    text: TextSettings = field(default_factory=TextSettings)
    flow: FlowSettings = field(default_factory=FlowSettings)
    ddpm: DDPMSettings = field(default_factory=DDPMSettings)


RANGES = {
    "label_dropout": "[0, 1)",
    "num_classes": (">= 0", "0 = unconditional"),
    "ddpm.min_snr_gamma": (">= 0", "0 = off"),
    "text.caption_dropout": "[0, 1)",
    "text.max_length": ">= 1",
}


def check_config(cfg: DiffusionConfig) -> str:
    """Every ldm setting checked against its accepted values and the settings it needs; returns
    ldm.conditioning resolved ("" -> class or none by ldm.num_classes). Errors (ConfigError) name the fields."""
    check_choices(cfg, "ldm.")
    check_ranges(cfg, RANGES, "ldm.")
    if cfg.objective == "flow" and (cfg.ddpm.min_snr_gamma or cfg.ddpm.timestep_sampling != "uniform"):
        raise ConfigError(
            f"config: ldm.objective='flow' draws s from ldm.flow.weighting: it takes no ldm.ddpm.min_snr_gamma "
            f"(got {cfg.ddpm.min_snr_gamma}) and ldm.ddpm.timestep_sampling='uniform' only "
            f"(got {cfg.ddpm.timestep_sampling!r})"
        )
    bad_groups = [c for c in cfg.unet.block_out_channels if c % cfg.unet.norm_num_groups]
    if bad_groups and cfg.backbone == "unet":
        raise ConfigError(
            f"config: ldm.unet.norm_num_groups={cfg.unet.norm_num_groups} must divide every "
            f"ldm.unet.block_out_channels entry; it does not divide {bad_groups}"
        )
    if (cfg.space == "vae") != bool(cfg.vae):
        raise ConfigError(
            f"config: ldm.space={cfg.space} with ldm.vae={cfg.vae!r}: ldm.space=vae encodes the images with the "
            f"AutoencoderKL at ldm.vae (a local folder or hub repo id), and the other spaces read no ldm.vae"
        )
    return _checked_conditioning(cfg)


def resolved_conditioning(cfg: DiffusionConfig) -> str:
    """ldm.conditioning, "" resolved: class when ldm.num_classes > 0, else none."""
    return cfg.conditioning or ("class" if cfg.num_classes else "none")


def _checked_conditioning(cfg: DiffusionConfig) -> str:
    conditioning = resolved_conditioning(cfg)
    if (conditioning == "class") != (cfg.num_classes > 0):
        raise ConfigError(
            f"config: ldm.conditioning={conditioning} with ldm.num_classes={cfg.num_classes}: class "
            f"conditioning needs ldm.num_classes > 0, and the others ldm.num_classes=0"
        )
    if conditioning == "text":
        if cfg.backbone != "dit":
            raise ConfigError(
                f"config: ldm.conditioning=text trains a cross-attention DiT (PixArtTransformer2DModel): set "
                f"ldm.backbone=dit (got {cfg.backbone!r})"
            )
        if cfg.text.features == "encoder" and not cfg.text.encoder:
            raise ConfigError(
                "config: ldm.conditioning=text needs ldm.text.encoder: the local folder of a transformers CLIP "
                "text model or T5 encoder (or ldm.text.features=precomputed: the shards hold its features)"
            )
        if cfg.text.features == "precomputed" and cfg.text.encoder:
            raise ConfigError(
                f"config: ldm.text.features=precomputed reads the features stored with the shards and loads no "
                f"encoder: drop ldm.text.encoder={cfg.text.encoder!r}"
            )
    elif cfg.dit.size_conditions:
        raise ConfigError(
            f"config: ldm.dit.size_conditions embeds each batch's image size as PixArt-alpha does, in the "
            f"text-conditional PixArt transformer (ldm.conditioning=text, ldm.backbone=dit); the "
            f"{cfg.backbone} backbone of conditioning {conditioning} has no such embedding (set "
            f"ldm.dit.size_conditions=false)"
        )
    elif cfg.text.encoder or cfg.text.features != "encoder":
        raise ConfigError(
            f"config: ldm.text.encoder={cfg.text.encoder!r}, ldm.text.features={cfg.text.features} are read with "
            f"ldm.conditioning=text only (conditioning is {conditioning})"
        )
    return conditioning
