"""Encode image shards once into latent shards with a diffusers AutoencoderKL, so latent-diffusion
runs stream `latent.npy` instead of running the VAE every step; with a text encoder, each caption's
features too (`text.npy`, its real tokens only), so a text-conditional run loads no encoder. The
output keeps every sample's key, label, caption, position and per-shard count, so global sample ids
(and pruner scores) are the same. It never downloads a model.

Many processes share the work (tools/commands/shard_jobs.py): output shard i is input shard i's, written by
one rank and sealed by its img2dataset stats file; a rerun skips sealed shards. A sample that does
not decode, or has no caption when features are asked for, stops the encoding (`on_bad_sample=stop`)
or is left out and recorded in OUT/skipped.json (`skip`): then every later sample's id moves down,
so side tables made on the image shards (embeddings, groups) no longer line up.

With `--buckets` (tools/commands/aspect_buckets.py), each image goes uncropped to its nearest
aspect-ratio bucket, is cut to it, and input shard i becomes one tar per bucket it holds
(shard-00000i.bNN.tar, that bucket's samples in input order), sealed together; index.json lists them
in input-shard order, then bucket order. Ids stay dense in index order: a permutation of the image
shards' ids (grouped by bucket within each input shard), so side tables made on the image shards do
not line up with the latent shards.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import webdataset as wds

from prunepipe.pipelines.atomic_write import atomic_open, move_into_place
from prunepipe.pipelines.checkpoint.manifest import file_crc32
from prunepipe.pipelines.data.decode import (
    CAPTION_FIELD,
    FLIPPED_LATENT_FIELD,
    LABEL_FIELDS,
    METADATA_FIELD,
    TEXT_FEATURES_FIELD,
    SampleDecoder,
    caption,
    image_pixels,
)
from prunepipe.pipelines.data.remote import ReadRetry, ShardReadError
from prunepipe.pipelines.data.resize import resize_cover_crop
from prunepipe.pipelines.data.shards import (
    DEFAULT_RETRY,
    TEXT_NULL_FILE,
    BadInputError,
    ShardEntry,
    ShardIndex,
    bucket_name,
    read_shard,
)
from prunepipe.pipelines.data.side_tables import write_json
from prunepipe.pipelines.tasks.diffusion.autoencoder import autoencoder_folder, load_autoencoder, vae_factor
from prunepipe.pipelines.tasks.diffusion.text import TextCondition, TextEncoder, identity_key
from prunepipe.tools.commands.aspect_buckets import BUCKET_FIELD, BucketTable, load_buckets
from prunepipe.tools.commands.shard_jobs import (
    WAIT_HOURS,
    Progress,
    ShardJob,
    job_device,
    job_rank,
    join_group,
    model_files,
    partial_path,
)

LATENT_FIELD = "latent.npy"
LATENT_DTYPES = ("float16", "float32")
BAD_SAMPLE_POLICIES = ("stop", "skip")
SKIPPED_FILE = "skipped.json"  # beside index.json: every sample left out, with its shard and reason
MAX_SANE_LENGTH = 100_000  # transformers' "no limit" model_max_length is about 1e30


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def output_shard(out_folder: str, shard: int) -> str:
    return os.path.join(out_folder, f"shard-{shard:06d}.tar")


def bucket_shard(output: str, bucket: int, buckets: int) -> str:
    """OUT/shard-000003.b07.tar: input shard 3's samples of bucket 7 (as many digits as the table needs,
    two at least, so that the names sort in bucket order)."""
    return f"{output[: -len('.tar')]}.b{bucket:0{max(2, len(str(buckets - 1)))}d}.tar"


def index_resolution(index: ShardIndex) -> int:
    """The image side the shards were written at, as their index records it."""
    for key in ("size", "resolution"):
        if isinstance(index.meta.get(key), int):
            return int(index.meta[key])
    raise ValueError(f"{index.path} records no image size (size or resolution): give --resolution")


def encoder_max_length(encoder: TextEncoder) -> int:
    """Tokens per caption the encoder was made for: its tokenizer's model_max_length (CLIP 77), else
    its config's max_position_embeddings."""
    length = getattr(encoder.tokenizer, "model_max_length", None)
    if isinstance(length, int) and 0 < length < MAX_SANE_LENGTH:
        return length
    length = getattr(encoder.model.config, "max_position_embeddings", None)
    if isinstance(length, int) and length > 0:
        return length
    raise ValueError(
        f"--text-encoder {encoder.path}: its tokenizer and config give no caption length; "
        f"give --text-max-length (CLIP 77, PixArt-alpha's T5 120)"
    )


