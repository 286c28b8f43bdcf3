"""Per-sample random draws (MAE masks, diffusion noise and timesteps) keyed by (seed, pass, id).

A sample's numbers do not depend on its rank, its batch-mates, the world size or a resume, so a
run on 2 ranks x B equals one on 1 rank x 2B, and a resumed run draws what the uninterrupted one
drew. The draws are a counter-based hash (SplitMix64) of (seed, pass, draw, id, element) evaluated
with int64 tensor ops on the batch's device: one handful of kernels per draw, no host generator, no
host-to-device copy. The integer math is exact on every device, so CPU and CUDA give the
same bits; the uniform and normal transforms agree to float tolerance.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch

from prunepipe.pruning.splitmix import GAMMA_I64, mix64_i64, shift_right_i64, signed, stream_key

_UNIFORM_BITS = 24  # a float32 mantissa holds 24 bits exactly: every uniform is k / 2**24 < 1


def hash_bits(key: int, ids: torch.Tensor, elements: int) -> torch.Tensor:
    """int64 [B, elements]: 64 random bits per (id, element) for a 64-bit `key`.

    Sample `id` starts its own SplitMix64 stream at mix64_i64(key + id * gamma); element e is output
    e + 1 of that stream, so it depends on (key, id, e) only."""
    start = mix64_i64(ids.to(torch.int64) * GAMMA_I64 + signed(key))  # [B]
    steps = torch.arange(1, elements + 1, dtype=torch.int64, device=ids.device) * GAMMA_I64  # [E]
    return mix64_i64(start[:, None] + steps[None, :])


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) from the top 24 bits (exact: k / 2**24)."""
    return shift_right_i64(bits, 64 - _UNIFORM_BITS).to(torch.float32) * (1.0 / (1 << _UNIFORM_BITS))


def bits_to_normal_pairs(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent float32 standard normals per 64 bits, by Box-Muller from two 24-bit
    uniforms: u1 in (0, 1] from the top bits (no log 0), u2 in [0, 1) from the low ones. |z| <= 5.77."""
    scale = 1.0 / (1 << _UNIFORM_BITS)
    u1 = (shift_right_i64(bits, 64 - _UNIFORM_BITS) + 1).to(torch.float32) * scale
    u2 = (bits & ((1 << _UNIFORM_BITS) - 1)).to(torch.float32) * scale
    radius, angle = torch.sqrt(-2.0 * torch.log(u1)), (2.0 * math.pi) * u2
    return radius * torch.cos(angle), radius * torch.sin(angle)


class SampleRandomness:
    """Random tensors [B, *shape] for one batch, on the ids' device; each call draws from a fresh
    stream (draw number 1, 2, ... keyed apart), so a task's draws must come in a fixed order."""

    def __init__(self, seed: int, pass_index: int, ids: torch.Tensor, device: torch.device | str | None = None):
        self.seed, self.pass_index = int(seed), int(pass_index)
        ids = torch.as_tensor(ids, dtype=torch.int64)
        self.ids = ids.to(device, non_blocking=True) if device is not None else ids
        self.device = self.ids.device
        self._calls = 0

    def __len__(self) -> int:
        return len(self.ids)

    def _bits(self, elements: int) -> torch.Tensor:
        """int64 [B, elements] for the next draw."""
        self._calls += 1
        key = stream_key(self.seed * 7919 + self._calls, self.pass_index)  # one stream per (seed, draw, pass)
        return hash_bits(key, self.ids, elements)

    def rand(self, *shape: int) -> torch.Tensor:
        return bits_to_uniform(self._bits(math.prod(shape))).reshape(len(self.ids), *shape)

    def randn(self, *shape: int) -> torch.Tensor:
        """Element e < E/2 is the cosine normal of hash e, element E/2 + e its sine partner:
        half the hashing of one normal per hash."""
        elements = math.prod(shape)
        first, second = bits_to_normal_pairs(self._bits((elements + 1) // 2))
        return torch.cat([first, second], dim=1)[:, :elements].reshape(len(self.ids), *shape)

    def randint(self, high: int) -> torch.Tensor:
        """int64 [B] in [0, high); the modulo bias is below high / 2**63."""
        return shift_right_i64(self._bits(1), 1).reshape(-1) % int(high)


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
