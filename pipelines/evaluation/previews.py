"""Preview pictures of a model while it trains (eval.preview): a diffusion model's samples from fixed
noise, an MAE's reconstructions of fixed held-out images, laid out as one grid, and a validation loss
on a few held-out samples at the task's fixed timesteps (or masks) and fixed noise, as SD3 and
torchtitan's Flux validate. `Preview` reads what it needs once (held-out samples, captions or their
features, the VAE that decodes latents) and then draws a pure function of the weights: the same weights
give the same pixels, so a resumed run draws the picture the uninterrupted one drew. Every caller draws
the whole grid in one batch, so the pixels do not depend on the number of ranks. Writes no file; the
training loop (pipelines/training/previews.py) decides when, with which weights and where it goes.
"""

from __future__ import annotations

import io
import math
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
from torchvision.utils import make_grid

from prunepipe.pipelines.data.batch import real_samples
from prunepipe.pipelines.data.mixture import first_path
from prunepipe.pipelines.data.shards import index_metadata
from prunepipe.pipelines.data.splits import read_captions, read_split, read_text_features
from prunepipe.pipelines.evaluation.precision import forward_precision, without_autocast_wrappers
from prunepipe.pipelines.evaluation.reconstruction import fixed_mask_noise, reconstruct
from prunepipe.pipelines.evaluation.sampling import generate_images, latent_decoder
from prunepipe.pipelines.ranks import decided_on_rank0
from prunepipe.pipelines.tasks.build import text_reading
from prunepipe.pipelines.tasks.diffusion.text import TextEncoder, identity_key
from prunepipe.pipelines.tasks.mae import MAETask

MAE_COLUMNS = 3  # original | masked | reconstruction


class Preview:
    """One run's preview: what it draws, read once on every rank (each from its own node) at the start."""

    def __init__(self, run_cfg, task, device: torch.device):
        self.cfg, self.task, self.device = run_cfg.eval.preview, task, device
        self.precision = run_cfg.eval.precision
        data = run_cfg.data
        folder = run_cfg.eval.val or first_path(data.val, "data.val")  # config.py refused none where one is needed
        self.is_mae = isinstance(task, MAETask)  # MAE reconstructs; a diffusion task samples

        def held_out(count: int, batch_size: int) -> list:
            return list(
                read_split(
                    folder,
                    resolution=data.resolution,
                    channels=data.channels,
                    batch_size=batch_size,
                    max_samples=count,
                    desc="preview samples",
                    **text_reading(task),
                )
            )

        # the validation loss's samples: the first val_samples of the held-out split, the same on every rank
        self.val_batches = held_out(self.cfg.val_samples, run_cfg.eval.batch_size) if self.cfg.val_samples else []
        self.captions: list[str] = []  # what each image of a text-conditional grid was drawn from
        if self.is_mae:
            self.images = held_out(self.cfg.num_images, self.cfg.num_images)
            return
        train = first_path(data.train)
        latent_index = index_metadata(train) if task.cfg.space == "latents" else None
        try:
            self.decode: Callable = latent_decoder(
                task, run_cfg.eval.fid.vae, run_cfg.eval.fid.vae_subfolder, latent_index
            )
        except ValueError as e:
            raise ValueError(
                f"eval.preview.every_steps={self.cfg.every_steps} draws samples, which need decoding: {e} (the "
                f"previews decode with the same eval.fid.vae), or set eval.preview.every_steps=0"
            ) from None
        self.classes: list[int] | None = None
        self.prompts: Sequence | None = None
        self.count = self.cfg.num_images
        if task.cfg.num_classes:
            self.classes = list(self.cfg.classes) or [i % task.cfg.num_classes for i in range(self.count)]
            self.count = len(self.classes)
        elif task.text_conditional:
            # each rank reads what it needs itself (no collective here: a rank that fails to read must not
            # leave the others in one); given prompts on precomputed features wait for `encode_prompts`
            self.captions = list(self.cfg.prompts) or read_captions(folder, self.count)
            self.count = len(self.captions)
            if not task.text.precomputed:
                self.prompts = self.captions  # the run's encoder encodes them as it draws
            elif not self.cfg.prompts:  # held-out captions: their stored features
                found = read_text_features(folder, range(self.count), *task.text.features)
                self.prompts = [found[i] for i in range(self.count)]
        self.text_dtype = run_cfg.ldm.text.dtype

    def encode_prompts(self) -> None:
        """Given prompts of a run on precomputed text features: encoded once, on rank 0 (the others wait
        in one broadcast), by the encoder the train split's index.json says wrote the features, found at
        the folder it records; nothing to do otherwise. Every rank calls it, after building the Preview."""
        if self.is_mae or self.prompts is not None or not self.task.text_conditional:
            return
        self.prompts = decided_on_rank0(lambda: encoded_prompts(self.task, self.captions, self.text_dtype, self.device))

    # ------------------------------------------------------------------ drawing
    @torch.no_grad()
    def picture(self, model: nn.Module) -> np.ndarray:
        """The grid of `model` (the bare module, holding the weights to show): uint8 [H, W, 3]."""
        with without_autocast_wrappers(model):
            if self.is_mae:
                rows = mae_preview(model, self.images, seed=self.cfg.seed, precision=self.precision)
                # the (original, masked, reconstruction) triples side by side, in a near-square grid of triples
                return grid_image(rows, MAE_COLUMNS * max(1, round(math.sqrt(len(rows) / MAE_COLUMNS**2))))
            images = diffusion_preview(
                self.task,
                model,
                count=self.count,
                seed=self.cfg.seed,
                steps=self.cfg.num_steps,
                guidance_scale=self.cfg.guidance_scale,
                decode=self.decode,
                precision=self.precision,
                classes=self.classes,
                prompts=self.prompts,
            )
        return grid_image(images)

    @torch.no_grad()
    def validation_loss(self, model: nn.Module) -> dict:
        """The task's held-out loss of `model` on the preview's held-out samples, each sample's noise and
        timesteps (or mask) fixed by (seed, id): {} when val_samples is 0."""
        if not self.val_batches:
            return {}
        with without_autocast_wrappers(model), forward_precision(self.precision, self.device):
            return self.task.held_out(model, self.val_batches, seed=self.cfg.seed)


