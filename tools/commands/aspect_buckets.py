"""Aspect-ratio buckets: which bucket an image goes to and how it is cut to it, as text-to-image
pretraining (PixArt, SDXL, Sana) trains at every aspect ratio. A table is a list of (height, width)
image sizes: one of diffusers' PixArt tables by name, or a file (`load_buckets`). An image goes to
the bucket whose h/w is nearest its own in log space (`nearest_buckets`), is resized to cover it and
centre-cropped to it (pipelines/data/resize.py:resize_cover_crop). Nothing here decodes an image:
`shards index --aspect` counts a folder from img2dataset's `json` sizes alone (`metadata_size`).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass

import numpy as np

from prunepipe.pipelines.data.shards import bucket_entries, bucket_name

# diffusers' PixArt tables ({"h/w": [h, w]} of floats), imported where used (the pipeline module
# imports transformers: seconds), never copied
PIXART = "diffusers.pipelines.pixart_alpha"
NAMED_TABLES = {
    "pixart256": (f"{PIXART}.pipeline_pixart_alpha", "ASPECT_RATIO_256_BIN", 256),
    "pixart512": (f"{PIXART}.pipeline_pixart_alpha", "ASPECT_RATIO_512_BIN", 512),
    "pixart1024": (f"{PIXART}.pipeline_pixart_alpha", "ASPECT_RATIO_1024_BIN", 1024),
    "pixart2048": (f"{PIXART}.pipeline_pixart_sigma", "ASPECT_RATIO_2048_BIN", 2048),
}
ALIASES = {str(base): name for name, (_, _, base) in NAMED_TABLES.items()}  # "512" -> "pixart512"
TIE_DECIMALS = 12  # log-ratio distances equal to 12 decimals are a tie: the bucket listed first wins
# the histogram's bins without a table: common ratios as (height, width), tall to wide; labelled width:height
# as ratios are said everywhere here (`shards write --aspects`, a 4:3 photo is wide), sizes stay HxW as in
# diffusers' tables and bucket files
RATIO_BINS = ((4, 1), (3, 1), (2, 1), (16, 9), (3, 2), (4, 3), (1, 1), (3, 4), (2, 3), (9, 16), (1, 2), (1, 3), (1, 4))
METADATA_FIELD = "json"  # img2dataset's per-sample metadata (width, height, original_width, ...)
# beside each latent of a bucketed encode: {"bucket": "HxW", "original_size": [H0, W0], "crop_top_left": [t, l]}
BUCKET_FIELD = "bucket.json"


@dataclass(frozen=True)
class BucketTable:
    """(height, width) image sizes, in the table's order (a bucket's number is its place here)."""

    sizes: tuple[tuple[int, int], ...]
    name: str  # pixart512, or the file's name
    source: str  # the diffusers table's module and name, or the file's absolute path
    base: int | None = None  # a named table's square side (512): the default --resolution

    @property
    def names(self) -> list[str]:
        return [bucket_name(h, w) for h, w in self.sizes]

    def index_entries(self, channels: int, factor: int) -> list[dict]:
        """index.json's `buckets`: each bucket's name, image size and latent shape for a VAE of
        `channels` latent channels and downsampling `factor`."""
        return bucket_entries(self.sizes, channels, factor)

    def describe(self) -> dict:
        """What index.json and the job's settings record of the table."""
        return {"name": self.name, "source": self.source, "sizes": [list(size) for size in self.sizes]}

    def nearest(self, height: int, width: int) -> int:
        """The bucket of an image of height x width (`nearest_buckets`)."""
        return int(nearest_buckets(np.array([height]), np.array([width]), self.sizes)[0])

    def check_factor(self, factor: int, setting: str = "--buckets") -> None:
        """Every size a multiple of the VAE's downsampling factor, or an error naming the bucket."""
        for height, width in self.sizes:
            if height % factor or width % factor:
                raise ValueError(
                    f"{setting} {self.name}: bucket {bucket_name(height, width)} is not a multiple of the VAE's "
                    f"downsampling factor {factor} in both sides; use sizes that are (e.g. "
                    f"{bucket_name(height // factor * factor or factor, width // factor * factor or factor)})"
                )


