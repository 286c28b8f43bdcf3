"""Shard index and raw shard reading: `index.json` (url and sample count per shard, dense ids
0..N-1 in index order, and each shard's bytes and CRC-32 where its writer recorded them) and an
iterator of (position, undecoded sample) for one shard.

Nothing here decodes an image: a sample the caller does not want costs its tar headers and nothing
more (pipelines/data/tar_reader.py seeks past its bytes). So a local shard is checked against its
index by its size alone, at open; its CRC-32 is checked where every byte passes anyway (a `pipe:`
or http(s) stream, pipelines/data/remote.py) and by `prunepipe shards verify`.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import tarfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterable, Iterator, NamedTuple
from urllib.parse import urlparse

import numpy as np

from prunepipe.pipelines.atomic_write import atomic_write_json
from prunepipe.pipelines.data.remote import (
    NOTHING_EXPECTED,
    Expected,
    ReadRetry,
    ShardReadError,
    is_retried,
    open_retrying,
)
from prunepipe.pipelines.data.tar_reader import TarMembers, plain_member_names

INDEX_NAME = "index.json"
TEXT_NULL_FILE = "text_null.npy"  # beside index.json: the empty caption's features, the null condition
DEFAULT_RETRY = ReadRetry()
SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's tar_file_iterator skips these names
SLASH, DOT, NEWLINE, UNDERSCORE = (ord(c) for c in "/.\n_")
UNKNOWN = -1  # a shard size or CRC-32 the index does not record
READ_CHUNK = 1 << 22  # bytes a whole-shard read (`shard_checksum`) takes at once
CRC32_HEX = re.compile(r"[0-9a-fA-F]{8}")  # index.json's crc32: 8 hex digits, written lowercase


class BadInputError(RuntimeError):
    """A shard or sample that cannot be used; the message names the shard url and key."""


@dataclass(frozen=True)
class BadInput:
    """One bad-input event: what went wrong and how many samples it cost."""

    message: str
    samples_lost: int = 1
    undecodable: bool = False  # read but not decodable: it took a place in the worker's sample order


class ShardEntry(NamedTuple):
    """One shard as `ShardIndex.write` lists it; a plain (url, count) or (url, count, size, crc32)
    tuple is one too. `size` and `crc32` (zlib.crc32 of the whole file) are None where unknown."""

    url: str
    num_samples: int
    size: int | None = None
    crc32: int | None = None
    bucket: int | None = None  # its aspect-ratio bucket (an index into the index's `buckets`), when bucketed


@dataclass(frozen=True)
class ShardIndex:
    """The shards of one split, in id order: shard i holds ids first_ids[i] .. first_ids[i]+counts[i]-1."""

    urls: tuple[str, ...]
    counts: np.ndarray  # int64 [S]
    path: str = ""  # where the index was read from, for messages
    meta: dict = field(default_factory=dict)  # the index's other keys (source, size, latent_shape, ...)
    # int64 [S] each, UNKNOWN (-1) where the index records none: two arrays, not an object a shard,
    # so that an index of 1e5 shards stays 1.6 MB in every loader worker
    sizes: np.ndarray | None = None  # each shard's bytes (index.json's `bytes`)
    crcs: np.ndarray | None = None  # zlib.crc32 of each shard's bytes (`crc32`)
    # int64 [S]: each shard's aspect-ratio bucket, an index into `bucket_shapes` (every sample of a
    # shard has the one shape); None where the shards are not bucketed (one shape for all)
    buckets: np.ndarray | None = None

    def __post_init__(self):
        for name in ("sizes", "crcs"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.full(len(self.urls), UNKNOWN, dtype=np.int64))
        if (
            self.buckets is not None
            and len(self.buckets)
            and not 0 <= int(self.buckets.min()) <= int(self.buckets.max()) < len(self.meta.get("buckets", []))
        ):
            raise ValueError(f"{self.path}: a shard names a bucket its table of {self.num_buckets} does not list")

    def expected(self, shard: int) -> Expected:
        """What the index knows of shard `shard`'s bytes, for its reader to check (`read_shard`)."""
        size, crc = int(self.sizes[shard]), int(self.crcs[shard])
        return Expected(size=None if size == UNKNOWN else size, crc32=None if crc == UNKNOWN else crc)

    @property
    def bucket_table(self) -> list[dict]:
        """The buckets as index.json lists them: {"name": "HxW", "image": [H, W], "shape": [C, h, w]} each
        (`image` the size the images were cropped to, `shape` the stored tensor's); [] when not bucketed."""
        return list(self.meta.get("buckets", [])) if self.buckets is not None else []

    @property
    def num_buckets(self) -> int:
        """Buckets in the table (every shard names one of them); 0 when not bucketed."""
        return len(self.bucket_table)

    @property
    def bucket_names(self) -> list[str]:
        """Each bucket's name, "HxW" of the images cut to it."""
        return [str(b["name"]) for b in self.bucket_table]

    @property
    def bucket_shapes(self) -> list[tuple[int, ...]]:
        """Each bucket's stored shape, [C, h, w] as a tuple."""
        return [tuple(int(v) for v in b["shape"]) for b in self.bucket_table]

    @property
    def first_ids(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

    def shard_of(self, ids) -> np.ndarray:
        """int64 per global id: the shard that holds it."""
        return np.searchsorted(self.first_ids, np.asarray(ids, dtype=np.int64), side="right") - 1

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum())

    def __len__(self) -> int:
        return len(self.urls)

    @classmethod
    def load(cls, location: str) -> "ShardIndex":
        """Read `index.json` from a folder (or the file itself); relative urls resolve beside it."""
        path = index_file(location)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"no shard index at {path}: write shards with `prunepipe shards write` or index "
                f"existing ones with `prunepipe shards index`"
            )
        raw = read_index_json(path)
        try:
            shards = raw["shards"]
            urls = tuple(_resolve(s["url"], os.path.dirname(os.path.abspath(path))) for s in shards)
            counts = np.array([int(s["num_samples"]) for s in shards], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: expected {{'shards': [{{'url': str, 'num_samples': int}}, ...]}}: {e!r}") from e
        if len(urls) == 0 or (counts < 0).any():
            raise ValueError(f"{path}: an index needs at least one shard and non-negative counts")
        sizes, crcs = _recorded_bytes(path, shards)
        meta = {k: v for k, v in raw.items() if k != "shards"}
        return cls(urls, counts, path, meta, sizes, crcs, _recorded_buckets(path, shards, meta))

    @staticmethod
    def write(folder: str, entries: Iterable[ShardEntry | tuple], **meta) -> str:
        """Write `index.json` in `folder`; urls of files inside the folder are stored relative.

        Each entry is a `ShardEntry` or a tuple of its fields, (url, count) or (url, count, size,
        crc32): a known size is written as `bytes`, a known CRC-32 as `crc32`, 8 lowercase hex digits."""
        folder_abs = os.path.abspath(folder)
        shards = []
        for entry in entries:
            url, count, size, crc, bucket = ShardEntry(*entry)
            if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0):
                raise ValueError(f"shard {url}: its size must be a non-negative integer of bytes, got {size!r}")
            if crc is not None and (
                isinstance(crc, bool) or not isinstance(crc, (int, np.integer)) or not 0 <= crc < 1 << 32
            ):
                raise ValueError(f"shard {url}: its CRC-32 must be an integer in [0, 2**32) (zlib.crc32), got {crc!r}")
            if _is_local(url) and os.path.dirname(os.path.abspath(url)) == folder_abs:
                url = os.path.basename(url)
            shard = {"url": url, "num_samples": int(count)}
            if size is not None:
                shard["bytes"] = int(size)
            if crc is not None:
                shard["crc32"] = f"{int(crc):08x}"
            if bucket is not None:
                shard["bucket"] = int(bucket)
            shards.append(shard)
        path = os.path.join(folder, INDEX_NAME)
        # two processes (two hosts, or two containers of one PID) sealing a job's last shards at once may both
        # write it: each into a temporary of its own
        atomic_write_json(path, {"shards": shards, **meta}, indent=1)
        return path