def encode_shards(
    image_shards_folder: str,
    vae: str,
    out_folder: str,
    *,
    resolution: int | None = None,
    batch_size: int = 32,
    subfolder: str = "",
    cache_dir: str = "",
    dtype: str = "float16",
    device: str | None = None,
    flip: bool = False,
    text_encoder: str = "",
    tokenizer: str = "",
    text_max_length: int | None = None,
    on_bad_sample: str = "stop",
    rank: int | None = None,
    world: int | None = None,
    wait_hours: float = WAIT_HOURS,
    retry: ReadRetry = DEFAULT_RETRY,
    buckets: str = "",
) -> str | None:
    """Write OUT/shard-%06d.tar (one per input shard) + OUT/index.json; return the index path (None in
    a process that leaves the index to another, tools/commands/shard_jobs.py).

    Each latent is (posterior mean - shift_factor) * scaling_factor, the scaled space the UNet
    denoises (DiffusionConfig(space="latents")). The mean, not a posterior sample, makes the
    shards a pure function of the images and the VAE; a KL-regularised VAE's posterior is narrow.
    Stored as `dtype` numpy arrays [C, h, w]; index.json records vae, subfolder, scaling_factor,
    shift_factor, latent_shape and flip. With `flip`, each sample also holds `latent_flip.npy`, the
    latent of its mirrored image, which a `data.hflip` run reads where the flip coin says: the exact
    flip, for twice the encoding and the bytes (docs/diffusion.md, "Latents and flips").

    With `text_encoder` (a local CLIP text or T5 encoder folder, `tokenizer` beside it unless given),
    each sample also holds `text.npy`: its caption's features, [n, D] for its n real tokens (at most
    `text_max_length`, by default the encoder's), in `dtype`; OUT/text_null.npy holds the empty
    caption's, and index.json the encoder's identity (ldm.text.features=precomputed reads them;
    docs/diffusion.md, "Text features"). `resolution` defaults to the image index's size. `retry` is
    how a remote input shard's failed read is retried (`--read-retries` ...; no setting of the
    outputs), and every input shard is checked against what its index records of its bytes.

    With `buckets` (a table name or file, tools/commands/aspect_buckets.py:load_buckets), each image is
    cut to its nearest bucket instead of the square: OUT/shard-%06d.bNN.tar per bucket present in input
    shard i, each latent [C, H_b/f, W_b/f], each sample with `bucket.json` ({"bucket": "HxW",
    "original_size": [H0, W0], "crop_top_left": [top, left]}); the seal `shard-%06d_stats.json` covers
    the shard's bucket tars. index.json then gives each shard its `bucket`, lists every bucket of the
    table (`buckets`: name, image, shape) and the table (`bucket_table`), and `latent_shape` is the
    square base [C, r/f, r/f] of `resolution` r (default: a named table's side, pixart512's 512; for a
    file, the image index's size).
    """
    if dtype not in LATENT_DTYPES:
        raise ValueError(f"--dtype: got {dtype!r}, accepted: {', '.join(LATENT_DTYPES)}")
    if on_bad_sample not in BAD_SAMPLE_POLICIES:
        raise ValueError(f"--on-bad-sample: got {on_bad_sample!r}, accepted: {', '.join(BAD_SAMPLE_POLICIES)}")
    index = ShardIndex.load(image_shards_folder)
    if os.path.abspath(out_folder) == os.path.dirname(os.path.abspath(index.path)):
        raise ValueError(f"out_folder {out_folder!r} is the image shard folder: choose another, not to overwrite it")
    table = load_buckets(buckets) if buckets else None
    if not resolution:  # a named table's square side is the model's base; else the size the images were written at
        resolution = table.base if table is not None and table.base is not None else index_resolution(index)
    me = job_rank(rank, world)
    device = device or job_device(me)
    autoencoder = load_autoencoder(vae, subfolder, cache_dir, setting="vae").to(device)
    scaling = float(autoencoder.config.scaling_factor)
    shift = float(getattr(autoencoder.config, "shift_factor", None) or 0.0)
    bucket_meta = None
    if table is not None:
        factor = vae_factor(autoencoder)
        table.check_factor(factor)  # before any shard: a bucket the VAE cannot encode exactly is named
        if resolution % factor:
            raise ValueError(
                f"--resolution {resolution}: the base size of a bucketed encode must be a multiple of the VAE's "
                f"downsampling factor {factor}"
            )
        channels = int(autoencoder.config.latent_channels)
        bucket_meta = {
            "latent_shape": [channels, resolution // factor, resolution // factor],
            "buckets": table.index_entries(channels, factor),
            "bucket_table": {"name": table.name, "source": table.source},
        }
    decoder = SampleDecoder(resolution=resolution, channels=autoencoder.config.in_channels)
    encoder = None
    if text_encoder:
        encoder = TextEncoder(
            text_encoder, tokenizer, text_max_length or 1, setting="--text-encoder", tokenizer_setting="--tokenizer"
        )
        encoder.max_length = text_max_length or encoder_max_length(encoder)
    # what the outputs depend on, and nothing that does not: the source by its shards' names and counts,
    # the VAE by its config and the sha256 of its weights, the text encoder by its files, never by a path
    # (a requeue may see the same folder under another mount, or the VAE staged to $TMPDIR; new weights
    # at the same path are another VAE). Not --on-bad-sample: a shard sealed under `stop` held no bad
    # sample, so a retry with `skip` (what a stop's error suggests) continues the same job; each seal
    # records the policy it was written under and what it left out
    settings = {
        "source_shards": [os.path.basename(url) for url in index.urls],
        "source_counts": index.counts.tolist(),
        "vae": model_files(autoencoder_folder(vae, subfolder, cache_dir)),
        "resolution": resolution,
        "dtype": dtype,
        "flip": flip,
        "batch_size": batch_size,
        "text_encoder": identity_key(encoder.identity()) if encoder else None,
    }
    if encoder is not None and encoder.model.dtype != torch.float32:  # bf16 on CUDA: other features than fp32's
        settings["text_dtype"] = str(encoder.model.dtype).removeprefix("torch.")
    if table is not None:  # only then: an unbucketed job's digest (and its seals) stay as they were
        settings["buckets"] = {"name": table.name, "sizes": [list(size) for size in table.sizes]}
    vae_source = {"vae": os.path.abspath(vae) if os.path.isdir(vae) else vae, "subfolder": subfolder}  # for humans
    join_group(me)  # every rank has its models: nobody encodes for hours beside a rank that could not start
    job = ShardJob(
        out_folder,
        settings,
        me,
        what="latents encode",
        command=f"prunepipe latents encode {image_shards_folder} --out {out_folder}",
    )
    outputs = [output_shard(out_folder, shard) for shard in range(len(index))]

    @torch.no_grad()
    def encode(images: torch.Tensor) -> np.ndarray:
        return ((autoencoder.encode(images).latent_dist.mean - shift) * scaling).float().cpu().numpy().astype(dtype)

    mine = me.mine(len(index))
    todo = [shard for shard in mine if job.sealed(outputs[shard]) is None]
    progress = Progress(me, "latents encode", len(mine), len(mine) - len(todo))
    if encoder is not None and me.rank == 0:
        print(f"prunepipe: latents encode: captions at most {encoder.max_length} tokens", flush=True)

    def encode_one(shard: int) -> None:
        record = encode_shard(
            index,
            shard,
            outputs[shard],
            decoder,
            encode,
            encoder,
            dtype,
            flip,
            batch_size,
            on_bad_sample,
            device,
            retry,
            table,
        )
        files = None if table is None else [part_path(outputs[shard], part) for part in record["buckets"]]
        job.seal(outputs[shard], {**record, "on_bad_sample": on_bad_sample}, files)
        progress.shard_done(os.path.basename(outputs[shard]), record["successes"], len(record["skipped"]))

    job.work(todo, outputs, encode_one)  # a shard whose store fails is tried again after the others, then named

    def write_index() -> str:
        return _write_index(
            index,
            image_shards_folder,
            out_folder,
            outputs,
            job,
            encoder,
            device,
            dtype,
            {**settings, **vae_source},
            scaling,
            shift,
            bucket_meta,
        )

    return job.finish(outputs, write_index, wait_hours)


def part_path(output: str, part: dict) -> str:
    """A bucket tar of a seal's `buckets` list, beside the input shard's nominal output."""
    return os.path.join(os.path.dirname(output), part["file"])


@dataclass
class _OutputTar:
    """One tar an input shard is encoded into: the square output, or one bucket's."""

    path: str
    writer: wds.TarWriter
    written: int = 0
    latent_shape: list[int] = field(default_factory=list)


def encode_shard(
    index: ShardIndex,
    shard: int,
    output: str,
    decoder: SampleDecoder,
    encode,
    encoder,
    dtype: str,
    flip: bool,
    batch_size: int,
    on_bad_sample: str,
    device,
    retry: ReadRetry = DEFAULT_RETRY,
    table: BucketTable | None = None,
) -> dict:
    """One input shard into `output` (written as OUTPUT.partial, then moved into place); returns its
    stats record: img2dataset's counts, the output's bytes and CRC-32 (`tar_bytes`, `tar_crc32`: its
    index entry, and what `shards index` reads instead of the tar), the latent shape, the fields seen
    and the samples skipped.

    With `table`, each image is cut to its bucket and each bucket's samples go to a tar of their own
    (`bucket_shard`, written and moved into place the same way), in input order, the VAE batching one
    bucket's images at a time; the record then lists the tars in bucket order (`buckets`: bucket,
    name, file, successes, tar_bytes, tar_crc32, latent_shape each) in place of the output's fields."""
    url, count, first_id = index.urls[shard], int(index.counts[shard]), int(index.first_ids[shard])
    skipped: list[dict] = []
    fields_seen: set[str] = set()
    tars: dict[int | None, _OutputTar] = {}  # None: the square output; else a bucket's tar
    pending: dict[int | None, list[tuple[dict, torch.Tensor, str | None]]] = {}

    def bad(key, reason: str, samples: int = 1) -> None:
        if on_bad_sample == "stop":
            raise BadInputError(
                f"{reason} (--on-bad-sample stop; skip leaves such samples out, recorded in {SKIPPED_FILE})"
            )
        print(f"prunepipe: latents encode: skipping {samples} sample(s): {reason}", flush=True)
        skipped.append({"shard": url, "key": key, "reason": reason, "samples": samples})

    def tar_of(bucket: int | None) -> _OutputTar:
        if bucket not in tars:
            path = output if bucket is None else bucket_shard(output, bucket, len(table.sizes))
            # a fixed mtime: a shard encoded again, by any rank, is the same bytes
            tars[bucket] = _OutputTar(path, wds.TarWriter(partial_path(path), mtime=0.0))
        return tars[bucket]

    def write_batch(bucket: int | None) -> None:
        batch, tar = pending[bucket], tar_of(bucket)
        # a bucket's pixels waited as bytes (a quarter of float32's memory); the square ones come finished
        images = decoder.finish(torch.stack([image for _, image, _ in batch]), np.zeros(len(batch), dtype=np.int64), 0)
        images = images.to(device)
        latents = encode(images)
        tar.latent_shape = list(latents.shape[1:])
        mirrored = encode(images.flip(-1)) if flip else [None] * len(latents)
        texts = (
            real_tokens(
                encoder.encode([text for _, _, text in batch], device),
                dtype,
                [fields["__key__"] for fields, _, _ in batch],
            )
            if encoder is not None
            else [None] * len(latents)
        )
        for (fields, _, _), latent, latent_of_mirror, text in zip(batch, latents, mirrored, texts):
            record = {**fields, LATENT_FIELD: npy_bytes(latent)}
            if flip:
                record[FLIPPED_LATENT_FIELD] = npy_bytes(latent_of_mirror)
            if text is not None:
                record[TEXT_FEATURES_FIELD] = npy_bytes(text)
            tar.writer.write(record)
        tar.written += len(batch)
        batch.clear()

    def cut(sample: dict, sample_id: int) -> tuple[torch.Tensor, int | None, dict]:
        """The image as the VAE reads it ([C, H, W] in [-1, 1]), its bucket (None: the square) and the
        fields that go with it."""
        if table is None:
            image, _ = decoder(sample, sample_id, 0)  # BadInputError names shard and key
            return image, None, {}
        original, _ = decoder.decode_original(sample)  # uncropped: the bucket is the whole image's
        width, height = original.size
        bucket = table.nearest(height, width)
        bucket_height, bucket_width = table.sizes[bucket]
        img, (top, left) = resize_cover_crop(original, bucket_height, bucket_width)
        pixels = image_pixels(img)  # uint8 until its batch is full
        where = {
            "bucket": bucket_name(bucket_height, bucket_width),
            "original_size": [height, width],
            "crop_top_left": [top, left],
        }
        return pixels, bucket, {BUCKET_FIELD: json.dumps(where).encode()}

    if table is None:
        tar_of(None)  # the square output is written even for a shard without samples
    try:
        seen = 0
        try:
            for position, sample in read_shard(url, retry=retry, expected=index.expected(shard)):
                if position >= count:  # every later id would be off: never skipped
                    raise BadInputError(
                        f"shard {url}: holds more than the {count} samples {index.path} lists; "
                        f"index the shards again (`prunepipe shards index`)"
                    )
                seen = position + 1
                try:
                    image, bucket, added = cut(sample, first_id + position)
                    text = caption(sample) if encoder is not None else None
                except BadInputError as e:
                    bad(sample["__key__"], str(e))
                    continue
                # labels, the caption and its metadata travel with the latent (a text run reads `txt`)
                kept = {k: sample[k] for k in ("__key__", *LABEL_FIELDS, CAPTION_FIELD, METADATA_FIELD) if k in sample}
                fields_seen.update(k for k in kept if k != "__key__")
                queue = pending.setdefault(bucket, [])
                queue.append(({**kept, **added}, image, text))
                if len(queue) == batch_size:
                    write_batch(bucket)
        except BadInputError as e:
            # a read that failed after its retries is the store's fault, not the data's: never sealed as skipped
            if "holds more than" in str(e) or on_bad_sample == "stop" or isinstance(e.__cause__, ShardReadError):
                raise
            bad(None, str(e), count - seen)
            seen = count
        for bucket in sorted(pending, key=lambda b: -1 if b is None else b):
            if pending[bucket]:
                write_batch(bucket)
        if seen != count:
            bad(None, f"shard {url}: ended after {seen} samples, {index.path} lists {count}", count - seen)
    except BaseException:
        for tar in tars.values():  # nothing half-written stays behind this writer
            with contextlib.suppress(Exception):
                tar.writer.close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial_path(tar.path))
        raise
    for tar in tars.values():
        tar.writer.close()
        move_into_place(partial_path(tar.path), tar.path)
    record = {
        "count": count,
        "successes": sum(tar.written for tar in tars.values()),
        "failed_to_decode": sum(s["samples"] for s in skipped),
        "failed_to_download": 0,
        "failed_to_resize": 0,
    }
    if table is None:
        record.update(
            tar_bytes=os.path.getsize(output),
            tar_crc32=f"{file_crc32(output):08x}",  # read back just written, from the page cache
            latent_shape=tars[None].latent_shape,
        )
    else:
        record["buckets"] = [
            {
                "bucket": bucket,
                "name": bucket_name(*table.sizes[bucket]),
                "file": os.path.basename(tar.path),
                "successes": tar.written,
                "tar_bytes": os.path.getsize(tar.path),
                "tar_crc32": f"{file_crc32(tar.path):08x}",
                "latent_shape": tar.latent_shape,
            }
            for bucket, tar in sorted(tars.items())
        ]
    return {**record, "fields": sorted(fields_seen), "skipped": skipped}


