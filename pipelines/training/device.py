"""The model, its optimizer and torch's backend flags set up for the device a run trains on: TF32,
fused AdamW, channels_last for the UNet and torch.compile (per block for DiT), as the `cuda:` config
asks (docs/gpu.md).
On a CPU every switch is ignored, so CPU runs and tests train exactly as they would without them.
"""

from __future__ import annotations

import torch
from diffusers import DiTTransformer2DModel

from prunepipe.pipelines.config import RunConfig
from prunepipe.pipelines.tasks.diffusion.dit import compile_blocks


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases, norms and embeddings of one dimension (as MAE and DiT do)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def set_backend_flags(cfg: RunConfig, device: torch.device) -> None:
    """TF32 for matmuls and cuDNN convolutions on CUDA (cuda.tf32); nothing on a CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.cuda.tf32
        torch.backends.cudnn.allow_tf32 = cfg.cuda.tf32


def place_model(cfg: RunConfig, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model on `device`; on CUDA the UNet in channels_last (cuda.channels_last) and the model
    compiled in place (cuda.compile: nn.Module.compile keeps the state-dict keys, so checkpoints and
    exports read the same)."""
    model = model.to(device)
    if device.type != "cuda":
        return model
    dit = isinstance(model, DiTTransformer2DModel)
    if cfg.cuda.channels_last and cfg.task == "ldm" and not dit:  # a convolution layout: the UNet's only
        model = model.to(memory_format=torch.channels_last)
    if cfg.cuda.compile:
        compile_blocks(model) if dit else model.compile()  # compile_repeated_blocks() refuses DiT: per block
    return model


def build_optimizer(cfg: RunConfig, model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the decay / no-decay groups; the fused kernel on CUDA when cuda.fused_adamw."""
    fused = cfg.cuda.fused_adamw and device.type == "cuda"
    return torch.optim.AdamW(
        parameter_groups(model, cfg.optim.weight_decay),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        fused=fused or None,
    )
