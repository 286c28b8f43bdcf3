"""All-gather of per-sample ids and losses over ranks, so every rank's pruner sees the global batch.

The only place pruning/ touches torch.distributed. Ids travel as int64 and losses as float32 in
two separate collectives (packing ids into a float tensor corrupts them beyond 2**24 or 2**53).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .base import as_ids, as_losses


def _collective_device() -> torch.device:
    """The device the process group's backend gathers on: CUDA for NCCL, CPU for gloo."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


def gather_ids_losses(ids: Any, losses: Any) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [world * B], losses float32 [world * B]) in rank order; every rank passes equal B.

    Without an initialised process group this is a conversion to numpy. Pad a short last batch
    with id -1 (pruners ignore ids < 0) rather than passing a different B, or ranks will hang.
    """
    ids, losses, _ = gather_batch(ids, losses)
    return ids, losses


def gather_batch(ids: Any, losses: Any, strata: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`gather_ids_losses` with the samples' strata (int64, e.g. diffusion timesteps) when given:
    they travel in the ids' integer collective, two rows of one int64 tensor."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return as_ids(ids), as_losses(losses), None if strata is None else as_ids(strata)
    device = _collective_device()
    ids_tensor = torch.as_tensor(ids).detach().reshape(-1).to(device=device, dtype=torch.int64)
    losses_tensor = torch.as_tensor(losses).detach().reshape(-1).to(device=device, dtype=torch.float32)
    if ids_tensor.shape != losses_tensor.shape:
        raise ValueError(f"gather_ids_losses got {ids_tensor.numel()} ids and {losses_tensor.numel()} losses")
    integers = ids_tensor[None]
    if strata is not None:
        strata_tensor = torch.as_tensor(strata).detach().reshape(-1).to(device=device, dtype=torch.int64)
        if strata_tensor.shape != ids_tensor.shape:
            raise ValueError(f"gather_batch got {ids_tensor.numel()} ids and {strata_tensor.numel()} strata")
        integers = torch.stack([ids_tensor, strata_tensor])
    gathered = torch.cat(_all_gather_rows(integers), dim=1).cpu().numpy()  # [rows, world * B], rank order
    gathered_losses = _all_gather(losses_tensor).cpu().numpy()
    return gathered[0], gathered_losses, (gathered[1] if strata is not None else None)


def _all_gather_rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts
