"""`prunepipe shards write | index | verify | inspect`: make WebDataset shards, index shards written
elsewhere, check shards against their index, and look at what a shard folder holds.

Layout written: OUT/train/shard-000000.tar ... + OUT/train/index.json, and the same for val (and, for
the redundant source, val_mix: held-out data drawn from the train mix; val is clean). An image folder
is written in a seeded global shuffle, holding its list of paths and one chunk of images at a time;
indexing reads tar headers only (or img2dataset's per-shard stats), shards in parallel threads, and
each shard's bytes once more for its CRC-32 only where the count did not read them all. Every index
written here records each shard's size and CRC-32 (`--no-checksums`: the size alone).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import json
import multiprocessing
import os
import threading
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, NamedTuple
from urllib.parse import urlparse

import numpy as np
import webdataset as wds
from braceexpand import braceexpand
from PIL import Image

from prunepipe.pipelines.checkpoint.manifest import file_crc32
from prunepipe.pipelines.data.remote import ReadRetry
from prunepipe.pipelines.data.shards import (
    CRC32_HEX,
    DEFAULT_RETRY,
    INDEX_NAME,
    BadInputError,
    ShardEntry,
    ShardIndex,
    read_keys,
    read_shard,
    shard_checksum,
    survey_shard,
)
from prunepipe.pipelines.data.side_tables import write_json
from prunepipe.pipelines.progress import progress, tracked
from prunepipe.tools.commands.aspect_buckets import (
    BUCKET_FIELD,
    METADATA_FIELD,
    AspectHistogram,
    BucketTable,
    aspect_histogram,
    metadata_size,
)
from prunepipe.tools.commands.captioned import CAPTIONED_KEYS, captioned_splits, img2dataset_sample
from prunepipe.tools.commands.source_registry import SourceOptions, resolve, shard_source

if TYPE_CHECKING:
    from prunepipe.tools.commands.source_registry import Item
from prunepipe.tools.commands.sources import (
    check_copy_kinds,
    copies_by_kind,
    folder_key,
    list_image_folder,
    load_image,
    redundant_splits,
    split_by_permutation,
)

FOLDER_CHUNK = 256  # images of an image folder decoded before they are written: what write holds at once
STATS_SUFFIX = "_stats.json"  # img2dataset writes NNNNN_stats.json beside NNNNN.tar


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def process_pool(workers: int) -> ProcessPoolExecutor:
    """`workers` processes; forked when this process runs no other thread (nothing to start again,
    no lock another thread could hold across the fork), else from a fork server."""
    method = (
        "fork"
        if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()
        else "forkserver"
        if "forkserver" in multiprocessing.get_all_start_methods()
        else "spawn"
    )
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method))


def write_shards(
    source: str,
    out: str,
    *,
    size: int = 32,
    shard_size: int = 500,
    val_fraction: float = 0.1,
    seed: int = 0,
    folder: str | None = None,
    crops_per_photo: int = 250,
    redundant_fraction: float = 0.5,
    redundant_originals: int = 64,
    redundant_copies: str = "even",
    redundant_kinds: Mapping[str, float] | None = None,
    workers: int | None = None,
    chunk: int = FOLDER_CHUNK,
    captions: bool = False,
    aspects: bool = False,
    square: bool = False,
) -> dict[str, str]:
    """Write the splits of `source`, a name of tools/commands/source_registry.py (train and val; `redundant`
    also val_mix and train_dedup) with webdataset's ShardWriter; returns index paths. `folder` is written by
    `write_folder`: each file's bytes as they are, or with `square` centre-cropped to `size` as PNG (then with
    `workers` and `chunk`). `redundant_copies` and `redundant_kinds` are redundant_splits' `copy_counts` and
    `copy_kinds`; with `captions`, digits and photos are written as img2dataset writes image-text pairs
    (tools/commands/captioned.py); with `aspects` too, the photo crops keep their own aspect ratios (four of
    them, shorter side `size`)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if captions:
        splits = captioned_splits(
            source, size, val_fraction=val_fraction, seed=seed, crops_per_photo=crops_per_photo, aspects=aspects
        )
        return {
            split: write_samples(
                os.path.join(out, split),
                (img2dataset_sample(*item) for item in chosen),
                source=source,
                size=size,
                shard_size=shard_size,
                keys=CAPTIONED_KEYS,
                desc=f"{source}/{split} (captioned)",
                total=len(chosen),
                captions=True,
            )
            for split, chosen in splits.items()
            if chosen
        }
    if aspects:
        raise ValueError("--aspects writes captioned photo crops: give --source photos --captions")
    options = SourceOptions(
        size=size,
        shard_size=shard_size,
        val_fraction=val_fraction,
        seed=seed,
        folder=folder,
        crops_per_photo=crops_per_photo,
        redundant_fraction=redundant_fraction,
        redundant_originals=redundant_originals,
        redundant_copies=redundant_copies,
        redundant_kinds=redundant_kinds,
        workers=workers,
        chunk=chunk,
        square=square,
    )
    found = shard_source(source)
    if found.write is not None:
        return resolve(found.write)(out, options)
    items = list(resolve(found.items)(options))
    return write_item_splits(out, source, split_by_permutation(items, val_fraction, seed), options)


def write_item_splits(
    out: str, source: str, splits: Mapping[str, list[Item]], options: SourceOptions, **meta
) -> dict[str, str]:
    """Each split's (key, image, class) items as PNG shards in OUT/SPLIT/, `meta` recorded in its index.json;
    an empty split is not written."""
    return {
        split: write_split(
            os.path.join(out, split),
            ((k, png_bytes(im), label) for k, im, label in chosen),
            source=source,
            size=options.size,
            shard_size=options.shard_size,
            desc=f"{source}/{split}",
            total=len(chosen),
            **meta,
            **split_meta(source, chosen),
        )
        for split, chosen in splits.items()
        if chosen
    }


def write_redundant(out: str, options: SourceOptions) -> dict[str, str]:
    """The redundant source (sources.py:redundant_splits): train, a clean val, val_mix and train_dedup, its
    settings recorded in each index.json."""
    splits = redundant_splits(
        options.size,
        fraction=options.redundant_fraction,
        originals=options.redundant_originals,
        val_fraction=options.val_fraction,
        crops_per_photo=options.crops_per_photo,
        seed=options.seed,
        copy_counts=options.redundant_copies,
        copy_kinds=options.redundant_kinds,
    )
    meta = {
        "redundant_fraction": options.redundant_fraction,
        "redundant_originals": options.redundant_originals,
        "redundant_copies": options.redundant_copies,
        "redundant_kinds": check_copy_kinds(options.redundant_kinds),
        "crops_per_photo": options.crops_per_photo,
        "seed": options.seed,
    }
    return write_item_splits(out, "redundant", splits, options, **meta)


def write_folder_source(out: str, options: SourceOptions) -> dict[str, str]:
    """The folder source: `write_folder` of --folder."""
    if not options.folder:
        raise ValueError("source 'folder' needs --folder PATH")
    return write_folder(
        options.folder,
        out,
        size=options.size,
        shard_size=options.shard_size,
        val_fraction=options.val_fraction,
        seed=options.seed,
        workers=options.workers,
        chunk=options.chunk,
        square=options.square,
    )


def split_meta(source: str, items: list[Item]) -> dict:
    """What index.json records of one split beyond the source's settings: for `redundant`, its copies
    of each kind (read from their keys)."""
    return {"copies_by_kind": copies_by_kind(key for key, _, _ in items)} if source == "redundant" else {}


