"""Checkpoints on disk, in one format: the model, the optimizer and the EMA's weights through
torch.distributed.checkpoint, every rank writing what it holds (sharded.py), the run's named parts beside
them (EMA settings, pruner, training position, ...: parts.py) and a manifest written last. A save goes
to a temporary folder that is renamed when complete; a failed save raises and leaves the previous
checkpoints as they were. `latest` means the newest checkpoint whose manifest verifies: damaged ones
are reported with the file and the reason, and skipped. Resuming from one that is not the newest
moves the newer ones aside (`abandon_newer`), so that the next `latest` is the branch that goes on.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from typing import Callable

import torch
from torch.distributed.checkpoint import CheckpointException

from prunepipe.pipelines.atomic_write import sync_directory
from prunepipe.pipelines.checkpoint.manifest import FORMAT, file_entry, manifest_format, verify, write_manifest
from prunepipe.pipelines.checkpoint.parts import EMA, POSITION, PRUNER, CheckpointParts, read_part
from prunepipe.pipelines.checkpoint.pruner_state import resolve_tables
from prunepipe.pipelines.checkpoint.sharded import EMA_WEIGHTS, MODEL, TrainingState, is_sharded, read_whole

CHECKPOINTS = "checkpoints"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
ABANDONED_PREFIX = "abandoned-"
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


def load_resume(folder: str, state: TrainingState, parts: CheckpointParts) -> None:
    """The model, optimizer and EMA weights (every rank its share, at this run's world size and strategy),
    then the run's parts by name; a failure named by the folder (a checkpoint that verifies can still fail
    to load, e.g. one of another model)."""
    if not is_sharded(folder):
        raise CheckpointError(
            f"{folder}: checkpoint format {manifest_format(folder)} (accelerate's save_state: model.safetensors, "
            f"optimizer.bin) cannot be resumed by this version, which resumes format {FORMAT} "
            f"(torch.distributed.checkpoint); start a stage from its weights and EMA with init.weights={folder}, "
            f"or finish the run with the version that wrote it"
        )
    try:
        state.load(folder)
        parts.load(folder)
    except ValueError:  # a part refusing this run's settings (another group table, another pruner): said as is
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP, pickle and torch raise their own types
        first = (
            _last_line(e)
            if isinstance(e, CheckpointException)
            else str(e).strip().splitlines()[0]
            if str(e).strip()
            else type(e).__name__
        )
        raise CheckpointError(
            f"{folder}: cannot be loaded ({type(e).__name__}: {first}); resume from an older "
            f"checkpoint with checkpoint.resume=PATH"
        ) from e


def save_checkpoint(
    accelerator, run_dir: str, step: int, keep: int, parts: CheckpointParts, state: TrainingState
) -> str:
    """Every rank calls this and writes its share of `state` (model, optimizer, EMA weights) and the
    manifest entries of its own files; rank 0 writes the named `parts`, the manifest, renames and prunes.
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
    entries: dict = {}

    def write_own_share() -> None:  # each rank sums up its own files: nobody reads the whole checkpoint back
        for path in state.save(tmp):
            entries[os.path.relpath(path, tmp)] = file_entry(path)

    failure = _attempt(write_own_share)
    if is_main and failure is None:
        failure = _attempt(lambda: parts.save(tmp))
    _raise_on_any_rank(accelerator, failure, final, tmp, run_dir)
    known = _gathered_entries(accelerator, entries)
    if is_main:
        failure = _attempt(lambda: _seal(tmp, final, step, known))
    _raise_on_any_rank(accelerator, failure, final, tmp, run_dir)
    if is_main:  # the new checkpoint verifies (its manifest was just made from its files) and is kept
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _gathered_entries(accelerator, entries: dict) -> dict:
    """Every rank's manifest entries of the files it wrote, merged (on every rank)."""
    if accelerator.num_processes == 1:
        return entries
    gathered: list = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, entries)
    return {name: entry for part in gathered for name, entry in part.items()}


