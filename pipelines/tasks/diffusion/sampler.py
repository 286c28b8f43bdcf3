"""The one denoising loop, for both backbones and both objectives: Euler (FlowMatchEulerDiscreteScheduler)
for flow, DDIM (eta 0) for DDPM, with classifier-free guidance for class- and text-conditional models. Used by
the FID evaluator on an in-memory model and by `sample()` on an export, so both draw the same images.
diffusers' DiTPipeline cannot be used: it calls scale_model_input (the flow scheduler has none) and
hard-codes the null class as 1000. It never draws noise itself: the caller passes the start.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers import DDIMScheduler, DiTTransformer2DModel, FlowMatchEulerDiscreteScheduler, PixArtTransformer2DModel

from prunepipe.pipelines.tasks.diffusion.dit import dit_inputs
from prunepipe.pipelines.tasks.diffusion.pixart import text_dit_inputs
from prunepipe.pipelines.tasks.diffusion.text import TextCondition
from prunepipe.pipelines.tasks.wrappers import unwrap

Condition = torch.Tensor | TextCondition | None  # class labels [B], caption features, or nothing

FLOW_SCHEDULER = "FlowMatchEulerDiscreteScheduler"


def predict(model: nn.Module, x: torch.Tensor, timesteps: torch.Tensor, labels: Condition) -> torch.Tensor:
    """The backbone's output for (x [B, C, H, W], timesteps [B] or scalar, labels [B] or None, or a
    TextCondition): a DiT gets float 1-D timesteps and the null label for None; a PixArt transformer
    the caption features and mask; a UNet gets them as they are."""
    bare = unwrap(model)
    if isinstance(bare, PixArtTransformer2DModel):
        if not isinstance(labels, TextCondition):
            raise ValueError("a text-conditional transformer needs caption features (a TextCondition)")
        return model(
            x,
            encoder_hidden_states=labels.features,
            timestep=text_dit_inputs(timesteps.to(x.device), len(x)),
            encoder_attention_mask=labels.mask,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        ).sample
    if isinstance(bare, DiTTransformer2DModel):
        timesteps, labels = dit_inputs(model, timesteps.to(x.device), labels, len(x))
    return model(x, timesteps, class_labels=labels).sample


def sampling_scheduler(class_name: str, train_config: dict):
    """A fresh sampler from the training scheduler (its class name, as scheduler_config.json records
    it, and its config): Euler for flow, DDIM for DDPM."""
    if class_name == FLOW_SCHEDULER:
        return FlowMatchEulerDiscreteScheduler.from_config(train_config)
    return DDIMScheduler.from_config(train_config)


@torch.no_grad()
def denoise(
    model: nn.Module,
    x: torch.Tensor,
    scheduler,
    steps: int,
    labels: Condition = None,
    *,
    null_label: int | TextCondition | None = None,
    guidance_scale: float = 1.0,
) -> torch.Tensor:
    """x [B, C, H, W] pure noise -> the sample after `steps` steps. Guidance (scale != 1) needs
    `labels` and `null_label` (the null class, or the empty caption's features as a batch of 1):
    out = uncond + scale * (cond - uncond), on every channel."""
    guided = guidance_scale != 1.0
    if guided and (labels is None or null_label is None):
        raise ValueError(
            f"guidance_scale={guidance_scale} needs a class- or text-conditional model "
            f"(ldm.num_classes > 0 or ldm.conditioning=text); use 1.0 for unconditional models"
        )
    scheduler.set_timesteps(steps, device=x.device)  # also resets the flow scheduler's step index
    if guided:
        labels = with_null(labels, null_label)
    for t in scheduler.timesteps:
        if guided:
            cond, uncond = predict(model, torch.cat([x, x]), t, labels).chunk(2)
            out = uncond + guidance_scale * (cond - uncond)
        else:
            out = predict(model, x, t, labels)
        x = scheduler.step(out, t, x).prev_sample
    return x


def with_null(condition: torch.Tensor | TextCondition, null: int | TextCondition) -> torch.Tensor | TextCondition:
    """The batch's condition followed by as many null ones: the conditional and unconditional halves."""
    if isinstance(condition, TextCondition):
        return TextCondition.cat([condition, null.to(condition.features.device).expand(len(condition))])
    return torch.cat([condition, torch.full_like(condition, null)])
