"""Remote shards that outlast a flaky network and are never spliced: a `pipe:` command, an http(s) url
or an object store url (s3://, gs://, hf://) read through one stream that, when a read fails, opens
the shard again and resumes at the byte it had reached.

A failed read is a command that exits non-zero or is killed, a connection that resets or closes short
of its body, an HTTP 5xx/408/429, or no byte for `timeout_seconds`. A reopened attempt must prove it
reads the same object before any new byte is handed out: the version it answers with (If-Range, ETag,
Last-Modified, length) is the first attempt's, and the bytes it re-reads (the last 64 KiB before the
offset on a ranged read, the whole prefix on a `pipe:` command, which cannot seek) are the bytes
handed out before. Where the index knows the shard's size and CRC-32, a stream that ends short or long
of it, or whose bytes hash to another value, is an error. So the reader above sees one byte-identical
stream, every sample keeps its position, id, score and group, and a changed object is an error that
names both versions, never a spliced sample.

A stall (a failure, until an attempt has delivered `HEALTHY_BYTES` new bytes or the end) may block
the reader for `deadline_seconds` in all: reopening, name resolution, skipping, backoff and closing
are each given what is left of it. Nothing here parses a tar or knows a sample.
"""

from __future__ import annotations

import io
import logging
import random
import time
import zlib
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urlparse

from prunepipe.pipelines.data.remote_sources import (
    HTTP_SCHEMES,
    OBJECT_STORE_SCHEMES,
    AnswerEnded,
    Failed,
    Version,
    open_source,
    ranged,
)

log = logging.getLogger(__name__)

BUFFER = 256 * 1024  # a pipe hands over at most 64 KiB a read; a tar header walk reads 512 bytes at a time
OVERLAP = 64 * 1024  # re-read and compared before a ranged reopen hands out a new byte
HEALTHY_BYTES = 1 << 20  # new bytes from one attempt that end a stall (a link that drops every 64 KiB never does)
# an attempt blocked timeout_seconds for fewer bytes than this is too slow: a trickle is a stall, not progress
FLOOR_BYTES = BUFFER
RETRIED_SCHEMES = HTTP_SCHEMES + OBJECT_STORE_SCHEMES
CLOSE_SECONDS = 5.0  # the longest a close of a healthy attempt waits for its command to go


@dataclass(frozen=True)
class ReadRetry:
    """How a remote shard's failed read is retried (`data.remote` in the run config)."""

    retries: int = 5  # reopens within one stall; 0 = fail at the first failure
    timeout_seconds: float = 60.0  # no byte for this long is a failed attempt
    deadline_seconds: float = 600.0  # the most one stall may block the reader: reopens, skips, backoff, DNS, close
    backoff_seconds: float = 2.0  # the cap of the first wait before a reopen, doubled before each next one
    max_backoff_seconds: float = 60.0

    def backoff(self, failures: int, draw: random.Random) -> float:
        """Seconds to wait after the `failures`-th failure of a stall (1, 2, ...): a uniform draw below the
        doubled cap ("full jitter"), so that the loader workers of a job that met one 503 together do
        not come back together."""
        return draw.uniform(0.0, min(self.backoff_seconds * 2 ** (failures - 1), self.max_backoff_seconds))

    def check(self) -> None:
        if (
            self.retries < 0
            or self.timeout_seconds <= 0
            or self.deadline_seconds <= 0
            or self.backoff_seconds < 0
            or self.max_backoff_seconds < 0
        ):
            raise ValueError(
                f"data.remote: need retries >= 0, timeout_seconds > 0, deadline_seconds > 0 and backoffs >= 0, "
                f"got {self}"
            )


@dataclass(frozen=True)
class Expected:
    """What the index knows of a shard's bytes (index.json's `bytes` and `crc32`); None = not recorded.
    A read that ends short of or past `size`, or whose bytes do not hash to `crc32`, is an error."""

    size: int | None = None
    crc32: int | None = None  # zlib.crc32 of the whole shard


NOTHING_EXPECTED = Expected()


class ShardReadError(OSError):
    """A remote shard could not be read, or not as the same object; the message tells the whole story."""


