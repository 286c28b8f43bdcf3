"""Checkpoints on disk, in one format: accelerate's `save_state` folder (model, optimizer, RNG of every
rank), the run's named parts beside them (EMA, pruner, training position, ...: parts.py) and a manifest
written last. A save goes
to a temporary folder that is renamed when complete; a failed save raises and leaves the previous
checkpoints as they were. `latest` means the newest checkpoint whose manifest verifies: damaged ones
are reported with the file and the reason, and skipped.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Callable

import torch

from prunepipe.pipelines.checkpoint.manifest import verify, write_manifest
from prunepipe.pipelines.checkpoint.parts import EMA, POSITION, PRUNER, CheckpointParts, read_part
from prunepipe.pipelines.checkpoint.pruner_state import resolve_tables

CHECKPOINTS = "checkpoints"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or none to resume or evaluate is intact; names the path."""


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def complete_checkpoints(run_dir: str) -> list[str]:
    """Checkpoint folders that were renamed into place (complete when written), oldest first."""
    folder = checkpoints_dir(run_dir)
    if not os.path.isdir(folder):
        return []
    steps = sorted((int(m.group(1)), name) for name in os.listdir(folder) if (m := _STEP.match(name)))
    return [os.path.join(folder, name) for _, name in steps]


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest complete folder, verified or not (see `newest_intact`)."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def newest_intact(run_dir: str, say: Callable[[str], None] = print, doing: str = "resuming from") -> str | None:
    """The newest checkpoint whose manifest verifies; each newer damaged one is reported. None when the
    run has no checkpoint; an error when none is intact."""
    found = complete_checkpoints(run_dir)
    skipped = []
    for folder in reversed(found):
        verdict = verify(folder)
        if verdict.problem is None:
            for i, problem in enumerate(skipped):
                last = i == len(skipped) - 1
                say(f"{problem}; {doing + ' ' + os.path.basename(folder) if last else 'skipped'}")
            return folder
        skipped.append(verdict.describe())
    if found:
        raise CheckpointError(
            f"{checkpoints_dir(run_dir)}: no intact checkpoint ("
            + "; ".join(skipped)
            + "); `prunepipe checkpoints verify RUN` lists them, checkpoint.resume= starts afresh"
        )
    return None


def checked(folder: str, what: str) -> str:
    """`folder` if its manifest verifies, else an error naming the file."""
    verdict = verify(folder)
    if verdict.problem is not None:
        raise CheckpointError(f"{what}={folder}: {verdict.problem}")
    return folder


def resolve_resume(resume: str, run_dir: str, say: Callable[[str], None] = print) -> str | None:
    """`""` -> None; `latest` -> the newest intact checkpoint of this run (or None); else that folder,
    which must verify."""
    if not resume:
        return None
    if resume == "latest":
        return newest_intact(run_dir, say)
    if not os.path.isdir(resume):
        raise FileNotFoundError(f"checkpoint.resume={resume!r}: no such checkpoint folder")
    return checked(resume, "checkpoint.resume")


def choose_resume(accelerator, resume: str, run_dir: str) -> str | None:
    """`resolve_resume` on rank 0, its answer (or its error) broadcast: every rank resumes from the
    same folder even if a shared file system shows them different bytes."""
    from accelerate.utils import broadcast_object_list

    answer: list = [None, None]
    if accelerator.is_main_process:
        try:
            answer[0] = resolve_resume(resume, run_dir)
        except (CheckpointError, FileNotFoundError) as e:
            answer[1] = e
    if accelerator.num_processes > 1:
        broadcast_object_list(answer, from_process=0)
    if answer[1] is not None:
        raise answer[1]
    return answer[0]


