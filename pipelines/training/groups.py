"""The `dedup` pruner's near-duplicate groups at the start of a run: every rank opens the table that
`pruner.groups` names and all ranks compare its digest (docs/DESIGN.md decision 6); each node's local
rank 0 turns it into each sample's group size in the node's shared memory, which the node's ranks map
read-only (4 bytes a sample per node, like a score table); the pruner gets those sizes and the
table's digest, which its checkpoints record. The table itself is not held after the start.
"""

from __future__ import annotations

import os

import numpy as np

from prunepipe.pipelines.data.group_table import GroupTable, group_table_path, open_group_table
from prunepipe.pipelines.data.mixture import first_path
from prunepipe.pipelines.data.shards import INDEX_NAME, ShardIndex
from prunepipe.pipelines.ranks import same_on_every_rank
from prunepipe.pipelines.training.node_tables import NodePlace, map_node_files
from prunepipe.pruning.groups import fill_group_sizes


def agree_on_table(table: GroupTable) -> None:
    """Every rank holds a table with the same digest, or every rank raises naming them all."""
    same_on_every_rank(table.digest, f"{table.path} (digest {table.digest})", "group tables for pruner.groups")


def group_sizes(table: GroupTable, rank: int, local_rank: int, local_size: int, token: str) -> np.ndarray:
    """int32 [N], read-only: each sample's group size, once per node in shared memory when the node
    has several ranks (its local rank 0 counts them), else in this process's memory."""
    num_samples = len(table.group_of)
    if local_size > 1:

        def fill(arrays):
            fill_group_sizes(table.group_of, arrays["group_size"])

        return map_node_files(
            {"group_size": ((num_samples,), np.int32)},
            rank,
            local_rank,
            local_size,
            token,
            fill=fill,
            read_only=True,
            what="shared group-size table",
        )["group_size"]
    sizes = np.zeros(num_samples, dtype=np.int32)
    fill_group_sizes(table.group_of, sizes)
    sizes.flags.writeable = False
    return sizes


def use_configured_groups(cfg, pruner, index: ShardIndex, place: NodePlace, announce: bool) -> None:
    """The table pruner.groups names, if any, given to `pruner` before a resume (the checkpoint names
    the table it needs); collective when several ranks run."""
    if not cfg.pruner.get("groups"):
        return
    path, digest = use_group_table(
        pruner,
        cfg.pruner["groups"],
        first_path(cfg.data.train),  # one source: the config refuses groups over a mixture
        index,
        rank=place.rank,
        local_rank=place.local_rank,
        local_size=place.local_size,
        token=place.token,
    )
    if announce:
        stats = pruner.stats()
        print(
            f"near-duplicate groups: {path} (digest {digest}), {stats['grouped_samples']} "
            f"samples in groups of 2 or more, about {stats['per_group']:.3g} of each group a pass"
        )


def use_group_table(
    pruner,
    value: str,
    train: str,
    index: ShardIndex,
    *,
    rank: int = 0,
    local_rank: int = 0,
    local_size: int = 1,
    token: str = "",
) -> tuple[str, str]:
    """Give `pruner` the group table `value` (pruner.groups) of the split at `train`; collective when
    several ranks run. Returns the table's (path, digest); its mapping is closed (only the sizes stay)."""
    if not hasattr(pruner, "use_groups"):
        raise ValueError(f"pruner.groups={value!r} is read by the dedup pruner only; pruner.name is {pruner.name!r}")
    folder = train if os.path.isdir(train) else os.path.dirname(os.path.abspath(train))
    shards_dir = folder if os.path.exists(os.path.join(folder, INDEX_NAME)) else None  # else: urls, a glob
    table = open_group_table(group_table_path(value, train), index.num_samples, index.path or train, shards_dir)
    give_groups(pruner, table, rank, local_rank, local_size, token)
    return table.path, table.digest


def give_groups(
    pruner, table: GroupTable, rank: int = 0, local_rank: int = 0, local_size: int = 1, token: str = ""
) -> None:
    """`table`, agreed on by every rank, as `pruner`'s group sizes (shared per node when it has several ranks)."""
    agree_on_table(table)
    pruner.use_groups(group_sizes(table, rank, local_rank, local_size, token), digest=table.digest, source=table.path)
