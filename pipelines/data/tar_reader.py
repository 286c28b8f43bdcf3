"""Tar members read by parsing the 512-byte headers directly, so that a member nobody wants costs a
seek (or, on a pipe, one read that is thrown away) and no Python object per header field.

Python's tarfile spends ~40 us per member building TarInfo objects; with two members per sample
that was most of what a pruned sample cost. This reader understands what shard writers produce:
POSIX ustar (with the name prefix field), pax extended headers (`path`, `size`) and GNU long
names. Compressed archives (gzip, bzip2, xz) go through tarfile, which handles them.

It is stricter than tarfile about endings, so that a cut-off shard never hands out its last sample
short of a field: an archive must end with its zero blocks, not after an extended header, and an
empty file is an error. Sparse members are refused.

A plain local file of small members, where every page holds headers and nothing can be seeked
past, is better read whole and all its headers checked at once as arrays (`plain_member_names`):
it answers only when it can prove the answer is the walk's, and declines anything else.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import tarfile
import threading
from typing import BinaryIO, Callable, Iterator
from zlib import adler32

import numpy as np

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
        key, _, value = data[space + 1 : position + length - 1].partition(b"=")
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

    def __init__(self, stream: BinaryIO, *, headers_only: bool = False, offset: int = 0):
        """`offset`: where in the archive `stream` stands, a header's start (a walk resumed there)."""
        self.stream = stream
        self.headers_only = headers_only  # no member will be read: a local file gets no readahead
        # bytes of the archive consumed so far, and where the current member's headers began (its
        # first pax or long-name header, else its own): a walk resumed at `entry_offset` meets it again
        self.offset = offset
        self.entry_offset = offset
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
        self.offset += n
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
        self.offset += n
        data = self.stream.read(n)
        if len(data) < n:
            data += self._read(n - len(data), "a member")
        return data[: self._size]

    # ------------------------------------------------------------------ headers
    def members(self) -> Iterator[tuple[str, int]]:
        resumed = self.offset > 0
        first = self.stream.read(BLOCK)
        if not first:
            raise TarFormatError("empty file")
        if first.startswith(COMPRESSED_MAGIC) and not resumed:
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
            if not extended:  # this header starts a member's headers
                self.entry_offset = self.offset
            self.offset += BLOCK
            if len(header) < BLOCK:
                if not header:  # every tar writer ends with zero blocks; tarfile would stop quietly
                    raise TarFormatError(
                        "the archive ends after an extended header, before its member"
                        if extended
                        else "the archive ends without its end-of-archive blocks"
                    )
                header += self._read(BLOCK - len(header), "a header")
            if header == ZERO_BLOCK:
                if extended:
                    raise TarFormatError("the archive ends after an extended header, before its member")
                return
            name, size_field, checksum, kind, magic, prefix = unpack(header)
            # the checksum: the header's byte sum with its checksum field read as spaces (Adler-32's
            # low half is 1 + the byte sum mod 65521, exact for 256 bytes: C speed, not a Python sum)
            if _number(checksum) != (
                (adler32(header[:256]) & 0xFFFF) + (adler32(header[256:]) & 0xFFFF) - 2 - sum(checksum) + 256
            ):
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


