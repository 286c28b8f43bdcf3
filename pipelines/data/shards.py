"""Shard index and raw shard reading: `index.json` (url and sample count per shard, dense ids
0..N-1 in index order) and an iterator of (position, undecoded sample) for one shard.

Nothing here decodes an image: a sample the caller does not want costs its tar headers and nothing
more (pipelines/data/tar_reader.py seeks past its bytes).
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterator
from urllib.parse import urlparse

import numpy as np
import webdataset as wds
from webdataset.tariterators import base_plus_ext

from prunepipe.pipelines.data.remote import ReadRetry, ShardReadError, is_retried, open_retrying
from prunepipe.pipelines.data.tar_reader import TarMembers, plain_member_names

INDEX_NAME = "index.json"
DEFAULT_RETRY = ReadRetry()
SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's tar_file_iterator skips these names
SLASH, DOT, NEWLINE, UNDERSCORE = (ord(c) for c in "/.\n_")


class BadInputError(RuntimeError):
    """A shard or sample that cannot be used; the message names the shard url and key."""


@dataclass(frozen=True)
class BadInput:
    """One bad-input event: what went wrong and how many samples it cost."""

    message: str
    samples_lost: int = 1
    undecodable: bool = False  # read but not decodable: it took a place in the worker's sample order


@dataclass(frozen=True)
class ShardIndex:
    """The shards of one split, in id order: shard i holds ids first_ids[i] .. first_ids[i]+counts[i]-1."""

    urls: tuple[str, ...]
    counts: np.ndarray  # int64 [S]
    path: str = ""  # where the index was read from, for messages
    meta: dict = field(default_factory=dict)  # the index's other keys (source, size, latent_shape, ...)

    @property
    def first_ids(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

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
        with open(path) as f:
            raw = json.load(f)
        try:
            shards = raw["shards"]
            urls = tuple(_resolve(s["url"], os.path.dirname(os.path.abspath(path))) for s in shards)
            counts = np.array([int(s["num_samples"]) for s in shards], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: expected {{'shards': [{{'url': str, 'num_samples': int}}, ...]}}: {e!r}") from e
        if len(urls) == 0 or (counts < 0).any():
            raise ValueError(f"{path}: an index needs at least one shard and non-negative counts")
        return cls(urls, counts, path, {k: v for k, v in raw.items() if k != "shards"})

    @staticmethod
    def write(folder: str, entries: list[tuple[str, int]], **meta) -> str:
        """Write `index.json` in `folder`; urls of files inside the folder are stored relative."""
        folder_abs = os.path.abspath(folder)
        shards = []
        for url, count in entries:
            if _is_local(url) and os.path.dirname(os.path.abspath(url)) == folder_abs:
                url = os.path.basename(url)
            shards.append({"url": url, "num_samples": int(count)})
        path = os.path.join(folder, INDEX_NAME)
        tmp = f"{path}.{os.getpid()}.tmp"  # two processes that seal a job's last shards at once may both write it
        with open(tmp, "w") as f:
            json.dump({"shards": shards, **meta}, f, indent=1)
        os.replace(tmp, path)
        return path


def index_file(location: str) -> str:
    """The index.json a split's location names: the file in a folder, or the file itself."""
    return os.path.join(location, INDEX_NAME) if os.path.isdir(location) else location


def _is_local(url: str) -> bool:
    return urlparse(url).scheme in ("", "file")


def _resolve(url: str, base: str) -> str:
    if _is_local(url) and not url.startswith("file:") and not os.path.isabs(url):
        return os.path.join(base, url)
    return url


def read_shard(
    url: str, wanted: Callable[[int], bool] | None = None, *, retry: ReadRetry = DEFAULT_RETRY
) -> Iterator[tuple[int, dict | None]]:
    """Yield (position, sample) for each sample of one shard, members grouped by key as webdataset
    groups them.

    A sample is webdataset's dict: `__key__`, `__url__` and one undecoded `bytes` field per
    extension. With `wanted`, a sample whose position it rejects is yielded as (position, None)
    and its bytes are skipped, not read. Raises BadInputError naming the url (and the last good
    key) when the shard is missing, corrupt or truncated, or a `pipe:` or http(s) read still fails
    after `retry`'s reopens (pipelines/data/remote.py); samples yielded before that point are valid.
    """
    last_key = None

    def where() -> str:
        return f"after key {last_key!r}" if last_key is not None else "before its first sample"

    with _reading(url, where, retry) as stream:
        for position, sample in _samples(TarMembers(stream), url, wanted):
            if sample is not None:
                last_key = sample["__key__"]
            yield position, sample


