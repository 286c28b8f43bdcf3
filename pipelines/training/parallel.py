"""How the model is spread over the ranks (parallel.strategy): DDP through accelerate, or FSDP2 / HSDP,
torch's `fully_shard` on each block and on the root (as torchtitan shards a transformer); activation
checkpointing of the same blocks under any strategy. A strategy changes where weights, gradients and
optimizer state live, never what a step computes: the loop, the pruner and the data path are the same.

Gradient accumulation under fsdp reduce-scatters every micro-batch (torchtitan's choice): holding the
group's gradients unsharded until its last micro-batch would keep 4 bytes a parameter on every rank,
the memory sharding exists to remove. Under hsdp the all-reduce between replicas (the inter-node
traffic) waits for the group's last micro-batch, except under on_nonfinite_loss=skip: FSDP2 keeps the
waiting sums inside itself, not in the gradients, so a skipped last micro-batch would leave them to be
added into the next group's.

Evaluation (the per-pass held-out loss, the evaluators) runs on whole weights: each rank's share of the
held-out data differs in size, and a sharded forward is a collective every rank must call as often as
the others. Under fsdp each rank gathers the weights (or the EMA's) into an unsharded copy, evaluates as
under ddp, and drops it: 4 bytes a parameter for the evaluation's length, one all-gather a parameter.
"""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from prunepipe.pipelines.trained import export_run
from prunepipe.pipelines.training.ema import with_ema_weights

# where each model keeps its repeated blocks, in forward order: DiT / PixArt, the MAE encoder and
# decoder, the UNet
BLOCK_LISTS = ("transformer_blocks", "encoder.blocks", "decoder_blocks", "down_blocks", "mid_block", "up_blocks")


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in forward order: each is one FSDP unit and one checkpointed region."""
    blocks: list[nn.Module] = []
    for path in BLOCK_LISTS:
        found: nn.Module | None = model
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, (nn.ModuleList, nn.Sequential)):
            blocks.extend(found)
        elif isinstance(found, nn.Module):
            blocks.append(found)
    return blocks


def checkpoint_activations(model: nn.Module, setting) -> int:
    """parallel.activation_checkpointing: recompute every block's (full) or every Nth block's activations in
    backward instead of keeping them. torch's composable checkpoint adds hooks and leaves the module, its
    parameter names and state dict as they are; a recomputed forward is the same arithmetic, so losses and
    gradients are bitwise those without it. Returns how many blocks are checkpointed."""
    from torch.distributed._composable import checkpoint

    every = {"none": 0, "full": 1}.get(setting, setting)
    if not every:
        return 0
    chosen = model_blocks(model)[::every]
    for block in chosen:
        checkpoint(block)
    return len(chosen)


def device_mesh(strategy: str, replicas: int, world: int, local_world: int, device_type: str) -> DeviceMesh:
    """fsdp: one dimension over every rank; hsdp: (replicas, world / replicas), replicas = one per node
    unless parallel.replicas says otherwise."""
    if strategy == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    replicas = replicas or max(1, world // max(1, local_world))
    if world % replicas:
        raise ValueError(
            f"parallel.replicas={replicas} does not divide the {world} ranks; each replica shards over "
            f"world / replicas ranks (0 = one per node: {world // max(1, local_world)})"
        )
    return init_device_mesh(device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, mesh: DeviceMesh, *, bf16: bool, reshard_after_forward: bool) -> int:
    """fully_shard each block, each module a forward calls from outside its own block (the model's
    `called_outside_their_block`, e.g. a DiT's final layer reads block 0's embedder), then the root.
    bf16 computes in bf16 with fp32 master weights and fp32 gradient reductions. Returns the units."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    keywords = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if policy is not None:
        keywords["mp_policy"] = policy
    outside = list(getattr(model, "called_outside_their_block", lambda: [])())
    units = outside + model_blocks(model)
    for unit in units:
        fully_shard(unit, **keywords)
    fully_shard(model, **keywords)
    return len(units) + 1


def parameter_skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` with its parameters on `meta` (no memory) and its buffers copied (some hold
    values computed at build time, such as positional tables): the unsharded shape to gather into."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)


class ModelParallel:
    """The strategy as the loop meets it: the sync decision of a micro-batch, the repair after a skipped
    one, gradient clipping and the forward's autocast."""

    def __init__(
        self,
        strategy: str,
        model: nn.Module,
        accelerator,
        mesh: DeviceMesh | None = None,
        may_skip: bool = False,
        skeleton: nn.Module | None = None,
    ):
        self.strategy, self.model, self.accelerator, self.mesh = strategy, model, accelerator, mesh
        self.skeleton = skeleton  # fsdp: the model unsharded, parameters on `meta` (parameter_skeleton)
        self.sharded = strategy != "ddp"
        # hsdp: replicas all-reduce at a group's last micro-batch only, unless that one may be skipped
        self.defer_all_reduce = strategy == "hsdp" and not may_skip and isinstance(model, FSDPModule)

    def autocast(self):
        """ddp: accelerate's autocast; fsdp: none (the MixedPrecisionPolicy casts the gathered weights)."""
        return nullcontext() if self.sharded else self.accelerator.autocast()

    def before_forward(self, is_step: bool) -> None:
        """hsdp: whether this micro-batch's backward all-reduces between replicas (fsdp always reduces)."""
        if self.defer_all_reduce:
            self.model.set_requires_all_reduce(is_step)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm clipped to `max_norm`: over the shards (a DTensor norm made whole)
        under fsdp, accelerate's under ddp."""
        if not self.sharded:
            return self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total

    def whole(self, weights: list[torch.Tensor] | None = None) -> nn.Module:
        """An unsharded copy on this rank's device holding `weights` (the EMA's shadows, in parameter
        order) or the trained weights, each gathered from every rank's shards: a collective, every rank
        calls it. Under fsdp only (ddp evaluates its own replica)."""
        named = list(self.model.named_parameters())
        weights = weights if weights is not None else [param for _, param in named]
        full = {}
        for (name, _), tensor in zip(named, weights, strict=True):
            tensor = tensor.detach()
            full[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()
        whole = copy.deepcopy(self.skeleton)
        missing, unexpected = whole.load_state_dict(full, strict=False, assign=True)
        left = [key for key in missing if key in dict(whole.named_parameters())]
        if left or unexpected:
            raise RuntimeError(f"whole model: parameters not gathered {left}, unknown {unexpected}")
        return whole.to(next(iter(full.values())).device).eval().requires_grad_(False)

    def export(self, task, ema, run_dir: str) -> None:
        """The trained model's export (RUN/export), written by rank 0: from the model in memory, or under
        fsdp, whose ranks each hold a shard, from the checkpoint just saved, read whole (as `prunepipe export`)."""
        out = os.path.join(run_dir, "export")
        if not self.accelerator.is_main_process:
            return
        if self.sharded:
            export_run(run_dir, out=out)
            return
        bare = self.accelerator.unwrap_model(self.model)
        task.export(bare, with_ema_weights(bare, ema), out)