def write_folder(
    folder: str,
    out: str,
    *,
    size: int,
    shard_size: int = 500,
    val_fraction: float = 0.1,
    seed: int = 0,
    workers: int | None = None,
    chunk: int = FOLDER_CHUNK,
    square: bool = False,
) -> dict[str, str]:
    """An image folder as train and val shards, in bounded memory and a global shuffle.

    It lists the files (paths only), draws one permutation of them from `seed`, takes val from its
    head and train from the rest, and writes each split in that order: shards in sorted path order
    would be class-sorted, and a rank's run of consecutive shards would then hold a few classes
    only. A sample's key is its position in sorted path order (`folder_key`): the same folder gives
    an image the same key whatever the seed.

    Each image's bytes are written as they are, under its format's field (a JPEG stays a JPEG, as
    img2dataset writes them): training crops the whole photograph (MAE's random resized crop) and
    nothing is re-encoded; each file is opened only to check that it is an image. With `square`, each
    is decoded, resized and centre-cropped to `size` and PNG-encoded, one chunk of `chunk` images at
    a time by `workers` processes (default: the usable cores; 0 or 1: in this process).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    paths, labels = list_image_folder(folder)
    order = np.random.default_rng(seed).permutation(len(paths))
    held = int(round(val_fraction * len(paths)))
    splits = {"train": order[held:], "val": order[:held]}
    if not square:
        return {
            split: write_samples(
                os.path.join(out, split),
                folder_files(paths, labels, positions),
                source="folder",
                size=None,
                shard_size=shard_size,
                keys=None,  # the fields its files' formats give
                desc=f"folder/{split}",
                total=len(positions),
                seed=seed,
            )
            for split, positions in splits.items()
            if len(positions)
        }
    workers = usable_cores() if workers is None else workers
    pool = process_pool(workers) if workers > 1 else None
    try:
        return {
            split: write_split(
                os.path.join(out, split),
                folder_samples(paths, labels, positions, size=size, chunk=chunk, pool=pool),
                source="folder",
                size=size,
                shard_size=shard_size,
                desc=f"folder/{split}",
                total=len(positions),
                seed=seed,
            )
            for split, positions in splits.items()
            if len(positions)
        }
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def folder_files(paths: list[str], labels: np.ndarray, positions: np.ndarray) -> Iterator[dict]:
    """The samples of the images at `positions`, in that order: each file's bytes unchanged under its
    format's field (`image_field`), its class as `cls`."""
    for i in positions:
        path = paths[i]
        field = image_field(path)
        with open(path, "rb") as f:
            data = f.read()
        sample = {"__key__": folder_key(int(i)), field: data}
        if labels[i] >= 0:
            sample["cls"] = str(int(labels[i]))
        yield sample


def image_field(path: str) -> str:
    """The sample field of an image file: its format's extension as the decoder reads it (jpg for
    JPEG, as img2dataset names it; png, webp, ...). PIL reads the header, not the pixels; a file that
    is not an image, or whose format the decoder does not read, is refused naming it."""
    try:
        with Image.open(path) as img:
            kind = img.format
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad bytes
        raise ValueError(f"{path}: not a readable image: {e}") from e
    field = IMAGE_FORMAT_FIELDS.get(kind)
    if field is None:
        raise ValueError(
            f"{path}: a {kind} image, which training does not decode; accepted: "
            f"{', '.join(sorted(IMAGE_FORMAT_FIELDS))} (or write with --square, which re-encodes as PNG)"
        )
    return field


IMAGE_FORMAT_FIELDS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "PPM": "ppm", "TIFF": "tiff"}


def folder_png(path: str, size: int) -> bytes:
    """One folder image decoded, resized and PNG-encoded (run in a pool worker)."""
    return png_bytes(load_image(path, size))


def folder_samples(
    paths: list[str],
    labels: np.ndarray,
    positions: np.ndarray,
    *,
    size: int,
    chunk: int,
    pool: ProcessPoolExecutor | None = None,
) -> Iterator[tuple[str, bytes, int]]:
    """(key, png, label) of the images at `positions`, in that order, decoded `chunk` at a time: the
    next chunk is decoded only once the caller has taken this one."""
    encode = functools.partial(folder_png, size=size)
    for start in range(0, len(positions), chunk):
        part = positions[start : start + chunk]
        files = [paths[i] for i in part]
        if pool is None:
            encoded = [encode(f) for f in files]
        else:
            encoded = list(pool.map(encode, files, chunksize=8))  # 8 images a message: little pickling
        for i, png in zip(part, encoded):
            yield folder_key(int(i)), png, int(labels[i])


def shard_sample(key: str, png: bytes, label: int) -> dict:
    """A webdataset sample: the image as `png`, its class as `cls` (none when the class is unknown, -1)."""
    sample = {"__key__": key, "png": png}
    if label >= 0:
        sample["cls"] = str(label)
    return sample


def write_split(
    folder: str,
    items: Iterable[tuple[str, bytes, int]],
    *,
    source: str,
    size: int,
    shard_size: int,
    desc: str,
    total: int | None = None,
    **meta,
) -> str:
    """(key, png, label) items, taken one at a time, as shards in `folder` with their index.json;
    returns its path."""
    samples = (shard_sample(key, png, label) for key, png, label in items)
    return write_samples(
        folder,
        samples,
        source=source,
        size=size,
        shard_size=shard_size,
        keys=["png", "cls"],
        desc=desc,
        total=total,
        **meta,
    )