# ---------------------------------------------------------------------------- plain local archives at once
# A shard of small samples has about four headers a sample (webdataset's TarWriter gives each member
# a pax header for its float mtime), and every 4 KiB page holds some: nothing can be seeked past, and
# walking the headers one at a time in Python is what indexing it costs. `plain_member_names` reads
# such a file whole, a chunk at a time, and checks all its headers at once: every block carrying the
# ustar magic is a candidate, and when the candidates chain exactly (the first is block 0, each one's
# size leads to the next, the last to a zero block), they are the headers the walk would visit. No
# "ustar" inside member data can hide among them: it would break the chain.
HEAD = 64 * 1024  # read first, to tell small members (read whole) from large ones (walked, seeked past)
SMALL_MEMBERS = 8  # headers in HEAD from which a file is read whole: 8 KiB a member or less
CHUNK = 4 << 20  # bytes checked at once; each thread keeps one buffer of this size
# bytes 257..262 of a header, "ustar" and a NUL (POSIX) or a space (GNU), inside its 33rd 8-byte word
# (read little-endian)
MAGIC_WORD, MAGIC_SHIFT, MAGIC_BITS = 32, np.uint64(8), np.uint64((1 << 48) - 1)
MAGICS = tuple(np.uint64(int.from_bytes(magic, "little")) for magic in (b"ustar\0", b"ustar "))
SIZE_DIGITS = 8.0 ** np.arange(10, -1, -1)  # an octal number's digits as a dot product (BLAS: float)
CHECKSUM_DIGITS = 8.0 ** np.arange(5, -1, -1)
SPACE, END = np.uint8(ord(" ")), np.uint8((ord(" ") - ord("0")) % 256)  # a NUL or a space, less "0", ORed with SPACE
KINDS = np.zeros(256, np.uint8)  # a header's type flag: 1 a regular file, 2 a pax header, 0 what the walk handles
REGULAR_FILE, PAX_HEADER = 1, 2
KINDS[[ord(kind) for kind in REGULAR]] = REGULAR_FILE
KINDS[ord("x")] = PAX_HEADER
PAX_RECORDS_READ = (b"path=", b"size=", b"GNU.sparse")  # the records the walk parses a pax header for
_buffers = threading.local()


