"""What a task's training step returns per sample: the loss the optimizer sees, where the task draws
a stratum per sample (diffusion: the timestep) that stratum, so that scores can be compared within
strata (pruning/scores.py), and the score the pruner sees when it is not the loss (an importance-
weighted loss is scored without its weight). Plain data."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SampleLosses:
    loss: torch.Tensor  # float32 [B]: the per-sample training loss
    stratum: torch.Tensor | None = None  # int64 [B] in [0, task.num_strata), or None
    score: torch.Tensor | None = None  # float32 [B] what the pruner sees, when not the loss (detached)

    def for_pruner(self) -> torch.Tensor:
        return (self.score if self.score is not None else self.loss).detach().float()