def encoded_prompts(task, prompts: list[str], dtype: str, device) -> list[np.ndarray]:
    """`prompts` through the encoder that wrote the run's precomputed text features (the folders the train
    split's index.json records, checked to hold the same files), each [real tokens, D] as stored features are."""
    info = task.text_encoder.info
    folder = info.get("text_encoder", "")
    setting = f"eval.preview.prompts: the text encoder {task.text_encoder.index_path} records"
    try:
        encoder = TextEncoder(folder, info.get("tokenizer", ""), int(info["max_length"]), setting=setting, dtype=dtype)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(
            f"{e}. A run on precomputed text features draws given prompts with the encoder that wrote them; "
            f"copy it to that folder, or leave eval.preview.prompts empty to draw the held-out captions' features"
        ) from None
    if identity_key(encoder.identity()) != task.text.identity:
        raise ValueError(
            f"{setting}: {folder!r} no longer holds the encoder that wrote the features (its files differ); "
            f"leave eval.preview.prompts empty to draw the held-out captions' features"
        )
    condition = encoder.encode(prompts, device)
    rows = [f[m.bool()].float().cpu().numpy() for f, m in zip(condition.features, condition.mask)]
    del encoder
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def diffusion_preview(
    task,
    model: nn.Module,
    *,
    count: int,
    seed: int,
    steps: int,
    guidance_scale: float,
    decode: Callable[[torch.Tensor], torch.Tensor],
    precision: str = "fp32",
    classes: Sequence[int] | None = None,
    prompts: Sequence | None = None,
) -> torch.Tensor:
    """`count` samples [N, C, H, W] in [0, 1] at the task's base size, image i from the noise of (seed, i)
    and classes[i] or prompts[i] (captions, or precomputed features [n, D] each); guided by
    `guidance_scale` where the model is conditional, unguided where it is not. One batch: every caller
    draws the whole grid, so the pixels do not depend on how many ranks there are."""
    conditional = bool(task.cfg.num_classes) or task.text_conditional
    images = generate_images(
        task,
        model,
        num_images=count,
        steps=steps,
        seed=seed,
        batch_size=count,
        decode=decode,
        guidance_scale=guidance_scale if conditional else 1.0,
        precision=precision,
        captions=prompts,
        classes=classes,
        show_progress=False,
    )
    return torch.cat([x.cpu() for x in images])


@torch.no_grad()
def mae_preview(model: nn.Module, batches, *, seed: int, precision: str = "fp32") -> torch.Tensor:
    """[3N, C, H, W] in [0, 1]: each held-out image of `batches`, then it with its hidden patches grey, then
    the reconstruction (visible patches from the input, hidden ones predicted), each image's mask fixed by
    (seed, id) as MAETask.held_out's. Through the model's own forward (a sharded model gathers its weights)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = []
    try:
        for batch in real_samples(batches):
            images = batch.images.to(device).float()
            noise = fixed_mask_noise(batch.ids.cpu().numpy(), model.num_patches, seed).to(device)
            with forward_precision(precision, device):
                recon, mask, _ = reconstruct(model, images, noise)
            patches = model.patchify(images)
            hidden = mask.unsqueeze(-1)
            masked = model.unpatchify(patches * (1 - hidden))  # 0 in [-1, 1]: mid grey
            for triple in zip(images, masked, recon.float()):
                rows.extend(triple)
    finally:
        model.train(was_training)
    return torch.stack([((x.cpu() + 1) / 2).clamp(0, 1) for x in rows])


def grid_image(images: torch.Tensor, columns: int = 0) -> np.ndarray:
    """Images [N, C, H, W] in [0, 1] -> one uint8 [H', W', 3] picture, `columns` a row (0 = a near-square
    grid), 2 pixels of black between them; grey images as RGB."""
    columns = columns or math.ceil(math.sqrt(len(images)))
    grid = make_grid(images.float(), nrow=columns, padding=2, pad_value=0.0)  # [3, H', W'] (C=1 repeated)
    return (grid.mul(255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)).numpy()


def png_bytes(picture: np.ndarray) -> bytes:
    """The PNG of a uint8 [H, W, 3] picture: the same pixels give the same bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    return buffer.getvalue()