def read_index_json(path: str) -> dict:
    """index.json at `path` as stored: the one place the file is opened (ShardIndex.load, the metadata
    and fingerprint readers), so that a run's reads of it can be counted."""
    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object {{'shards': [...], ...}}, got {type(raw).__name__}")
    return raw


def index_metadata(location: str) -> dict:
    """The keys of a split's index.json beside its shard list (source, latent_shape, vae, buckets, ...)."""
    return {k: v for k, v in read_index_json(index_file(location)).items() if k != "shards"}


def bucket_name(height: int, width: int) -> str:
    """A bucket's name in index.json: "HxW" of the images cut to it."""
    return f"{height}x{width}"


def bucket_entries(sizes: Iterable[tuple[int, int]], channels: int, factor: int) -> list[dict]:
    """index.json's `buckets`, as `_recorded_buckets` reads them back: each image size's name, the size
    and the stored latent shape [channels, H / factor, W / factor] (a VAE of downsampling `factor`)."""
    return [
        {"name": bucket_name(h, w), "image": [h, w], "shape": [channels, h // factor, w // factor]} for h, w in sizes
    ]


def _recorded_bytes(path: str, shards: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Each shard's `bytes` and `crc32` as int64 arrays, UNKNOWN where an entry has none (an index
    written by img2dataset's tools or by hand); a value of another kind names the index and shard.
    Lists first, one array each at the end: 0.07 s of a 1e5-shard load, against 0.16 s item by item."""
    sizes, crcs = [], []
    for shard in shards:
        size, crc = shard.get("bytes"), shard.get("crc32")
        if size is None:
            size = UNKNOWN
        elif type(size) is not int or size < 0:  # type, not isinstance: JSON's true is no size
            raise ValueError(
                f"{path}: shard {shard['url']}: 'bytes' must be a non-negative integer (the shard's size), got {size!r}"
            )
        if crc is None:
            crc = UNKNOWN
        elif type(crc) is not str or not CRC32_HEX.fullmatch(crc):
            raise ValueError(
                f"{path}: shard {shard['url']}: 'crc32' must be 8 hex digits (zlib.crc32 of the shard, "
                f'e.g. "0a1b2c3d"), got {crc!r}'
            )
        else:
            crc = int(crc, 16)
        sizes.append(size)
        crcs.append(crc)
    return np.array(sizes, dtype=np.int64), np.array(crcs, dtype=np.int64)


def _recorded_buckets(path: str, shards: list[dict], meta: dict) -> np.ndarray | None:
    """Each shard's `bucket` as an int64 array, or None for an index without buckets. A bucketed index
    lists `buckets` ({"name", "image", "shape"} each) and gives every shard one of them."""
    table = meta.get("buckets")
    marked = [s for s in shards if "bucket" in s]
    if table is None and not marked:
        return None
    if (
        not isinstance(table, list)
        or not table
        or not all(isinstance(b, dict) and {"name", "shape"} <= b.keys() for b in table)
    ):
        raise ValueError(
            f"{path}: shards name aspect-ratio buckets but the index's 'buckets' is not a list of "
            f'{{"name", "image", "shape"}} entries (got {table!r})'
        )
    if len(marked) != len(shards):
        unmarked = next(s for s in shards if "bucket" not in s)
        raise ValueError(f"{path}: shard {unmarked['url']} names no 'bucket' but the index is bucketed")
    buckets = []
    for shard in shards:
        bucket = shard["bucket"]
        if type(bucket) is not int or not 0 <= bucket < len(table):
            raise ValueError(
                f"{path}: shard {shard['url']}: 'bucket' must be an index into the {len(table)} buckets, got {bucket!r}"
            )
        buckets.append(bucket)
    return np.array(buckets, dtype=np.int64)


def index_file(location: str) -> str:
    """The index.json a split's location names: the file in a folder, or the file itself."""
    return os.path.join(location, INDEX_NAME) if os.path.isdir(location) else location


def _is_local(url: str) -> bool:
    return urlparse(url).scheme in ("", "file")


def _resolve(url: str, base: str) -> str:
    if _is_local(url) and not url.startswith("file:") and not os.path.isabs(url):
        return os.path.join(base, url)
    return url


@dataclass
class ShardCursor:
    """Where a read of a shard stands: the next sample's position and the byte offset where its
    headers start. `read_shard` moves it past each sample it yields; a later read given it starts
    there, a seek on a local file (`resumable`), not a walk from the start."""

    position: int = 0
    offset: int = 0


def resumable(url: str) -> bool:
    """Whether a read of `url` can start at a ShardCursor by seeking: a local plain tar."""
    return _is_local(url) and url.lower().endswith(".tar")


def read_shard(
    url: str,
    wanted: Callable[[int], bool] | None = None,
    *,
    retry: ReadRetry = DEFAULT_RETRY,
    expected: Expected = NOTHING_EXPECTED,
    cursor: ShardCursor | None = None,
) -> Iterator[tuple[int, dict | None]]:
    """Yield (position, sample) for each sample of one shard, members grouped by key as webdataset
    groups them.

    A sample is webdataset's dict: `__key__`, `__url__` and one undecoded `bytes` field per
    extension. With `wanted`, a sample whose position it rejects is yielded as (position, None)
    and its bytes are skipped, not read. Raises BadInputError naming the url (and the last good
    key) when the shard is missing, corrupt or truncated, or a `pipe:` or http(s) read still fails
    after `retry`'s reopens (pipelines/data/remote.py); samples yielded before that point are valid.
    `expected` is what the index knows of the shard's bytes (`ShardIndex.expected`): a local file of
    another size is refused at open, except one shorter that ends inside the tar (cut short: its
    samples before the cut are yielded, then the error names the cut); a remote stream checks size
    and CRC-32 as its bytes pass.

    `cursor` (a local plain tar only, `resumable`): the read starts where it stands, and it is moved
    past every sample yielded, so that a reader closed between samples can be opened again there.
    """
    last_key = None
    start = cursor if cursor is not None and cursor.offset > 0 else None
    if start is not None and not resumable(url):
        raise ValueError(f"shard {url}: only a local .tar is read from a byte offset")

    def where() -> str:
        return f"after key {last_key!r}" if last_key is not None else "before its first sample"

    with _reading(url, where, retry, expected) as stream:
        if start is not None:
            stream.seek(start.offset)
        members = TarMembers(stream, offset=0 if start is None else start.offset)
        for position, sample in _samples(members, url, wanted, 0 if start is None else start.position):
            if sample is not None:
                last_key = sample["__key__"]
            if cursor is not None:  # a sample is yielded when the walk meets the next one's headers;
                # a rejected one as soon as its own are met, and a read resumed there rejects it again
                cursor.position = position if sample is None else position + 1
                cursor.offset = members.entry_offset
            yield position, sample


@contextmanager
def _reading(
    url: str, where: Callable[[], str], retry: ReadRetry = DEFAULT_RETRY, expected: Expected = NOTHING_EXPECTED
):
    """The shard's byte stream: remote urls through the retrying reader, which checks `expected` as
    the bytes pass (a walk that ends reads the stream to its end, so that size and CRC-32 are checked), anything else as webdataset opens it, a local file refused at once
    when its size is not `expected.size`. A tar or I/O error while it is read becomes a
    BadInputError naming the shard and `where()` (the last good key); so does a failed close, which
    is how webdataset's streams report a failed command, unless another error is already on its way.
    A remote read that failed after its retries says so, not that the tar is corrupt."""
    import webdataset as wds  # here, not at the top: webdataset imports torch, which reading an index needs not

    retried = is_retried(url)
    try:
        stream = open_retrying(url, retry, expected) if retried else wds.gopen(url, "rb")
    except Exception as e:  # noqa: BLE001 - any opener failure is the same user-facing problem
        raise BadInputError(f"shard {url}: cannot open: {e}") from e
    finished = False
    cut_short = ""
    try:
        size = _file_size(stream)
        if expected.size is not None and size is not None and size != expected.size:
            # a stat, not a read: the reader seeks past unwanted members, so this is all it can check
            if size > expected.size or not url.lower().endswith(".tar") or _ends_a_tar(stream, size):
                raise BadInputError(
                    f"shard {url}: the file is {size} bytes but its index records {expected.size}: it was "
                    f"replaced, cut short or grown since it was indexed; restore it, or index the shards "
                    f"again (`prunepipe shards index`; `prunepipe shards verify` checks every shard's bytes)"
                )
            # A plain tar, shorter and ending inside the archive: the file was cut (a copy or a download
            # stopped). The members before the cut are the indexed ones, in place: they are read, and the
            # first one that runs past the end is where the shard's loss starts. (A compressed one cut
            # short cannot be told from one replaced without reading it: refused.)
            cut_short = f", the file cut short at {size} of the {expected.size} bytes its index records"
        yield stream
        if retried:  # the padding after the end blocks too: the stream checks the index's size and CRC-32 at its end
            while stream.read(1 << 16):
                pass
        finished = True
    except ShardReadError as e:
        raise BadInputError(f"shard {url}: {e} ({where()}{cut_short})") from e
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise BadInputError(f"shard {url}: corrupt or truncated tar {where()}{cut_short}: {_first_line(e)}") from e
    finally:
        try:
            stream.close()
        except Exception as e:  # noqa: BLE001
            if finished:  # otherwise the error being raised already names the shard
                raise BadInputError(f"shard {url}: reading failed: {_first_line(e)}") from e


def _ends_a_tar(stream: BinaryIO, size: int) -> bool:
    """Whether a local file ends as a whole tar does, in zero blocks (the end-of-archive marker, or a
    writer's padding after it); the stream is left at its start."""
    try:
        stream.seek(max(0, size - 2 * 512))
        tail = stream.read(2 * 512)
    finally:
        stream.seek(0)
    return len(tail) == 2 * 512 and not tail.strip(b"\0")


def _file_size(stream: BinaryIO) -> int | None:
    """The size of the regular local file a stream reads, else None (a pipe, a socket, a remote stream)."""
    try:
        status = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


class _Tally:
    """The size and CRC-32 of bytes handed over in file order (`update`), for an index's entry."""

    def __init__(self, checksum: bool = True):
        self.size, self.crc, self.checksum = 0, 0, checksum

    def reset(self) -> None:
        self.size, self.crc = 0, 0

    def update(self, data) -> None:
        self.size += len(data)
        if self.checksum:
            self.crc = zlib.crc32(data, self.crc)


class _Tallied(io.RawIOBase):
    """A stream that tallies every byte read through it; it cannot seek, so none is left out."""

    def __init__(self, stream: BinaryIO, tally: _Tally):
        self.stream, self.tally = stream, tally

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.tally.update(data)
        return data

    def drain(self) -> None:
        """Read to the end: the bytes after a tar's end blocks (a writer's padding) are the shard's too."""
        while self.read(READ_CHUNK):
            pass


def _sample_field(name: str) -> tuple[str, str] | None:
    """(sample key, field) of a member name as webdataset splits it (tar_file_iterator +
    group_by_keys): the name up to the basename's first dot, and the rest in lower case; None for
    `__...__` metadata members and names without an extension, which belong to no sample."""
    if name.startswith("__") and (SKIP_META.match(name) or ("/" not in name and name.endswith("__"))):
        return None
    # base_plus_ext without its regex: the basename up to its first dot, when that dot is not the
    # basename's first character; other names (and any with a newline) go through the regex
    start = name.rfind("/") + 1
    dot = name.find(".", start)
    if dot > start and "\n" not in name:
        return name[:dot], name[dot + 1 :].lower()
    from webdataset.tariterators import base_plus_ext

    prefix, suffix = base_plus_ext(name)
    return None if prefix is None else (prefix, suffix.lower())


def _samples(members: TarMembers, url: str, wanted, first: int = 0) -> Iterator[tuple[int, dict | None]]:
    """Consecutive members sharing a key form a sample (webdataset's grouping, `_sample_field`);
    the first one met is at position `first`."""
    position, key, sample = first - 1, None, None
    for name, _ in members.members():
        split = _sample_field(name)
        if split is None:
            continue
        prefix, suffix = split
        if prefix != key:
            if sample is not None:
                yield position, sample
            position, key = position + 1, prefix
            sample = {"__key__": prefix, "__url__": url} if wanted is None or wanted(position) else None
            if sample is None:
                yield position, None
        if sample is None:
            continue  # a rejected sample: the reader skips its bytes
        if suffix in sample:
            raise ValueError(f"{name}: duplicate file name in tar file {suffix} {list(sample)}")
        sample[suffix] = members.read()
    if sample is not None:
        yield position, sample


def _first_line(e: BaseException) -> str:
    text = str(e.args[0]) if e.args else repr(e)
    return text.split(" @ ")[0].splitlines()[0] if text else repr(e)


def count_plain_archive(
    stream: BinaryIO, seen: Callable[[memoryview], None] | None = None
) -> tuple[int, list[str]] | None:
    """`count_samples`'s answer for a plain local tar of small members, from all its headers at once
    (`plain_member_names`) and its names grouped as arrays, as `_sample_field` and the walk group
    them; None when it declines, and then the walk gives the answer or the error: it also declines
    what the arrays leave to the walk (a name `_sample_field` skips or sends through webdataset's
    regex, one with a newline or starting with `__`, a field twice in a sample or named `__key__`).
    `seen` gets every byte read (`plain_member_names`): the whole file when an answer comes back."""
    names = plain_member_names(stream, seen)
    if names is None:
        return None
    n = len(names)
    if n == 0:
        return 0, []
    nul = names == 0
    length = nul.argmax(1)
    length[(length == 0) & ~nul[:, 0]] = names.shape[1]  # a name that fills its field
    if length.min() < 2:  # no shorter name has a key and a field
        return None
    wide = int(length.max()) + 8  # room to read any field as 8 bytes
    if wide > names.shape[1]:  # a name near the field's 100 bytes
        names = np.pad(names, ((0, 0), (0, wide - names.shape[1])))
    column = np.arange(wide)
    names = np.where(column < length[:, None], names[:, :wide], 0)  # [N, W + 8] each name, then zeros
    if ((names[:, 0] == UNDERSCORE) & (names[:, 1] == UNDERSCORE)).any() or (names == NEWLINE).any():
        return None
    slash, dots = names == SLASH, names == DOT
    start = np.zeros(n, int)  # where the basename starts
    if slash.any():
        start = np.where(slash.any(1), wide - slash[:, ::-1].argmax(1), 0)
        dots &= column >= start[:, None]
    dot = dots.argmax(1)  # the basename's first dot: the key ends there (no dot: 0)
    if not (dot > start).all():
        return None
    keys = np.where(column < dot[:, None], names, 0).view(f"V{wide}")[:, 0]  # zero-padded: equal iff same key
    first = np.concatenate([[True], keys[1:] != keys[:-1]])  # [N] a member that starts a sample
    # a member's field: the bytes after its dot, read as one 8-byte integer when they fit
    longest = int((length - dot).max()) - 1
    if longest <= 8:
        at = (np.arange(n) * wide + dot + 1)[:, None] + np.arange(8)
        raw, member_raw = np.unique(names.reshape(-1)[at].view("<u8")[:, 0], return_inverse=True)
        raw = [int(value).to_bytes(8, "little") for value in raw]
    else:
        at = np.minimum(dot[:, None] + 1 + np.arange(longest), wide - 1)
        raw, member_raw = np.unique(np.take_along_axis(names, at, 1).view(f"V{longest}")[:, 0], return_inverse=True)
        raw = [value.tobytes() for value in raw]
    lowered = [value.rstrip(b"\0").decode("utf-8", "surrogateescape").lower() for value in raw]
    fields = sorted(set(lowered))
    if "__key__" in fields or "__url__" in fields:  # the walk raises: a duplicate of webdataset's own keys
        return None
    field = np.array([fields.index(f) for f in lowered])[member_raw.reshape(-1)]
    sample = np.cumsum(first) - 1
    if np.bincount(sample * len(fields) + field).max() > 1:  # a field twice in one sample: the walk raises
        return None
    return int(sample[-1]) + 1, fields


class ShardSurvey(NamedTuple):
    """What indexing one shard learns (`survey_shard`): its samples, the field names seen, its bytes
    and their CRC-32 (zlib.crc32), each None where not learned."""

    samples: int
    fields: list[str]
    size: int | None
    crc32: int | None


def count_samples(
    url: str, retry: ReadRetry = DEFAULT_RETRY, expected: Expected = NOTHING_EXPECTED
) -> tuple[int, list[str]]:
    """Samples in a shard and the sorted field names seen, from its tar headers alone. A plain local
    file of small members is read whole and its headers checked at once (`count_plain_archive`);
    otherwise the headers are walked: member data is seeked past on a local file, which the kernel
    is told not to read ahead (read and dropped on a pipe or http stream; compressed archives are
    decompressed). Samples are grouped exactly as `read_shard` groups them, and a truncated or
    corrupt shard, or a field twice in one sample, raises BadInputError naming the url and key;
    `expected` is checked as `read_shard` checks it."""
    samples, fields, _, _ = _count(url, retry, expected, None)
    return samples, fields


def survey_shard(url: str, retry: ReadRetry = DEFAULT_RETRY, *, checksum: bool = True) -> ShardSurvey:
    """`count_samples`' answer, and the shard's bytes and (with `checksum`) their CRC-32 for its index
    entry, computed as the bytes pass in the one read the count makes: a `pipe:` or http(s) stream
    is read to its end (past the tar's end blocks), a plain local file of small members is read
    whole anyway, and any other local file is read in order instead of seeking past its member data
    (without `checksum` it is seeked past as `count_samples` does, and its size is a stat)."""
    return _count(url, retry, NOTHING_EXPECTED, _Tally(checksum))


def _count(url: str, retry: ReadRetry, expected: Expected, tally: _Tally | None) -> ShardSurvey:
    count, key, in_sample, fields = 0, None, set(), set()

    def where() -> str:
        return f"in or after key {key!r}" if key is not None else "before its first sample"

    def surveyed(samples: int, found: list[str]) -> ShardSurvey:
        if tally is None:
            return ShardSurvey(samples, found, None, None)
        size = tally.size if local_size is None else local_size
        whole = tally.checksum and tally.size == size  # every byte tallied, in file order
        return ShardSurvey(samples, found, size, tally.crc if whole else None)

    with _reading(url, where, retry, expected) as opened:
        local_size = _file_size(opened)
        stream, seen = opened, None
        if tally is not None and local_size is None:
            stream = _Tallied(opened, tally)  # a stream's every byte is read, seeked past or not
        elif tally is not None:
            seen = tally.update  # a local file of small members is read whole, its bytes tallied there
        counted = count_plain_archive(stream, seen)
        if counted is not None:
            return surveyed(*counted)
        if seen is not None and tally.checksum and tally.size != local_size:
            # Declined before the file's end (large members, most often): the walk reads the file in
            # order instead of seeking past member data, so that one pass gives the CRC-32, not a walk
            # and a second read (one sequential read, cold, against scattered ones and then all of it)
            tally.reset()
            stream = _Tallied(opened, tally)
        for name, _ in TarMembers(stream, headers_only=True).members():
            split = _sample_field(name)
            if split is None:
                continue
            prefix, suffix = split
            if prefix != key:  # a field named like webdataset's own keys is a duplicate for read_shard too
                count, key, in_sample = count + 1, prefix, {"__key__", "__url__"}
            if suffix in in_sample:  # webdataset's group_by_keys refuses it too
                raise ValueError(f"{name}: duplicate file name in tar file {suffix} {sorted(in_sample)}")
            in_sample.add(suffix)
            fields.add(suffix)
        if isinstance(stream, _Tallied):
            stream.drain()
    return surveyed(count, sorted(fields))


def shard_checksum(url: str, retry: ReadRetry = DEFAULT_RETRY) -> tuple[int, int]:
    """(bytes, zlib.crc32) of a whole shard, every byte read through `read_shard`'s opener (a local
    file, a retried `pipe:` or http(s) stream, whatever webdataset opens); nothing is parsed. An
    unreadable shard raises BadInputError naming it."""
    tally = _Tally()
    with _reading(url, lambda: "while its bytes were read", retry) as stream:
        _Tallied(stream, tally).drain()
    return tally.size, tally.crc


def read_keys(
    url: str, field: str | None = None, retry: ReadRetry = DEFAULT_RETRY, expected: Expected = NOTHING_EXPECTED
) -> list[tuple[str, bytes | None]]:
    """(key, bytes of `field` or None) of each sample of one shard, in position order, from its tar
    headers and that one member: the other members' data is seeked past. Samples are grouped
    exactly as `read_shard` groups them; errors name the url and key as there. Joins by key
    (embeddings made elsewhere) read this, not the images; `expected` is checked as `read_shard`
    checks it."""
    samples: list[tuple[str, bytes | None]] = []
    key = None

    def where() -> str:
        return f"in or after key {key!r}" if key is not None else "before its first sample"

    with _reading(url, where, retry, expected) as stream:
        members = TarMembers(stream, headers_only=field is None)
        for name, _ in members.members():
            split = _sample_field(name)
            if split is None:
                continue
            prefix, suffix = split
            if prefix != key:
                key = prefix
                samples.append((prefix, None))
            if suffix == field:
                samples[-1] = (prefix, members.read())
    return samples
