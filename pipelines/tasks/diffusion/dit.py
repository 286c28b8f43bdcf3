"""The DiT backbone (Peebles & Xie 2023, arXiv 2212.09748) as diffusers' DiTTransformer2DModel: the
paper's presets, its initialisation, and the traps of diffusers 0.42 handled once, here.
It builds and calls the model; it never draws random numbers for training (the task does).

Traps: every block owns a timestep MLP and a label table and drops labels itself with a
hard-coded p = 0.1, an independent mask per block, in train mode: we set that to 0 and drop labels
once per sample in the task. `class_labels=None` raises, so unconditional = always the null label
(index num_classes). Timesteps must be a 1-D float tensor. diffusers leaves the default init: we
apply the paper's (xavier, N(0, 0.02) embeddings, zero adaLN modulation and final layer). Its
forward unpatchifies every input as a square (`DiTTransformer2DModel` below takes any size).
"""

from __future__ import annotations

import re

import diffusers
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from prunepipe.pipelines.tasks.wrappers import unwrap

# name -> (depth, hidden size, heads): Table 1 of the paper; the patch size follows the slash. 8B: this
# project's, ~8.2 B parameters (48 blocks of 3072, heads of 128), the size of the largest diffusion transformers
# pretrained now, for sharded training (docs/multinode.md, "Models past one GPU")
DIT_SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16), "8B": (48, 3072, 24)}
DIT_PRESETS = tuple(f"DiT-{size}/{patch}" for size in DIT_SIZES for patch in (2, 4, 8))


def dit_shape(preset: str, depth: int = 0, width: int = 0, heads: int = 0, patch_size: int = 0) -> dict:
    """(num_layers, hidden size, heads, patch size) of `preset`, each overridden when > 0
    (tiny CPU models: `DiT-S/2` with depth 2, width 64, heads 2)."""
    match = re.fullmatch(rf"DiT-({'|'.join(DIT_SIZES)})/(\d+)", preset)
    if not match:
        raise ValueError(
            f"ldm.dit.preset={preset!r} is not accepted; accepted: {', '.join(DIT_PRESETS)} "
            f"(ldm.dit.depth, dit_width, dit_heads, dit_patch_size override its numbers)"
        )
    layers, hidden, n_heads = DIT_SIZES[match.group(1)]
    shape = {
        "num_layers": depth or layers,
        "width": width or hidden,
        "heads": heads or n_heads,
        "patch_size": patch_size or int(match.group(2)),
    }
    if shape["width"] % shape["heads"]:
        raise ValueError(f"ldm.dit.width={shape['width']} must be a multiple of ldm.dit.heads={shape['heads']}")
    return shape


def transformer_shape(
    preset: str, sample_size: int, in_channels: int, depth: int = 0, width: int = 0, heads: int = 0, patch_size: int = 0
) -> dict:
    """The keyword arguments diffusers' DiT-style transformers share, for a preset and its overrides,
    checked against the input size."""
    shape = dit_shape(preset, depth, width, heads, patch_size)
    if sample_size % shape["patch_size"]:
        raise ValueError(
            f"ldm.sample_size={sample_size} must be a multiple of the DiT patch size "
            f"{shape['patch_size']} (ldm.dit.preset={preset!r}, ldm.dit.patch_size)"
        )
    return dict(
        num_attention_heads=shape["heads"],
        attention_head_dim=shape["width"] // shape["heads"],
        in_channels=in_channels,
        out_channels=in_channels,
        num_layers=shape["num_layers"],
        sample_size=sample_size,
        patch_size=shape["patch_size"],
    )


