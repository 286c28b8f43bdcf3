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
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return as_ids(ids), as_losses(losses)
    device = _collective_device()
    ids_tensor = torch.as_tensor(ids).detach().reshape(-1).to(device=device, dtype=torch.int64)
    losses_tensor = torch.as_tensor(losses).detach().reshape(-1).to(device=device, dtype=torch.float32)
    if ids_tensor.shape != losses_tensor.shape:
        raise ValueError(f"gather_ids_losses got {ids_tensor.numel()} ids and {losses_tensor.numel()} losses")
    gathered_ids = _all_gather(ids_tensor)
    gathered_losses = _all_gather(losses_tensor)
    return gathered_ids.cpu().numpy(), gathered_losses.cpu().numpy()
