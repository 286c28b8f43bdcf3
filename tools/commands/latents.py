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
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch
import webdataset as wds

from prunepipe.pipelines.checkpoint.manifest import file_crc32
from prunepipe.pipelines.data.decode import (
    CAPTION_FIELD,
    FLIPPED_LATENT_FIELD,
    LABEL_FIELDS,
    METADATA_FIELD,
    TEXT_FEATURES_FIELD,
    TEXT_NULL_FILE,
    SampleDecoder,
    caption,
)
from prunepipe.pipelines.data.remote import ReadRetry, ShardReadError
from prunepipe.pipelines.data.shards import DEFAULT_RETRY, BadInputError, ShardEntry, ShardIndex, read_shard
from prunepipe.pipelines.data.side_tables import write_json
from prunepipe.pipelines.tasks.diffusion.autoencoder import autoencoder_folder, load_autoencoder
from prunepipe.pipelines.tasks.diffusion.text import TextCondition, TextEncoder, identity_key
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
    """
    if dtype not in LATENT_DTYPES:
        raise ValueError(f"--dtype: got {dtype!r}, accepted: {', '.join(LATENT_DTYPES)}")
    if on_bad_sample not in BAD_SAMPLE_POLICIES:
        raise ValueError(f"--on-bad-sample: got {on_bad_sample!r}, accepted: {', '.join(BAD_SAMPLE_POLICIES)}")
    index = ShardIndex.load(image_shards_folder)
    if os.path.abspath(out_folder) == os.path.dirname(os.path.abspath(index.path)):
        raise ValueError(f"out_folder {out_folder!r} is the image shard folder: choose another, not to overwrite it")
    resolution = resolution or index_resolution(index)
    me = job_rank(rank, world)
    device = device or job_device(me)
    autoencoder = load_autoencoder(vae, subfolder, cache_dir, setting="vae").to(device)
    scaling = float(autoencoder.config.scaling_factor)
    shift = float(getattr(autoencoder.config, "shift_factor", None) or 0.0)
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
    # at the same path are another VAE)
    settings = {
        "source_shards": [os.path.basename(url) for url in index.urls],
        "source_counts": index.counts.tolist(),
        "vae": model_files(autoencoder_folder(vae, subfolder, cache_dir)),
        "resolution": resolution,
        "dtype": dtype,
        "flip": flip,
        "batch_size": batch_size,
        "on_bad_sample": on_bad_sample,
        "text_encoder": identity_key(encoder.identity()) if encoder else None,
    }
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
        )
        job.seal(outputs[shard], record)
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
        )

    return job.finish(outputs, write_index, wait_hours)


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
) -> dict:
    """One input shard into `output` (written as OUTPUT.partial, then moved into place); returns its
    stats record: img2dataset's counts, the output's bytes and CRC-32 (`tar_bytes`, `tar_crc32`: its
    index entry, and what `shards index` reads instead of the tar), the latent shape, the fields seen
    and the samples skipped."""
    url, count, first_id = index.urls[shard], int(index.counts[shard]), int(index.first_ids[shard])
    skipped: list[dict] = []
    fields_seen: set[str] = set()
    latent_shape: list[int] = []
    written = 0
    partial = partial_path(output)

    def bad(key, reason: str, samples: int = 1) -> None:
        if on_bad_sample == "stop":
            raise BadInputError(
                f"{reason} (--on-bad-sample stop; skip leaves such samples out, recorded in {SKIPPED_FILE})"
            )
        print(f"prunepipe: latents encode: skipping {samples} sample(s): {reason}", flush=True)
        skipped.append({"shard": url, "key": key, "reason": reason, "samples": samples})

    # a fixed mtime: a shard encoded again, by any rank, is the same bytes
    with wds.TarWriter(partial, mtime=0.0) as writer:
        pending: list[tuple[dict, torch.Tensor, str | None]] = []

        def write_batch() -> None:
            nonlocal written
            images = torch.stack([image for _, image, _ in pending]).to(device)
            latents = encode(images)
            latent_shape[:] = list(latents.shape[1:])
            mirrored = encode(images.flip(-1)) if flip else [None] * len(latents)
            texts = (
                real_tokens(
                    encoder.encode([text for _, _, text in pending], device),
                    dtype,
                    [fields["__key__"] for fields, _, _ in pending],
                )
                if encoder is not None
                else [None] * len(latents)
            )
            for (fields, _, _), latent, latent_of_mirror, text in zip(pending, latents, mirrored, texts):
                record = {**fields, LATENT_FIELD: npy_bytes(latent)}
                if flip:
                    record[FLIPPED_LATENT_FIELD] = npy_bytes(latent_of_mirror)
                if text is not None:
                    record[TEXT_FEATURES_FIELD] = npy_bytes(text)
                writer.write(record)
            written += len(pending)
            pending.clear()

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
                    image, _ = decoder(sample, first_id + position, 0)  # BadInputError names shard and key
                    text = caption(sample) if encoder is not None else None
                except BadInputError as e:
                    bad(sample["__key__"], str(e))
                    continue
                # labels, the caption and its metadata travel with the latent (a text run reads `txt`)
                kept = {k: sample[k] for k in ("__key__", *LABEL_FIELDS, CAPTION_FIELD, METADATA_FIELD) if k in sample}
                fields_seen.update(k for k in kept if k != "__key__")
                pending.append((kept, image, text))
                if len(pending) == batch_size:
                    write_batch()
        except BadInputError as e:
            # a read that failed after its retries is the store's fault, not the data's: never sealed as skipped
            if "holds more than" in str(e) or on_bad_sample == "stop" or isinstance(e.__cause__, ShardReadError):
                raise
            bad(None, str(e), count - seen)
            seen = count
        if pending:
            write_batch()
        if seen != count:
            bad(None, f"shard {url}: ended after {seen} samples, {index.path} lists {count}", count - seen)
    os.replace(partial, output)
    lost = sum(s["samples"] for s in skipped)
    return {
        "count": count,
        "successes": written,
        "failed_to_decode": lost,
        "failed_to_download": 0,
        "failed_to_resize": 0,
        "tar_bytes": os.path.getsize(output),
        "tar_crc32": f"{file_crc32(output):08x}",  # read back just written, from the page cache
        "latent_shape": latent_shape,
        "fields": sorted(fields_seen),
        "skipped": skipped,
    }


def _write_index(
    index, image_shards_folder, out_folder, outputs, job, encoder, device, dtype, settings, scaling, shift
) -> str:
    """index.json (and text_null.npy, skipped.json) from the seals of every output shard."""
    seals = [job.sealed(output) for output in outputs]
    shapes = {tuple(seal["latent_shape"]) for seal in seals if seal["latent_shape"]}
    if len(shapes) > 1:
        raise ValueError(f"{out_folder}: the sealed shards hold latents of different shapes {sorted(shapes)}")
    skipped = [entry for seal in seals for entry in seal["skipped"]]
    write_json(
        os.path.join(out_folder, SKIPPED_FILE), {"count": sum(e["samples"] for e in skipped), "samples": skipped}
    )
    text_meta = {}
    if encoder is not None:
        null = real_tokens(encoder.encode([""], device), dtype, ["(the empty caption)"])[0]
        null_path = os.path.join(out_folder, TEXT_NULL_FILE)
        tmp = partial_path(null_path)  # a killed writer's is removed by the next run, as a shard's
        with open(tmp, "wb") as f:  # a file, not a name: np.save would add `.npy` to the name
            np.save(f, null, allow_pickle=False)
        os.replace(tmp, null_path)
        text_meta = {"text_encoder": encoder.identity(), "text_width": encoder.hidden_size}
    fields = sorted({field for seal in seals for field in seal["fields"]})
    path = ShardIndex.write(
        out_folder,
        [
            # a seal written before seals held the CRC-32 gives the size alone
            ShardEntry(output, seal["successes"], seal["tar_bytes"], _seal_crc32(seal))
            for output, seal in zip(outputs, seals)
        ],
        source=os.path.abspath(image_shards_folder),
        vae=settings["vae"],
        subfolder=settings["subfolder"],
        scaling_factor=scaling,
        shift_factor=shift,
        latent_shape=list(shapes.pop()) if shapes else [],
        resolution=settings["resolution"],
        dtype=dtype,
        flip=settings["flip"],
        keys=[
            LATENT_FIELD,
            *([FLIPPED_LATENT_FIELD] if settings["flip"] else []),
            *([TEXT_FEATURES_FIELD] if encoder else []),
            *fields,
        ],
        skipped=sum(e["samples"] for e in skipped),
        **text_meta,
    )
    print(
        f"prunepipe: latents encode: {path}: {len(outputs)} shards, {sum(s['successes'] for s in seals)} samples"
        + (f", {len(skipped)} skip record(s) in {SKIPPED_FILE}" if skipped else ""),
        flush=True,
    )
    return path


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