def _seal(tmp: str, final: str, step: int, known: dict) -> None:
    """Manifest last, then the rename that makes the checkpoint visible."""
    write_manifest(tmp, step, known)
    if os.path.exists(final):  # the same step again, after its pass's end: the older copy goes once replaced
        aside = os.path.join(os.path.dirname(final), f"{TMP_PREFIX}replaced-{os.path.basename(final)}")
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, final)
    sync_directory(os.path.dirname(final))


def _attempt(action) -> BaseException | None:
    try:
        action()
    except Exception as e:  # noqa: BLE001 - OSError, torch's RuntimeError: all a failed save
        return e
    except CheckpointException as e:  # DCP's (a BaseException): each failed rank's traceback, the cause last
        return OSError(_last_line(e))
    return None


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


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


def abandon_newer(run_dir: str, resumed: str, say: Callable[[str], None] = print) -> str | None:
    """Resuming from `resumed`, an older checkpoint of this run (a rollback): its newer checkpoints belong to
    the branch given up, so they move into checkpoints/abandoned-TIME/ (named in the log) before the run
    saves again; `latest` and retention then see the live branch only. Returns the folder they went to."""
    match = _STEP.match(os.path.basename(os.path.normpath(resumed)))
    if not match or os.path.abspath(os.path.dirname(os.path.normpath(resumed))) != os.path.abspath(
        checkpoints_dir(run_dir)
    ):
        return None  # another run's checkpoint: nothing of this run's to set aside
    at = int(match.group(1))
    newer = [f for f in complete_checkpoints(run_dir) if int(_STEP.match(os.path.basename(f)).group(1)) > at]
    if not newer:
        return None
    aside = os.path.join(checkpoints_dir(run_dir), ABANDONED_PREFIX + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(aside, exist_ok=True)
    for folder in newer:
        os.replace(folder, os.path.join(aside, os.path.basename(folder)))
    sync_directory(checkpoints_dir(run_dir))
    say(
        f"rolled back to {os.path.basename(resumed)}: {len(newer)} newer checkpoint(s) "
        f"({', '.join(os.path.basename(f) for f in newer)}) moved to {aside}"
    )
    return aside


def load_checkpoint_states(checkpoint: str, read_model: bool = True, read_tables: bool = True) -> dict:
    """{"model": state dict, "ema": EMAModel state | None, "pruner": state | None, "position": dict | None}
    of one checkpoint folder, its parts read by name (parts.py).
    `read_model=False` leaves the weights and the EMA's unread ("model": None, no "shadow_params"), for
    readers of the pruner state only;
    `read_tables=False` leaves the pruner's table files unread (their names stay), for readers of the weights."""
    from safetensors.torch import load_file

    weights = os.path.join(checkpoint, "model.safetensors")  # format 1: accelerate's files
    if not read_model:
        model = None
    elif is_sharded(checkpoint):
        model = read_whole(checkpoint, MODEL)
    elif os.path.isfile(weights):
        model = load_file(weights)
    elif os.path.isfile(os.path.join(checkpoint, "pytorch_model.bin")):
        model = torch.load(os.path.join(checkpoint, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{checkpoint}: no weights (neither a DCP .metadata nor model.safetensors)")
    pruner = read_part(checkpoint, PRUNER)
    if pruner is not None and read_tables:
        pruner = resolve_tables(pruner, checkpoint)
    ema = read_part(checkpoint, EMA)
    if ema is not None and "names" in ema:  # format 2: the weights beside the settings, by parameter name
        names = ema.pop("names")
        if read_model and is_sharded(checkpoint):
            shadow = read_whole(checkpoint, EMA_WEIGHTS) or {}
            ema["shadow_params"] = [shadow[name] for name in names]
    return {
        "model": model,
        "ema": ema,
        "pruner": pruner,
        "position": read_part(checkpoint, POSITION),
    }