@contextmanager
def _reading(url: str, where: Callable[[], str], retry: ReadRetry = DEFAULT_RETRY):
    """The shard's byte stream: `pipe:` and http(s) through the retrying reader, anything else as
    webdataset opens it. A tar or I/O error while it is read becomes a BadInputError naming the
    shard and `where()` (the last good key); so does a failed close, which is how webdataset's
    streams report a failed command, unless another error is already on its way. A remote read
    that failed after its retries says so, not that the tar is corrupt."""
    try:
        stream = open_retrying(url, retry) if is_retried(url) else wds.gopen(url, "rb")
    except Exception as e:  # noqa: BLE001 - any opener failure is the same user-facing problem
        raise BadInputError(f"shard {url}: cannot open: {e}") from e
    finished = False
    try:
        yield stream
        finished = True
    except ShardReadError as e:
        raise BadInputError(f"shard {url}: {e} ({where()})") from e
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise BadInputError(f"shard {url}: corrupt or truncated tar {where()}: {_first_line(e)}") from e
    finally:
        try:
            stream.close()
        except Exception as e:  # noqa: BLE001
            if finished:  # otherwise the error being raised already names the shard
                raise BadInputError(f"shard {url}: reading failed: {_first_line(e)}") from e


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
    prefix, suffix = base_plus_ext(name)
    return None if prefix is None else (prefix, suffix.lower())


def _samples(members: TarMembers, url: str, wanted) -> Iterator[tuple[int, dict | None]]:
    """Consecutive members sharing a key form a sample (webdataset's grouping, `_sample_field`)."""
    position, key, sample = -1, None, None
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


def count_plain_archive(stream: BinaryIO) -> tuple[int, list[str]] | None:
    """`count_samples`'s answer for a plain local tar of small members, from all its headers at once
    (`plain_member_names`) and its names grouped as arrays, as `_sample_field` and the walk group
    them; None when it declines, and then the walk gives the answer or the error: it also declines
    what the arrays leave to the walk (a name `_sample_field` skips or sends through webdataset's
    regex, one with a newline or starting with `__`, a field twice in a sample or named `__key__`)."""
    names = plain_member_names(stream)
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


def count_samples(url: str, retry: ReadRetry = DEFAULT_RETRY) -> tuple[int, list[str]]:
    """Samples in a shard and the sorted field names seen, from its tar headers alone. A plain local
    file of small members is read whole and its headers checked at once (`count_plain_archive`);
    otherwise the headers are walked: member data is seeked past on a local file, which the kernel
    is told not to read ahead (read and dropped on a pipe or http stream; compressed archives are
    decompressed). Samples are grouped exactly as `read_shard` groups them, and a truncated or
    corrupt shard, or a field twice in one sample, raises BadInputError naming the url and key."""
    count, key, in_sample, fields = 0, None, set(), set()

    def where() -> str:
        return f"in or after key {key!r}" if key is not None else "before its first sample"

    with _reading(url, where, retry) as stream:
        counted = count_plain_archive(stream)
        if counted is not None:
            return counted
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
    return count, sorted(fields)


def read_keys(url: str, field: str | None = None, retry: ReadRetry = DEFAULT_RETRY) -> list[tuple[str, bytes | None]]:
    """(key, bytes of `field` or None) of each sample of one shard, in position order, from its tar
    headers and that one member: the other members' data is seeked past. Samples are grouped
    exactly as `read_shard` groups them; errors name the url and key as there. Joins by key
    (embeddings made elsewhere) read this, not the images."""
    samples: list[tuple[str, bytes | None]] = []
    key = None

    def where() -> str:
        return f"in or after key {key!r}" if key is not None else "before its first sample"

    with _reading(url, where, retry) as stream:
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
