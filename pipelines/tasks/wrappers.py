"""Reaching the bare model behind wrappers: DDP / accelerate (`.module`), torch.compile
(`._orig_mod`), and EMA weights kept outside the model (diffusers EMAModel)."""

from __future__ import annotations

import copy

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module inside DDP / accelerate (`.module`) or torch.compile (`._orig_mod`)."""
    while True:
        inner = [getattr(model, a) for a in ("module", "_orig_mod") if isinstance(getattr(model, a, None), nn.Module)]
        if not inner:
            return model
        model = inner[0]


def weights_module(ema_model, model: nn.Module) -> nn.Module:
    """The module holding the EMA weights: an nn.Module copy (optionally wrapped, e.g. timm's
    ModelEmaV3) as is, or a diffusers EMAModel copied into a deep copy of `model`."""
    if isinstance(ema_model, nn.Module):
        return unwrap(ema_model)
    if hasattr(ema_model, "copy_to") and hasattr(ema_model, "shadow_params"):
        target = copy.deepcopy(unwrap(model))
        ema_model.copy_to(target.parameters())
        return target
    raise TypeError(f"ema_model: expected an nn.Module or a diffusers EMAModel, got {type(ema_model).__name__}")
