"""The Task: what the training loop (pipelines/training/) asks of a task, and all it asks. MAETask and
DiffusionTask provide it; a new task provides it and is one entry of build.py's TASKS. The builder, the
loop and the evaluator hold a task as a Task, and mypy checks that each task provides it
(tests/test_packaging.py). The evaluators may read a task's own fields as well (a diffusion task's
autoencoder, say); the loop never does (tests/test_layout.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn as nn

from prunepipe.pipelines.tasks.randomness import SampleDraws
from prunepipe.pipelines.tasks.sample_losses import SampleLosses


@dataclass(frozen=True)
class TextReading:
    """The text a text-conditional task's batches carry, and the encoder its features come from."""

    captions: bool  # batches carry captions (txt) for an encoder the task runs
    features: tuple[int, int]  # (width, max tokens) of the precomputed text features batches carry, or (0, 0)
    identity: str  # the encoder's files and caption length: equal on every rank, unchanged by a resume
    encoder: str  # the encoder's name (its folder, or the record of precomputed features), for messages

    @property
    def precomputed(self) -> bool:
        return self.features != (0, 0)


@runtime_checkable
class Task(Protocol):
    model: nn.Module  # the module trained; the loop wraps it (DDP, compile) and passes the wrapper back

    # read-only: a task may answer each by an attribute or a property
    @property
    def num_strata(self) -> int:
        """Per-sample strata its scores are comparable within (0: none)."""

    @property
    def label_classes(self) -> int:
        """Labels a batch must hold fewer than (0: labels unused), checked by the decoder."""

    @property
    def text(self) -> TextReading | None:
        """The text its batches carry (None: no text)."""

    @property
    def timestep_sampler(self) -> object | None:
        """State the checkpoint keeps beside the model (a stateful sampler), or None."""

    def per_sample(self, model: nn.Module, batch, generator: torch.Generator | SampleDraws) -> SampleLosses:
        """The batch's per-sample losses [B] (and strata) from the draws of `generator`, through `model`."""

    def observe(self, ids: np.ndarray, strata: np.ndarray | None, scores: np.ndarray) -> None:
        """Every rank's gathered batch after each step, one step late (a sampler that learns from losses)."""

    def held_out(self, model: nn.Module, batches: Iterable, seed: int = 0) -> dict:
        """The held-out loss of `model` on `batches`, with each sample's draws fixed by (seed, id)."""

    def export(self, model: nn.Module, ema_model, out_dir: str) -> list[str]:
        """What a user loads after training (the EMA weights when given) into `out_dir`; the paths written."""
