"""Images from an in-memory model for FID: DDIM (eta 0), or Euler for flow, with classifier-free
guidance when asked (the task's loop, pipelines/tasks/sampler.py), then the VAE decoder for latent runs.
Sample i starts from noise seeded by (seed, i), and a text-conditional model draws it from caption i,
so the set of images is the same for any world size and batch size; each rank generates only its
share. Samples are drawn at the task's square base size (`task.sample_size`, index.json's latent_shape)
whatever aspect-ratio buckets the run trained on, so FID, the replication search and their reference
images (square, at the samples' side) compare like with like; a model built with size conditions gets
the base image size's. Nothing here measures anything or touches files other than a VAE's.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn

from prunepipe.pipelines.evaluation.precision import forward_precision
from prunepipe.pipelines.progress import progress
from prunepipe.pipelines.tasks.diffusion.autoencoder import load_autoencoder
from prunepipe.pipelines.tasks.diffusion.sampler import denoise
from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask
from prunepipe.pipelines.tasks.randomness import per_sample_seeded


def latent_decoder(
    task: DiffusionTask, vae: str = "", vae_subfolder: str = "", latent_index: dict | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """What maps the UNet's output space to images in [-1, 1]: unscaling in pixel space, the task's
    VAE, or for runs on precomputed latents the VAE named by `vae` or by the latent shards' index."""
    cfg = task.cfg
    if cfg.space == "pixel":
        return lambda x: x / task.scaling_factor
    if cfg.space == "latents":
        info = latent_index or {}
        name = vae or info.get("vae", "")
        if not name:
            raise ValueError(
                "this run trained on precomputed latents and their index.json names no VAE: pass "
                "fid.vae=FOLDER_OR_REPO_ID (and fid.vae_subfolder) to decode samples for FID"
            )
        autoencoder = load_autoencoder(name, vae_subfolder if vae else info.get("subfolder", ""), cfg.cache_dir)
        scale = task.scaling_factor or info.get("scaling_factor") or float(autoencoder.config.scaling_factor)
        shift = float(info.get("shift_factor") or getattr(autoencoder.config, "shift_factor", None) or 0.0)
    else:
        autoencoder, scale, shift = task.autoencoder, task.scaling_factor, task.shift_factor

    def decode(x: torch.Tensor) -> torch.Tensor:
        if autoencoder.device != x.device:
            autoencoder.to(x.device)
        return autoencoder.decode(x / scale + shift).sample

    return decode


@torch.no_grad()
def generate_images(
    task: DiffusionTask,
    model: nn.Module,
    *,
    num_images: int,
    steps: int,
    seed: int,
    batch_size: int = 64,
    rank: int = 0,
    world_size: int = 1,
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
    guidance_scale: float = 1.0,
    precision: str = "fp32",
    captions: Sequence[str] | None = None,
    classes: Sequence[int] | None = None,
    show_progress: bool = True,
) -> Iterator[torch.Tensor]:
    """This rank's samples i = rank, rank + world_size, ... < num_images as float [B, C, H, W]
    batches in [0, 1]. Class-conditional models get balanced labels i % num_classes (or classes[i]), text-conditional
    ones captions[i] (every rank holds the whole list; a run on precomputed features gets features
    [n, D] at this rank's places), guided by `guidance_scale` (1 = none) against
    the null label or the empty caption's features. `precision`: that of the model's and the decoder's
    forwards, entered per batch (never across a yield, which would leak it into whatever consumes the images)."""
    if task.text_conditional and (captions is None or len(captions) < num_images):
        raise ValueError(
            f"a text-conditional model is sampled from captions: {num_images} images need as many "
            f"captions, {0 if captions is None else len(captions)} given"
        )
    decode = decode or latent_decoder(task)
    device = next(model.parameters()).device
    # guidance steers away from the null label, or the empty caption's features
    null = task.cfg.num_classes if task.cfg.num_classes else None
    if task.text_conditional:
        null = task.text_encoder.null(device)
    was_training = model.training
    model.eval()
    scheduler = task.sampler()
    size = task.sample_size
    shape = (task.in_channels, *((size, size) if isinstance(size, int) else size))
    mine = np.arange(rank, num_images, world_size)
    name = "Euler" if task.cfg.objective == "flow" else "DDIM"
    bar = progress(
        len(mine), desc=f"sampling ({name} {steps} steps)", unit="img", disable=rank != 0 or not show_progress
    )
    try:
        for start in range(0, len(mine), batch_size):
            indices = mine[start : start + batch_size]
            x = per_sample_seeded(shape, indices, seed, normal=True).to(device)
            labels = None
            if task.cfg.num_classes:
                chosen = indices % task.cfg.num_classes if classes is None else np.asarray(classes)[indices]
                labels = task.class_labels(torch.from_numpy(chosen).to(device))
            if task.text_conditional:  # captions, or their precomputed features
                labels = task.text_encoder.encode([captions[i] for i in indices], device)
            with forward_precision(precision, device):
                x = denoise(
                    model,
                    x,
                    scheduler,
                    steps,
                    labels,
                    null_label=null,
                    guidance_scale=guidance_scale,
                    sizes=task.size_conditions,
                )
                images = decode(x)
            bar.update(len(indices))
            yield (images.float() / 2 + 0.5).clamp(0, 1)
    finally:
        bar.close()
        model.train(was_training)
