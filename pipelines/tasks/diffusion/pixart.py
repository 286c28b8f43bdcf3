"""The text-conditional DiT: diffusers' PixArtTransformer2DModel (PixArt-alpha, Chen et al. 2023, arXiv
2310.00426): DiT blocks with one shared adaLN-single timestep modulation and a cross-attention to the
caption's token features under the caption mask. The smallest step from DiTTransformer2DModel, sized by
the same presets (pipelines/tasks/dit.py). It builds and calls the model; it never draws random numbers.

Any size: the model takes inputs of any height and width that are multiples of the patch size (aspect-
ratio buckets). diffusers' PatchEmbed recomputes the sin-cos positions for the input's grid, PixArt's
way: each axis's positions spread over the base grid (sample_size / patch, the square it was built
at) and divided by `interpolation_scale`, so a bucket of twice the base height places its rows at
half-steps of the base's. The scale is PixArt-alpha's for the base size (`pixart_interpolation_scale`).

PixArt-alpha's size conditions, its multi-aspect models' resolution and aspect-ratio embeddings added
to the timestep's, are an option (ldm.dit.size_conditions: `SizeConditions`). Not taken: the learned
variance (out_channels = 2 C); this trains epsilon / v / velocity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from diffusers import PixArtTransformer2DModel

from prunepipe.pipelines.tasks.diffusion.dit import transformer_shape
from prunepipe.pipelines.tasks.wrappers import unwrap


def pixart_interpolation_scale(sample_size: int) -> int:
    """The position-embedding interpolation scale PixArt-alpha uses for a base latent side (its
    `lewei_scale`): 1 up to 512 px (sample_size 64 at 8x VAE downsampling), 2 at 1024 px (128). It is
    diffusers' default, max(sample_size // 64, 1), set explicitly so an export's config.json records it."""
    return max(sample_size // 64, 1)


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
    size_conditions: bool = False,
) -> PixArtTransformer2DModel:
    """A PixArt transformer of a DiT preset's shape (ldm.dit.preset and its overrides) that reads
    `caption_channels`-wide text features, initialised as PixArt-alpha's code does. `sample_size` is the
    base latent side; any multiple of the patch size runs. `size_conditions`: PixArt-alpha's resolution
    and aspect-ratio embeddings (use_additional_conditions), each forward then needs `SizeConditions`."""
    shape = transformer_shape(preset, sample_size, in_channels, depth, width, heads, patch_size)
    inner = shape["num_attention_heads"] * shape["attention_head_dim"]
    if size_conditions and inner % 3:
        raise ValueError(
            f"ldm.dit.size_conditions embeds the height, the width and the aspect ratio in a third of the "
            f"model's width each (diffusers' AdaLayerNormSingle): ldm.dit.width={inner} must be a multiple of "
            f"3 (DiT-S, B and XL widths are; DiT-L's 1024 is not)"
        )
    model = PixArtTransformer2DModel(
        **shape,
        # the caption projection maps text features to the model's width
        cross_attention_dim=inner,
        caption_channels=caption_channels,
        interpolation_scale=pixart_interpolation_scale(sample_size),
        use_additional_conditions=size_conditions,
    )
    initialise_like_pixart(model)
    return model


@torch.no_grad()
def initialise_like_pixart(model: PixArtTransformer2DModel) -> None:
    """`PixArt.initialize_weights` (PixArt-alpha's diffusion/model/nets/PixArt.py, PixArtMS.py) on diffusers'
    names: xavier Linears and patch embedding, N(0, 0.02) timestep, size and caption MLPs, zero
    cross-attention output projections (each block starts blind to the text) and a zero final projection."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    patch = model.pos_embed.proj.weight
    nn.init.xavier_uniform_(patch.view(patch.shape[0], -1))
    nn.init.zeros_(model.pos_embed.proj.bias)
    embedders = [model.adaln_single.emb.timestep_embedder]
    if model.use_additional_conditions:
        embedders += [model.adaln_single.emb.resolution_embedder, model.adaln_single.emb.aspect_ratio_embedder]
    for embedder in embedders:
        nn.init.normal_(embedder.linear_1.weight, std=0.02)
        nn.init.normal_(embedder.linear_2.weight, std=0.02)
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


@dataclass(frozen=True)
class SizeConditions:
    """PixArt-alpha's size conditions of a batch of latents [B, C, h, w]: the images' (H, W) in pixels,
    [B, 2], and H / W, [B, 1], as PixArtTransformer2DModel's `added_cond_kwargs` (PixArtAlphaPipeline
    passes the same for the size it draws). (H, W) is what the bucket table lists for latents of h x w
    (`images`), else (h f, w f), f = `downsampling` (image pixels per latent pixel: the VAE's factor, 1
    in pixel space)."""

    downsampling: int
    images: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)

    def image_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) in pixels of latents `height` x `width`."""
        return self.images.get((height, width), (height * self.downsampling, width * self.downsampling))

    def of(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """`added_cond_kwargs` for the batch `x` (every sample of a batch has its one size)."""
        height, width = self.image_size(int(x.shape[-2]), int(x.shape[-1]))
        # filled on the device: a tensor of a Python list would be a host copy the step waits for
        full = [torch.full((len(x), 1), float(value), device=x.device) for value in (height, width)]
        return {
            "resolution": torch.cat(full, dim=1),
            "aspect_ratio": torch.full((len(x), 1), height / width, device=x.device),
        }


def added_conditions(model: nn.Module, x: torch.Tensor, sizes: SizeConditions | None) -> dict:
    """The `added_cond_kwargs` a PixArt transformer takes for `x`: the size conditions where it was built
    with them (ldm.dit.size_conditions), none otherwise."""
    if not getattr(unwrap(model), "use_additional_conditions", False):
        return {"resolution": None, "aspect_ratio": None}
    if sizes is None:
        raise ValueError(
            "this PixArt transformer takes PixArt-alpha's size conditions (use_additional_conditions, "
            "ldm.dit.size_conditions): pass sizes= a SizeConditions naming its images' size"
        )
    return sizes.of(x)
