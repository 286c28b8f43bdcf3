"""One score table per node, not one per rank: the pruner's per-sample tables live once per node in shared
memory, files in /dev/shm created by the node's local rank 0 and mapped by its other ranks. Local rank
0 writes the all-gathered updates; the others read the same pages. A single process (or a node with
one rank) keeps its tables in process memory.

The files are unlinked as soon as every rank of the node has mapped them, so the memory goes back to
the system when the last of those processes exits, a crash included; only a crash in the moment
between creating and mapping leaves a `prunepipe-*` file in /dev/shm behind. Read-only side data
(a near-duplicate table's group sizes, pipelines/training/groups.py) is shared the same way.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from prunepipe.pipelines.ranks import rank0_value

SHM = "/dev/shm"


def local_rank_and_size(env=os.environ) -> tuple[int, int]:
    """(local rank, processes on this node) from the launcher's environment: torchrun and accelerate
    launch (LOCAL_RANK, LOCAL_WORLD_SIZE), SLURM srun (SLURM_LOCALID, SLURM_NTASKS_PER_NODE or
    SLURM_TASKS_PER_NODE such as `8(x4)`); (0, 1) for a process started alone."""
    if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    if "SLURM_LOCALID" in env:
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
        return int(env["SLURM_LOCALID"]), int(re.match(r"\d+", per_node).group())
    return 0, 1


@dataclass(frozen=True)
class NodePlace:
    """Where a rank sits: its rank, its place on its node, the node's ranks, and the run's token that
    names its shared files (the same on every rank)."""

    rank: int
    local_rank: int = 0
    local_size: int = 1
    token: str = ""

    def as_tuple(self) -> tuple[int, int, int, str]:
        return self.rank, self.local_rank, self.local_size, self.token


def node_place(rank: int, world: int) -> NodePlace:
    """This rank's NodePlace; collective when several ranks run (the token is rank 0's)."""
    if world == 1:
        return NodePlace(rank)
    local_rank, local_size = local_rank_and_size()
    return NodePlace(rank, local_rank, local_size, run_token())


class NodeTables:
    """The pruner's tables mapped from this node's shared files (or left as they are on one process)."""

    def __init__(
        self, pruner, rank: int, local_rank: int, local_size: int, token: str, folder: str = SHM, announce: bool = False
    ):
        self.pruner, self.shared = pruner, local_size > 1 and bool(pruner.table_specs())
        self.writer = local_rank == 0
        if not self.shared:
            return
        if announce:
            print(
                f"pruner tables: one copy per node in shared memory, written by local rank 0 ({local_size} ranks per node)"
            )
        # writable everywhere so that torch can wrap them for a checkpoint; only the writer records
        tables = map_node_files(
            pruner.table_specs(), rank, local_rank, local_size, token, folder=folder, what="shared score table"
        )
        pruner.share_tables(tables, writes=self.writer)

    def wait_for_writer(self) -> None:
        """Wait until this node's writer has written every update so far (before anyone reads)."""
        if self.shared:
            dist.barrier()


def map_node_files(
    specs: dict,
    rank: int,
    local_rank: int,
    local_size: int,
    token: str,
    *,
    folder: str = SHM,
    fill=None,
    read_only: bool = False,
    what: str = "shared table",
) -> dict[str, np.ndarray]:
    """Arrays of `specs` (name -> (shape, dtype)) in files of this node's shared memory: local rank 0
    creates them (zero) and, with `fill`, writes them (`fill(arrays)`) before any other rank maps
    them; the names are unlinked once every rank of the node has mapped them. Collective over all ranks."""
    node = rank // local_size  # launchers number the ranks of a node contiguously
    paths = {name: os.path.join(folder, f"prunepipe-{token}-node{node}-{name}") for name in specs}
    if local_rank == 0:
        for name, (shape, dtype) in specs.items():
            with open(paths[name], "wb") as f:  # a sparse file: pages cost memory once written
                f.truncate(max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize))
        if fill is not None:
            filled = {
                name: np.memmap(paths[name], dtype=dtype, mode="r+", shape=shape)
                for name, (shape, dtype) in specs.items()
            }
            fill(filled)
            for array in filled.values():
                array.flush()
    dist.barrier()  # created (and filled) before the others map them
    arrays = {}
    for name, (shape, dtype) in specs.items():
        if not os.path.exists(paths[name]):
            raise RuntimeError(
                f"rank {rank}: {what} {paths[name]} is missing; local rank 0 of this node creates "
                f"it (is LOCAL_RANK / LOCAL_WORLD_SIZE={local_size} right, and is {folder} one file "
                f"system on the node?)"
            )
        arrays[name] = np.memmap(paths[name], dtype=dtype, mode="r" if read_only else "r+", shape=shape)
    dist.barrier()  # mapped everywhere: the names can go, the mappings stay
    if local_rank == 0:
        for path in paths.values():
            os.unlink(path)
    return arrays


def run_token() -> str:
    """A name for this run's shared files, the same on every rank (rank 0's, broadcast)."""
    return rank0_value(uuid.uuid4().hex[:12])
