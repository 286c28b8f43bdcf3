"""The pruner in a checkpoint at any scale: its small state is the checkpoint's part `pruner.pt`
(parts.py), each per-sample table to `pruner_tables/NAME.npy`, written once per
run by the main process straight from the table's memory (process or node-shared) a chunk at a time,
and read back the same way into the table, so no second copy of a table exists while saving or
loading. Opens only files of the checkpoint folder it is given.
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np
import torch

TABLES = "pruner_tables"
_CHUNK_BYTES = 1 << 26


class CheckpointedPruner:
    """The checkpoint's pruner part: `state_dict` names the table files that `write_files` writes;
    `load_state_dict` then `read_files(folder)` restores the pruner."""

    def __init__(self, pruner):
        self.pruner = pruner
        self._pending: dict | None = None

    def state_dict(self) -> dict:
        state = self.pruner.state_dict()
        state["tables"] = {name: f"{TABLES}/{name}.npy" for name in state["tables"]}
        return state

    def load_state_dict(self, state: dict) -> None:
        self._pending = state  # the tables follow in read_files, from the folder

    def write_files(self, folder: str) -> None:
        """Every table to `folder/pruner_tables/` (call on the main process only)."""
        os.makedirs(os.path.join(folder, TABLES), exist_ok=True)
        for name, table in self.pruner.tables().items():  # not state_dict(): it would copy the plan too
            np.save(os.path.join(folder, TABLES, f"{name}.npy"), table)  # straight from the table's memory

    def read_files(self, folder: str) -> None:
        """Stream the tables of the state just loaded from `folder` into the pruner's own."""
        if self._pending is None:
            return
        readers = {
            name: partial(read_npy_into, os.path.join(folder, relative))
            for name, relative in self._pending["tables"].items()
        }
        self.pruner.load_state_dict({**self._pending, "tables": readers})
        self._pending = None


def read_npy_into(path: str, out: np.ndarray) -> None:
    """Read an .npy file (`np.save`'s format, header 1.0 or 2.0) into `out` a chunk at a time, with no
    second copy in memory; its shape and dtype must match."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        if shape != out.shape or dtype != out.dtype:
            raise ValueError(
                f"{path}: pruner table is {dtype}{list(shape)}, this pruner expects "
                f"{out.dtype}{list(out.shape)} (a checkpoint of another data set or pruner?)"
            )
        step = max(1, _CHUNK_BYTES // max(1, out.itemsize))
        for start in range(0, len(out), step):
            view = out[start : start + step].data.cast("B")
            if f.readinto(view) != len(view):
                raise ValueError(f"{path}: ends early, at sample {start} of {len(out)}")


def resolve_tables(state: dict, folder: str) -> dict:
    """A loaded pruner state with its table files read into tensors (for readers of a checkpoint)."""
    tables = {}
    for name, relative in state["tables"].items():  # files of the checkpoint, named relative to it
        tables[name] = torch.from_numpy(np.load(os.path.join(folder, relative)))
    return {**state, "tables": tables}
