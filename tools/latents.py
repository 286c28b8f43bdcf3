"""Encode image shards once into latent shards with a diffusers AutoencoderKL, so latent-diffusion
runs stream `latent.npy` instead of running the VAE every step; with a text encoder, each caption's
features too (`text.npy`, its real tokens only), so a text-conditional run loads no encoder. The
output keeps every sample's key, label, caption, position and per-shard count, so global sample ids
(and pruner scores) are the same. It never downloads a model and never skips a sample: a sample that
does not decode, or has no caption when features are asked for, stops it.
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch

from pipelines.data.decode import (CAPTION_FIELD, FLIPPED_LATENT_FIELD, LABEL_FIELDS, TEXT_FEATURES_FIELD, TEXT_NULL_FILE,
                                   SampleDecoder, caption)
from pipelines.data.shards import BadInputError, ShardIndex, read_shard
from pipelines.progress import progress
from pipelines.tasks.diffusion import load_autoencoder
from pipelines.tasks.text import TextCondition, TextEncoder
from tools.shards import counted_shard_writer

LATENT_FIELD = "latent.npy"
LATENT_DTYPES = ("float16", "float32")


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def encode_shards(
    image_shards_folder: str,
    vae: str,
    out_folder: str,
    *,
    resolution: int,
    batch_size: int = 32,
    subfolder: str = "",
    cache_dir: str = "",
    dtype: str = "float16",
    device: str | None = None,
    flip: bool = False,
    text_encoder: str = "",
    tokenizer: str = "",
    text_max_length: int = 77,
) -> str:
    """Write OUT/shard-%06d.tar (one per input shard) + OUT/index.json; return the index path.

    Each latent is (posterior mean - shift_factor) * scaling_factor, the scaled space the UNet
    denoises (DiffusionConfig(autoencoder="latents")). The mean, not a posterior sample, makes the
    shards a pure function of the images and the VAE; a KL-regularised VAE's posterior is narrow.
    Stored as `dtype` numpy arrays [C, h, w]; index.json records vae, subfolder, scaling_factor,
    shift_factor, latent_shape and flip. With `flip`, each sample also holds `latent_flip.npy`, the
    latent of its mirrored image, which a `data.hflip` run reads where the flip coin says: the exact
    flip, for twice the encoding and the bytes (docs/diffusion.md, "Latents and flips").

    With `text_encoder` (a local CLIP text or T5 encoder folder, `tokenizer` beside it unless given),
    each sample also holds `text.npy`: its caption's features, [n, D] for its n real tokens (at most
    `text_max_length`), in `dtype`; OUT/text_null.npy holds the empty caption's, and index.json the
    encoder's identity (ldm.text_encoder=precomputed reads them; docs/diffusion.md, "Text features").
    """
    if dtype not in LATENT_DTYPES:
        raise ValueError(f"dtype: got {dtype!r}, accepted: {', '.join(LATENT_DTYPES)}")
    index = ShardIndex.load(image_shards_folder)
    if os.path.abspath(out_folder) == os.path.dirname(os.path.abspath(index.path)):
        raise ValueError(f"out_folder {out_folder!r} is the image shard folder: choose another, not to overwrite it")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    autoencoder = load_autoencoder(vae, subfolder, cache_dir, setting="vae").to(device)
    scaling = float(autoencoder.config.scaling_factor)
    shift = float(getattr(autoencoder.config, "shift_factor", None) or 0.0)
    decoder = SampleDecoder(resolution=resolution, channels=autoencoder.config.in_channels)
    encoder = TextEncoder(text_encoder, tokenizer, text_max_length, setting="text_encoder") if text_encoder else None

    entries: list[tuple[str, int]] = []
    latent_shape: list[int] = []
    fields_seen: set[str] = set()

    @torch.no_grad()
    def encode(images: torch.Tensor) -> np.ndarray:
        return ((autoencoder.encode(images).latent_dist.mean - shift) * scaling).float().cpu().numpy().astype(dtype)

    @torch.no_grad()
    def write_batch(writer, pending: list[tuple[dict, torch.Tensor, str | None]]) -> None:
        images = torch.stack([image for _, image, _ in pending]).to(device)
        latents = encode(images)
        latent_shape[:] = list(latents.shape[1:])
        mirrored = encode(images.flip(-1)) if flip else [None] * len(latents)
        texts = real_tokens(encoder.encode([text for _, _, text in pending], device), dtype,
                            [fields["__key__"] for fields, _, _ in pending]) \
            if encoder is not None else [None] * len(latents)
        for (fields, _, _), latent, latent_of_mirror, text in zip(pending, latents, mirrored, texts):
            record = {**fields, LATENT_FIELD: npy_bytes(latent)}
            if flip:
                record[FLIPPED_LATENT_FIELD] = npy_bytes(latent_of_mirror)
            if text is not None:
                record[TEXT_FEATURES_FIELD] = npy_bytes(text)
            writer.write(record)
        pending.clear()

    # One output shard per input shard: no size or count limit may split one.
    with counted_shard_writer(out_folder, entries, maxcount=int(index.counts.max()) + 1, maxsize=float("inf")) as writer:
        bar = progress(index.num_samples, desc=f"encoding {os.path.basename(out_folder.rstrip('/'))}", unit="img")
        for shard, (url, count, first_id) in enumerate(zip(index.urls, index.counts, index.first_ids)):
            if shard > 0:
                writer.next_stream()  # close the previous shard even when it was empty
            pending: list[tuple[dict, torch.Tensor, str | None]] = []
            seen = 0
            for position, sample in read_shard(url):
                if position >= count:
                    raise BadInputError(f"shard {url}: holds more than the {count} samples {index.path} lists")
                image, _ = decoder(sample, int(first_id) + position, 0)  # BadInputError names shard and key
                text = caption(sample) if encoder is not None else None  # no caption: stop, naming it
                # labels and the caption travel with the latent (a text run reads `txt` from latent shards)
                kept = {k: sample[k] for k in ("__key__", *LABEL_FIELDS, CAPTION_FIELD) if k in sample}
                fields_seen.update(k for k in kept if k != "__key__")
                pending.append((kept, image, text))
                seen = position + 1
                if len(pending) == batch_size:
                    write_batch(writer, pending)
                bar.update(1)
            if pending:
                write_batch(writer, pending)
            if seen != count:
                raise BadInputError(f"shard {url}: ended after {seen} samples, {index.path} lists {count}")
        bar.close()
    text_meta = {}
    if encoder is not None:
        null = real_tokens(encoder.encode([""], device), dtype, ["(the empty caption)"])[0]
        np.save(os.path.join(out_folder, TEXT_NULL_FILE), null, allow_pickle=False)
        text_meta = {"text_encoder": encoder.identity(), "text_width": encoder.hidden_size}
    return ShardIndex.write(
        out_folder,
        entries,
        source=os.path.abspath(image_shards_folder),
        vae=os.path.abspath(vae) if os.path.isdir(vae) else vae,
        subfolder=subfolder,
        scaling_factor=scaling,
        shift_factor=shift,
        latent_shape=latent_shape,
        resolution=resolution,
        dtype=dtype,
        flip=flip,
        keys=[LATENT_FIELD, *([FLIPPED_LATENT_FIELD] if flip else []), *([TEXT_FEATURES_FIELD] if encoder else []),
              *sorted(fields_seen)],
        **text_meta,
    )


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
            raise ValueError(f"key {key!r}: its caption's text features are not finite in {dtype} (largest "
                             f"magnitude {np.abs(features).max():.4g}); encode with --dtype float32")
    return rows
