"""`prunepipe shards embed`: one L2-normalised float16 row per sample id, written beside the split's
index.json (pipelines/data/side_tables.py), by a feature network or the perceptual hash.

Resumable: rows go into `embeddings/NAME.npy.partial` in place, a chunk of ids at a time, and
`NAME.progress.json` (replaced atomically once the chunk's bytes are flushed) says how far it got. A
killed embed continues at the first unfinished chunk and ends with the same bytes as one that never
stopped: batches never cross a chunk boundary, so each batch holds the same images either way. A
sample that cannot be read or decoded gets a zero row and is listed as missing, never guessed.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np

from pipelines.data.decode import SampleDecoder
from pipelines.data.shards import BadInputError, ShardIndex, read_shard
from pipelines.data.side_tables import make_header, table_paths, write_json
from pipelines.progress import progress
from tools.feature_models import FeatureModel, load_feature_model

CHUNK = 4096  # ids per committed chunk: what a killed embed redoes at most
MISSING_SHOWN = 20  # missing ids (and keys) named in a header and a message; all are in NAME.missing.npy


def default_name(spec: str) -> str:
    """A file name for the embeddings of `spec`: phash, phash-12, feature-net, mae-RUN, timm-ARCH."""
    kind, _, target = spec.partition(":")
    if kind == "feature-net" or not target:
        return kind
    if kind == "phash":
        return f"phash-{target}"
    base = os.path.basename(os.path.normpath(target))
    if kind == "mae" and base == "export":
        base = os.path.basename(os.path.dirname(os.path.normpath(target)))
    return f"{kind}-{''.join(c if c.isalnum() or c in '-_.' else '_' for c in base)}"


class EmbeddingWriter:
    """Rows written in place into NAME.npy.partial; `commit` records progress, `finish` seals the table
    (the .npy renamed into place, then its header: a table is readable only when both are there)."""

    def __init__(self, shards_dir: str, name: str, num_samples: int, dim: int, made_by: dict, *, resume: bool = True):
        self.shards_dir, self.name, self.made_by = shards_dir, name, made_by
        self.array_path, self.header_path = table_paths(shards_dir, "embeddings", name)
        self.partial_path = self.array_path + ".partial"
        self.progress_path = self.array_path[:-len(".npy")] + ".progress.json"
        self.missing_path = self.array_path[:-len(".npy")] + ".missing.npy"
        self.done, self.missing, self.reasons = 0, [], []
        os.makedirs(os.path.dirname(self.array_path), exist_ok=True)
        if resume and os.path.exists(self.progress_path) and os.path.exists(self.partial_path):
            with open(self.progress_path) as f:
                state = json.load(f)
            if state.get("made_by") != made_by:
                raise ValueError(f"{self.progress_path}: an unfinished embedding {name!r} made by "
                                 f"{state.get('made_by', {}).get('model')!r} with other settings is there; finish it "
                                 f"with the same command, remove {self.partial_path}, or choose another --out")
            self.rows = np.load(self.partial_path, mmap_mode="r+")
            if self.rows.shape != (num_samples, dim):
                raise ValueError(f"{self.partial_path}: shape {list(self.rows.shape)}, expected {[num_samples, dim]}")
            self.done, self.missing, self.reasons = int(state["done"]), list(state["missing"]), list(state["reasons"])
        else:
            for stale in (self.header_path, self.array_path, self.missing_path, self.progress_path):
                if os.path.exists(stale):  # the old table is unreadable from now on, not half replaced
                    os.remove(stale)
            self.rows = np.lib.format.open_memmap(self.partial_path, mode="w+", dtype=np.float16,
                                                  shape=(num_samples, dim))

    def put(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """L2-normalise `rows` (float32 [n, D]) into the ids' places; returns the ids whose row could not
        be normalised (zero or not finite): those stay zero and are the caller's to mark missing."""
        rows = np.asarray(rows, dtype=np.float32)
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        bad = ~np.isfinite(norms[:, 0]) | (norms[:, 0] == 0)
        rows = np.where(bad[:, None], 0.0, rows / np.where(bad[:, None], 1.0, norms))
        self.rows[np.asarray(ids)] = rows.astype(np.float16)
        return np.asarray(ids)[bad]

    def commit(self, done: int, missing: list[int], reasons: list[str] = ()) -> None:
        """Every id below `done` is written (`missing` ones as zeros, for `reasons`): flush the bytes,
        then record it atomically."""
        self.rows.flush()
        self.done = done
        self.missing += [int(i) for i in missing]
        self.reasons = (self.reasons + list(reasons))[:MISSING_SHOWN]
        write_json(self.progress_path, {"done": done, "missing": self.missing, "reasons": self.reasons,
                                        "made_by": self.made_by})

    def finish(self, missing_keys: list[str] | None = None, **extra) -> str:
        """Seal the table; returns the .npy path."""
        self.rows.flush()
        count, dim = self.rows.shape
        del self.rows
        missing = np.unique(np.array(self.missing, dtype=np.int64))
        if len(missing):
            np.save(self.missing_path, missing)
        header = make_header(self.shards_dir, "embeddings", (count, dim), **self.made_by, count=count, **extra,
                             missing={"count": int(len(missing)), "first_ids": missing[:MISSING_SHOWN].tolist(),
                                      "first_keys": (missing_keys or [])[:MISSING_SHOWN],
                                      "first_reasons": self.reasons,
                                      "file": os.path.basename(self.missing_path) if len(missing) else None})
        os.replace(self.partial_path, self.array_path)
        write_json(self.header_path, header)
        if os.path.exists(self.progress_path):
            os.remove(self.progress_path)
        return self.array_path


