"""The device a run trains on: the accelerator (mixed precision, the collectives' timeout), the model,
its optimizer and torch's backend flags set up for it (TF32, fused AdamW, channels_last for the UNet and
torch.compile, per block for DiT, as the `cuda:` config asks: docs/gpu.md), and the debug check that a
step never waits for it (debug_device_sync).
On a CPU every switch is ignored, so CPU runs and tests train exactly as they would without them.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from diffusers import DiTTransformer2DModel, PixArtTransformer2DModel

from prunepipe.pipelines.config import RunConfig
from prunepipe.pipelines.tasks.diffusion.dit import compile_blocks
from prunepipe.pipelines.training.node_tables import local_rank_and_size
from prunepipe.pipelines.training.parallel import (
    ModelParallel,
    checkpoint_activations,
    device_mesh,
    parameter_skeleton,
    shard_model,
)
from prunepipe.pipelines.training.trackers import accelerator_logging


def mixed_precision(cfg: RunConfig) -> str:
    """cfg.mixed_precision, `auto` resolved: bf16 where the GPU has it, else none."""
    if cfg.mixed_precision == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return cfg.mixed_precision


def start_accelerator(cfg: RunConfig) -> Accelerator:
    """The run's Accelerator (and process group, and trackers): a collective that waits longer than
    dist_timeout_seconds fails the job instead of holding it."""
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout_seconds))
    return Accelerator(
        mixed_precision=mixed_precision(cfg),
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=[timeout],
        **accelerator_logging(cfg),  # log_with: the trackers (pipelines/training/trackers.py)
    )


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases, norms and embeddings of one dimension (as MAE and DiT do)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def set_backend_flags(cfg: RunConfig, device: torch.device) -> None:
    """TF32 for matmuls and cuDNN convolutions on CUDA (cuda.tf32); nothing on a CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.cuda.tf32
        torch.backends.cudnn.allow_tf32 = cfg.cuda.tf32


def place_model(cfg: RunConfig, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model on `device`; on CUDA the UNet in channels_last (cuda.channels_last) and the model
    compiled in place (cuda.compile: nn.Module.compile keeps the state-dict keys, so checkpoints and
    exports read the same)."""
    model = model.to(device)
    if device.type != "cuda":
        return model
    # the DiT and PixArt transformers: compiled per block, since a whole-model graph recompiles for every
    # aspect-ratio bucket's shape (and diffusers' compile_repeated_blocks() refuses DiT)
    transformer = isinstance(model, (DiTTransformer2DModel, PixArtTransformer2DModel))
    if cfg.cuda.channels_last and cfg.task == "ldm" and not transformer:  # a convolution layout: the UNet's only
        model = model.to(memory_format=torch.channels_last)
    if cfg.cuda.compile:
        compile_blocks(model) if transformer else model.compile()
    return model


def build_optimizer(cfg: RunConfig, model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the decay / no-decay groups; the fused kernel on CUDA when cuda.fused_adamw."""
    fused = cfg.cuda.fused_adamw and device.type == "cuda"
    return torch.optim.AdamW(
        parameter_groups(model, cfg.optim.weight_decay),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        fused=fused or None,
    )


def prepare_model(cfg: RunConfig, accelerator: Accelerator, model: torch.nn.Module):
    """(the model made ready for the run, its AdamW, the strategy): activation checkpointing, the device,
    then DDP through accelerate's prepare, or FSDP2 / HSDP units (parallel.strategy)."""
    device, par = accelerator.device, cfg.parallel
    set_backend_flags(cfg, device)
    skeleton = parameter_skeleton(model) if par.strategy != "ddp" else None  # evaluation's unsharded copies
    checkpoint_activations(model, par.activation_checkpointing)  # hooks only: names and state dict unchanged
    place_model(cfg, model, device)  # before the optimizer: the fused kernel checks the parameters' device
    if par.strategy == "ddp":
        model, optimizer = accelerator.prepare(model, build_optimizer(cfg, model, device))
        return model, optimizer, ModelParallel("ddp", model, accelerator)
    ensure_process_group(device)
    _, local_world = local_rank_and_size() if accelerator.num_processes > 1 else (0, 1)
    mesh = device_mesh(par.strategy, par.replicas, accelerator.num_processes, local_world, device.type)
    shard_model(model, mesh, bf16=mixed_precision(cfg) == "bf16", reshard_after_forward=par.reshard_after_forward)
    optimizer = build_optimizer(cfg, model, device)  # over the shards
    may_skip = cfg.on_nonfinite_loss == "skip"
    return model, optimizer, ModelParallel(par.strategy, model, accelerator, mesh, may_skip=may_skip, skeleton=skeleton)


def ensure_process_group(device: torch.device) -> None:
    """A process group of one where accelerate made none (one process): FSDP2's mesh needs one. An
    in-memory store, so nothing listens on a port."""
    if not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)


class DeviceWaitCheck:
    """debug_device_sync: any device-to-host synchronisation inside a step is an error on CUDA, from
    the second micro-batch of this process on (the first may wait: lazy setup); off between steps that
    must read the host (checkpoints, pass ends). Nothing at all when not asked for."""

    def __init__(self, on: bool, device: torch.device):
        if on and device.type != "cuda":
            raise ValueError("debug_device_sync=true checks CUDA synchronisation; this run has no CUDA device")
        self.on, self.steps = on and torch.cuda.is_available(), 0

    def step(self) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("error" if self.steps else "default")
            self.steps += 1

    def pause(self) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