def nearest_buckets(heights: np.ndarray, widths: np.ndarray, sizes) -> np.ndarray:
    """int64 [N]: each image's bucket, the one whose log(h/w) is nearest the image's (diffusers'
    `classify_height_width_bin` takes the nearest ratio itself: in log space a 2:1 and a 1:2 image are
    as far from square). Ties (to TIE_DECIMALS decimals: a square image between 2:1 and 1:2) go to the
    bucket listed first."""
    table = np.asarray(sizes, dtype=np.float64)
    theirs = np.log(np.asarray(heights, dtype=np.float64)) - np.log(np.asarray(widths, dtype=np.float64))
    ours = np.log(table[:, 0]) - np.log(table[:, 1])
    distance = np.round(np.abs(theirs[:, None] - ours[None, :]), TIE_DECIMALS)  # [N, B]
    return distance.argmin(axis=1).astype(np.int64)  # argmin: the first of equal minima


def load_buckets(spec: str) -> BucketTable:
    """A table by name (pixart256, pixart512, pixart1024, pixart2048, or 256, 512, 1024, 2048: diffusers'
    PixArt-alpha tables, PixArt-Sigma's for 2048) or from a file: a JSON list of [h, w], or text with one
    HxW a line (blank lines and # comments ignored). A bad entry names the file and its line (a JSON
    file: its entry); a size listed twice is refused."""
    name = ALIASES.get(spec, spec)
    if name in NAMED_TABLES:
        module, attribute, base = NAMED_TABLES[name]
        ratios = getattr(importlib.import_module(module), attribute)
        sizes = [(int(h), int(w)) for h, w in ratios.values()]
        return BucketTable(tuple(sizes), name, f"{module}.{attribute}", base)
    if not os.path.isfile(spec):
        raise ValueError(
            f"--buckets {spec!r}: neither a table name ({', '.join(NAMED_TABLES)}, or "
            f"{', '.join(ALIASES)}) nor a file of sizes (HxW a line, or a JSON list of [h, w])"
        )
    with open(spec) as f:
        text = f.read()
    entries = (
        _json_sizes(spec, text) if spec.endswith(".json") or text.lstrip().startswith("[") else _text_sizes(spec, text)
    )
    if not entries:
        raise ValueError(f"--buckets {spec}: lists no size (HxW a line, or a JSON list of [h, w])")
    seen: dict[tuple[int, int], str] = {}
    for where, size in entries:
        if size in seen:
            raise ValueError(f"{spec}: {where}: bucket {bucket_name(*size)} is listed twice (first at {seen[size]})")
        seen[size] = where
    return BucketTable(tuple(size for _, size in entries), os.path.basename(spec), os.path.abspath(spec))


def _text_sizes(path: str, text: str) -> list[tuple[str, tuple[int, int]]]:
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        height, x, width = entry.lower().partition("x")
        size = _size(height.strip(), width.strip()) if x else None
        if size is None:
            raise ValueError(
                f"{path}: line {number}: {line.strip()!r} is not HEIGHTxWIDTH in pixels, both positive integers "
                f"(e.g. 512x768)"
            )
        entries.append((f"line {number}", size))
    return entries


def _json_sizes(path: str, text: str) -> list[tuple[str, tuple[int, int]]]:
    try:
        listed = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e}); expected a list of [height, width]") from e
    if not isinstance(listed, list):
        raise ValueError(f"{path}: expected a JSON list of [height, width], got {type(listed).__name__}")
    entries = []
    for number, item in enumerate(listed):
        size = _size(*item) if isinstance(item, list) and len(item) == 2 else None
        if size is None:
            raise ValueError(
                f"{path}: entry {number} (line {_json_line(text, number)}): {item!r} is not [height, width], "
                f"both positive integers"
            )
        entries.append((f"entry {number}", size))
    return entries


