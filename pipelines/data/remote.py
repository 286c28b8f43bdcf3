"""Remote shards that outlast a flaky network: a `pipe:` command or an http(s) url read through a
stream that, when a read fails, opens the shard again and resumes at the byte it had reached.

A failed read is a command that exits non-zero or is killed, a connection that resets or closes
short of its Content-Length, an HTTP 5xx/408/429, or no byte for `timeout_seconds` (a hung command
or connection). The new stream skips the bytes already handed out, so the reader above sees one
byte-identical stream and every sample keeps its position, id, score and group. After `retries`
reopens the error names the url, the byte offset, every attempt, the exit status and the command's
last stderr lines. Nothing here parses a tar or knows a sample.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import select
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urlparse

log = logging.getLogger(__name__)

BUFFER = 256 * 1024  # a pipe hands over at most 64 KiB a read; a tar header walk reads 512 bytes at a time
STDERR_LINES = 5  # of a failed command's stderr, in the error and the retry warning
RETRIED_SCHEMES = ("http", "https")
# HTTP statuses worth another try; any other 4xx (a missing object, no permission) is final at once
TRANSIENT_HTTP = (408, 429)


@dataclass(frozen=True)
class ReadRetry:
    """How a remote shard's failed read is retried (`data.remote` in the run config)."""

    retries: int = 5  # reopens after failed reads at one byte offset (progress starts the count again); 0 = none
    timeout_seconds: float = 60.0  # no byte for this long is a failed read
    backoff_seconds: float = 2.0  # the wait before the first reopen, doubled before each next one
    max_backoff_seconds: float = 60.0

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failure (1, 2, ...)."""
        return min(self.backoff_seconds * 2 ** (failures - 1), self.max_backoff_seconds)

    def worst_case_seconds(self) -> float:
        """The longest one shard read can stall before its error: every attempt hangs to its timeout."""
        return (self.retries + 1) * self.timeout_seconds + sum(self.backoff(k) for k in range(1, self.retries + 1))

    def check(self) -> None:
        if self.retries < 0 or self.timeout_seconds <= 0 or self.backoff_seconds < 0 or self.max_backoff_seconds < 0:
            raise ValueError(f"data.remote: need retries >= 0, timeout_seconds > 0 and backoffs >= 0, got {self}")


class ShardReadError(OSError):
    """A remote shard could not be read, after its retries; the message tells the whole story."""


class _Failed(Exception):
    """One attempt's failure: why, the command's last stderr lines, and whether another try can help."""

    def __init__(self, reason: str, stderr: str = "", final: bool = False):
        super().__init__(reason)
        self.reason, self.stderr, self.final = reason, stderr, final

    def describe(self) -> str:
        return self.reason + (f"; stderr: {self.stderr}" if self.stderr else "")


def is_retried(url: str) -> bool:
    return url.startswith("pipe:") or urlparse(url).scheme in RETRIED_SCHEMES


def open_retrying(url: str, retry: ReadRetry) -> BinaryIO:
    """A buffered binary stream of a `pipe:` or http(s) shard that retries failed reads."""
    return io.BufferedReader(RetryingStream(url, retry), BUFFER)


class RetryingStream(io.RawIOBase):
    """The bytes of one remote shard from its first on; a failed read reopens it at the offset reached."""

    def __init__(self, url: str, retry: ReadRetry):
        self.url, self.retry = url, retry
        self.offset = 0  # bytes handed to the reader
        self.failures: list[tuple[int, _Failed]] = []  # (offset, failure) of each failed attempt
        self._source: _Command | _Http | None = None
        self._ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._ended:
            return 0
        while True:
            try:
                if self._source is None:
                    self._source = _open(self.url, self.offset, self.retry.timeout_seconds)
                data = self._source.read(len(buffer))
                break
            except _Failed as failure:
                self._drop_source()
                self.failures.append((self.offset, failure))
                # the budget is per stretch without progress: a multi-GB shard may meet several resets
                stalled = sum(offset == self.offset for offset, _ in self.failures)
                if failure.final or stalled > self.retry.retries:
                    raise ShardReadError(self._story(stalled)) from None
                wait = self.retry.backoff(stalled)
                log.warning(
                    "shard %s: read failed at byte %d (%s); reopening in %.1f s (retry %d of %d)",
                    self.url,
                    self.offset,
                    failure.describe(),
                    wait,
                    stalled,
                    self.retry.retries,
                )
                time.sleep(wait)
        if not data:
            self._ended = True
            self._drop_source()
            return 0
        buffer[: len(data)] = data
        self.offset += len(data)
        return len(data)

    def _story(self, stalled: int) -> str:
        lines = [
            f"attempt {k + 1} at byte {offset}: {failure.describe()}"
            for k, (offset, failure) in enumerate(self.failures)
        ]
        final = self.failures[-1][1]
        why = (
            "not retried: another try cannot help"
            if final.final and stalled <= self.retry.retries
            else f"gave up after {stalled} attempt(s) at this byte (data.remote.retries={self.retry.retries})"
        )
        return f"reading failed at byte {self.offset}, {why}: " + "; ".join(lines)

    def _drop_source(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            source.close()

    def close(self) -> None:
        self._drop_source()
        super().close()


def _open(url: str, offset: int, timeout: float) -> "_Command | _Http":
    source = _Command(url[len("pipe:") :], timeout) if url.startswith("pipe:") else _Http(url, offset, timeout)
    try:
        # a pipe cannot seek, and a server may ignore the Range header: drop what an earlier attempt read
        while source.position < offset:
            if not source.read(min(offset - source.position, BUFFER)):
                raise _Failed(
                    f"the shard ended at byte {source.position}, short of the {offset} bytes an earlier "
                    f"attempt read: it changed between attempts",
                    final=True,
                )
    except BaseException:
        source.close()
        raise
    return source


class _Command:
    """A shell command's stdout, read with a timeout; its exit status decides whether the end is the end."""

    def __init__(self, command: str, timeout: float):
        self.timeout = timeout
        self.stderr = tempfile.TemporaryFile()
        # its own process group: a hung `aws s3 cp ... -` under `sh -c` is stopped with its shell
        try:
            self.process = subprocess.Popen(
                command, shell=True, stdout=subprocess.PIPE, stderr=self.stderr, bufsize=0, start_new_session=True
            )
        except OSError as e:  # out of processes or descriptors for a moment: worth another try
            self.stderr.close()
            raise _Failed(f"cannot start the command: {e}") from None
        self.fd = self.process.stdout.fileno()
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        self.position = 0  # bytes of the shard read from this command

    def read(self, size: int) -> bytes:
        # poll, not select: a rank of a large gloo or NCCL job holds descriptors past select's 1024
        if not self.poller.poll(self.timeout * 1000):
            raise _Failed(
                f"no byte for {self.timeout:g} s (data.remote.timeout_seconds): the command hangs", self._stderr_tail()
            )
        data = os.read(self.fd, size)
        if data:
            self.position += len(data)
            return data
        try:  # the output ended: only a zero exit status says it is the shard's end
            status = self.process.wait(self.timeout)
        except subprocess.TimeoutExpired:
            raise _Failed(
                f"the command closed its output but had not exited {self.timeout:g} s later", self._stderr_tail()
            ) from None
        if status != 0:
            raise _Failed(_status_text(status), self._stderr_tail())
        return b""

    def _stderr_tail(self) -> str:
        self.stderr.seek(0, os.SEEK_END)
        size = self.stderr.tell()
        self.stderr.seek(max(0, size - 4096))
        lines = self.stderr.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(line.strip() for line in lines[-STDERR_LINES:])

    def close(self) -> None:
        """Stop the command if it still runs (the reader may want no more of the shard); its status then
        means nothing."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.stdout.close()
        try:
            self.process.wait(self.timeout)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a dead mount): leave it, do not hang the reader
            log.warning("shard command %d did not exit after SIGKILL", self.process.pid)
        self.stderr.close()


def _status_text(status: int) -> str:
    if status < 0:
        return f"the command was killed by signal {-status} ({signal.Signals(-status).name})"
    return f"the command exited with status {status}"


class _Http:
    """An http(s) body from a byte offset (a Range request), read with a socket timeout."""

    def __init__(self, url: str, offset: int, timeout: float):
        self.url, self.timeout = url, timeout
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            self.response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
        except urllib.error.HTTPError as e:
            final = 400 <= e.code < 500 and e.code not in TRANSIENT_HTTP
            raise _Failed(f"HTTP {e.code} {e.reason}", final=final) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise _Failed(f"cannot connect: {getattr(e, 'reason', e)}") from None
        # where the body starts: a server that ignores the Range header sends all of it again
        self.position = offset if offset and self.response.status == 206 else 0
        length = self.response.headers.get("Content-Length")
        self.end = self.position + int(length) if length is not None else None

    def read(self, size: int) -> bytes:
        try:
            data = self.response.read1(size)
        except TimeoutError:
            raise _Failed(f"no byte for {self.timeout:g} s (data.remote.timeout_seconds)") from None
        except (OSError, http.client.HTTPException) as e:
            raise _Failed(f"the connection failed: {type(e).__name__}: {e}") from None
        if not data and self.end is not None and self.position < self.end:
            raise _Failed(f"the connection closed at byte {self.position} of {self.end}")
        self.position += len(data)
        return data

    def close(self) -> None:
        self.response.close()
