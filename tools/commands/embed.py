"""`prunepipe shards embed`: one L2-normalised float16 row per sample id, written beside the split's
index.json (pipelines/data/side_tables.py), by a feature network or the perceptual hash.

Split over processes as latents encode is (tools/commands/shard_jobs.py): each input shard's rows go into
`embeddings/NAME.parts/shard-NNNNNN.npy`, sealed by its stats file; a rerun skips sealed shards, and
the process that writes the table joins the parts into NAME.npy and its header, the same bytes as one
process writes (batches never cross a shard), then removes them. A sample that cannot be read or
decoded gets a zero row and is listed as missing, never guessed (`on_bad_sample=skip`, the default:
no id moves), or stops the embedding (`stop`). No two processes write one file: on NFS or Lustre,
two nodes writing disjoint rows of one page can lose writes.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from prunepipe.pipelines.atomic_write import atomic_open, move_into_place
from prunepipe.pipelines.data.decode import SampleDecoder
from prunepipe.pipelines.data.remote import ReadRetry, ShardReadError
from prunepipe.pipelines.data.shards import DEFAULT_RETRY, BadInputError, ShardIndex, read_shard
from prunepipe.pipelines.data.side_tables import index_fingerprint, make_header, table_paths, write_json
from prunepipe.tools.commands.feature_models import FeatureModel, load_feature_model
from prunepipe.tools.commands.shard_jobs import (
    WAIT_HOURS,
    Progress,
    ShardJob,
    job_device,
    job_rank,
    join_group,
    partial_path,
    remove_gone_partials,
)

MISSING_SHOWN = 20  # missing ids (and keys) named in a header and a message; all are in NAME.missing.npy
BAD_SAMPLE_POLICIES = ("stop", "skip")


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


def normalised(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """L2-normalised float16 rows of float32 [n, D], and the mask of rows that could not be normalised
    (zero or not finite): those are zeros, and the caller's to mark missing."""
    rows = np.asarray(rows, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    bad = ~np.isfinite(norms[:, 0]) | (norms[:, 0] == 0)
    rows = np.where(bad[:, None], 0.0, rows / np.where(bad[:, None], 1.0, norms))
    return rows.astype(np.float16), bad


class EmbeddingWriter:
    """A whole table written in place into NAME.npy.HOST.PID-TOKEN.partial (a memory map: a billion rows
    never sit in memory); `finish` seals it (the .npy renamed into place, then its header: a table is
    readable only when both are there). Any earlier table of the name is removed first, not left half
    replaced, and so are the partials of writers that are gone (a killed join's, any table's:
    shard_jobs.remove_gone_partials says when a writer is gone)."""

    def __init__(self, shards_dir: str, name: str, num_samples: int, dim: int, made_by: dict):
        self.shards_dir, self.made_by = shards_dir, made_by
        self.array_path, self.header_path = table_paths(shards_dir, "embeddings", name)
        self.partial_path = partial_path(self.array_path)
        self.missing_path = self.array_path[: -len(".npy")] + ".missing.npy"
        self.missing: list[int] = []
        self.reasons: list[str] = []
        os.makedirs(os.path.dirname(self.array_path), exist_ok=True)
        remove_gone_partials(os.path.dirname(self.array_path))
        for stale in (self.header_path, self.array_path, self.missing_path):
            if os.path.exists(stale):
                os.remove(stale)
        self.rows = np.lib.format.open_memmap(self.partial_path, mode="w+", dtype=np.float16, shape=(num_samples, dim))

    def put(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """`rows` (float32 [n, D]) L2-normalised into the ids' places; returns the ids whose row could not
        be normalised (zero or not finite): those stay zero and are the caller's to mark missing."""
        made, bad = normalised(rows)
        self.rows[np.asarray(ids)] = made
        return np.asarray(ids)[bad]

    def mark_missing(self, ids, reasons=()) -> None:
        self.missing += [int(i) for i in ids]
        self.reasons = (self.reasons + list(reasons))[:MISSING_SHOWN]

    def finish(self, missing_keys: list[str] | None = None, **extra) -> str:
        """Seal the table; returns the .npy path."""
        self.rows.flush()
        count, dim = self.rows.shape
        del self.rows
        missing = np.unique(np.array(self.missing, dtype=np.int64))
        if len(missing):
            np.save(self.missing_path, missing)
        header = make_header(
            self.shards_dir,
            "embeddings",
            (count, dim),
            **self.made_by,
            count=count,
            **extra,
            missing={
                "count": int(len(missing)),
                "first_ids": missing[:MISSING_SHOWN].tolist(),
                "first_keys": (missing_keys or [])[:MISSING_SHOWN],
                "first_reasons": self.reasons,
                "file": os.path.basename(self.missing_path) if len(missing) else None,
            },
        )
        move_into_place(self.partial_path, self.array_path)
        write_json(self.header_path, header)
        return self.array_path


def shard_pixels(index: ShardIndex, shard: int, decoder: SampleDecoder, retry: ReadRetry = DEFAULT_RETRY):
    """(position, uint8 pixels or None, problem or None) for every position of one shard, in order: a
    sample, or the rest of a shard, that cannot be read or decoded (or is not the shard its index
    describes: `ShardIndex.expected`) yields None and the reason."""
    url, count = index.urls[shard], int(index.counts[shard])
    first = int(index.first_ids[shard])
    seen = 0
    try:
        for position, sample in read_shard(url, retry=retry, expected=index.expected(shard)):
            if position >= count:  # the ids of every later shard would be off: nothing after this can be trusted
                raise ValueError(
                    f"shard {url}: holds more than the {count} samples {index.path} lists; index the "
                    f"shards again (`prunepipe shards index`)"
                )
            seen = position + 1
            try:
                pixels, _ = decoder.decode(sample, first + position)
                yield position, pixels, None
            except BadInputError as e:
                yield position, None, str(e)
        problem = None if seen == count else f"shard {url}: ended after {seen} samples, {index.path} lists {count}"
    except BadInputError as e:
        if isinstance(e.__cause__, ShardReadError):  # the store failed, not the data: the shard stays unsealed
            raise
        problem = str(e)
    for position in range(seen, count):  # what the shard did not give
        yield position, None, problem


def embed_shard(
    index: ShardIndex,
    shard: int,
    part: str,
    model: FeatureModel,
    decoder: SampleDecoder,
    batch_size: int,
    on_bad_sample: str,
    retry: ReadRetry = DEFAULT_RETRY,
) -> dict:
    """One shard's rows into `part` (PART.partial, then moved into place); returns its seal record."""
    import torch

    count, first = int(index.counts[shard]), int(index.first_ids[shard])
    rows = np.zeros((count, model.dim), dtype=np.float16)
    missing: list[int] = []
    reasons: list[str] = []
    batch: list[tuple[int, object]] = []

    def run_batch() -> None:
        if batch:
            made, bad = normalised(model(torch.stack([pixels for _, pixels in batch])))
            positions = np.array([position for position, _ in batch])
            rows[positions] = made
            for position in positions[bad].tolist():
                missing.append(position)
                reasons.append(f"id {first + position}: the model gave a zero or non-finite vector")
            batch.clear()

    for position, pixels, problem in shard_pixels(index, shard, decoder, retry):
        if pixels is None:
            if on_bad_sample == "stop":
                raise BadInputError(f"{problem} (--on-bad-sample stop; skip gives it a zero row, listed as missing)")
            missing.append(position)
            if len(reasons) < MISSING_SHOWN:
                reasons.append(f"id {first + position}: {problem}")
                print(f"prunepipe: embed: id {first + position} missing: {problem}", flush=True)
            continue
        batch.append((position, pixels))
        if len(batch) == batch_size:
            run_batch()
    run_batch()
    with atomic_open(part, "wb", suffix=".partial") as f:  # a file, not a name: np.save would add `.npy` to a name
        np.save(f, rows)
    return {
        "count": count,
        "successes": count - len(missing),
        "missing": sorted(first + m for m in missing),
        "reasons": reasons[:MISSING_SHOWN],
    }


def embed_shards(
    shards_dir: str,
    spec: str,
    *,
    weights: str | None = None,
    name: str | None = None,
    batch_size: int = 64,
    image_size: int | None = None,
    device: str | None = None,
    model: FeatureModel | None = None,
    on_bad_sample: str = "skip",
    rank: int | None = None,
    world: int | None = None,
    wait_hours: float = WAIT_HOURS,
    retry: ReadRetry = DEFAULT_RETRY,
) -> str | None:
    """Embed every sample of the split in `shards_dir` with the model `spec` names (tools/commands/feature_models.py);
    writes embeddings/NAME.npy and NAME.json beside its index.json and returns the .npy path (None in a
    process that leaves the table to another). Continues an unfinished run of the same settings.
    `retry` is how a remote shard's failed read is retried (`--read-retries` ...; not a setting of
    the table: the rows are the same however often a read was retried)."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if on_bad_sample not in BAD_SAMPLE_POLICIES:
        raise ValueError(f"--on-bad-sample: got {on_bad_sample!r}, accepted: {', '.join(BAD_SAMPLE_POLICIES)}")
    index = ShardIndex.load(shards_dir)
    me = job_rank(rank, world)
    if device is None and model is None:
        device = job_device(me)
    model = model or load_feature_model(
        spec, weights=weights, image_size=image_size, shards_dir=shards_dir, device=device
    )
    name = name or default_name(spec)
    array_path, header_path = table_paths(shards_dir, "embeddings", name)
    parts_dir = array_path[: -len(".npy")] + ".parts"
    made_by = {**model.describe(), "batch_size": batch_size}
    if finished_table(shards_dir, header_path, made_by):  # a requeue after the join: nothing to redo or remove
        print(f"prunepipe: embed {name}: {array_path} is complete, made with these settings", flush=True)
        return array_path
    join_group(me)
    settings = {
        **path_free(made_by),
        "shards": [os.path.basename(url) for url in index.urls],
        "counts": index.counts.tolist(),
    }  # not on_bad_sample: a part sealed under `stop` held no bad sample, so a retry with `skip` continues it
    job = ShardJob(
        parts_dir, settings, me, what=f"embed {name}", command=f"prunepipe shards embed {shards_dir} --model {spec}"
    )
    remove_gone_partials(os.path.dirname(array_path))  # a killed join's table (gigabytes) goes now, not at the join
    parts = [os.path.join(parts_dir, f"shard-{shard:06d}.npy") for shard in range(len(index))]
    decoder = SampleDecoder(resolution=model.image_size, channels=model.channels)
    mine = me.mine(len(index))
    todo = [shard for shard in mine if job.sealed(parts[shard]) is None]
    if todo:
        for stale in (header_path, array_path):
            if os.path.exists(stale):  # the old table is unreadable from now on, not half replaced
                os.remove(stale)
    progress = Progress(me, f"embed {name}", len(mine), len(mine) - len(todo))

    def embed_one(shard: int) -> None:
        record = embed_shard(index, shard, parts[shard], model, decoder, batch_size, on_bad_sample, retry)
        job.seal(parts[shard], record)
        progress.shard_done(os.path.basename(parts[shard]), record["successes"], len(record["missing"]))

    job.work(todo, parts, embed_one)  # a shard whose store fails is tried again after the others, then named

    def write_table() -> str:
        return join_parts(shards_dir, index, job, parts, parts_dir, name, made_by, model.dim)

    return job.finish(parts, write_table, wait_hours)


def finished_table(shards_dir: str, header_path: str, made_by: dict) -> bool:
    """A table of this name, made with these settings for this index, is already whole."""
    try:
        with open(header_path) as f:
            header = json.load(f)
    except (OSError, ValueError):
        return False
    wanted = json.loads(json.dumps(made_by))  # as the header holds them (tuples as lists)
    return (
        path_free({key: header.get(key) for key in wanted}) == path_free(wanted)
        and header.get("index") == index_fingerprint(shards_dir)
        and os.path.exists(header_path[: -len(".json")] + ".npy")
    )


def path_free(made_by: dict) -> dict:
    """What made the rows, less the paths the model was read from (its header keeps them, for humans):
    the spec's kind (with a timm architecture or a phash side, which are no paths) and the weights by
    their sha256. The same model staged to another folder makes the same rows; other weights at the
    same path do not."""
    kind, _, target = str(made_by.get("model", "")).partition(":")
    by_path = kind in ("mae", "feature-net") or (kind == "timm" and (os.sep in target or os.path.isdir(target)))
    found = {key: value for key, value in made_by.items() if key != "weights"}
    if by_path:
        found["model"] = kind
    return found


def join_parts(shards_dir, index, job, parts, parts_dir, name, made_by, dim) -> str:
    """NAME.npy and its header from the sealed parts, then the parts go."""
    seals = [job.sealed(part) for part in parts]
    writer = EmbeddingWriter(shards_dir, name, index.num_samples, dim, made_by)
    for part, first, count in zip(parts, index.first_ids.tolist(), index.counts.tolist()):
        writer.rows[first : first + count] = np.load(part)
    for seal in seals:
        writer.mark_missing(seal["missing"], seal["reasons"])
    path = writer.finish()
    shutil.rmtree(parts_dir, ignore_errors=True)
    return path
