"""Which diffusion timesteps to train on: uniform, or importance-sampled by the second moment of
their loss (Nichol & Dhariwal 2021, improved-diffusion's LossSecondMomentResampler): keep the last
`history` losses of every timestep, draw t with p_t proportional to sqrt(E[loss_t^2]) mixed with a
little uniform mass, and weight the sample's loss by 1 / (T p_t) so the expected loss is unchanged.
Until every timestep has `history` losses, it draws uniformly.

The other axis of saving, beside choosing samples. The draw is the inverse CDF of the sample's own
uniform draw, so it depends on (seed, pass, id) and the frozen table only; the table is updated from
the globally gathered batch after each step, so every rank holds the same, and it is checkpointed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

TIMESTEP_SAMPLING = ("uniform", "loss_second_moment")


class LossSecondMomentSampler:
    def __init__(self, num_timesteps: int, history: int = 10, uniform_mass: float = 0.001):
        self.num_timesteps, self.history, self.uniform_mass = int(num_timesteps), int(history), float(uniform_mass)
        self.losses = np.zeros((self.num_timesteps, self.history), dtype=np.float64)
        self.count = np.zeros(self.num_timesteps, dtype=np.int64)  # losses recorded per timestep (capped)
        self._probabilities: torch.Tensor | None = None  # cached between updates

    @property
    def warmed_up(self) -> bool:
        return bool((self.count == self.history).all())

    def probabilities(self) -> np.ndarray:
        """p_t, float64 [T]: uniform until warmed up."""
        if not self.warmed_up:
            return np.full(self.num_timesteps, 1.0 / self.num_timesteps)
        p = np.sqrt(np.mean(self.losses**2, axis=-1))
        p /= p.sum()
        return p * (1.0 - self.uniform_mass) + self.uniform_mass / self.num_timesteps

    def draw(self, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps int64 [B], loss weights 1 / (T p_t) float32 [B]) from uniforms in [0, 1), on their device."""
        if self._probabilities is None:
            self._probabilities = torch.from_numpy(self.probabilities())
        p = self._probabilities.to(uniforms.device)
        cdf = torch.cumsum(p, 0)
        t = torch.searchsorted(cdf, uniforms.double().reshape(-1), right=True).clamp_(max=self.num_timesteps - 1)
        return t, (1.0 / (self.num_timesteps * p[t])).float()

    def update(self, ids: np.ndarray, timesteps: np.ndarray | None, losses: np.ndarray) -> None:
        """Record the unweighted losses of the real, finite samples of a gathered batch, in order."""
        if timesteps is None:
            return
        keep = (np.asarray(ids) >= 0) & np.isfinite(losses)
        for t, loss in zip(np.asarray(timesteps)[keep], np.asarray(losses, dtype=np.float64)[keep]):
            if self.count[t] == self.history:  # a full history shifts: the oldest loss leaves
                self.losses[t, :-1] = self.losses[t, 1:]
                self.losses[t, -1] = loss
            else:
                self.losses[t, self.count[t]] = loss
                self.count[t] += 1
        self._probabilities = None

    def state_dict(self) -> dict[str, Any]:
        return {"timestep_sampler": "loss_second_moment", "num_timesteps": self.num_timesteps,
                "history": self.history, "uniform_mass": self.uniform_mass,
                "losses": torch.from_numpy(self.losses.copy()), "count": torch.from_numpy(self.count.copy())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_timesteps", "history", "uniform_mass"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"timestep sampler state: {key} saved {state.get(key)!r}, "
                                 f"configured {getattr(self, key)!r}")
        self.losses[...] = state["losses"].numpy()
        self.count[...] = state["count"].numpy()
        self._probabilities = None
