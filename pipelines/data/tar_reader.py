"""Tar members read by parsing the 512-byte headers directly, so that a member nobody wants costs a
seek (or, on a pipe, one read that is thrown away) and no Python object per header field.

Python's tarfile spends ~40 us per member building TarInfo objects; with two members per sample
that was most of what a pruned sample cost. This reader understands what shard writers produce:
POSIX ustar (with the name prefix field), pax extended headers (`path`, `size`) and GNU long
names. Compressed archives (gzip, bzip2, xz) go through tarfile, which handles them.

It is stricter than tarfile about endings, so that a cut-off shard never hands out its last sample
short of a field: an archive must end with its zero blocks, not after an extended header, and an
empty file is an error. Sparse members are refused.
"""

from __future__ import annotations

import io
import os
import struct
import tarfile
from zlib import adler32
from typing import BinaryIO, Iterator

BLOCK = 512
REGULAR = (b"0", b"\0", b"7")  # what tarfile's isreg() accepts
NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, fifos: a size field means nothing
COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")
POSIX_MAGIC = b"ustar\x0000"
ZERO_BLOCK = bytes(BLOCK)
# name, size, checksum, type flag, ustar magic, ustar name prefix: one unpack instead of six slices
HEADER = struct.Struct("100s24x12s12x8s1s100x8s80x155s")


class TarFormatError(ValueError):
    """The bytes are not a tar archive, or it ends inside a header or a member."""


def _number(field: bytes) -> int:
    if field[0] & 0x80:  # GNU base-256, for sizes of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    try:  # what writers write: octal digits, then NULs or spaces
        return int(field.rstrip(b" \0"), 8)
    except ValueError:
        pass
    text = field.partition(b"\0")[0]
    try:
        return int(text, 8)  # int() ignores surrounding spaces
    except ValueError:
        if not text.strip():
            return 0
        raise TarFormatError(f"invalid number field {field!r} in a tar header") from None


