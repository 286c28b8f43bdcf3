"""`prunepipe shards import-embeddings`: embeddings that web datasets already ship, joined to the split's
samples by key (never by position) and written as the split's own embeddings (pipelines/data/side_tables.py).

    clip-retrieval   DIR/img_emb/img_emb_N.npy, row r described by row r of DIR/metadata/metadata_N.parquet,
                     whose `image_path` column holds the WebDataset key (clip-retrieval's inference output)
    datacomp         DIR/STEM.npz (`l14_img` or `b32_img`), row r described by row r of DIR/STEM.parquet,
                     whose `uid` column is the sample's 32-hex-digit uid; in DataComp's shards that uid is
                     the `uid` of each sample's .json (img2dataset's save_additional_columns=["uid"])

A sample no imported row names gets a zero row and is reported (count and first keys), never guessed.
"""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np

from prunepipe.pipelines.data.shards import ShardIndex, read_keys
from prunepipe.pipelines.progress import tracked
from prunepipe.tools.commands.embed import MISSING_SHOWN, EmbeddingWriter

FORMATS = ("clip-retrieval", "datacomp")
DATACOMP_EMBEDDINGS = ("l14_img", "b32_img")
SAMPLE_KEYS = ("key", "json:FIELD")


def sample_keys(index: ShardIndex, how: str) -> list[str | None]:
    """Each sample's join key in id order: its WebDataset key (`key`), or a field of its .json member
    (`json:uid`); None where the sample has no such field."""
    field = None
    if how.startswith("json:") and len(how) > 5:
        field = how[5:]
    elif how != "key":
        raise ValueError(f"--sample-key {how!r}; accepted: {', '.join(SAMPLE_KEYS)}")
    keys: list[str | None] = []
    shards = list(enumerate(zip(index.urls, index.counts.tolist())))
    for shard, (url, count) in tracked(shards, desc="reading keys", unit="shard"):
        found = read_keys(url, "json" if field else None, expected=index.expected(shard))
        if len(found) != count:
            raise ValueError(
                f"shard {url}: holds {len(found)} samples, {index.path} lists {count}; index the shards "
                f"again (`prunepipe shards index`)"
            )
        for key, member in found:
            if field is None:
                keys.append(key)
                continue
            try:
                value = json.loads(member)[field] if member is not None else None
            except (ValueError, TypeError, KeyError):
                value = None
            keys.append(None if value is None else str(value))
    return keys


def clip_retrieval_parts(folder: str) -> list[tuple[str, str]]:
    """(img_emb_N.npy, metadata_N.parquet) pairs of a clip-retrieval output folder, by N."""
    arrays = glob.glob(os.path.join(folder, "img_emb", "img_emb_*.npy"))
    if not arrays:
        raise FileNotFoundError(
            f"{folder}/img_emb/img_emb_N.npy: none there (clip-retrieval inference writes img_emb/ and metadata/)"
        )
    parts = []
    for array in sorted(arrays, key=lambda p: int(re.findall(r"(\d+)\.npy$", p)[0])):
        number = re.findall(r"(\d+)\.npy$", array)[0]
        metadata = os.path.join(folder, "metadata", f"metadata_{number}.parquet")
        if not os.path.isfile(metadata):
            raise FileNotFoundError(f"{metadata}: missing, and {array} cannot be joined without it")
        parts.append((array, metadata))
    return parts


def datacomp_parts(folder: str) -> list[tuple[str, str]]:
    """(STEM.npz, STEM.parquet) pairs of a DataComp metadata folder."""
    tables = sorted(glob.glob(os.path.join(folder, "*.parquet")))
    if not tables:
        raise FileNotFoundError(
            f"{folder}: no *.parquet (DataComp's metadata: download_upstream.py --download_npz "
            f"puts STEM.parquet and STEM.npz side by side)"
        )
    parts = []
    for table in tables:
        array = table[: -len(".parquet")] + ".npz"
        if not os.path.isfile(array):
            raise FileNotFoundError(f"{array}: missing beside {table} (download_upstream.py --download_npz)")
        parts.append((array, table))
    return parts


