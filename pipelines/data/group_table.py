"""A near-duplicate group table beside the shards (docs/DESIGN.md decision 7): an int32 group id per
sample id (a group's smallest sample id; a sample without near-duplicates is its own group), a .npy
that memory-maps, with a JSON header of the same name saying what made it:

    TRAIN/groups/NAME.npy     int32 [N]
    TRAIN/groups/NAME.json    header: what made it, the index it describes

Here a table is found from the config's `pruner.groups` or by its name beside a split, checked against
the index (its sample count; and the shard list, when its header records one as side_tables.py's
headers do), and named by a digest of its contents. `open_group_table` is the one reader of these
files, so that the loop, the tools and the benchmarks refuse the same tables with the same messages.
It is read a chunk at a time, never loaded whole; the training loop shares what the pruner needs
(pipelines/training/groups.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from prunepipe.pipelines.atomic_write import atomic_open, atomic_write_json
from prunepipe.pipelines.data.shards import INDEX_NAME
from prunepipe.pipelines.data.side_tables import FORMAT, KINDS, check_made_for, existing_table, index_fingerprint

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

    @property
    def rows(self) -> np.ndarray:
        """The group ids under the name every side table gives its array (embeddings' rows)."""
        return self.group_of

    def __len__(self) -> int:
        return int(self.group_of.shape[0])

    def is_first(self) -> np.ndarray:
        """bool [N]: the sample is its group's first (smallest id): what a deduplication keeps."""
        return self.group_of == np.arange(len(self.group_of), dtype=np.int32)


def open_groups(shards_dir: str, name: str) -> GroupTable:
    """The near-duplicate groups `name` beside `shards_dir`'s index (groups/NAME.npy and its side
    table header, as `prunepipe shards dedup` writes them), checked against that index."""
    array_path, _ = existing_table(shards_dir, "groups", name)
    return open_group_table(array_path, shards_dir=shards_dir, side_table=True)


def open_group_table(
    path: str,
    num_samples: int | None = None,
    index_path: str | None = None,
    shards_dir: str | None = None,
    *,
    side_table: bool = False,
) -> GroupTable:
    """The table at `path`, checked to hold one group id in 0..N-1 per sample of the index (read once
    in chunks, which also makes its digest) and, when its header is a side table's and `shards_dir`
    is given, to have been made for that folder's shard list; errors name the file and the index.
    `num_samples` None: the count of `shards_dir`'s index.json. A side table's header must agree with
    the array (kind, dtype, shape); `side_table` requires one (a table opened by name as side data).
    `index_path` names the index in messages (data.train by default)."""
    if num_samples is None:
        if shards_dir is None:
            raise ValueError(f"{path}: opening a group table needs the sample count or the shards' folder")
        num_samples = index_fingerprint(shards_dir)["num_samples"]
        index_path = index_path or os.path.join(shards_dir, INDEX_NAME)
    index_path = index_path or "data.train"
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"pruner.groups: no group table at {path} (an int32 [N] .npy of group ids per "
            f"sample of {index_path}; a bare name means groups/NAME.npy beside it)"
        )
    try:
        group_of = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a .npy group table: {e}") from e
    if group_of.ndim != 1 or not np.issubdtype(group_of.dtype, np.integer):
        raise ValueError(
            f"{path}: a group table is one integer group id per sample (int32 [N]), got "
            f"{group_of.dtype}{list(group_of.shape)}"
        )
    if len(group_of) != num_samples:
        raise ValueError(
            f"{path}: {len(group_of)} group ids, but {index_path} indexes {num_samples} samples "
            f"(a table of another split, or of shards written since)"
        )
    header = {}
    if os.path.exists(header_path(path)):
        with open(header_path(path)) as f:
            header = json.load(f)
    if side_table or header.get("format") == FORMAT:
        check_side_header(path, group_of, header)
    if header:
        made_for = header.get("index", {}).get("num_samples", num_samples)
        if made_for != num_samples:
            raise ValueError(
                f"{header_path(path)}: made for an index of {made_for} samples, {index_path} indexes {num_samples}"
            )
        if header.get("format") == FORMAT and shards_dir is not None:
            check_made_for(header, len(group_of), shards_dir, path, header_path(path), "groups")
    digest = hashlib.blake2b(f"{group_of.dtype.str}{list(group_of.shape)}".encode(), digest_size=16)
    for start in range(0, num_samples, _CHUNK):
        chunk = np.ascontiguousarray(group_of[start : start + _CHUNK])
        bad = (chunk < 0) | (chunk >= num_samples)
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"{path}: sample {start + at} has group id {int(chunk[at])}; group ids must be in "
                f"0..{num_samples - 1} (a group's smallest sample id)"
            )
        digest.update(chunk.data)
    return GroupTable(path, group_of, header, digest.hexdigest())


def check_side_header(path: str, group_of: np.ndarray, header: dict) -> None:
    """A side table's header (side_tables.py) of kind groups that describes the array: its dtype and shape."""
    if header.get("format") != FORMAT or header.get("kind") != "groups":
        raise ValueError(
            f"{header_path(path)}: not a groups header (format {header.get('format')!r}, kind "
            f"{header.get('kind')!r}; expected {FORMAT!r}, 'groups')"
        )
    if group_of.dtype != KINDS["groups"]:
        raise ValueError(f"{path}: dtype {group_of.dtype}, groups are stored as {KINDS['groups'].name}")
    if list(group_of.shape) != header.get("shape"):
        raise ValueError(
            f"{path}: shape {list(group_of.shape)}, its header {header_path(path)} says {header.get('shape')}"
        )


def write_group_table(path: str, group_of: np.ndarray, header: dict) -> str:
    """`group_of` as int32 at `path` and `header` beside it, each written whole before it is renamed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_open(path, "wb") as f:
        np.save(f, np.asarray(group_of, dtype=np.int32))
    atomic_write_json(header_path(path), header, indent=1)
    return path
