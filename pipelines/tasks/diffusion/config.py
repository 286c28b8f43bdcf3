"""The `ldm:` section: backbone, objective, conditioning, noise schedule, loss and autoencoder settings,
and the one check of them (`check_config`), run by the run config and by the task alike. Reads no file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelines.tasks.diffusion.dit import DIT_PRESETS
from pipelines.tasks.diffusion.flow import FLOW_WEIGHTINGS
from pipelines.tasks.diffusion.timesteps import TIMESTEP_SAMPLING

BACKBONES = ("unet", "dit")
OBJECTIVES = ("ddpm", "flow")
PREDICTION_TYPES = ("epsilon", "v_prediction")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid")
PIXEL_SPACE, PRECOMPUTED = "identity", "latents"
CONDITIONINGS = ("none", "class", "text")
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
    # none | class | text; "" = class when num_classes > 0, else none
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


def check_config(cfg: DiffusionConfig) -> str:
    """Every ldm setting checked against its accepted values and the settings it needs; returns
    ldm.conditioning resolved ("" -> class or none by ldm.num_classes). Errors name the fields."""
    for name, value, accepted in (("backbone", cfg.backbone, BACKBONES), ("objective", cfg.objective, OBJECTIVES),
                                  ("flow_weighting", cfg.flow_weighting, FLOW_WEIGHTINGS),
                                  ("dit", cfg.dit, DIT_PRESETS), ("prediction_type", cfg.prediction_type,
                                                                   PREDICTION_TYPES),
                                  ("beta_schedule", cfg.beta_schedule, BETA_SCHEDULES),
                                  ("timestep_sampling", cfg.timestep_sampling, TIMESTEP_SAMPLING)):
        if value not in accepted:
            raise ValueError(f"ldm.{name}: got {value!r}, accepted: {', '.join(accepted)}")
    if not 0.0 <= cfg.label_dropout < 1.0:
        raise ValueError(f"ldm.label_dropout must be in [0, 1), got {cfg.label_dropout}")
    if cfg.objective == "flow" and (cfg.min_snr_gamma or cfg.timestep_sampling != "uniform"):
        raise ValueError(f"ldm.objective='flow' draws s from ldm.flow_weighting: it takes no ldm.min_snr_gamma "
                         f"(got {cfg.min_snr_gamma}) and ldm.timestep_sampling='uniform' only "
                         f"(got {cfg.timestep_sampling!r})")
    if cfg.min_snr_gamma < 0:
        raise ValueError(f"ldm.min_snr_gamma must be >= 0 (0 = off), got {cfg.min_snr_gamma}")
    if cfg.num_classes < 0:
        raise ValueError(f"ldm.num_classes must be >= 0 (0 = unconditional), got {cfg.num_classes}")
    bad_groups = [c for c in cfg.block_out_channels if c % cfg.norm_num_groups]
    if bad_groups and cfg.backbone == "unet":
        raise ValueError(f"ldm.norm_num_groups={cfg.norm_num_groups} must divide every ldm.block_out_channels "
                         f"entry; it does not divide {bad_groups}")
    return _checked_conditioning(cfg)


def _checked_conditioning(cfg: DiffusionConfig) -> str:
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