def read_part(array_path: str, table_path: str, column: str, embedding: str | None) -> tuple[list[str], np.ndarray]:
    """(keys, rows) of one part; the two files must hold as many rows."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(table_path)
    if column not in schema.names:
        raise ValueError(f"{table_path}: no column {column!r} (columns: {', '.join(schema.names)})")
    keys = [
        None if k is None else str(k) for k in pq.read_table(table_path, columns=[column]).column(column).to_pylist()
    ]
    if embedding is None:
        rows = np.load(array_path, mmap_mode="r")
    else:
        with np.load(array_path) as archive:
            if embedding not in archive.files:
                raise ValueError(f"{array_path}: no array {embedding!r} (has: {', '.join(archive.files)})")
            rows = archive[embedding]
    if rows.ndim != 2 or len(rows) != len(keys):
        raise ValueError(
            f"{array_path}: {list(rows.shape)} rows against {len(keys)} rows of {table_path}; a part's "
            f"row r is described by its metadata's row r, so both must hold as many"
        )
    return keys, rows  # as stored (a memory map for .npy): the caller converts the rows it uses


def import_embeddings(
    shards_dir: str,
    source: str,
    *,
    format: str,
    name: str | None = None,
    embedding: str = "l14_img",
    sample_key: str | None = None,
) -> dict:
    """Join the embeddings in `source` (a clip-retrieval or DataComp folder) to the split in
    `shards_dir` by key; write embeddings/NAME; return a summary (path, matched, missing, unused rows)."""
    if format not in FORMATS:
        raise ValueError(f"--format {format!r}; accepted: {', '.join(FORMATS)}")
    if format == "datacomp" and embedding not in DATACOMP_EMBEDDINGS:
        raise ValueError(f"--embedding {embedding!r}; DataComp ships {', '.join(DATACOMP_EMBEDDINGS)}")
    index = ShardIndex.load(shards_dir)
    if format == "clip-retrieval":
        parts, column, array_key = clip_retrieval_parts(source), "image_path", None
        sample_key = sample_key or "key"
    else:
        parts, column, array_key = datacomp_parts(source), "uid", embedding
        sample_key = sample_key or "json:uid"
    keys = sample_keys(index, sample_key)
    id_of: dict[str, int] = {}
    for sample_id, key in enumerate(keys):
        if key is None:
            continue
        normal = key.lower() if format == "datacomp" else key  # uids are hex digits, written in either case
        if normal in id_of:
            raise ValueError(
                f"{index.path}: samples {id_of[normal]} and {sample_id} share the key {key!r}; a join by "
                f"key needs unique keys"
            )
        id_of[normal] = sample_id
    filled_by = np.full(len(keys), -1, dtype=np.int32)  # the part that gave each id its row
    writer = None
    unused, unused_keys = 0, []
    for part, (array_path, table_path) in enumerate(tracked(parts, desc="importing", unit="part")):
        part_keys, rows = read_part(array_path, table_path, column, array_key)
        if writer is None:
            made_by = {
                "model": f"import:{format}" + (f":{embedding}" if array_key else ""),
                "weights": None,
                "weights_sha256": None,
                "dim": int(rows.shape[1]),
                "source": os.path.abspath(source),
                "sample_key": sample_key,
                "join_column": column,
                "preprocessing": "as shipped, L2-normalised again and stored as float16",
            }
            writer = EmbeddingWriter(shards_dir, name or format, len(keys), int(rows.shape[1]), made_by)
        if rows.shape[1] != writer.rows.shape[1]:
            raise ValueError(f"{array_path}: rows of {rows.shape[1]} dims, earlier parts had {writer.rows.shape[1]}")
        ids = np.array([id_of.get(k.lower() if format == "datacomp" and k else k, -1) for k in part_keys], np.int64)
        matched = ids >= 0
        unused += int((~matched).sum())
        unused_keys += [k for k, m in zip(part_keys, matched) if not m][: MISSING_SHOWN - len(unused_keys)]
        taken = ids[matched]
        values, counts = np.unique(taken, return_counts=True)
        twice = np.concatenate([taken[filled_by[taken] >= 0], values[counts > 1]])
        if len(twice):
            first = int(twice[0])
            earlier = parts[filled_by[first]][1] if filled_by[first] >= 0 else table_path
            raise ValueError(
                f"key {keys[first]!r} has a row in {earlier} and again in {table_path}; which one is "
                f"the sample's is not known"
            )
        filled_by[taken] = part
        unusable = writer.put(taken, rows[np.flatnonzero(matched)])
        filled_by[unusable] = -1
    missing = np.flatnonzero(filled_by < 0)
    missing_keys = [
        keys[i] if keys[i] is not None else f"<sample {i}: no {sample_key}>" for i in missing[:MISSING_SHOWN]
    ]
    writer.mark_missing(
        missing.tolist(),
        [f"id {i} (key {k!r}): no row in {source}" for i, k in zip(missing[:MISSING_SHOWN].tolist(), missing_keys)],
    )
    path = writer.finish(missing_keys=missing_keys, rows_matching_no_sample=unused)
    return {
        "path": path,
        "samples": len(keys),
        "matched": len(keys) - len(missing),
        "missing": len(missing),
        "missing_first_keys": missing_keys,
        "rows_matching_no_sample": unused,
        "unused_first_keys": unused_keys,
    }
