"""The MAE task: a masked autoencoder (He et al. 2022, arXiv 2111.06377) whose encoder IS a timm
VisionTransformer, a per-sample masked-patch loss, a fixed-mask held-out error, and an export timm
loads for fine-tuning. Randomness comes from the caller's generator; nothing here knows about shards,
pruners, optimizers or torch.distributed.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from timm.layers import build_sincos2d_pos_embed
from timm.models.vision_transformer import Block, VisionTransformer

from prunepipe.pipelines.data.batch import real_samples
from prunepipe.pipelines.tasks.mae_config import PAPER_DECODER, PRESETS, MAEConfig  # noqa: F401 (re-exported)
from prunepipe.pipelines.tasks.randomness import SampleDraws, batch_draws, per_sample_seeded
from prunepipe.pipelines.tasks.sample_losses import SampleLosses
from prunepipe.pipelines.tasks.wrappers import unwrap, weights_module

ENCODER_WEIGHTS = "encoder.safetensors"
ENCODER_CONFIG = "encoder_config.json"

MASK_SHARE_STRATA = 100


def kept_patches(length: int, mask_ratio: float) -> int:
    """How many of an image's `length` patches the encoder sees."""
    return int(length * (1 - mask_ratio))


def hidden_patches(noise: torch.Tensor, mask_ratio: float) -> torch.Tensor:
    """bool [N, L]: the patches MaskedAutoencoder.random_masking hides for `noise` [N, L] (those not
    among the kept_patches smallest noise values)."""
    rank = torch.argsort(torch.argsort(noise, dim=1), dim=1)
    return rank >= kept_patches(noise.shape[1], mask_ratio)


def hidden_share(patches: torch.Tensor, noise: torch.Tensor, mask_ratio: float) -> torch.Tensor:
    """[N] share of each image's variation in the patches its mask hides (the mask that
    MaskedAutoencoder.random_masking draws from `noise`): sum over hidden patches of the patch's
    mean squared deviation from the image mean, over the sum for all patches. About `mask_ratio`
    on average; a flat image (no variation) counts as exactly `mask_ratio`.

    patches [N, L, P] (patchify), noise [N, L].
    """
    centred = patches - patches.mean(dim=(1, 2), keepdim=True)
    variation = centred.pow(2).mean(dim=2)  # [N, L]
    hidden = (variation * hidden_patches(noise, mask_ratio)).sum(dim=1)
    total = variation.sum(dim=1)
    flat = total <= 1e-12
    return torch.where(flat, torch.full_like(total, mask_ratio), hidden / total.clamp_min(1e-12))


