"""The denoising backbones by name, as DiT's `DiT_models`: ldm.backbone (and the conditioning) -> a builder
of the module the task trains. Each builder takes the `ldm:` section and the input the task worked out
(the base latent side, the channels, the text features' width); a new backbone is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn
from diffusers import UNet2DModel

from prunepipe.pipelines.tasks.diffusion.config import DiffusionConfig
from prunepipe.pipelines.tasks.diffusion.dit import build_dit
from prunepipe.pipelines.tasks.diffusion.pixart import build_text_dit


@dataclass(frozen=True)
class BackboneInput:
    """What a backbone is built for: the square base side it is built at and the channels it denoises,
    and for a text-conditional one the width of the text features it reads (0 otherwise)."""

    sample_size: int
    in_channels: int
    caption_channels: int = 0


def build_unet(cfg: DiffusionConfig, shape: BackboneInput) -> nn.Module:
    """diffusers' UNet2DModel of ldm.unet; class-conditional through a class embedding with a null class."""
    return UNet2DModel(
        sample_size=shape.sample_size,
        in_channels=shape.in_channels,
        out_channels=shape.in_channels,
        block_out_channels=tuple(cfg.unet.block_out_channels),
        layers_per_block=cfg.unet.layers_per_block,
        down_block_types=tuple(cfg.unet.down_block_types),
        up_block_types=tuple(cfg.unet.up_block_types),
        norm_num_groups=cfg.unet.norm_num_groups,
        num_class_embeds=cfg.num_classes + 1 if cfg.num_classes else None,  # +1: the null class
    )


def _transformer_sizes(cfg: DiffusionConfig, shape: BackboneInput) -> dict:
    """What both transformers take from ldm.dit and the input's shape."""
    return {
        "sample_size": shape.sample_size,
        "in_channels": shape.in_channels,
        "depth": cfg.dit.depth,
        "width": cfg.dit.width,
        "heads": cfg.dit.heads,
        "patch_size": cfg.dit.patch_size,
    }


def build_class_dit(cfg: DiffusionConfig, shape: BackboneInput) -> nn.Module:
    """The DiT of ldm.dit.preset (dit.py), unconditional or class-conditional."""
    return build_dit(cfg.dit.preset, num_classes=cfg.num_classes, **_transformer_sizes(cfg, shape))


def build_text_conditional_dit(cfg: DiffusionConfig, shape: BackboneInput) -> nn.Module:
    """The PixArt transformer at ldm.dit.preset's size (pixart.py), reading the text features."""
    return build_text_dit(
        cfg.dit.preset,
        caption_channels=shape.caption_channels,
        size_conditions=cfg.dit.size_conditions,
        **_transformer_sizes(cfg, shape),
    )


BACKBONES: dict[str, Callable[[DiffusionConfig, BackboneInput], nn.Module]] = {
    "unet": build_unet,
    "dit": build_class_dit,
    "text_dit": build_text_conditional_dit,
}


def backbone_name(cfg: DiffusionConfig, text_conditional: bool) -> str:
    """The BACKBONES entry of a config: ldm.backbone, its text-conditional form where captions condition it
    (the config's check accepts text with backbone=dit only)."""
    return f"text_{cfg.backbone}" if text_conditional else cfg.backbone


def build_backbone(cfg: DiffusionConfig, shape: BackboneInput, text_conditional: bool) -> nn.Module:
    """The module the task trains, by its name in BACKBONES."""
    name = backbone_name(cfg, text_conditional)
    if name not in BACKBONES:
        raise ValueError(f"ldm.backbone={cfg.backbone!r}: no backbone {name!r}; accepted: {', '.join(BACKBONES)}")
    return BACKBONES[name](cfg, shape)