def _write_index(
    index, image_shards_folder, out_folder, outputs, job, encoder, device, dtype, settings, scaling, shift, bucket_meta
) -> str:
    """index.json (and text_null.npy, skipped.json) from the seals of every output shard; bucketed
    (`bucket_meta`: the base latent_shape, the `buckets` table and `bucket_table`), every bucket tar of
    every input shard, in input-shard order, then bucket order."""
    seals = [job.sealed(output) for output in outputs]
    if bucket_meta is None:
        shapes = {tuple(seal["latent_shape"]) for seal in seals if seal["latent_shape"]}
        if len(shapes) > 1:
            raise ValueError(f"{out_folder}: the sealed shards hold latents of different shapes {sorted(shapes)}")
        latent_shape = list(shapes.pop()) if shapes else []
        entries = [
            # a seal written before seals held the CRC-32 gives the size alone
            ShardEntry(output, seal["successes"], seal["tar_bytes"], _seal_crc32(seal))
            for output, seal in zip(outputs, seals)
        ]
        bucketed = {}
    else:
        latent_shape, entries = bucket_meta["latent_shape"], _bucket_entries(out_folder, outputs, seals, bucket_meta)
        bucketed = {"buckets": bucket_meta["buckets"], "bucket_table": bucket_meta["bucket_table"]}
    skipped = [entry for seal in seals for entry in seal["skipped"]]
    write_json(
        os.path.join(out_folder, SKIPPED_FILE), {"count": sum(e["samples"] for e in skipped), "samples": skipped}
    )
    text_meta = {}
    if encoder is not None:
        null = real_tokens(encoder.encode([""], device), dtype, ["(the empty caption)"])[0]
        null_path = os.path.join(out_folder, TEXT_NULL_FILE)
        # a file, not a name (np.save would add `.npy` to a name); a killed writer's partial is removed by
        # the next run, as a shard's
        with atomic_open(null_path, "wb", suffix=".partial") as f:
            np.save(f, null, allow_pickle=False)
        text_meta = {"text_encoder": encoder.identity(), "text_width": encoder.hidden_size}
    fields = sorted({field for seal in seals for field in seal["fields"]})
    path = ShardIndex.write(
        out_folder,
        entries,
        source=os.path.abspath(image_shards_folder),
        vae=settings["vae"],
        subfolder=settings["subfolder"],
        scaling_factor=scaling,
        shift_factor=shift,
        latent_shape=latent_shape,
        resolution=settings["resolution"],
        dtype=dtype,
        flip=settings["flip"],
        keys=[
            LATENT_FIELD,
            *([FLIPPED_LATENT_FIELD] if settings["flip"] else []),
            *([TEXT_FEATURES_FIELD] if encoder else []),
            *([BUCKET_FIELD] if bucketed else []),
            *fields,
        ],
        skipped=sum(e["samples"] for e in skipped),
        **text_meta,
        **bucketed,
    )
    in_buckets = f" in {len(entries)} bucket tars" if bucketed else ""
    print(
        f"prunepipe: latents encode: {path}: {len(outputs)} shards{in_buckets}, "
        f"{sum(s['successes'] for s in seals)} samples"
        + (f", {len(skipped)} skip record(s) in {SKIPPED_FILE}" if skipped else ""),
        flush=True,
    )
    return path


