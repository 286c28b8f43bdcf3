"""A near-duplicate group table beside the shards (docs/DESIGN.md decision 7): an int32 group id per
sample id (a group's smallest sample id; a sample without near-duplicates is its own group), a .npy
that memory-maps, with a JSON header of the same name saying what made it:

    TRAIN/groups/NAME.npy     int32 [N]
    TRAIN/groups/NAME.json    header: what made it, the index it describes

Here a table is found from the config's `pruner.groups`, checked against the train index (its
sample count; and the shard list, when its header records one as side_tables.py's headers do), and
named by a digest of its contents. It is read a chunk at a time, never loaded whole; the training loop
shares what the pruner needs (pipelines/training/groups.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from pipelines.data.side_tables import FORMAT, check_made_for

GROUPS_FOLDER = "groups"
_CHUNK = 1 << 22


def group_table_path(value: str, train: str) -> str:
    """Where `pruner.groups` points: a bare NAME is groups/NAME.npy in data.train's folder (where the
    group tools write tables), a relative path resolves in that folder, an absolute one is itself."""
    folder = train if os.path.isdir(train) else os.path.dirname(os.path.abspath(train))
    if os.path.isabs(value):
        return value
    if os.sep not in value and not value.endswith(".npy"):
        return os.path.join(folder, GROUPS_FOLDER, value + ".npy")
    return os.path.join(folder, value)


def header_path(path: str) -> str:
    return os.path.splitext(path)[0] + ".json"


@dataclass(frozen=True)
class GroupTable:
    """An opened group table: its ids memory-mapped (read-only), its header, its digest."""

    path: str
    group_of: np.ndarray  # [N] integer, memory-mapped
    header: dict
    digest: str  # blake2b of dtype, shape and contents: the same table gives the same digest anywhere


def open_group_table(path: str, num_samples: int, index_path: str = "data.train",
                     shards_dir: str | None = None) -> GroupTable:
    """The table at `path`, checked to hold one group id in 0..N-1 per sample of the index (read once
    in chunks, which also makes its digest) and, when its header is a side table's and `shards_dir`
    is given, to have been made for that folder's shard list; errors name the file and the index."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"pruner.groups: no group table at {path} (an int32 [N] .npy of group ids per "
                                f"sample of {index_path}; a bare name means groups/NAME.npy beside it)")
    try:
        group_of = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a .npy group table: {e}") from e
    if group_of.ndim != 1 or not np.issubdtype(group_of.dtype, np.integer):
        raise ValueError(f"{path}: a group table is one integer group id per sample (int32 [N]), got "
                         f"{group_of.dtype}{list(group_of.shape)}")
    if len(group_of) != num_samples:
        raise ValueError(f"{path}: {len(group_of)} group ids, but {index_path} indexes {num_samples} samples "
                         f"(a table of another split, or of shards written since)")
    header = {}
    if os.path.exists(header_path(path)):
        with open(header_path(path)) as f:
            header = json.load(f)
        made_for = header.get("index", {}).get("num_samples", num_samples)
        if made_for != num_samples:
            raise ValueError(f"{header_path(path)}: made for an index of {made_for} samples, {index_path} "
                             f"indexes {num_samples}")
        if header.get("format") == FORMAT and shards_dir is not None:
            check_made_for(header, len(group_of), shards_dir, path, header_path(path), "groups")
    digest = hashlib.blake2b(f"{group_of.dtype.str}{list(group_of.shape)}".encode(), digest_size=16)
    for start in range(0, num_samples, _CHUNK):
        chunk = np.ascontiguousarray(group_of[start:start + _CHUNK])
        bad = (chunk < 0) | (chunk >= num_samples)
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{path}: sample {start + at} has group id {int(chunk[at])}; group ids must be in "
                             f"0..{num_samples - 1} (a group's smallest sample id)")
        digest.update(chunk.data)
    return GroupTable(path, group_of, header, digest.hexdigest())


def write_group_table(path: str, group_of: np.ndarray, header: dict) -> str:
    """`group_of` as int32 at `path` and `header` beside it, each written whole before it is renamed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        np.save(f, np.asarray(group_of, dtype=np.int32))
    os.replace(path + ".tmp", path)
    with open(header_path(path) + ".tmp", "w") as f:
        json.dump(header, f, indent=1)
    os.replace(header_path(path) + ".tmp", header_path(path))
    return path
