"""Atomic checkpoints in one format: accelerate's `save_state` folder (model, optimizer, scaler,
RNG of every rank, and the registered pruner, EMA and training position), written to a temporary
folder and renamed when complete. `latest` is the newest complete folder; a half-written one
is never picked and is removed by the next save.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass, fields

import numpy as np
import torch

CHECKPOINTS = "checkpoints"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")


@dataclass
class TrainingPosition:
    """Where the run is: enough, with the pruner's frozen plan, to continue the pass exactly."""

    epoch: int = 0
    batch_in_pass: int = 0  # micro-batches of this rank already trained in the pass (or segment)
    optimizer_steps: int = 0
    samples_forwarded: int = 0  # over all ranks, padding excluded
    skipped_nonfinite: int = 0
    bad_samples: int = 0
    wall_seconds: float = 0.0
    world_size: int = 1  # the layout the pass was running under
    num_workers: int = 0
    # A pass resumed under another world size continues as a "segment" over the samples no rank
    # had trained on: `excluded` marks those already consumed when it began, `pass_offset` is
    # the fraction of the pass they were (for the LR schedule).
    pass_offset: float = 0.0
    excluded: np.ndarray | None = None  # bool [N] or None
    consumed: np.ndarray | None = None  # bool [N]: ids trained on in this pass, on every rank
    # int64 [world * workers]: undecodable samples each rank's worker part met in this pass so far;
    # a resume under the same layout skips them with the batches they were read for.
    undecodable: np.ndarray | None = None

    def state_dict(self) -> dict:
        state = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "undecodable" and value is not None:
                state[f.name] = [int(v) for v in value]
            elif isinstance(value, np.ndarray):  # a bool mask, as packed bits: N / 8 bytes
                state[f.name] = torch.from_numpy(np.packbits(value))
                state[f.name + "_len"] = len(value)
            elif value is not None:
                state[f.name] = value
        return state

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            if f.name in ("excluded", "consumed"):
                packed = state.get(f.name)
                value = None if packed is None else np.unpackbits(
                    np.asarray(packed), count=int(state[f.name + "_len"])).astype(bool)
                setattr(self, f.name, value)
            elif f.name == "undecodable":
                value = state.get(f.name)
                setattr(self, f.name, None if value is None else np.asarray(value, dtype=np.int64))
            elif f.name in state:
                setattr(self, f.name, type(f.default)(state[f.name]))


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def complete_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoint folders, oldest first."""
    folder = checkpoints_dir(run_dir)
    if not os.path.isdir(folder):
        return []
    steps = sorted((int(m.group(1)), name) for name in os.listdir(folder) if (m := _STEP.match(name)))
    return [os.path.join(folder, name) for _, name in steps]


def latest_checkpoint(run_dir: str) -> str | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(resume: str, run_dir: str) -> str | None:
    """`""` -> None; `latest` -> newest complete checkpoint of this run (or None); else a path."""
    if not resume:
        return None
    if resume == "latest":
        return latest_checkpoint(run_dir)
    if not os.path.isdir(resume):
        raise FileNotFoundError(f"checkpoint.resume={resume!r}: no such checkpoint folder")
    return resume


def save_checkpoint(accelerator, run_dir: str, step: int, keep: int) -> str:
    """Every rank calls this (each saves its RNG state); rank 0 renames and prunes."""
    folder = checkpoints_dir(run_dir)
    final = os.path.join(folder, f"{PREFIX}{step:06d}")
    tmp = os.path.join(folder, f"{TMP_PREFIX}{PREFIX}{step:06d}")
    if accelerator.is_main_process:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):  # leftovers of a run killed while saving
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(folder)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint_states(checkpoint: str) -> dict:
    """{"model": state dict, "ema": EMAModel state | None, "pruner": state | None, "position": dict | None}
    of one accelerate `save_state` folder; the registered objects are told apart by their keys."""
    from safetensors.torch import load_file

    weights = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(weights):
        model = load_file(weights)
    elif os.path.isfile(os.path.join(checkpoint, "pytorch_model.bin")):
        model = torch.load(os.path.join(checkpoint, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{checkpoint}: no model.safetensors (not an accelerate checkpoint of prunepipe train)")
    found = {"model": model, "ema": None, "pruner": None, "position": None}
    for path in sorted(glob.glob(os.path.join(checkpoint, "custom_checkpoint_*.pkl"))):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "shadow_params" in state:
            found["ema"] = state
        elif isinstance(state, dict) and "tables" in state and "pruner" in state:
            found["pruner"] = state
        elif isinstance(state, dict) and "optimizer_steps" in state and "epoch" in state:
            found["position"] = state
    return found
