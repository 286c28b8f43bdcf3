"""The model, its optimizer and the EMA's weights in a checkpoint, through torch.distributed.checkpoint
(DCP): every rank writes what it holds, in parallel (its shards under fsdp; under ddp the planner writes
each replicated tensor once), and any world size reads it back under any strategy, since DCP cuts the
saved tensors to what each reading rank holds. Everything is keyed by parameter name, so ddp and fsdp
runs read each other's checkpoints. Loaded tensors land in the run's own (device) tensors.
Opens only the folder it is given.
"""

from __future__ import annotations

import glob
import os
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

MODEL = "model"
OPTIMIZER = "optimizer"
EMA_WEIGHTS = "ema_weights"
METADATA = ".metadata"  # DCP's index of every saved tensor and its pieces, written by rank 0 last


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _one_process_quietly():
    """DCP warns on every call without a process group that it assumes one process: so it is, here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class ModelState(Stateful):
    """The model's state dict by parameter name (DTensor shards under fsdp, whole tensors under ddp)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState(Stateful):
    """AdamW's moments and steps keyed by parameter name (not by position), so that they follow the
    parameters across strategies and world sizes."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


class EMAWeights(Stateful):
    """The EMA's shadow weights by the name of the parameter each follows (sharded as it is)."""

    def __init__(self, ema, names: list[str]):
        if len(names) != len(ema.shadow_params):
            raise ValueError(f"{len(names)} parameter names for {len(ema.shadow_params)} EMA weights")
        self.ema, self.names = ema, names

    def state_dict(self) -> dict:
        return dict(zip(self.names, self.ema.shadow_params))

    def load_state_dict(self, state: dict) -> None:
        for name, shadow in zip(self.names, self.ema.shadow_params):
            if state[name] is not shadow:
                shadow.copy_(state[name])


class TrainingState:
    """What DCP saves of a run: the model, the optimizer and (when kept) the EMA's weights."""

    def __init__(self, model, optimizer, ema=None, names: list[str] | None = None):
        self.parts = {MODEL: ModelState(model), OPTIMIZER: OptimizerState(model, optimizer)}
        if ema is not None:
            self.parts[EMA_WEIGHTS] = EMAWeights(ema, names or [])

    def save(self, folder: str) -> list[str]:
        """Every rank writes its pieces into `folder` (collective); returns the files this rank wrote."""
        rank = dist.get_rank() if _distributed() else 0
        with _one_process_quietly():
            dcp.save(self.parts, checkpoint_id=folder, no_dist=not _distributed())
        return sorted(glob.glob(os.path.join(folder, f"__{rank}_*.distcp")))

    def load(self, folder: str) -> None:
        """Every rank reads what it holds from `folder` (collective), resharded to this run's layout."""
        with _one_process_quietly():
            dcp.load(self.parts, checkpoint_id=folder, no_dist=not _distributed())


def is_sharded(folder: str) -> bool:
    """Whether `folder` holds a DCP checkpoint (format 2)."""
    return os.path.isfile(os.path.join(folder, METADATA))


def read_whole(folder: str, section: str) -> dict[str, torch.Tensor] | None:
    """One part (MODEL, OPTIMIZER's tensors or EMA_WEIGHTS) of a DCP checkpoint as whole tensors on the
    host, keyed by name, on one process (eval, export, init.weights, comparisons); None when absent."""
    reader = dcp.FileSystemReader(folder)
    prefix = section + "."
    target = {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not target:
        return None
    with _one_process_quietly():
        dcp.load({section: target}, storage_reader=reader, no_dist=True)
    return target
