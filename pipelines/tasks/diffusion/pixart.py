"""The text-conditional DiT: diffusers' PixArtTransformer2DModel (PixArt-alpha, Chen et al. 2023, arXiv
2310.00426): DiT blocks with one shared adaLN-single timestep modulation and a cross-attention to the
caption's token features under the caption mask. The smallest step from DiTTransformer2DModel, sized by
the same presets (pipelines/tasks/dit.py). It builds and calls the model; it never draws random numbers.

PixArt-alpha's own choices not taken here: it predicts a learned variance (out_channels = 2 C) and
conditions on resolution and aspect ratio at 1024 px; this trains epsilon / v / velocity at one size.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers import PixArtTransformer2DModel

from prunepipe.pipelines.tasks.diffusion.dit import transformer_shape


def build_text_dit(
    preset: str,
    *,
    sample_size: int,
    in_channels: int,
    caption_channels: int,
    depth: int = 0,
    width: int = 0,
    heads: int = 0,
    patch_size: int = 0,
) -> PixArtTransformer2DModel:
    """A PixArt transformer of a DiT preset's shape (ldm.dit.preset and its overrides) that reads
    `caption_channels`-wide text features, initialised as PixArt-alpha's code does."""
    shape = transformer_shape(preset, sample_size, in_channels, depth, width, heads, patch_size)
    model = PixArtTransformer2DModel(
        **shape,
        # the caption projection maps text features to the model's width
        cross_attention_dim=shape["num_attention_heads"] * shape["attention_head_dim"],
        caption_channels=caption_channels,
        use_additional_conditions=False,  # no resolution / aspect-ratio embedding: one size per run
    )
    initialise_like_pixart(model)
    return model


@torch.no_grad()
def initialise_like_pixart(model: PixArtTransformer2DModel) -> None:
    """`PixArt.initialize_weights` (PixArt-alpha's diffusion/model/nets/PixArt.py) on diffusers' names:
    xavier Linears and patch embedding, N(0, 0.02) timestep and caption MLPs, zero cross-attention
    output projections (each block starts blind to the text) and a zero final projection."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    patch = model.pos_embed.proj.weight
    nn.init.xavier_uniform_(patch.view(patch.shape[0], -1))
    nn.init.zeros_(model.pos_embed.proj.bias)
    timestep = model.adaln_single.emb.timestep_embedder
    nn.init.normal_(timestep.linear_1.weight, std=0.02)
    nn.init.normal_(timestep.linear_2.weight, std=0.02)
    nn.init.normal_(model.adaln_single.linear.weight, std=0.02)
    nn.init.normal_(model.caption_projection.linear_1.weight, std=0.02)
    nn.init.normal_(model.caption_projection.linear_2.weight, std=0.02)
    for block in model.transformer_blocks:
        nn.init.zeros_(block.attn2.to_out[0].weight)
        nn.init.zeros_(block.attn2.to_out[0].bias)
    nn.init.zeros_(model.proj_out.weight)
    nn.init.zeros_(model.proj_out.bias)


def text_dit_inputs(timesteps: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Timesteps as the 1-D float [B] that adaLN-single embeds."""
    return timesteps.float().reshape(-1).expand(batch_size) if timesteps.numel() == 1 else timesteps.float()
