"""All-gather of per-sample ids and losses over ranks, so every rank's pruner sees the global batch.

The only place pruning/ touches torch.distributed. Ids travel as int64 and losses as float32 in
two separate collectives (packing ids into a float tensor corrupts them beyond 2**24 or 2**53).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .base import as_ids, as_losses

if TYPE_CHECKING:  # imported where used: the package imports without torch (a config check needs none)
    import torch


def _collective_device() -> torch.device:
    """The device the process group's backend gathers on: CUDA for NCCL, CPU for gloo."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return as_ids(ids), as_losses(losses), None if strata is None else as_ids(strata)
    ids, losses, strata = gather_tensors(
        torch.as_tensor(ids), torch.as_tensor(losses), None if strata is None else torch.as_tensor(strata)
    )
    return ids.cpu().numpy(), losses.cpu().numpy(), None if strata is None else strata.cpu().numpy()


def gather_tensors(ids: torch.Tensor, losses: torch.Tensor, strata: torch.Tensor | None = None):
    """`gather_batch` without leaving the device: (ids int64, losses float32, strata int64 | None)
    tensors [world * B] on the collective's device, for a loop that must not wait on a host copy.
    On one process they are the inputs, detached, flattened and typed."""
    import torch
    import torch.distributed as dist

    ids_tensor = ids.detach().reshape(-1).to(torch.int64)
    losses_tensor = losses.detach().reshape(-1).to(torch.float32)
    strata_tensor = None if strata is None else strata.detach().reshape(-1).to(torch.int64)
    if ids_tensor.shape != losses_tensor.shape:
        raise ValueError(f"gather_ids_losses got {ids_tensor.numel()} ids and {losses_tensor.numel()} losses")
    if strata_tensor is not None and strata_tensor.shape != ids_tensor.shape:
        raise ValueError(f"gather_batch got {ids_tensor.numel()} ids and {strata_tensor.numel()} strata")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ids_tensor, losses_tensor, strata_tensor
    device = _collective_device()
    ids_tensor, losses_tensor = ids_tensor.to(device), losses_tensor.to(device)
    integers = ids_tensor[None] if strata_tensor is None else torch.stack([ids_tensor, strata_tensor.to(device)])
    gathered = torch.cat(_all_gather(integers), dim=1)  # [rows, world * B], rank order
    gathered_losses = torch.cat(_all_gather(losses_tensor))
    return gathered[0], gathered_losses, (gathered[1] if strata_tensor is not None else None)


def _all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor`, in rank order."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts
