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
        # a ring per timestep: loss number k of timestep t sits in slot k % history
        self.losses = np.zeros((self.num_timesteps, self.history), dtype=np.float64)
        self.count = np.zeros(self.num_timesteps, dtype=np.int64)  # losses recorded per timestep (capped)
        self.written = np.zeros(self.num_timesteps, dtype=np.int64)  # losses recorded per timestep, all
        self._probabilities: tuple[torch.Tensor, torch.Tensor] | None = None  # (p, cdf), cached between changes

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
        if self._probabilities is None or self._probabilities[0].device != uniforms.device:
            p = torch.from_numpy(self.probabilities())
            if uniforms.device.type == "cuda":  # pinned and non-blocking: the step never waits for the copy
                p = p.pin_memory().to(uniforms.device, non_blocking=True)
            self._probabilities = p, torch.cumsum(p, 0)
        p, cdf = self._probabilities
        t = torch.searchsorted(cdf, uniforms.double().reshape(-1), right=True).clamp_(max=self.num_timesteps - 1)
        return t, (1.0 / (self.num_timesteps * p[t])).float()

    def update(self, ids: np.ndarray, timesteps: np.ndarray | None, losses: np.ndarray) -> None:
        """Record the unweighted losses of the real, finite samples of a gathered batch, in order
        (vectorised: this runs every step)."""
        if timesteps is None:
            return
        keep = (np.asarray(ids) >= 0) & np.isfinite(losses)
        t = np.asarray(timesteps, dtype=np.int64)[keep]
        values = np.asarray(losses, dtype=np.float64)[keep]
        if not len(t):
            return
        order = np.argsort(t, kind="stable")  # batch order kept within each timestep
        t, values = t[order], values[order]
        firsts = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
        sizes = np.diff(np.r_[firsts, len(t)])
        rank = np.arange(len(t)) - np.repeat(firsts, sizes)  # k-th loss of its timestep in this batch
        newest = rank >= np.repeat(sizes, sizes) - self.history  # more than `history` of one t: the last ones
        t, values, rank = t[newest], values[newest], rank[newest]
        self.losses[t, (self.written[t] + rank) % self.history] = values  # (t, slot) pairs are distinct
        distinct = t[np.r_[True, t[1:] != t[:-1]]]
        self.written[distinct] += sizes
        self.count[distinct] = np.minimum(self.written[distinct], self.history)
        if self.warmed_up:  # until then p is uniform, whatever was recorded: the cached one holds
            self._probabilities = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "timestep_sampler": "loss_second_moment",
            "num_timesteps": self.num_timesteps,
            "history": self.history,
            "uniform_mass": self.uniform_mass,
            "losses": torch.from_numpy(self.losses.copy()),
            "count": torch.from_numpy(self.count.copy()),
            "written": torch.from_numpy(self.written.copy()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_timesteps", "history", "uniform_mass"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"timestep sampler state: {key} saved {state.get(key)!r}, configured {getattr(self, key)!r}"
                )
        self.losses[...] = state["losses"].numpy()
        self.count[...] = state["count"].numpy()
        self.written[...] = state["written"].numpy()
        self._probabilities = None
