"""MAE reconstruction quality on held-out images: the masked-patch MSE of the task (each sample's
mask fixed by (seed, id)), and PSNR / SSIM (torchmetrics) of the reconstructed image: visible
patches from the input, masked ones from the prediction. Reads no files; trains nothing.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from prunepipe.pipelines.data.batch import real_samples
from prunepipe.pipelines.evaluation.precision import forward_precision
from prunepipe.pipelines.tasks.mae import MAETask, MaskedAutoencoder
from prunepipe.pipelines.tasks.randomness import per_sample_seeded
from prunepipe.pipelines.tasks.wrappers import unwrap


def fixed_mask_noise(ids: np.ndarray, num_patches: int, seed: int) -> torch.Tensor:
    """[B, L] masking noise of each sample from (seed, id) alone: MAETask.held_out's masks."""
    return per_sample_seeded((num_patches,), ids, seed, normal=False)


@torch.no_grad()
def reconstruct(
    model: MaskedAutoencoder, images: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """images [N, C, H, W] in [-1, 1], noise [N, L] -> (reconstruction [N, C, H, W], mask [N, L]
    with 1 = masked, masked-patch MSE [N] exactly as the training loss computes it).

    With norm_pix_loss the prediction is per-patch standardised pixels; it is mapped back with each
    true patch's mean and variance, as the MAE authors' visualisation does (so those statistics
    of masked patches come from the input)."""
    masked_mse, pred, mask = model(images, noise, with_prediction=True)  # through forward: FSDP's hooks run
    pred = pred.float()  # [N, L, p*p*C]
    patches = model.patchify(images.float())
    if model.norm_pix_loss:
        mean = patches.mean(dim=-1, keepdim=True)
        var = patches.var(dim=-1, keepdim=True)
        pred = pred * (var + 1e-6) ** 0.5 + mean
    masked = mask.unsqueeze(-1)
    composite = patches * (1 - masked) + pred * masked
    return model.unpatchify(composite), mask, masked_mse


@torch.no_grad()
def reconstruction_metrics(task: MAETask, model, batches: Iterable, seed: int = 0, precision: str = "fp32") -> dict:
    """Held-out masked-patch MSE (MAETask.held_out: the number the training log shows) and the mean
    over images of per-image PSNR and SSIM of the reconstruction, both in [0, 1] pixels (data range
    1). Per-image means do not depend on how the images were batched, so ranks may each take a share
    (pipelines/ranks.py combines them). Padding (id < 0) is ignored. `precision` is that
    of the model's forwards (pipelines/evaluation/precision.py); the metrics are computed in fp32."""
    bare = unwrap(model)
    device = next(bare.parameters()).device
    was_training = bare.training
    bare.eval()
    mse_sum, psnr_sum, ssim_sum, count = 0.0, 0.0, 0.0, 0
    try:
        for batch in real_samples(batches):
            ids = batch.ids.cpu().numpy()
            images = batch.images.to(device)
            with forward_precision(precision, device):
                held = task.held_out(bare, [batch], seed=seed)
                recon, _, _ = reconstruct(bare, images, fixed_mask_noise(ids, bare.num_patches, seed).to(device))
            mse_sum += held["masked_mse"] * held["num_samples"]
            recon = recon.float()
            preds, target = ((recon + 1) / 2).clamp(0, 1), ((images.float() + 1) / 2).clamp(0, 1)
            psnr = peak_signal_noise_ratio(preds, target, data_range=1.0, reduction="none", dim=(1, 2, 3))
            ssim = structural_similarity_index_measure(preds, target, data_range=1.0, reduction="none")
            psnr_sum += float(psnr.double().sum())
            ssim_sum += float(ssim.double().sum())
            count += len(ids)
    finally:
        bare.train(was_training)
    n = max(count, 1)
    return {"masked_mse": mse_sum / n, "psnr": psnr_sum / n, "ssim": ssim_sum / n, "num_samples": count}
