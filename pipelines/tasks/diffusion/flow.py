"""The flow-matching (rectified-flow) objective: x_s = (1 - s) x0 + s noise, target v = noise - x0
(SD3, Esser et al. 2024, arXiv 2403.03206, Eq. 1-3; SiT's linear path). s per sample from a density
of diffusers' compute_density_for_timestep_sampling, mapped from the sample's own draws on the
device: no generator of the batch, no host sync (the diffusers examples look sigmas up with
`.nonzero().item()` per sample). It knows nothing about models beyond "predict v from (x_s, s T)".
"""

from __future__ import annotations

import math

import torch

FLOW_WEIGHTINGS = ("logit_normal", "uniform", "mode")
HELD_OUT_S = tuple((k + 0.5) / 10 for k in range(10))  # 0.05 .. 0.95: the held-out grid


def draw_s(
    draws,
    weighting: str,
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """s float32 [B] in (0, 1) from one call of the sample's draws: compute_density_for_timestep_sampling's
    formulas, fed the per-sample normals (logit_normal) or uniforms (uniform, mode)."""
    if weighting == "logit_normal":
        return torch.sigmoid(draws.randn().to(device).float() * logit_std + logit_mean)
    u = draws.rand().to(device).float()
    if weighting == "mode":  # SD3 Eq. 20: mode-seeking density, mode_scale 1.29 is the paper's
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def interpolate(x0: torch.Tensor, noise: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_s, v): the point on the straight path at s [B] and the velocity that moves along it."""
    s = s.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise, noise - x0


def s_stratum(s: torch.Tensor, num_strata: int) -> torch.Tensor:
    """int64 [B]: s's bucket of num_strata equal widths, for score normalisation within a bucket."""
    return (s * num_strata).long().clamp_(0, num_strata - 1)
