"""What a task's training step returns per sample: the loss the optimizer sees and, where the task
draws a stratum per sample (diffusion: the timestep), that stratum, so that scores can be compared
within strata (pruning/scores.py). Plain data."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SampleLosses:
    loss: torch.Tensor  # float32 [B]: the per-sample training loss
    stratum: torch.Tensor | None = None  # int64 [B] in [0, task.num_strata), or None