class DiTTransformer2DModel(diffusers.DiTTransformer2DModel):
    """diffusers' DiT at any input size whose sides are multiples of the patch size (aspect-ratio
    buckets): its PatchEmbed recomputes the sin-cos positions for another grid, but its forward
    unpatchifies the tokens as an int(sqrt(tokens))-sided square, which for a non-square input raises
    or, worse, returns something else: 2 inputs of 12x8 at patch 2 are 48 tokens of a 6x4 grid,
    read as three 4x4 grids, 3 samples of 8x8. This forward is diffusers' with the grid taken from
    the input; at a square input it computes what diffusers' does, operation for operation.

    The same name as diffusers' class on purpose: save_pretrained writes it into config.json, an
    export's model_index.json names it, and init.weights compares it, so an export loads in diffusers
    (DiTPipeline, DiTTransformer2DModel.from_pretrained: square inputs there)."""

    def called_outside_their_block(self) -> list[nn.Module]:
        """Modules the forward calls from outside the block that holds them: the final layer's modulation
        reads block 0's timestep and label embedder after the last block (diffusers' design; DiT shares one
        embedder, diffusers gives each block its own and keeps block 0's for the end, and exports depend on
        those names). A sharded model makes each of them a unit of its own (pipelines/training/parallel.py),
        gathered whenever it is called."""
        return [self.transformer_blocks[0].norm1.emb]

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor | None = None,
        class_labels: torch.Tensor | None = None,
        cross_attention_kwargs: dict | None = None,
        return_dict: bool = True,
    ):
        patch = self.patch_size
        height, width = hidden_states.shape[-2] // patch, hidden_states.shape[-1] // patch
        if height * patch != hidden_states.shape[-2] or width * patch != hidden_states.shape[-1]:
            raise ValueError(
                f"DiT input {hidden_states.shape[-2]}x{hidden_states.shape[-1]}: each side must be a multiple "
                f"of the patch size {patch} (ldm.dit.patch_size)"
            )
        hidden_states = self.pos_embed(hidden_states)
        for block in self.transformer_blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                hidden_states = self._gradient_checkpointing_func(
                    block, hidden_states, None, None, None, timestep, cross_attention_kwargs, class_labels
                )
            else:
                hidden_states = block(
                    hidden_states,
                    attention_mask=None,
                    encoder_hidden_states=None,
                    encoder_attention_mask=None,
                    timestep=timestep,
                    cross_attention_kwargs=cross_attention_kwargs,
                    class_labels=class_labels,
                )
        conditioning = self.transformer_blocks[0].norm1.emb(timestep, class_labels, hidden_dtype=hidden_states.dtype)
        shift, scale = self.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
        hidden_states = self.norm_out(hidden_states) * (1 + scale[:, None]) + shift[:, None]
        hidden_states = self.proj_out_2(hidden_states)
        # unpatchify on the input's grid (diffusers: height = width = int(tokens ** 0.5))
        hidden_states = hidden_states.reshape(-1, height, width, patch, patch, self.out_channels)
        hidden_states = torch.einsum("nhwpqc->nchpwq", hidden_states)
        output = hidden_states.reshape(-1, self.out_channels, height * patch, width * patch)
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)


def build_dit(
    preset: str,
    *,
    sample_size: int,
    in_channels: int,
    num_classes: int,
    depth: int = 0,
    width: int = 0,
    heads: int = 0,
    patch_size: int = 0,
) -> DiTTransformer2DModel:
    """A DiT with the paper's initialisation and no built-in label dropout, at any input size whose
    sides are multiples of the patch size (`sample_size` is the base: the square it samples at).
    Predicts as many channels as it takes (no learned sigma: epsilon / v / velocity only)."""
    model = DiTTransformer2DModel(
        **transformer_shape(preset, sample_size, in_channels, depth, width, heads, patch_size),
        num_embeds_ada_norm=num_classes,  # the label table has num_classes + 1 rows: the last is the null label
    )
    disable_block_label_dropout(model)
    initialise_like_dit(model)
    return model


def disable_block_label_dropout(model: DiTTransformer2DModel) -> None:
    """Every block's LabelEmbedding drops labels on its own (p = 0.1, hard-coded, a fresh mask per
    block and again for the final layer): off, so the task's one per-sample drop is the only one.
    An attribute, not config: from_pretrained brings the 0.1 back (harmless in eval mode)."""
    for block in model.transformer_blocks:
        block.norm1.emb.class_embedder.dropout_prob = 0.0


@torch.no_grad()
def initialise_like_dit(model: DiTTransformer2DModel) -> None:
    """DiT's `initialize_weights` (models.py of facebookresearch/DiT) on diffusers' module names."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    patch = model.pos_embed.proj.weight  # a conv: initialised like a Linear over its flattened kernel
    nn.init.xavier_uniform_(patch.view(patch.shape[0], -1))
    nn.init.zeros_(model.pos_embed.proj.bias)
    for block in model.transformer_blocks:
        emb = block.norm1.emb
        nn.init.normal_(emb.class_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(emb.timestep_embedder.linear_1.weight, std=0.02)
        nn.init.normal_(emb.timestep_embedder.linear_2.weight, std=0.02)
        # adaLN-Zero: each block starts as the identity (the paper's Sec. 3.2)
        nn.init.zeros_(block.norm1.linear.weight)
        nn.init.zeros_(block.norm1.linear.bias)
    for layer in (model.proj_out_1, model.proj_out_2):  # the final layer's modulation and projection
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)


def dit_inputs(
    model: nn.Module, timesteps: torch.Tensor, labels: torch.Tensor | None, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps as 1-D float [B], labels with None = the null label [B]) as the DiT forward needs."""
    timesteps = timesteps.float().reshape(-1).expand(batch_size) if timesteps.numel() == 1 else timesteps.float()
    if labels is None:
        null = dit_null_label(model)
        labels = torch.full((batch_size,), null, dtype=torch.long, device=timesteps.device)
    return timesteps, labels


def dit_null_label(model: nn.Module) -> int:
    """The index of the null label: num_embeds_ada_norm (= the number of classes)."""
    return int(unwrap(model).config.num_embeds_ada_norm)


def compile_blocks(model, **compile_kwargs) -> None:
    """torch.compile each transformer block of a DiT or PixArt transformer in place: diffusers'
    compile_repeated_blocks() refuses DiT (it declares no _repeated_blocks), and compiling the whole
    model recompiles per shape (per aspect-ratio bucket)."""
    for block in model.transformer_blocks:
        block.compile(**compile_kwargs)
