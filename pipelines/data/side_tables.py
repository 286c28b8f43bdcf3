"""Side data beside the shards (docs/DESIGN decision 7): per-sample embeddings and near-duplicate
groups, one row per sample id, stored beside `index.json` with a JSON header saying what made them.

    SHARDS_DIR/embeddings/NAME.npy    float16 [N, D], rows L2-normalised; a sample without one: zeros
    SHARDS_DIR/embeddings/NAME.json   header: model, weights sha256, dim, preprocessing, missing ids
    SHARDS_DIR/groups/NAME.npy        int32 [N]: a sample's group = the smallest sample id in its group
    SHARDS_DIR/groups/NAME.json       header: threshold, clusters, source embeddings, counts

Every header records the index it was made for (its sample count and the sha256 of its shard list),
and opening a table checks both, so a table never meets shards it does not describe. Nothing here
computes an embedding or a group; tools/ writes them, pruners and the loop read them. Groups are
opened by pipelines/data/group_table.py, the one reader of group tables, with these headers' checks.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from prunepipe.pipelines.atomic_write import atomic_write_json
from prunepipe.pipelines.data.shards import INDEX_NAME, read_index_json

FORMAT = "prunepipe-side-table"
KINDS = {"embeddings": np.dtype("float16"), "groups": np.dtype("int32")}
HOW_TO_MAKE = {
    "embeddings": "`prunepipe shards embed` or `prunepipe shards import-embeddings`",
    "groups": "`prunepipe shards dedup`",
}


def index_fingerprint(shards_dir: str) -> dict:
    """What a side table's ids depend on: the index's sample count and the sha256 of its shard list
    (urls and counts in canonical JSON; the index's other keys do not move an id)."""
    path = os.path.join(shards_dir, INDEX_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no shard index at {path}: side data lives beside a split's index.json")
    shards = read_index_json(path).get("shards")
    if not isinstance(shards, list):
        raise ValueError(f"{path}: expected a 'shards' list")
    canonical = json.dumps([[s.get("url"), int(s.get("num_samples", -1))] for s in shards], separators=(",", ":"))
    return {
        "num_samples": sum(int(s["num_samples"]) for s in shards),
        "shards_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
    }


def table_paths(shards_dir: str, kind: str, name: str) -> tuple[str, str]:
    """(array .npy, header .json) of side table `name` of `kind` in `shards_dir`."""
    if kind not in KINDS:
        raise ValueError(f"side table kind {kind!r}; accepted: {', '.join(KINDS)}")
    if not name or os.sep in name or name.startswith(".") or (os.altsep and os.altsep in name):
        raise ValueError(f"side table name {name!r}: a plain file name is expected (no folder, not hidden)")
    folder = os.path.join(shards_dir, kind)
    return os.path.join(folder, name + ".npy"), os.path.join(folder, name + ".json")


def write_json(path: str, data: dict) -> None:
    """`data` as JSON at `path`, atomically (a reader sees the old file or the new one)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_json(path, data, indent=1)  # a temporary of its own: another process, host or thread may write it


def make_header(shards_dir: str, kind: str, shape: tuple[int, ...], **made_by) -> dict:
    """The header every side table starts from: format, kind, dtype, shape, the index it describes."""
    return {
        "format": FORMAT,
        "kind": kind,
        "dtype": KINDS[kind].name,
        "shape": [int(n) for n in shape],
        "index": index_fingerprint(shards_dir),
        **made_by,
    }


@dataclass(frozen=True)
class SideTable:
    """One opened side table: the array (memory-mapped, read-only) and its header."""

    rows: np.ndarray  # embeddings: float16 [N, D]
    header: dict
    path: str  # the .npy, for messages

    def __len__(self) -> int:
        return int(self.rows.shape[0])


@dataclass(frozen=True)
class Embeddings(SideTable):
    @property
    def dim(self) -> int:
        return int(self.rows.shape[1])

    def missing_ids(self) -> np.ndarray:
        """int64 ids without an embedding (their rows are zeros), sorted."""
        missing = self.header.get("missing", {})
        if not missing.get("count"):
            return np.zeros(0, dtype=np.int64)
        path = os.path.join(os.path.dirname(self.path), missing["file"])
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: the missing ids its header {self.path[:-4]}.json names are gone")
        return np.load(path).astype(np.int64)


def open_embeddings(shards_dir: str, name: str) -> Embeddings:
    """The embeddings `name` beside `shards_dir`'s index, checked against it."""
    return Embeddings(*_open(shards_dir, "embeddings", name))


def available(shards_dir: str, kind: str) -> list[str]:
    """Names of the side tables of `kind` beside `shards_dir` (those with both files)."""
    folder = os.path.join(shards_dir, kind)
    if not os.path.isdir(folder):
        return []
    return sorted(
        f[:-5]
        for f in os.listdir(folder)
        if f.endswith(".json") and os.path.exists(os.path.join(folder, f[:-5] + ".npy"))
    )


def existing_table(shards_dir: str, kind: str, name: str) -> tuple[str, str]:
    """(array .npy, header .json) of side table `name` of `kind`, both there; else the error names the
    missing file and lists the names that are there."""
    array_path, header_path = table_paths(shards_dir, kind, name)
    for path in (header_path, array_path):
        if not os.path.exists(path):
            others = available(shards_dir, kind)
            raise FileNotFoundError(
                f"{path}: no {kind} named {name!r} beside {shards_dir}/{INDEX_NAME} (make them "
                f"with {HOW_TO_MAKE[kind]}; there: {', '.join(others) or 'none'})"
            )
    return array_path, header_path


def _open(shards_dir: str, kind: str, name: str) -> tuple[np.ndarray, dict, str]:
    array_path, header_path = existing_table(shards_dir, kind, name)
    with open(header_path) as f:
        header = json.load(f)
    if header.get("format") != FORMAT or header.get("kind") != kind:
        raise ValueError(
            f"{header_path}: not a {kind} header (format {header.get('format')!r}, kind "
            f"{header.get('kind')!r}; expected {FORMAT!r}, {kind!r})"
        )
    rows = np.load(array_path, mmap_mode="r")
    if rows.dtype != KINDS[kind]:
        raise ValueError(f"{array_path}: dtype {rows.dtype}, {kind} are stored as {KINDS[kind].name}")
    if list(rows.shape) != header.get("shape"):
        raise ValueError(f"{array_path}: shape {list(rows.shape)}, its header {header_path} says {header.get('shape')}")
    check_made_for(header, rows.shape[0], shards_dir, array_path, header_path, kind)
    return rows, header, array_path


def check_made_for(header: dict, rows: int, shards_dir: str, array_path: str, header_path: str, kind: str) -> None:
    """Refuse a table whose header was made for another index than `shards_dir`'s (another sample
    count or shard list: its ids may name other samples)."""
    index, made_for = index_fingerprint(shards_dir), header.get("index", {})
    if rows != index["num_samples"] or made_for.get("num_samples") != index["num_samples"]:
        raise ValueError(
            f"{array_path}: {rows} rows, made for an index of {made_for.get('num_samples')} "
            f"samples, but {shards_dir}/{INDEX_NAME} lists {index['num_samples']}: the shards changed "
            f"since; make the {kind} again"
        )
    if made_for.get("shards_sha256") != index["shards_sha256"]:
        raise ValueError(
            f"{header_path}: made for another shard list (sha256 {made_for.get('shards_sha256')}, "
            f"{shards_dir}/{INDEX_NAME} has {index['shards_sha256']}): the ids may not match; make "
            f"the {kind} again"
        )