def _bucket_entries(out_folder: str, outputs: list[str], seals: list[dict], bucket_meta: dict) -> list[ShardEntry]:
    """The index entries of a bucketed encode: each input shard's bucket tars as its seal lists them
    (bucket order), checked against the table's shapes."""
    table = bucket_meta["buckets"]
    entries = []
    for output, seal in zip(outputs, seals):
        for part in seal["buckets"]:
            expected = table[part["bucket"]]
            if list(part["latent_shape"]) != list(expected["shape"]):
                raise ValueError(
                    f"{part_path(output, part)}: holds latents of shape {part['latent_shape']}, but bucket "
                    f"{expected['name']} of the table gives {expected['shape']}"
                )
            entries.append(
                ShardEntry(
                    part_path(output, part),
                    part["successes"],
                    part["tar_bytes"],
                    int(part["tar_crc32"], 16),
                    part["bucket"],
                )
            )
    if not entries:
        raise BadInputError(f"{out_folder}: no sample was encoded (see {SKIPPED_FILE}): nothing to index")
    return entries


def _seal_crc32(seal: dict) -> int | None:
    """An output shard's CRC-32 as its seal records it (`encode_shard`), None in an older seal."""
    crc = seal.get("tar_crc32")
    return None if crc is None else int(crc, 16)


def real_tokens(condition: TextCondition, dtype: str, keys: list[str]) -> list[np.ndarray]:
    """Each caption's features at its real tokens only (where the mask is 1, whichever side the
    tokenizer pads), [n, D] in `dtype`: the padding is masked out of the cross-attention anyway, and
    stored it would be most of the bytes (T5's 120 tokens, ~30 real). A value that does not fit
    `dtype` stops the encoding, naming the sample's key."""
    features = condition.features.float().cpu().numpy()
    masks = condition.mask.bool().cpu().numpy()
    rows = [np.ascontiguousarray(f[m]).astype(dtype) for f, m in zip(features, masks)]
    for key, row in zip(keys, rows):
        if not np.isfinite(row).all():
            raise ValueError(
                f"key {key!r}: its caption's text features are not finite in {dtype} (largest "
                f"magnitude {np.abs(features).max():.4g}); encode with --dtype float32"
            )
    return rows