def write_samples(
    folder: str,
    samples: Iterable[dict],
    *,
    source: str,
    size: int | None,
    shard_size: int,
    keys: list[str] | None,
    desc: str,
    total: int | None = None,
    **meta,
) -> str:
    """webdataset samples, taken one at a time, as shards in `folder` with their index.json (listing
    `keys`, or with None the fields the samples held; `size`, the side the images were cut to, where
    there is one); returns its path."""
    entries: list[ShardEntry] = []
    held: set[str] = set()
    with counted_shard_writer(folder, entries, maxcount=shard_size) as writer:
        for sample in tracked(samples, total=total, desc=desc, unit="img"):
            if keys is None:
                held.update(k for k in sample if not k.startswith("__"))
            writer.write(sample)
    if size is not None:
        meta["size"] = size
    return ShardIndex.write(folder, entries, source=source, keys=sorted(held) if keys is None else keys, **meta)


@contextlib.contextmanager
def counted_shard_writer(folder: str, entries: list[ShardEntry], **limits) -> Iterator[wds.ShardWriter]:
    """webdataset's ShardWriter over `folder`/shard-NNNNNN.tar. Each shard it closes is appended to
    `entries` (path, samples, bytes, CRC-32) and gets img2dataset's shard-NNNNNN_stats.json beside it,
    so that `shards index` counts these shards again, wherever the folder is copied on local or
    mounted storage, from a stat and the stats file (it reads the first shard's headers to check)."""
    os.makedirs(folder, exist_ok=True)
    # an earlier write's shards, stats and index go first: a write that dies midway leaves no index
    # over a mix of old and new tars
    for pattern in (INDEX_NAME, "shard-*.tar", f"shard-*{STATS_SUFFIX}"):
        for stale in glob.glob(os.path.join(folder, pattern)):
            os.remove(stale)
    with wds.ShardWriter(os.path.join(folder, "shard-%06d.tar"), verbose=0, **limits) as writer:

        def closed(path: str) -> None:
            # read back just written, from the page cache: a few ms a 500-sample shard
            entry = ShardEntry(path, writer.count, os.path.getsize(path), file_crc32(path))
            entries.append(entry)
            write_shard_stats(path, writer.count, entry.crc32)

        writer.post = closed
        yield writer


def write_shard_stats(tar_path: str, samples: int, crc32: int | None = None) -> None:
    """The counts of img2dataset's NNNNN_stats.json (img2dataset/logger.py `write_stats`) for a shard
    of `samples` samples, none failed, the tar's size (`tar_bytes`, ours: a tar cut short or written
    again since no longer matches it) and its CRC-32 (`tar_crc32`, ours: `shards index` takes it from
    here instead of reading the tar)."""
    write_json(
        tar_path[: -len(".tar")] + STATS_SUFFIX,
        {
            "count": samples,
            "successes": samples,
            "failed_to_download": 0,
            "failed_to_resize": 0,
            "tar_bytes": os.path.getsize(tar_path),
            **({"tar_crc32": f"{crc32:08x}"} if crc32 is not None else {}),
            "written_by": "prunepipe",
        },
    )


def shard_urls(sources: list[str]) -> list[str]:
    """Expand folders (their *.tar), globs and brace patterns into a sorted list of shard urls."""
    urls: list[str] = []
    for source in sources:
        for pattern in braceexpand(source):
            if os.path.isdir(pattern):
                urls += sorted(glob.glob(os.path.join(pattern, "*.tar")))
            elif any(c in pattern for c in "*?[") and "://" not in pattern:
                urls += sorted(glob.glob(pattern))
            else:
                urls.append(pattern)
    if not urls:
        raise FileNotFoundError(f"no shards found in {sources}")
    return urls


def img2dataset_stats_path(url: str) -> str | None:
    """img2dataset's NNNNN_stats.json beside a local NNNNN.tar, when there is one."""
    if urlparse(url).scheme not in ("", "file") or not url.endswith(".tar"):
        return None
    path = local_path(url)[: -len(".tar")] + STATS_SUFFIX
    return path if os.path.isfile(path) else None


