"""Atomic checkpoints in one format: accelerate's `save_state` folder (model, optimizer, scaler,
RNG of every rank, and the registered pruner, EMA and training position), written to a temporary
folder and renamed when complete. `latest` is the newest complete folder; a half-written one
is never picked and is removed by the next save.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass

CHECKPOINTS = "checkpoints"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")


@dataclass
class TrainingPosition:
    """Where the run is: enough, with the pruner's frozen plan, to continue the pass exactly."""

    epoch: int = 0
    batch_in_pass: int = 0  # micro-batches of this rank already trained in the pass
    optimizer_steps: int = 0
    samples_forwarded: int = 0  # over all ranks, padding excluded
    skipped_nonfinite: int = 0
    bad_samples: int = 0
    wall_seconds: float = 0.0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))


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