def _pax_records(data: bytes) -> dict[str, str]:
    """`LENGTH KEY=VALUE\\n` records of a pax extended header."""
    records, position = {}, 0
    while position < len(data) and data[position]:
        space = data.find(b" ", position)
        if space < 0:
            raise TarFormatError("malformed pax extended header")
        try:
            length = int(data[position:space])
        except ValueError:
            raise TarFormatError("malformed pax extended header") from None
        if length <= space - position:
            raise TarFormatError("malformed pax extended header")
        key, _, value = data[space + 1:position + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        position += length
    return records


class _Replay(io.RawIOBase):
    """A stream with bytes already read from it put back in front (for tarfile's compression sniffing)."""

    def __init__(self, head: bytes, rest: BinaryIO):
        self.head, self.rest = head, rest

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.rest.read(size)
        if size < 0:
            data, self.head = self.head + self.rest.read(), b""
            return data
        data, self.head = self.head[:size], self.head[size:]
        return data + (self.rest.read(size - len(data)) if len(data) < size else b"")


class TarMembers:
    """Iterate `members()` for (name, size) of each regular file; call `read()` for the current
    member's bytes, or do nothing and its data is skipped when the next member is asked for."""

    def __init__(self, stream: BinaryIO, *, headers_only: bool = False):
        self.stream = stream
        self.headers_only = headers_only  # no member will be read: a local file gets no readahead
        try:
            self.seekable = bool(stream.seekable())
        except (AttributeError, OSError, ValueError):
            self.seekable = False
        self._unread = 0  # data + padding of the current member not consumed yet
        self._size = 0
        self._fallback: tarfile.TarFile | None = None  # compressed archives: tarfile reads them
        self._fallback_data = b""

    # ------------------------------------------------------------------ reading bytes
    def _read(self, n: int, what: str) -> bytes:
        data = self.stream.read(n)
        while len(data) < n:
            more = self.stream.read(n - len(data))
            if not more:
                raise TarFormatError(f"unexpected end of data inside {what}")
            data += more
        return data

    def _discard(self, n: int) -> None:
        if n <= 0:
            return
        if self.seekable:  # the member's last byte is read, so a truncated member is noticed
            self.stream.seek(n - 1, io.SEEK_CUR)
            if not self.stream.read(1):
                raise TarFormatError("unexpected end of data inside a member")
        else:
            while n > 0:
                chunk = self.stream.read(min(n, 1 << 20))
                if not chunk:
                    raise TarFormatError("unexpected end of data inside a member")
                n -= len(chunk)

    def read(self) -> bytes:
        """The current member's bytes."""
        if self._fallback is not None:
            return self._fallback_data
        n, self._unread = self._unread, 0
        data = self.stream.read(n)
        if len(data) < n:
            data += self._read(n - len(data), "a member")
        return data[:self._size]

    # ------------------------------------------------------------------ headers
    def members(self) -> Iterator[tuple[str, int]]:
        first = self.stream.read(BLOCK)
        if not first:
            raise TarFormatError("empty file")
        if first.startswith(COMPRESSED_MAGIC):
            yield from self._compressed(first)
            return
        if self.headers_only and self.seekable:
            _advise_scattered(self.stream)
        # Every name is looked up once, outside the loop: at two or four headers a sample (writers
        # give each member a pax header for its float mtime) the loop is what indexing costs.
        read, unpack, discard = self.stream.read, HEADER.unpack_from, self._discard
        header = first
        long_name, pax, extended = None, {}, False  # extended: an x or L header waits for its member
        while True:
            if len(header) < BLOCK:
                if not header:  # every tar writer ends with zero blocks; tarfile would stop quietly
                    raise TarFormatError("the archive ends after an extended header, before its member" if extended
                                         else "the archive ends without its end-of-archive blocks")
                header += self._read(BLOCK - len(header), "a header")
            if header == ZERO_BLOCK:
                if extended:
                    raise TarFormatError("the archive ends after an extended header, before its member")
                return
            name, size_field, checksum, kind, magic, prefix = unpack(header)
            # the checksum: the header's byte sum with its checksum field read as spaces (Adler-32's
            # low half is 1 + the byte sum mod 65521, exact for 256 bytes: C speed, not a Python sum)
            if _number(checksum) != ((adler32(header[:256]) & 0xFFFF) + (adler32(header[256:]) & 0xFFFF) - 2
                                     - sum(checksum) + 256):
                raise TarFormatError("bad checksum in a tar header: not a tar archive, or a damaged one")
            if kind == b"S":
                raise TarFormatError("sparse members are not supported in shards")
            size = 0 if kind in NO_DATA else int(pax["size"]) if "size" in pax else _number(size_field)
            self._size, self._unread = size, (size + BLOCK - 1) & -BLOCK
            if kind in REGULAR:
                extended_name = pax.get("path") or long_name if extended else None
                if extended_name:
                    name = extended_name
                else:
                    name = name.partition(b"\0")[0]
                    if prefix[0] and magic == POSIX_MAGIC:  # a ustar name prefix
                        name = prefix.partition(b"\0")[0] + b"/" + name
                    name = name.decode("utf-8", "surrogateescape")
                long_name, pax, extended = None, {}, False
                yield name, size
            elif kind == b"x":  # describes the next member
                data, extended = self.read(), True
                # Only path, size and GNU.sparse.* change what is read; writers' usual records (a
                # float mtime, for webdataset's TarWriter) are not parsed: half a header walk's time
                pax = _pax_records(data) if b"path=" in data or b"size=" in data or b"GNU.sparse" in data else {}
                if b"GNU.sparse" in data and any(key.startswith("GNU.sparse") for key in pax):
                    raise TarFormatError("sparse members are not supported in shards")
            elif kind == b"L":
                long_name, extended = self.read().split(b"\0", 1)[0].decode("utf-8", "surrogateescape"), True
            else:  # directories, links, global pax headers, ...
                long_name, pax, extended = None, {}, False
            if self._unread:
                discard(self._unread)
                self._unread = 0
            header = read(BLOCK)

    def _compressed(self, head: bytes) -> Iterator[tuple[str, int]]:
        archive = tarfile.open(fileobj=_Replay(head, self.stream), mode="r|*")
        for info in archive:
            if info.isreg():
                self._fallback = archive
                self._fallback_data = archive.extractfile(info).read()
                yield info.name, info.size
            archive.members = []  # stream mode: keep no history


def _advise_scattered(stream: BinaryIO) -> None:
    """Tell the kernel that a local file is read at scattered places (POSIX_FADV_RANDOM): its
    readahead would otherwise fetch member data that is seeked past. Streams without a file
    descriptor and systems without posix_fadvise are left as they are."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        pass