def sincos_pos_embed(grid: int, dim: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding [1, 1 + grid*grid, dim]; the class token's row is zero."""
    patches = build_sincos2d_pos_embed([grid, grid], dim=dim)  # [L, D]
    return torch.cat([torch.zeros(1, dim), patches], dim=0).unsqueeze(0)


class MaskedAutoencoder(nn.Module):
    """ViT encoder on the visible patches, light Transformer decoder, per-sample masked-patch MSE."""

    def __init__(
        self,
        *,
        img_size: int,
        in_chans: int,
        patch_size: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float,
        decoder_embed_dim: int,
        decoder_depth: int,
        decoder_num_heads: int,
        mask_ratio: float,
        norm_pix_loss: bool,
    ):
        super().__init__()
        self.mask_ratio = mask_ratio
        self.norm_pix_loss = norm_pix_loss
        # The exported encoder is rebuilt from exactly these kwargs (encoder_config.json).
        self.encoder_kwargs = dict(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            num_classes=0,
            class_token=True,
            global_pool="token",
        )
        self.encoder = VisionTransformer(**self.encoder_kwargs)
        grid = img_size // patch_size
        self.num_patches = grid * grid
        self.patch_size = patch_size
        self.in_chans = in_chans
        # Fixed sin-cos positions, not learned (MAE Appendix A.1).
        self.encoder.pos_embed.requires_grad_(False)

        # ---------------------------------------------------------------- decoder
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(
            torch.zeros(1, self.num_patches + 1, decoder_embed_dim), requires_grad=False
        )
        self.decoder_blocks = nn.ModuleList(
            Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True) for _ in range(decoder_depth)
        )
        self.decoder_norm = nn.LayerNorm(decoder_embed_dim, eps=1e-6)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size * patch_size * in_chans)
        self._init_weights(grid)

    def _init_weights(self, grid: int) -> None:
        """The MAE reference initialisation: xavier-uniform linears (the patch projection seen as
        one), N(0, 0.02) class and mask tokens, and the fixed sin-cos tables."""
        with torch.no_grad():
            self.encoder.pos_embed.copy_(sincos_pos_embed(grid, self.encoder.pos_embed.shape[-1]))
            self.decoder_pos_embed.copy_(sincos_pos_embed(grid, self.decoder_pos_embed.shape[-1]))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        w = self.encoder.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.normal_(self.encoder.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)

    # ---------------------------------------------------------------- patches
    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, L, p*p*C], patches in row-major order, pixels (p, q, c) inside."""
        n, c, h, w = images.shape
        p = self.patch_size
        x = images.reshape(n, c, h // p, p, w // p, p)
        x = torch.einsum("nchpwq->nhwpqc", x)
        return x.reshape(n, (h // p) * (w // p), p * p * c)

    def unpatchify(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, L, p*p*C] -> [N, C, H, W], the inverse of `patchify` for square images."""
        n, length, _ = patches.shape
        p, c = self.patch_size, self.in_chans
        g = int(round(length**0.5))
        x = patches.reshape(n, g, g, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(n, c, g * p, g * p)

    # ---------------------------------------------------------------- the method
    def random_masking(self, x: torch.Tensor, noise: torch.Tensor):
        """Keep the (1 - mask_ratio) * L patches with the smallest noise, per sample.

        x: [N, L, D], noise: [N, L] -> kept [N, L_keep, D], mask [N, L] (1 = removed),
        ids_restore [N, L]. Shuffling by argsort of uniform noise is MAE's per-sample random
        sampling without replacement (Sec. 3, "Masking"); the caller owns the noise.
        """
        n, length, dim = x.shape
        len_keep = kept_patches(length, self.mask_ratio)
        ids_shuffle = torch.argsort(noise, dim=1)  # ascending: small noise is kept
        ids_restore = torch.argsort(ids_shuffle, dim=1)  # each patch's rank: hidden_patches' rule
        ids_keep = ids_shuffle[:, :len_keep]
        kept = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, dim))
        mask = (ids_restore >= len_keep).float()  # in patch order
        return kept, mask, ids_restore

    def forward_encoder(self, images: torch.Tensor, noise: torch.Tensor):
        """images [N, C, H, W] -> latent [N, 1 + L_keep, D], mask [N, L], ids_restore [N, L].

        The same modules and position convention as timm's forward_features (class token with
        pos_embed row 0, patches with rows 1..L), so the exported encoder sees what MAE trained.
        """
        enc = self.encoder
        x = enc.patch_embed(images)  # [N, L, D]
        x = x + enc.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, noise)  # [N, L_keep, D]
        cls = (enc.cls_token + enc.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1)  # [N, 1 + L_keep, D]
        x = enc.blocks(x)
        return enc.norm(x), mask, ids_restore

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """latent [N, 1 + L_keep, D] -> predicted pixels [N, L, p*p*C] for every patch."""
        x = self.decoder_embed(latent)  # [N, 1 + L_keep, Dd]
        n, _, dim = x.shape
        length = ids_restore.shape[1]
        mask_tokens = self.mask_token.expand(n, length + 1 - x.shape[1], -1)
        patches = torch.cat([x[:, 1:, :], mask_tokens], dim=1)  # [N, L, Dd], shuffled order
        patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, dim))  # unshuffle
        x = torch.cat([x[:, :1, :], patches], dim=1) + self.decoder_pos_embed  # [N, 1 + L, Dd]
        for block in self.decoder_blocks:
            x = block(x)
        x = self.decoder_pred(self.decoder_norm(x))
        return x[:, 1:, :]  # drop the class token

    def patch_targets(self, images: torch.Tensor) -> torch.Tensor:
        """[N, L, p*p*C] targets; with norm_pix_loss each patch is standardised by its own mean and
        variance (MAE Sec. 4.1 / Table 1d: better representations)."""
        target = self.patchify(images.float())
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1e-6) ** 0.5
        return target

    def per_patch_loss(self, images: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """[N, L] float32 mean squared error of each patch's pixels."""
        return (pred.float() - self.patch_targets(images)).pow(2).mean(dim=-1)

    def forward(self, images: torch.Tensor, mask_noise: torch.Tensor, with_prediction: bool = False):
        """images [N, C, H, W], mask_noise [N, L] -> per-sample masked-patch MSE [N] float32, and with
        `with_prediction` also the predicted patches [N, L, p*p*C] and the mask [N, L] (1 = hidden): a
        reconstruction through the module's own forward, which a sharded model's hooks gather weights for.

        Every sample masks the same number of patches, so the batch mean of this equals the
        paper's (loss * mask).sum() / mask.sum().
        """
        latent, mask, ids_restore = self.forward_encoder(images, mask_noise)
        pred = self.forward_decoder(latent, ids_restore)
        loss = self.per_patch_loss(images, pred)
        masked_mse = (loss * mask).sum(dim=1) / mask.sum(dim=1)
        return (masked_mse, pred, mask) if with_prediction else masked_mse


class MAETask:
    """What the training loop needs from MAE: the model, a per-sample loss, evaluation and export."""

    def __init__(self, cfg: MAEConfig, *, image_size: int, channels: int, strata: bool = False):
        self.cfg = cfg = cfg.resolved()
        # The stratum of a draw is the share of the image's variation its mask hid, in hundredths: a
        # mask that happens to hide the flat patches gives a low loss whatever the sample, so scores
        # are made comparable within a share (score.normalise, pruning/scores.py), as diffusion's within
        # a timestep. Measured only when asked for: it costs a pass over the pixels every step.
        self.num_strata = MASK_SHARE_STRATA if strata else 0
        self.label_classes = 0  # labels are not trained on
        self.text = None  # batches carry no text
        if image_size % cfg.patch_size:
            raise ValueError(f"mae.patch_size={cfg.patch_size} must divide the image size {image_size}")
        for field, dim in (("embed_dim", cfg.embed_dim), ("decoder_embed_dim", cfg.decoder_embed_dim)):
            if dim % 4:
                raise ValueError(f"mae.{field}={dim} must be a multiple of 4 for the 2-D sin-cos positions")
        if cfg.embed_dim % cfg.num_heads or cfg.decoder_embed_dim % cfg.decoder_num_heads:
            raise ValueError(
                f"mae.num_heads={cfg.num_heads} must divide mae.embed_dim={cfg.embed_dim} and "
                f"mae.decoder_num_heads={cfg.decoder_num_heads} must divide "
                f"mae.decoder_embed_dim={cfg.decoder_embed_dim}"
            )
        patches = (image_size // cfg.patch_size) ** 2
        if not 0 < int(patches * (1 - cfg.mask_ratio)) < patches:
            raise ValueError(
                f"mae.mask_ratio={cfg.mask_ratio} must mask some but not all of the {patches} patches "
                f"(0 < mask_ratio < 1; 0.75 in the paper)"
            )
        self.model = MaskedAutoencoder(
            img_size=image_size,
            in_chans=channels,
            patch_size=cfg.patch_size,
            embed_dim=cfg.embed_dim,
            depth=cfg.depth,
            num_heads=cfg.num_heads,
            mlp_ratio=cfg.mlp_ratio,
            decoder_embed_dim=cfg.decoder_embed_dim,
            decoder_depth=cfg.decoder_depth,
            decoder_num_heads=cfg.decoder_num_heads,
            mask_ratio=cfg.mask_ratio,
            norm_pix_loss=cfg.norm_pix_loss,
        )
        self.num_patches = self.model.num_patches

    timestep_sampler = None

    def observe(self, ids, strata, scores) -> None:
        """Nothing of MAE learns from the gathered batch."""

    def per_sample(self, model: nn.Module, batch, generator: torch.Generator | SampleDraws) -> SampleLosses:
        """[B] float32 masked-patch MSE of each sample under a fresh random mask drawn from `generator`
        (a torch.Generator, or per-sample draws such as prunepipe.pipelines.tasks.randomness.SampleRandomness),
        with its mask's hidden share as the stratum when the task was built with strata.

        `model` is self.model or its DDP/accelerate wrapper: always call the one passed, so the
        wrapper's gradient hooks run.
        """
        images = batch.images
        noise = batch_draws(generator, len(images)).rand(self.num_patches).to(images.device)  # [B, L]
        stratum = None
        if self.num_strata:
            share = hidden_share(unwrap(model).patchify(images.float()), noise, self.cfg.mask_ratio)
            stratum = (share * MASK_SHARE_STRATA).long().clamp_(0, MASK_SHARE_STRATA - 1)
        return SampleLosses(model(images, noise), stratum)

    @torch.no_grad()
    def held_out(self, model: nn.Module, batches: Iterable, seed: int = 0) -> dict:
        """Masked-patch MSE on validation batches with each sample's mask fixed by (seed, id).

        Deterministic across calls and batchings; padding (id < 0) is ignored. Evaluate the
        unwrapped or EMA model when only one rank runs this.
        """
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        total, count = 0.0, 0
        try:
            for batch in real_samples(batches):
                ids = batch.ids.cpu().numpy()
                images = batch.images.to(device)
                noise = per_sample_seeded((self.num_patches,), ids, seed, normal=False)
                losses = model(images, noise.to(device))
                total += float(losses.double().sum())
                count += len(ids)
        finally:
            model.train(was_training)
        return {"masked_mse": total / max(count, 1), "num_samples": count}

    def export(self, model: nn.Module, ema_model, out_dir: str) -> list[str]:
        """Write encoder.safetensors (timm VisionTransformer state dict, from the EMA weights when
        given) and encoder_config.json (its constructor kwargs); return the paths written."""
        source = weights_module(ema_model, model) if ema_model is not None else unwrap(model)
        encoder = source.encoder
        os.makedirs(out_dir, exist_ok=True)
        weights_path = os.path.join(out_dir, ENCODER_WEIGHTS)
        config_path = os.path.join(out_dir, ENCODER_CONFIG)
        state = {k: v.detach().cpu().contiguous() for k, v in encoder.state_dict().items()}
        save_file(state, weights_path, metadata={"format": "pt", "producer": "prunepipe MAE"})
        with open(config_path, "w") as f:
            json.dump(unwrap(model).encoder_kwargs, f, indent=1)
        return [weights_path, config_path]


def load_exported_encoder(out_dir: str) -> VisionTransformer:
    """The exported encoder as a timm VisionTransformer (strict load: every key must match).

    For fine-tuning with a classifier, call `reset_classifier(num_classes)` on the result; the
    position table then trains like timm's (MAE fine-tunes it too).
    """
    with open(os.path.join(out_dir, ENCODER_CONFIG)) as f:
        kwargs = json.load(f)
    encoder = VisionTransformer(**kwargs)
    encoder.load_state_dict(load_file(os.path.join(out_dir, ENCODER_WEIGHTS)), strict=True)
    return encoder