def is_retried(url: str) -> bool:
    return url.startswith("pipe:") or urlparse(url).scheme in RETRIED_SCHEMES


def open_retrying(url: str, retry: ReadRetry, expected: Expected = NOTHING_EXPECTED) -> BinaryIO:
    """A buffered binary stream of a remote shard that retries failed reads."""
    return io.BufferedReader(RetryingStream(url, retry, expected), BUFFER)


class RetryingStream(io.RawIOBase):
    """The bytes of one remote shard from its first on; a failed read reopens it at the offset reached."""

    def __init__(
        self, url: str, retry: ReadRetry, expected: Expected = NOTHING_EXPECTED, draw: random.Random | None = None
    ):
        self.url, self.retry, self.expected = url, retry, expected
        self.offset = 0  # bytes handed to the reader
        self.failures: list[tuple[int, Failed]] = []  # (offset, failure) of each failed attempt of this stall
        self.version: Version | None = None  # what the first attempt read
        self._crc_before_tail = 0  # CRC-32 of the bytes handed out, but for those of the tail
        self._tail = bytearray()  # the last OVERLAP to 2 OVERLAP bytes handed out
        self._window_seconds, self._window_bytes = 0.0, 0  # the current attempt's blocked time and bytes
        self._confirming = False  # a reopen that asks whether a body of no stated length ended with the object
        self._resume_url = url  # where a reopen asks first: the first answer's after its redirects
        self._source = None
        self._new_bytes = 0  # handed out from the current attempt
        self._stalled: float | None = None  # seconds the reader was blocked in this stall's earlier calls
        self._ended = False
        self._draw = draw or random.Random()
        self._sleep = time.sleep  # the backoff's wait

    def readable(self) -> bool:
        return True

    def readall(self) -> bytes:
        """All the rest, in BUFFER steps (io's default reads 8 KiB at a time)."""
        parts, chunk = [], bytearray(BUFFER)
        while True:
            n = self.readinto(chunk)
            if not n:
                return b"".join(parts)
            parts.append(bytes(chunk[:n]))

    def readinto(self, buffer) -> int:
        if self._ended:
            return 0
        started = time.monotonic()
        try:
            data = self._read(len(buffer), started)
        finally:
            if self._stalled is not None:
                self._stalled += time.monotonic() - started
        if not data:
            self._end()
            return 0
        self._hand_out(data)
        buffer[: len(data)] = data
        return len(data)

    # -- the deadline ---------------------------------------------------------------------------------

    def _left(self, started: float) -> float:
        """Seconds this stall may still block the reader (a call without a stall may start one)."""
        return self.retry.deadline_seconds - (self._stalled or 0.0) - (time.monotonic() - started)

    def _wait(self, started: float) -> float:
        """How long one blocking step may take: the attempt's timeout, or what is left of the deadline."""
        return max(min(self.retry.timeout_seconds, self._left(started)), 0.001)

    # -- attempts -------------------------------------------------------------------------------------

    def _read(self, size: int, started: float) -> bytes:
        while True:
            try:
                if self._source is None:
                    if self.failures and self._known_length() == self.offset:
                        return b""  # all of it was handed out before the failure (a chunked body's lost terminator)
                    self._source = self._reopen(started)
                data = self._timed_read(size, started)
                if not data and getattr(self._source, "unsure_end", False) and self._known_length() is None:
                    self._confirming = True  # a body of no stated length ended: ask whether the object did
                    self._drop_source(started)
                    continue
                if not data and self._known_length() is not None and self.offset < self._known_length():
                    raise Failed(f"the stream ended at byte {self.offset} of {self._known_length()}")
                return data
            except AnswerEnded:  # a server that caps its answers: ask for the rest, no failure
                if self._new_bytes == 0:
                    self._failed(Failed(f"an answer from byte {self.offset} brought no new byte"), started)
                self._drop_source(started)
            except Failed as failure:
                self._failed(failure, started)

    def _timed_read(self, size: int, started: float) -> bytes:
        """One read of the attempt; an attempt that was blocked timeout_seconds for fewer than FLOOR_BYTES
        has failed (a byte every half second never trips a timeout, and would hold a rank for days)."""
        before = time.monotonic()
        data = self._source.read(size, self._wait(started))
        self._window_seconds += time.monotonic() - before
        self._window_bytes += len(data)
        if self._window_seconds >= self.retry.timeout_seconds:
            if data and self._window_bytes < FLOOR_BYTES:
                raise Failed(
                    f"too slow: {self._window_bytes} bytes in {self._window_seconds:.3g} s of waiting, fewer than "
                    f"{FLOOR_BYTES} per data.remote.timeout_seconds"
                )
            self._window_seconds, self._window_bytes = 0.0, 0
        return data

    def _known_length(self) -> int | None:
        if self.expected.size is not None:
            return self.expected.size
        return self.version.length if self.version is not None else None

    def _failed(self, failure: Failed, started: float) -> None:
        """Record a failed attempt; raise ShardReadError when no retry can help or the budget is spent,
        else wait the backoff."""
        self._drop_source(started)
        if self._stalled is None:
            self._stalled = 0.0  # this call's time is added when it returns
        self.failures.append((self.offset, failure))
        attempts = len(self.failures)
        left = self._left(started)
        if failure.final:
            raise ShardReadError(self._story("not retried: another try cannot help"))
        if attempts > self.retry.retries:
            raise ShardReadError(
                self._story(
                    f"gave up after {attempts} attempt(s) in this stall (data.remote.retries={self.retry.retries})"
                )
            )
        wait = self.retry.backoff(attempts, self._draw)
        if failure.retry_after is not None:  # the jitter on top: every worker that met the 503 was told the same
            wait += failure.retry_after
        if wait >= left or left <= 0.01:
            asked = f"the server asks to wait {failure.retry_after:g} s, " if failure.retry_after else ""
            raise ShardReadError(
                self._story(
                    f"{asked}the stall reached data.remote.deadline_seconds={self.retry.deadline_seconds:g} "
                    f"({max(left, 0):.1f} s left, the next attempt waits {wait:.1f} s){self._seek_hint()}"
                )
            )
        log.warning(
            "shard %s: read failed at byte %d (%s); reopening in %.1f s (retry %d of %d, %.0f s of the deadline left)",
            self.url,
            self.offset,
            failure.describe(),
            wait,
            attempts,
            self.retry.retries,
            left,
        )
        self._sleep(wait)

    def _reopen(self, started: float):
        """A new attempt that has proved it reads the object read before, positioned at `offset`."""
        start = max(0, self.offset - min(len(self._tail), OVERLAP)) if ranged(self.url) else 0
        try:
            source = open_source(self._resume_url, start, self._wait(started), self.version)
        except Failed as failure:
            if self._resume_url == self.url or failure.status is None or not 400 <= failure.status < 500:
                raise
            # the redirect's target is gone (an expired presigned url): the original url redirects anew
            self._resume_url = self.url
            raise Failed(f"{failure.reason} at the redirected url; asking the original url again") from None
        try:
            self._check_version(source.version)
            if source.start > self.offset:
                raise Failed(
                    f"asked for the bytes from {start}, the store answered from byte {source.start}", final=True
                )
            self._check_prefix(source, started)
        except BaseException:
            source.close(min(self._wait(started), CLOSE_SECONDS))
            raise
        self._resume_url = getattr(source, "final_url", None) or self._resume_url
        self._new_bytes, self._window_seconds, self._window_bytes = 0, 0.0, 0
        if self._confirming:
            self._confirming = False
            if getattr(source, "unsure_end", False) and source.version.length is None:
                source.unsure_end = False  # no length said again (no Range either): its end is the end
        return source

    def _check_version(self, version: Version) -> None:
        if self.version is None or (self.offset == 0 and version.differs(self.version)):
            if self.version is not None:
                log.warning(
                    "shard %s: changed before any byte was read (%s, now %s): reading the new version",
                    self.url,
                    self.version,
                    version,
                )
            self.version = version
        elif version.differs(self.version):
            raise Failed(
                f"the object changed between attempts: {self.offset} bytes were read of ({self.version}), "
                f"the store now serves ({version})",
                final=True,
            )
        else:  # the same object: what the first answer did not say (a length), a later one may
            self.version = Version(
                self.version.etag or version.etag,
                self.version.last_modified or version.last_modified,
                self.version.length if self.version.length is not None else version.length,
            )
        size = self.expected.size
        if size is not None and version.length is not None and version.length != size:
            raise Failed(
                f"the object is {version.length} bytes, the index lists {size}: it changed since it was indexed",
                final=True,
            )

    def _check_prefix(self, source, started: float) -> None:
        """Re-read what lies before `offset` in this attempt and compare it with what was handed out: the
        overlap's bytes exactly, and the CRC-32 of the bytes before it where the attempt starts at 0."""
        position, crc = source.start, 0
        overlap_at = self.offset - len(self._tail)
        while position < self.offset:
            if self._left(started) <= 0:
                raise Failed(
                    f"re-reading the {self.offset - source.start} bytes before byte {self.offset} took the rest of "
                    f"data.remote.deadline_seconds"
                )
            target = overlap_at if position < overlap_at else self.offset
            data = source.read(min(target - position, BUFFER), self._wait(started))
            if not data:
                raise Failed(
                    f"the object ended at byte {position}, short of the {self.offset} bytes an earlier attempt "
                    f"read: it changed between attempts",
                    final=True,
                )
            if position >= overlap_at:
                at = position - overlap_at
                if data != self._tail[at : at + len(data)]:
                    raise Failed(self._changed(f"its bytes {position}..{position + len(data) - 1}"), final=True)
            elif source.start == 0:
                crc = zlib.crc32(data, crc)
            position += len(data)
            if source.start == 0 and 0 < overlap_at == position and crc != self._crc_before_tail:
                raise Failed(self._changed(f"its first {overlap_at} bytes"), final=True)

    def _seek_hint(self) -> str:
        if ranged(self.url) or self.offset == 0:
            return ""
        return (
            f"; a pipe: command re-reads the {self.offset} bytes before the offset on every reopen, an s3:// or "
            f"http(s) url reads from it"
        )

    def _changed(self, what: str) -> str:
        return (
            f"the object changed between attempts: {what} are not those an earlier attempt handed out "
            f"(read before: {self.version}; the store names no other version, but its bytes differ)"
        )

    def _hand_out(self, data: bytes) -> None:
        if self.expected.size is not None and self.offset + len(data) > self.expected.size:
            self._drop_source(time.monotonic())
            raise ShardReadError(
                f"reading failed at byte {self.offset}: the shard runs past the {self.expected.size} bytes the "
                f"index lists: it changed since it was indexed"
            )
        self._tail += data
        excess = len(self._tail) - OVERLAP
        if excess >= OVERLAP:  # trimmed in steps of at least OVERLAP: one copy a byte, whatever the read sizes
            with memoryview(self._tail) as view:
                self._crc_before_tail = zlib.crc32(view[:excess], self._crc_before_tail)
            del self._tail[:excess]
        self.offset += len(data)
        self._new_bytes += len(data)
        if self._stalled is not None and self._new_bytes >= HEALTHY_BYTES:
            self._stalled, self.failures = None, []  # whole again: a later failure is a new stall

    @property
    def crc32(self) -> int:
        """CRC-32 of the bytes handed out so far."""
        return zlib.crc32(self._tail, self._crc_before_tail)

    def _end(self) -> None:
        self._ended = True
        self._drop_source(time.monotonic())
        if self.expected.crc32 is not None and self.crc32 != self.expected.crc32:
            raise ShardReadError(
                f"reading ended at byte {self.offset}: the shard's CRC-32 is {self.crc32:08x}, the index lists "
                f"{self.expected.crc32:08x}: it changed since it was indexed, or the store returned other bytes"
            )

    def _story(self, why: str) -> str:
        lines = [
            f"attempt {k + 1} at byte {offset}: {failure.describe()}"
            for k, (offset, failure) in enumerate(self.failures)
        ]
        return f"reading failed at byte {self.offset}, {why}: " + "; ".join(lines)

    def _drop_source(self, started: float) -> None:
        source, self._source = self._source, None
        if source is not None:
            source.close(min(max(self._left(started), 0.01), CLOSE_SECONDS))

    def close(self) -> None:
        self._drop_source(time.monotonic())
        super().close()