def _json_line(text: str, entry: int) -> int:
    """The line of a top-level list's entry number `entry` in `text` (for a message): found by the
    decoder's own positions, one entry at a time."""
    decoder, position = json.JSONDecoder(), text.index("[") + 1
    for _ in range(entry + 1):
        while text[position] in " \t\r\n,":
            position += 1
        start = position
        _, position = decoder.raw_decode(text, position)
    return text.count("\n", 0, start) + 1


def _size(height, width) -> tuple[int, int] | None:
    """(height, width) as positive integers (512, "512", 512.0 alike), else None."""
    try:
        h, w = float(height), float(width)
    except (TypeError, ValueError):
        return None
    if isinstance(height, bool) or isinstance(width, bool) or not (h.is_integer() and w.is_integer()):
        return None
    return (int(h), int(w)) if h > 0 and w > 0 else None


# ---- the histogram of `shards index --aspect` ------------------------------------------------------


def metadata_size(raw: bytes | None) -> tuple[int, int] | None:
    """(height, width) of a sample from img2dataset's `json`: its `height`/`width` (the image as
    stored), else `original_height`/`original_width`; None where neither pair is there."""
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(meta, dict):
        return None
    for height, width in (("height", "width"), ("original_height", "original_width")):
        size = _size(meta.get(height), meta.get(width))
        if size is not None:
            return size
    return None


@dataclass(frozen=True)
class AspectHistogram:
    """Samples per bucket (or per ratio bin) and those whose size no `json` gives."""

    labels: list[str]
    counts: np.ndarray  # int64 [B]
    unknown: int

    @property
    def total(self) -> int:
        return int(self.counts.sum()) + self.unknown

    def plus(self, other: AspectHistogram) -> AspectHistogram:
        """Two histograms of the same bins added (two shards' counts)."""
        return AspectHistogram(self.labels, self.counts + other.counts, self.unknown + other.unknown)


def aspect_histogram(sizes: list[tuple[int, int] | None], table: BucketTable | None = None) -> AspectHistogram:
    """The samples of `sizes` ((height, width) or None: unknown) by the bucket `table` gives them, or
    without one by the nearest of the common ratios RATIO_BINS (labelled w:h, width:height)."""
    bins = table.sizes if table is not None else RATIO_BINS
    labels = table.names if table is not None else [f"{w}:{h}" for h, w in RATIO_BINS]
    known = np.array([size for size in sizes if size is not None], dtype=np.int64).reshape(-1, 2)
    chosen = nearest_buckets(known[:, 0], known[:, 1], bins) if len(known) else np.zeros(0, np.int64)
    counts = np.bincount(chosen, minlength=len(bins)).astype(np.int64)
    return AspectHistogram(labels, counts, len(sizes) - len(known))


def histogram_lines(histogram: AspectHistogram, table: BucketTable | None = None) -> list[str]:
    """The histogram as a table: bucket of `table` (HxW) or ratio bin (w:h), count, share; empty rows left out
    (and counted), the unknown ones last."""
    what = "bucket HxW" if table is not None else "ratio w:h"
    total = max(histogram.total, 1)
    width = max([len(what), len("unknown"), *(len(label) for label in histogram.labels)])
    lines = [f"{what:<{width}}  {'count':>10}  {'share':>7}"]
    for label, count in zip(histogram.labels, histogram.counts.tolist()):
        if count:
            lines.append(f"{label:<{width}}  {count:>10}  {count / total:>7.1%}")
    lines.append(f"{'unknown':<{width}}  {histogram.unknown:>10}  {histogram.unknown / total:>7.1%}")
    empty = int((histogram.counts == 0).sum())
    if empty:
        bins = f"buckets of {table.name}" if table is not None else "ratio bins"
        lines.append(f"({empty} of {len(histogram.labels)} {bins} hold no sample)")
    return lines