def load_resume(accelerator, folder: str, parts: CheckpointParts) -> None:
    """accelerate's load_state (model, optimizer, RNG), then the run's parts by name; a failure named
    by the folder (a checkpoint that verifies can still fail to load, e.g. one of another model)."""
    try:
        accelerator.load_state(folder)
        parts.load(folder)
    except ValueError:  # a part refusing this run's settings (another group table, another pruner): said as is
        raise
    except Exception as e:  # noqa: BLE001 - safetensors, pickle and torch raise their own types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{folder}: cannot be loaded ({type(e).__name__}: {first}); resume from an older "
            f"checkpoint with checkpoint.resume=PATH"
        ) from e


def save_checkpoint(accelerator, run_dir: str, step: int, keep: int, parts: CheckpointParts) -> str:
    """Every rank calls this (each saves its RNG state); rank 0 writes the model, the optimizer and the
    named `parts`, the manifest, renames and prunes.
    A failure on any rank raises on every rank, removes the partial folder and touches no older one."""
    folder = checkpoints_dir(run_dir)
    final = os.path.join(folder, f"{PREFIX}{step:06d}")
    tmp = os.path.join(folder, f"{TMP_PREFIX}{PREFIX}{step:06d}")
    is_main = accelerator.is_main_process
    if is_main:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):  # leftovers of a run killed while saving
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    accelerator.wait_for_everyone()
    failure = _attempt(lambda: accelerator.save_state(tmp))
    if is_main and failure is None:
        failure = _attempt(lambda: parts.save(tmp))
    _raise_on_any_rank(accelerator, failure, final, tmp, run_dir)
    if is_main:
        failure = _attempt(lambda: _seal(tmp, final, step))
    _raise_on_any_rank(accelerator, failure, final, tmp, run_dir)
    if is_main:  # the new checkpoint verifies (its manifest was just made from its files) and is kept
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _seal(tmp: str, final: str, step: int) -> None:
    """Manifest last, then the rename that makes the checkpoint visible."""
    write_manifest(tmp, step)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final))


def _attempt(action) -> BaseException | None:
    try:
        action()
    except Exception as e:  # noqa: BLE001 - OSError, torch's RuntimeError, safetensors' own: all a failed save
        return e
    return None


def _raise_on_any_rank(accelerator, failure: BaseException | None, final: str, tmp: str, run_dir: str) -> None:
    failed = torch.tensor([0 if failure is None else 1], device=accelerator.device)
    if accelerator.num_processes > 1:  # a collective every rank reaches: no rank waits for a dead save
        failed = accelerator.reduce(failed, reduction="sum")
    if int(failed.item()) == 0:
        return
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    previous = latest_checkpoint(run_dir)
    cause = f"{type(failure).__name__}: {failure}" if failure is not None else "another rank failed to write its part"
    raise CheckpointError(
        f"saving checkpoint {final} failed ({cause}); the previous checkpoints are untouched"
        f"{' (newest: ' + previous + ')' if previous else ''}; check free space, quota and "
        f"permissions of {os.path.dirname(final)}"
    ) from failure


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint_states(checkpoint: str, read_model: bool = True, read_tables: bool = True) -> dict:
    """{"model": state dict, "ema": EMAModel state | None, "pruner": state | None, "position": dict | None}
    of one checkpoint folder, its parts read by name (parts.py).
    `read_model=False` leaves the weights unread ("model": None), for readers of the pruner state only;
    `read_tables=False` leaves the pruner's table files unread (their names stay), for readers of the weights."""
    from safetensors.torch import load_file

    weights = os.path.join(checkpoint, "model.safetensors")
    if not read_model:
        model = None
    elif os.path.isfile(weights):
        model = load_file(weights)
    elif os.path.isfile(os.path.join(checkpoint, "pytorch_model.bin")):
        model = torch.load(os.path.join(checkpoint, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{checkpoint}: no model.safetensors (not an accelerate checkpoint of prunepipe train)")
    pruner = read_part(checkpoint, PRUNER)
    if pruner is not None and read_tables:
        pruner = resolve_tables(pruner, checkpoint)
    return {
        "model": model,
        "ema": read_part(checkpoint, EMA),
        "pruner": pruner,
        "position": read_part(checkpoint, POSITION),
    }
