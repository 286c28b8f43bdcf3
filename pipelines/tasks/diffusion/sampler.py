"""The one denoising loop, for both backbones and both objectives: Euler for flow, DDIM (eta 0) for DDPM,
with classifier-free guidance for class- and text-conditional models. Used by the FID evaluator on an
in-memory model and by `sample()` on an export, so both draw the same images, and its schedulers are
the ones the export's diffusers pipelines step with, so they draw them too. It never draws noise
itself: the caller passes the start.

Flow's Euler is diffusers' DPMSolverMultistepScheduler in its flow mode (the one Sana samples with) at
first order, whose step is x + (s' - s) v (`flow_sampler`), not FlowMatchEulerDiscreteScheduler:
DiTPipeline and the PixArt pipelines call scheduler.scale_model_input, which the latter lacks (issue 38).
DiTPipeline hard-codes the null class as 1000, so guided class-conditional sampling stays here.
Any size: x may be any height and width the backbone takes (a bucket's); a PixArt transformer built
with size conditions gets them for x's size from `sizes` (pixart.SizeConditions).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers import DDIMScheduler, DiTTransformer2DModel, DPMSolverMultistepScheduler, PixArtTransformer2DModel

from prunepipe.pipelines.tasks.diffusion.dit import dit_inputs
from prunepipe.pipelines.tasks.diffusion.pixart import SizeConditions, added_conditions, text_dit_inputs
from prunepipe.pipelines.tasks.diffusion.text import TextCondition
from prunepipe.pipelines.tasks.wrappers import unwrap

Condition = torch.Tensor | TextCondition | None  # class labels [B], caption features, or nothing

FLOW_SCHEDULER = "FlowMatchEulerDiscreteScheduler"  # the training scheduler of flow runs (and of older exports)
FLOW_SAMPLER = "DPMSolverMultistepScheduler"  # what flow runs sample with, and their exports hold


def predict(
    model: nn.Module,
    x: torch.Tensor,
    timesteps: torch.Tensor,
    labels: Condition,
    sizes: SizeConditions | None = None,
) -> torch.Tensor:
    """The backbone's output for (x [B, C, H, W], timesteps [B] or scalar, labels [B] or None, or a
    TextCondition): a DiT gets float 1-D timesteps and the null label for None; a PixArt transformer
    the caption features and mask, and its size conditions for x's size where it takes them (`sizes`);
    a UNet gets them as they are."""
    bare = unwrap(model)
    if isinstance(bare, PixArtTransformer2DModel):
        if not isinstance(labels, TextCondition):
            raise ValueError("a text-conditional transformer needs caption features (a TextCondition)")
        return model(
            x,
            encoder_hidden_states=labels.features,
            timestep=text_dit_inputs(timesteps.to(x.device), len(x)),
            encoder_attention_mask=labels.mask,
            added_cond_kwargs=added_conditions(bare, x, sizes),
        ).sample
    if isinstance(bare, DiTTransformer2DModel):
        timesteps, labels = dit_inputs(model, timesteps.to(x.device), labels, len(x))
    return model(x, timesteps, class_labels=labels).sample


def sampling_scheduler(class_name: str, train_config: dict):
    """A fresh sampler from a scheduler's class name (as scheduler_config.json records it) and config: the
    training scheduler's (Euler for flow, DDIM for DDPM), or an export's sampler as it was saved."""
    if class_name == FLOW_SCHEDULER:
        return flow_sampler(train_config["num_train_timesteps"], train_config.get("shift", 1.0))
    if class_name == FLOW_SAMPLER:
        return DPMSolverMultistepScheduler.from_config(train_config)
    return DDIMScheduler.from_config(train_config)


def flow_sampler(num_train_timesteps: int, shift: float = 1.0) -> DPMSolverMultistepScheduler:
    """Euler on the straight path x_s = (1 - s) x0 + s noise, as a scheduler every diffusers pipeline can
    step. In flow mode sigma is s (alpha_s = 1 - s) and the model's v gives x0 = x - s v, so DPM-Solver++'s
    first-order step (DDIM) to s' is (s'/s) x + (1 - s') x0 - (1 - s) (s'/s) x0 = x + (s' - s) v, also into
    s' = 0 (final_sigmas_type zero). For N steps it visits s_k = (1 - 1/T)(1 - k/N), k < N, then 0, and
    the model sees timestep floor(s_k T) (diffusers casts them to int64), T = num_train_timesteps; training
    fed s T unrounded, within one of it. `shift` warps the grid as SD3's shift does (1: none)."""
    return DPMSolverMultistepScheduler(
        num_train_timesteps=num_train_timesteps,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=shift,
        solver_order=1,  # 2 is DPM-Solver++(2M), Sana's: a pipeline may ask for it with from_config
        algorithm_type="dpmsolver++",
        final_sigmas_type="zero",
    )


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
    sizes: SizeConditions | None = None,
) -> torch.Tensor:
    """x [B, C, H, W] pure noise -> the sample after `steps` steps. Guidance (scale != 1) needs
    `labels` and `null_label` (the null class, or the empty caption's features as a batch of 1):
    out = uncond + scale * (cond - uncond), on every channel. `sizes`: the size conditions of a PixArt
    transformer built with them (pixart.SizeConditions), for x's size."""
    guided = guidance_scale != 1.0
    if guided and (labels is None or null_label is None):
        raise ValueError(
            f"guidance_scale={guidance_scale} needs a class- or text-conditional model "
            f"(ldm.num_classes > 0 or ldm.conditioning=text); use 1.0 for unconditional models"
        )
    scheduler.set_timesteps(steps, device=x.device)  # also resets a multistep scheduler's history
    if guided:
        labels = with_null(labels, null_label)
    for t in scheduler.timesteps:
        if guided:
            cond, uncond = predict(model, torch.cat([x, x]), t, labels, sizes).chunk(2)
            out = uncond + guidance_scale * (cond - uncond)
        else:
            out = predict(model, x, t, labels, sizes)
        x = scheduler.step(out, t, x).prev_sample
    return x


def with_null(condition: torch.Tensor | TextCondition, null: int | TextCondition) -> torch.Tensor | TextCondition:
    """The batch's condition followed by as many null ones: the conditional and unconditional halves."""
    if isinstance(condition, TextCondition):
        return TextCondition.cat([condition, null.to(condition.features.device).expand(len(condition))])
    return torch.cat([condition, torch.full_like(condition, null)])