def _pread(fd: int, into: memoryview, offset: int) -> int:
    """Read into `into` from `offset` until it is full or the file ends; returns the bytes read."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if not got:
            break
        done += got
    return done


def _regular_file(stream: BinaryIO) -> int | None:
    """The descriptor of a stream that reads a regular local file, else None (pipes, sockets, http)."""
    try:
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, ValueError):
        return None


def _magic_blocks(blocks: np.ndarray) -> np.ndarray:
    """Indices of the blocks [B, 512] that carry the ustar magic."""
    word = (blocks.view("<u8")[:, MAGIC_WORD] >> MAGIC_SHIFT) & MAGIC_BITS
    return np.flatnonzero((word == MAGICS[0]) | (word == MAGICS[1]))


class _HeaderChain:
    """The candidate headers of the chunks read so far, checked one chunk at a time."""

    def __init__(self):
        self.starts: list[np.ndarray] = []  # block of each header
        self.afters: list[np.ndarray] = []  # the block its member's data leads to
        self.pax: list[np.ndarray] = []  # is it a pax header
        self.names: list[np.ndarray] = []  # name fields of the regular members [n, 100]
        self.end, self.end_is_zero = -1, False  # the block the last header leads to; is it a zero block

    def add(self, blocks: np.ndarray, base: int, final: bool) -> int | None:
        """Check the candidates in `blocks` (the file's blocks from `base` on); returns how many
        blocks are done with (all, unless a pax header is not followed by its records and the next
        header inside the chunk: from that header on, the blocks start the next chunk), or None
        when the archive is not one this check covers."""
        if base <= self.end < base + len(blocks):
            self.end_is_zero = not blocks[self.end - base].any()
        found, done = _magic_blocks(blocks), len(blocks)
        if not len(found):  # inside a member larger than a chunk, or past the archive's end
            return done
        headers = blocks[found]  # [K, 512], a copy
        # bytes 124..155: the size (11 octal digits, then a NUL or a space), the mtime (not read), the
        # checksum (6 digits, then NULs or spaces); less "0", a digit is 0..7 and an end ORed with a
        # space is END (a byte below "0" wraps above 7)
        numbers = headers[:, 124:156] - np.uint8(ord("0"))
        if (
            numbers[:, :11].max() > 7
            or numbers[:, 24:30].max() > 7
            or not ((numbers[:, 11] | SPACE) == END).all()
            or not ((numbers[:, 30:32] | SPACE) == END).all()
        ):
            return None  # a number written otherwise (base-256, fewer digits): the walk parses it
        sizes = (numbers[:, :11] @ SIZE_DIGITS).astype(np.int64)  # exact: below 2**53
        # the checksum: the header's byte sum with its checksum field read as spaces (each half's
        # sum fits 16 bits, which numpy sums without a full-size temporary)
        headers[:, 148:156] = ord(" ")
        if (
            numbers[:, 24:30] @ CHECKSUM_DIGITS
            != headers[:, :256].sum(1, dtype=np.uint16).astype(np.int64) + headers[:, 256:].sum(1, dtype=np.uint16)
        ).any():
            return None
        kind = KINDS[headers[:, 156]]
        regular, pax = kind == REGULAR_FILE, kind == PAX_HEADER
        if not kind.all() or (regular & (headers[:, 345] != 0)).any():  # or a ustar name prefix
            return None
        after = found + 1 + (sizes + BLOCK - 1) // BLOCK
        crossing = pax & (after >= len(blocks))  # records that reach past the chunk, or no header after them
        if crossing.any():
            cut = int(crossing.argmax())
            if final or found[cut] == 0:  # the file ends there, or records larger than a chunk
                return None
            done = int(found[cut])
            found, headers, sizes, after, regular, pax = (
                part[:cut] for part in (found, headers, sizes, after, regular, pax)
            )
        if pax.any():
            sizes, first, last = sizes[pax], found[pax] + 1, after[pax]
            if sizes.max() <= BLOCK:  # one block of records each: the usual
                records = blocks[first, : int(sizes.max())].tobytes()
            else:
                counts = last - first
                records = blocks[
                    np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
                ].tobytes()
            # one byte looked for first (memchr): webdataset's mtime records hold neither a "p" nor a "z"
            if (b"p" in records or b"z" in records) and any(key in records for key in PAX_RECORDS_READ):
                return None  # or a false alarm (a value, the padding): the walk decides
        if len(found):
            self.starts.append(found + base)
            self.afters.append(after + base)
            self.pax.append(pax)
            self.names.append(headers[regular, :100])
            self.end = base + int(after[-1])
            self.end_is_zero = self.end < base + len(blocks) and not blocks[after[-1]].any()
        return done

    def names_if_chained(self) -> np.ndarray | None:
        """The regular members' names when the headers chain from block 0 to a zero block, else None."""
        if not self.starts:
            return None
        starts, afters, pax = (np.concatenate(parts) for parts in (self.starts, self.afters, self.pax))
        if starts[0] != 0 or (afters[:-1] != starts[1:]).any() or pax[-1] or not self.end_is_zero:
            return None
        return np.concatenate(self.names)


def plain_member_names(stream: BinaryIO, seen: Callable[[memoryview], None] | None = None) -> np.ndarray | None:
    """The 100-byte name fields [N, 100] of the regular members of a plain local tar file of small
    members, in archive order, exactly what `TarMembers(stream).members()` would yield; None when
    it declines, so that the caller walks the headers and gets the walk's result or error: not a
    regular file, compressed, large members (the walk seeks past their data), a broken chain, a bad
    checksum, a number not in plain octal, a type other than a regular file or a pax header, a
    ustar name prefix, a pax header that names or sizes a member, no end block, or one right after
    a pax header. Reads with pread: the stream's position is left where it was. `seen` is handed
    every byte read, in file order (an index's CRC-32 of the shard, `count_samples`); when the names
    come back, it has been handed the whole file."""
    fd = _regular_file(stream)
    if fd is None:
        return None
    buffer = getattr(_buffers, "chunk", None)
    if buffer is None or len(buffer) != CHUNK:
        buffer = _buffers.chunk = np.empty(CHUNK, np.uint8)
    view = memoryview(buffer)
    filled = _pread(fd, view[:HEAD], 0)
    if seen is not None:
        seen(view[:filled])
    if filled < BLOCK or bytes(view[:6]).startswith(COMPRESSED_MAGIC):
        return None
    if len(_magic_blocks(buffer[: filled // BLOCK * BLOCK].reshape(-1, BLOCK))) < SMALL_MEMBERS:
        return None
    chain, base, offset = _HeaderChain(), 0, filled
    while True:
        got = _pread(fd, view[filled:], offset)
        if seen is not None:
            seen(view[filled : filled + got])
        filled, offset = filled + got, offset + got
        final = filled < len(buffer)
        blocks = buffer[: filled // BLOCK * BLOCK].reshape(-1, BLOCK)
        done = chain.add(blocks, base, final)
        if done is None:
            return None
        if final:
            return chain.names_if_chained()
        kept = filled - done * BLOCK  # a pax header cut off from what follows it starts the next
        buffer[:kept] = buffer[done * BLOCK : filled]
        base, filled = base + done, kept