def shard_samples(index: ShardIndex, start: int, decoder: SampleDecoder) -> Iterator[tuple[int, object, str | None]]:
    """(id, uint8 pixels or None, problem or None) for every id from `start` on, in id order: a
    sample, a shard or the rest of a shard that cannot be read or decoded yields None and the reason."""
    for shard, (url, count, first) in enumerate(zip(index.urls, index.counts.tolist(), index.first_ids.tolist())):
        if first + count <= start:
            continue
        seen, longer = max(start - first, 0), False
        try:
            for position, sample in read_shard(url, lambda p, skip=seen: p >= skip):
                if sample is None:
                    continue
                if position >= count:
                    longer = True
                    break
                try:
                    pixels, _ = decoder.decode(sample, first + position)
                    yield first + position, pixels, None
                except BadInputError as e:
                    yield first + position, None, str(e)
                seen = position + 1
            problem = None if seen == count else f"shard {url}: ended after {seen} samples, {index.path} lists {count}"
        except BadInputError as e:
            problem = str(e)
        if longer:  # the ids of every later shard would be off: nothing after this can be trusted
            raise BadInputError(f"shard {url}: holds more than the {count} samples {index.path} lists; index the "
                                f"shards again (`prunepipe shards index`)")
        for position in range(seen, count):  # what the shard did not give
            yield first + position, None, problem


def embed_shards(shards_dir: str, spec: str, *, weights: str | None = None, name: str | None = None,
                 batch_size: int = 64, chunk: int = CHUNK, image_size: int | None = None,
                 device: str | None = None, model: FeatureModel | None = None) -> str:
    """Embed every sample of the split in `shards_dir` with the model `spec` names (tools/feature_models.py);
    writes embeddings/NAME.npy and NAME.json beside its index.json and returns the .npy path. Continues
    an unfinished run of the same settings."""
    if batch_size < 1 or chunk < 1:
        raise ValueError(f"batch size and chunk must be at least 1, got {batch_size}, {chunk}")
    index = ShardIndex.load(shards_dir)
    model = model or load_feature_model(spec, weights=weights, image_size=image_size, shards_dir=shards_dir,
                                        device=device)
    name = name or default_name(spec)
    made_by = {**model.describe(), "chunk": chunk, "batch_size": batch_size}
    writer = EmbeddingWriter(shards_dir, name, index.num_samples, model.dim, made_by)
    decoder = SampleDecoder(resolution=model.image_size, channels=model.channels)
    total = index.num_samples
    bar = progress(total, initial=writer.done, desc=f"embed {name}", unit="img")
    batch_ids: list[int] = []
    batch_pixels: list = []
    missing: list[int] = []
    reasons: list[str] = []

    def run_batch() -> None:
        import torch

        if batch_ids:
            unusable = writer.put(np.array(batch_ids), model(torch.stack(batch_pixels))).tolist()
            missing.extend(unusable)
            reasons.extend(f"id {i}: the model gave a zero or non-finite vector" for i in unusable)
            batch_ids.clear()
            batch_pixels.clear()

    try:
        for sample_id, pixels, problem in shard_samples(index, writer.done, decoder):
            if pixels is None:
                missing.append(sample_id)
                if len(writer.reasons) + len(reasons) < MISSING_SHOWN:
                    reasons.append(f"id {sample_id}: {problem}")
                    print(f"prunepipe: embed {name}: id {sample_id} missing: {problem}", flush=True)
            else:
                batch_ids.append(sample_id)
                batch_pixels.append(pixels)
                if len(batch_ids) == batch_size:
                    run_batch()
            bar.update(1)
            if (sample_id + 1) % chunk == 0 or sample_id + 1 == total:
                run_batch()  # a batch never crosses a chunk boundary: a resumed run batches alike
                writer.commit(sample_id + 1, missing, reasons)
                missing.clear()
                reasons.clear()
    finally:
        bar.close()
    if writer.done != total:
        raise BadInputError(f"{index.path}: embedded {writer.done} of {total} samples")
    return writer.finish()
