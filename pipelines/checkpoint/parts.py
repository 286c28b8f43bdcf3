"""A checkpoint's named parts: what the run keeps beside the model, optimizer and EMA weights that
torch.distributed.checkpoint writes (sharded.py), each in a file named for what it holds, whichever options
are on: `ema.pt` (its settings and step count), `pruner.pt` (its tables in `pruner_tables/`,
pruner_state.py), `position.pt`, `score_normaliser.pt`, `timestep_sampler.pt`. A part is found by its
name, and a part the run has and the checkpoint lacks (or the reverse) is refused by name. Opens only
files of the folder it is given.
"""

from __future__ import annotations

import os

import torch

from prunepipe.pipelines.checkpoint.pruner_state import TABLES

EMA = "ema"
PRUNER = "pruner"
POSITION = "position"
SCORE_NORMALISER = "score_normaliser"
TIMESTEP_SAMPLER = "timestep_sampler"
NAMES = (EMA, PRUNER, POSITION, SCORE_NORMALISER, TIMESTEP_SAMPLER)
SUFFIX = ".pt"


def part_file(name: str) -> str:
    """The file of part `name` in a checkpoint folder (relative to it)."""
    return name + SUFFIX


def is_part_file(relative: str) -> bool:
    """Whether `relative` (a path in a checkpoint folder) is a part's or a pruner table's, not accelerate's."""
    return relative in {part_file(name) for name in NAMES} or relative.startswith(TABLES + "/")


class CheckpointParts:
    """The run's parts by name: objects with `state_dict()` / `load_state_dict(state)`; a part that
    keeps files of its own (the pruner's tables) has `write_files(folder)` / `read_files(folder)` too.
    None stands for a part the run has not (no score normaliser, no timestep sampler)."""

    def __init__(self, **parts):
        unknown = sorted(set(parts) - set(NAMES))
        if unknown:
            raise ValueError(f"checkpoint parts {unknown}: the parts are {', '.join(NAMES)}")
        self.parts = {name: part for name, part in parts.items() if part is not None}

    def save(self, folder: str) -> None:
        """Every part into `folder` (on the main process only)."""
        for name, part in self.parts.items():
            torch.save(part.state_dict(), os.path.join(folder, part_file(name)))
            if hasattr(part, "write_files"):
                part.write_files(folder)

    def load(self, folder: str) -> None:
        """Every part from `folder` (on every rank), read on the host: a part moves what it loads to
        its device itself (the EMA does)."""
        held = {name for name in NAMES if os.path.isfile(os.path.join(folder, part_file(name)))}
        if held != set(self.parts):
            missing, extra = sorted(set(self.parts) - held), sorted(held - set(self.parts))
            raise ValueError(
                f"{folder}: "
                + "; ".join(
                    [f"holds no {', '.join(part_file(n) for n in missing)}, which this run keeps"] * bool(missing)
                    + [f"holds {', '.join(part_file(n) for n in extra)}, which this run does not keep"] * bool(extra)
                )
                + " (score.normalise or ldm.ddpm.timestep_sampling changed since it was written?)"
            )
        for name, part in self.parts.items():
            part.load_state_dict(
                torch.load(os.path.join(folder, part_file(name)), map_location="cpu", weights_only=True)
            )
            if hasattr(part, "read_files"):
                part.read_files(folder)


def read_part(folder: str, name: str):
    """Part `name`'s state as saved in `folder` (on the host), None when the checkpoint has none."""
    path = os.path.join(folder, part_file(name))
    return torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None