def local_path(url: str) -> str:
    return url.removeprefix("file://").removeprefix("file:")


def img2dataset_count(stats_path: str) -> tuple[int, int | None, int | None]:
    """The samples img2dataset wrote to a shard, its stats file's `successes` (the others failed to
    download or resize and are not in the tar), and the tar's size and CRC-32 when the file records
    them (`tar_bytes` and `tar_crc32`, which `shards write` and `latents encode` add)."""
    try:
        with open(stats_path) as f:
            stats = json.load(f)
        successes, size, crc = stats["successes"], stats.get("tar_bytes"), stats.get("tar_crc32")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{stats_path}: expected img2dataset's stats, a JSON object with an integer 'successes': {e!r}"
        ) from e
    for name, value in (("successes", successes), ("tar_bytes", size)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{stats_path}: '{name}' must be a non-negative integer, got {value!r}")
    if crc is not None and (not isinstance(crc, str) or not CRC32_HEX.fullmatch(crc)):
        raise ValueError(f"{stats_path}: 'tar_crc32' must be 8 hex digits (zlib.crc32 of the tar), got {crc!r}")
    return successes, size, None if crc is None else int(crc, 16)


def looks_whole(tar_path: str, size: int | None) -> bool:
    """Whether a local tar is as its stats file describes it, for the price of a stat and a 1 KiB read:
    the size the file records, or, without one, whole 512-byte blocks ending in the two zero blocks
    every tar writer closes an archive with. A tar cut short in a copy fails this (its headers are then
    read, and name the damage)."""
    actual = os.path.getsize(tar_path)
    if size is not None:
        return actual == size
    if actual < 1024 or actual % 512:
        return False
    with open(tar_path, "rb") as f:
        f.seek(actual - 1024)
        return not any(f.read(1024))


class ShardCount(NamedTuple):
    samples: int
    fields: list[str]  # known only when the headers were read
    had_stats: bool  # an img2dataset stats file sat beside the shard
    headers_read: bool
    size: int | None = None  # the shard's bytes
    crc32: int | None = None  # zlib.crc32 of them; None with checksums off


def count_shard(url: str, read_headers: bool, checksums: bool = True) -> ShardCount:
    """One shard's samples: the count of img2dataset's stats file when one sits beside it, else (or
    also, with `read_headers`, and then the two must agree) from its tar headers; and its size and,
    with `checksums`, its CRC-32: from the stats file when it records one (`tar_crc32`), else from the
    bytes as the count reads them (`survey_shard`), else, for a shard counted from img2dataset's
    stats alone, from reading the tar (its stats record none)."""
    stats_path = img2dataset_stats_path(url)
    stated, stated_size, stated_crc = img2dataset_count(stats_path) if stats_path else (None, None, None)
    if stated is not None and not read_headers and looks_whole(local_path(url), stated_size):
        path = local_path(url)
        crc = (stated_crc if stated_crc is not None else file_crc32(path)) if checksums else None
        return ShardCount(stated, [], True, False, os.path.getsize(path), crc)
    count, fields, size, crc = survey_shard(url, checksum=checksums)
    if stated is not None and stated != count:
        raise BadInputError(
            f"shard {url}: its tar headers hold {count} samples, but {stats_path} says "
            f"{stated} successes; re-index without the stats file or fix the shard"
        )
    if checksums and stated_crc is not None and crc != stated_crc:
        raise BadInputError(
            f"shard {url}: its bytes have CRC-32 {crc:08x}, but {stats_path} records {stated_crc:08x} "
            f"(tar_crc32); the tar changed since the stats file was written: re-index without the stats "
            f"file or restore the shard"
        )
    return ShardCount(count, fields, stated is not None, True, size, crc)


def index_shards(
    sources: list[str], out: str, *, workers: int | None = None, verify: bool = False, checksums: bool = True
) -> str:
    """Count each shard's samples and write `out`/index.json (img2dataset and plain-tar layouts).

    A shard with img2dataset's NNNNN_stats.json beside it is counted from the stats' `successes`; the
    first shard, and every shard with `verify`, from its tar headers too (they must agree). Headers
    are read without the member data where it can be seeked past (a local file of large members),
    `workers` shards at a time in threads (default: the usable cores). index.json's `counted` splits
    the shards by where their count came from, so the two add up to `shards`: `img2dataset_stats`
    (the stats file alone) and `tar_headers_read` (the headers, of which `checked_against_stats` had
    a stats file that agreed); `describe_counting` says it in a sentence.

    Each shard's entry records its size (`bytes`) and, with `checksums`, its CRC-32 (`crc32`,
    `count_shard` says where it comes from): without them, a shard of img2dataset's (whose stats
    record no CRC-32) costs a stat, not a read of every byte, and readers check its size alone.
    """
    urls = shard_urls(sources)
    workers = usable_cores() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    read_headers = [verify or i == 0 for i in range(len(urls))]  # the first shard's fields name the index's keys
    bar = progress(len(urls), desc="indexing", unit="shard")
    try:
        if workers == 1 or len(urls) == 1:
            counted = []
            for url, headers in zip(urls, read_headers):
                counted.append(count_shard(url, headers, checksums))
                bar.update(1)
        else:
            # Threads, not processes: counting a shard is reading it and numpy's array work, which
            # release the GIL, or waiting on storage; forking this process (webdataset brings torch)
            # costs more, ~10 ms a worker and copy-on-write faults after, than 180 small shards take.
            with ThreadPoolExecutor(min(workers, len(urls))) as pool:
                counted = []
                for result in pool.map(count_shard, urls, read_headers, [checksums] * len(urls), chunksize=1):
                    counted.append(result)
                    bar.update(1)
    finally:
        bar.close()
    keys = sorted({field for shard in counted for field in shard.fields})
    if BUCKET_FIELD in keys:  # an index without each shard's bucket would stack latents of two shapes in a batch
        raise ValueError(
            f"{', '.join(sources)[:200]}: latent shards written by `latents encode --buckets` (their samples "
            f"carry {BUCKET_FIELD}); their index.json is the encode's, with each shard's bucket: keep it, or encode again"
        )
    how = {
        "shards": len(urls),
        "img2dataset_stats": sum(not shard.headers_read for shard in counted),
        "tar_headers_read": sum(shard.headers_read for shard in counted),
        "checked_against_stats": sum(shard.headers_read and shard.had_stats for shard in counted),
    }
    os.makedirs(out, exist_ok=True)
    entries = [ShardEntry(url, shard.samples, shard.size, shard.crc32) for url, shard in zip(urls, counted)]
    return ShardIndex.write(out, entries, keys=keys, counted=how)


def shard_aspects(url: str, table: BucketTable | None = None, retry: ReadRetry = DEFAULT_RETRY) -> AspectHistogram:
    """One shard's samples by aspect ratio, from each sample's img2dataset `json` member alone (its
    width and height, `metadata_size`): the images' bytes are seeked past, never decoded."""
    sizes = [metadata_size(raw) for _, raw in read_keys(url, METADATA_FIELD, retry)]
    return aspect_histogram(sizes, table)


def aspect_counts(
    sources: list[str],
    table: BucketTable | None = None,
    *,
    workers: int | None = None,
    retry: ReadRetry = DEFAULT_RETRY,
) -> AspectHistogram:
    """The samples of every shard `sources` name (as `shards index` lists them) by bucket of `table`, or
    by the common ratio bins without one, `workers` shards at a time in threads; a sample whose `json`
    gives no width and height is counted as unknown."""
    urls = shard_urls(sources)
    workers = usable_cores() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    bar = progress(len(urls), desc="aspect ratios", unit="shard")
    total = None
    try:
        with ThreadPoolExecutor(min(workers, len(urls))) as pool:
            for found in pool.map(shard_aspects, urls, [table] * len(urls), [retry] * len(urls)):
                bar.update(1)
                total = found if total is None else total.plus(found)
    finally:
        bar.close()
    return total


def describe_counting(counted: dict, verify: bool = False) -> str:
    """index.json's `counted` (`index_shards`) as a sentence whose numbers add up to the shards."""
    stats, headers = counted["img2dataset_stats"], counted["tar_headers_read"]
    checked = counted.get("checked_against_stats", 0)
    parts = []
    if stats:
        parts.append(
            f"{stats} counted from img2dataset's *_stats.json"
            + ("" if verify else " (--verify reads their tar headers too)")
        )
    if headers:
        parts.append(
            f"{headers} from their tar headers"
            + (f" ({checked} of them checked against their *_stats.json)" if checked else "")
        )
    return f"of {counted['shards']} shard(s), " + ", ".join(parts) if parts else "no shards"


class ShardCheck(NamedTuple):
    """What `verify_shards` found of one shard: `problem` None when its bytes are what the index says."""

    shard: int
    url: str
    problem: str | None
    checked: str  # "size and crc32", "size" or "nothing" (what the index records of it)
    bytes_read: int


def check_shard(index: ShardIndex, shard: int, retry: ReadRetry = DEFAULT_RETRY) -> ShardCheck:
    """One shard against its index entry: a local file's size by a stat, then (when the index records
    it) its CRC-32 by reading it; any other url is read whole, as the training stream reads it."""
    url, expected = index.urls[shard], index.expected(shard)
    checked = "size and crc32" if expected.crc32 is not None else "size" if expected.size is not None else "nothing"

    def found(problem: str | None, read: int = 0) -> ShardCheck:
        return ShardCheck(shard, url, problem, checked, read)

    if expected.size is None and expected.crc32 is None:
        return found(None)
    if urlparse(url).scheme in ("", "file"):
        path = local_path(url)
        if not os.path.isfile(path):
            return found(f"missing ({index.path} lists it)")
        size = os.path.getsize(path)
        if expected.size is not None and size != expected.size:
            return found(f"is {size} bytes, {index.path} records {expected.size} (replaced, cut short or grown)")
        if expected.crc32 is None:
            return found(None)
        crc = file_crc32(path)
    else:
        try:
            size, crc = shard_checksum(url, retry)
        except BadInputError as e:
            return found(str(e).removeprefix(f"shard {url}: "))
        if expected.size is not None and size != expected.size:
            return found(
                f"holds {size} bytes, {index.path} records {expected.size} (replaced, cut short or grown)", size
            )
    if expected.crc32 is not None and crc != expected.crc32:
        return found(f"has CRC-32 {crc:08x}, {index.path} records {expected.crc32:08x} (its bytes changed)", size)
    return found(None, size)


def verify_shards(
    location: str, *, workers: int | None = None, retry: ReadRetry = DEFAULT_RETRY
) -> Iterator[ShardCheck]:
    """Every shard of the index at `location` checked against its `bytes` and `crc32` (`check_shard`),
    `workers` at a time in threads (default: the usable cores; zlib's CRC-32 and the reads release
    the GIL), yielded in index order under a progress bar. The training reader checks a local
    shard's size only (it seeks past unwanted members): this is where its CRC-32 is checked."""
    index = ShardIndex.load(location)
    workers = usable_cores() if workers is None else workers
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    bar = progress(len(index), desc="verifying", unit="shard")
    try:
        with ThreadPoolExecutor(min(workers, len(index))) as pool:
            for result in pool.map(check_shard, [index] * len(index), range(len(index)), [retry] * len(index)):
                bar.update(1)
                yield result
    finally:
        bar.close()


def inspect_shards(location: str, grid_path: str | None = None, grid_count: int = 64) -> dict:
    """Counts, fields and labels of an indexed shard folder; optionally a PNG grid of images."""
    from prunepipe.pipelines.data.decode import SampleDecoder

    index = ShardIndex.load(location)
    fields, labels = Counter(), Counter()
    images = []
    decoder = SampleDecoder(resolution=int(index.meta.get("size") or 32))  # none: a folder's bytes as they are
    for shard, url in enumerate(index.urls):
        for _, sample in read_shard(url, expected=index.expected(shard)):
            fields.update(k for k in sample if not k.startswith("__"))
            if "cls" in sample:
                labels[int(sample["cls"])] += 1
            if grid_path and len(images) < grid_count:
                images.append(decoder(sample, 0, 0)[0])
    report = {
        "index": index.path,
        "shards": len(index),
        "samples": index.num_samples,
        "fields": dict(fields),
        "labels": dict(sorted(labels.items())),
    }
    if grid_path and images:
        import torch
        from torchvision.utils import save_image

        save_image((torch.stack(images) + 1) / 2, grid_path, nrow=int(np.ceil(np.sqrt(len(images)))))
        report["grid"] = grid_path
    return report
