"""Per-sample random draws (MAE masks, diffusion noise and timesteps) keyed by (seed, epoch, id).

A sample's numbers do not depend on its rank, its batch-mates, the world size or a resume, so a
run on 2 ranks x B equals one on 1 rank x 2B, and a resumed run draws what the uninterrupted one
drew. Draws happen on the CPU (one small generator per sample) and move to the device once.
"""

from __future__ import annotations

from typing import Protocol

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


class SampleDraws(Protocol):
    """What a task draws from: SampleRandomness in training, GeneratorDraws where one
    torch.Generator is enough (tests, notebooks)."""

    def rand(self, *shape: int) -> torch.Tensor: ...  # [B, *shape] uniform in [0, 1)
    def randn(self, *shape: int) -> torch.Tensor: ...  # [B, *shape] standard normal
    def randint(self, high: int) -> torch.Tensor: ...  # [B] int64 in [0, high)


class GeneratorDraws:
    """SampleDraws from one torch.Generator: each call draws the whole batch, on its device."""

    def __init__(self, generator: torch.Generator, batch_size: int):
        self.generator, self.batch_size = generator, batch_size

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand((self.batch_size, *shape), generator=self.generator, device=self.generator.device)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn((self.batch_size, *shape), generator=self.generator, device=self.generator.device)

    def randint(self, high: int) -> torch.Tensor:
        return torch.randint(0, high, (self.batch_size,), generator=self.generator, device=self.generator.device)


def batch_draws(source: torch.Generator | SampleDraws, batch_size: int) -> SampleDraws:
    """The task's source of randomness as SampleDraws; the caller owns it, the task draws in order."""
    return GeneratorDraws(source, batch_size) if isinstance(source, torch.Generator) else source


def per_sample_seeded(shape_per_sample: tuple[int, ...], ids: np.ndarray, seed: int, normal: bool) -> torch.Tensor:
    """[B, *shape] float32 noise whose slice for sample `id` depends only on (seed, id): held-out
    masks and noise are the same in every call, batching and process."""
    draws = SampleRandomness(seed, 0, torch.as_tensor(np.asarray(ids, dtype=np.int64)))
    return draws.randn(*shape_per_sample) if normal else draws.rand(*shape_per_sample)
