"""Per-sample random draws (MAE masks, diffusion noise and timesteps) keyed by (seed, epoch, id).

A sample's numbers do not depend on its rank, its batch-mates, the world size or a resume, so a
run on 2 ranks x B equals one on 1 rank x 2B, and a resumed run draws what the uninterrupted one
drew. Draws happen on the CPU (one small generator per sample) and move to the device once.
"""

from __future__ import annotations

import numpy as np
import torch

from pruning.base import uniform_coin

_SEED_SPACE = float(2**53)


class SampleRandomness:
    """Random tensors [B, *shape] for one batch; each call draws from a fresh stream."""

    def __init__(self, seed: int, epoch: int, ids: torch.Tensor, device: torch.device | str = "cpu"):
        self.seed, self.epoch, self.device = int(seed), int(epoch), torch.device(device)
        self.ids = ids.detach().to("cpu", torch.int64).numpy()
        self._calls = 0

    def __len__(self) -> int:
        return len(self.ids)

    def _generators(self) -> list[torch.Generator]:
        self._calls += 1
        # Stream `calls` of sample `id`: a 53-bit seed from the counter-based coin, keyed apart by call.
        stream_seed = self.seed * 7919 + self._calls
        seeds = (uniform_coin(stream_seed, self.epoch, self.ids) * _SEED_SPACE).astype(np.int64)
        generators = []
        for s in seeds.tolist():
            g = torch.Generator()
            g.manual_seed(s)
            generators.append(g)
        return generators

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.stack([torch.rand(shape, generator=g) for g in self._generators()]).to(self.device)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.stack([torch.randn(shape, generator=g) for g in self._generators()]).to(self.device)

    def randint(self, high: int) -> torch.Tensor:
        draws = [torch.randint(high, (1,), generator=g) for g in self._generators()]
        return torch.cat(draws).to(self.device)
