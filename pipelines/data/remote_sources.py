"""One attempt at a remote shard's bytes from a byte offset: a `pipe:` command's stdout, an http(s)
body (a Range request, If-Range on the first answer's validator), or an object store's ranged reads
through fsspec (s3://, gs://, hf://). Each says where its bytes really start, what version of the
object it reads and how long the object is, and fails with `Failed` within the wait it is given,
name resolution and connecting included.

Nothing here retries, skips or checks bytes against what was read before: pipelines/data/remote.py
does, for every scheme alike.
"""

from __future__ import annotations

import email.utils
import functools
import http.client
import os
import re
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlparse

STDERR_LINES = 5  # of a failed command's stderr, in the error and the retry warning
HTTP_SCHEMES = ("http", "https")
# fsspec's object stores (s3fs, gcsfs, huggingface_hub's HfFileSystem), each read by ranged GETs
OBJECT_STORE_SCHEMES = ("s3", "gs", "gcs", "hf")
OBJECT_STORE_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub"}
OBJECT_BLOCK = 4 << 20  # one ranged GET: fewer requests than a small block, less lost to a stall than s3fs's 50 MiB
# HTTP statuses worth another try beside 5xx; any other 4xx (a missing object, no permission) is final
TRANSIENT_HTTP = (408, 429)
CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")
UNSATISFIED_RANGE = re.compile(r"bytes\s+\*/(\d+)")


class Failed(Exception):
    """One attempt's failure: why, the command's last stderr lines, whether another try can help, and
    how long the server asked to be left alone (Retry-After)."""

    def __init__(
        self,
        reason: str,
        stderr: str = "",
        final: bool = False,
        retry_after: float | None = None,
        status: int | None = None,
    ):
        super().__init__(reason)
        self.reason, self.stderr, self.final, self.retry_after, self.status = reason, stderr, final, retry_after, status

    def describe(self) -> str:
        return self.reason + (f"; stderr: {self.stderr}" if self.stderr else "")


class AnswerEnded(Exception):
    """A 206 ended where it said it would, short of the object's end: a server that caps each answer.
    The rest is asked for; no failure."""


def within(seconds: float, what: str, call, *args):
    """`call(*args)` in a thread of its own, given up after `seconds`: an SDK's or a resolver's wait is
    not the reader's to choose. Returns its value or raises its exception; Failed when it takes longer."""
    answer: dict = {}

    def run() -> None:
        try:
            answer["value"] = call(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the reader's thread below
            answer["error"] = e

    worker = threading.Thread(target=run, daemon=True)  # one stuck for good is left behind
    worker.start()
    worker.join(max(seconds, 0.001))
    if worker.is_alive():
        raise Failed(f"no answer for {seconds:.3g} s ({what})")
    if "error" in answer:
        raise answer["error"]
    return answer.get("value")


@dataclass(frozen=True)
class Version:
    """What identifies the object an attempt reads: its validator(s) and length, each None when the
    store did not say."""

    etag: str | None = None  # an http ETag, an S3 ETag or VersionId, a GCS generation, a hub blob id
    last_modified: str | None = None
    length: int | None = None

    def differs(self, other: "Version") -> bool:
        """Another object, judged by what both versions know; two unknowns never differ."""
        pairs = ((self.etag, other.etag), (self.last_modified, other.last_modified), (self.length, other.length))
        return any(a is not None and b is not None and a != b for a, b in pairs)

    def __str__(self) -> str:
        parts = [
            f"ETag {self.etag}" if self.etag else "",
            f"Last-Modified {self.last_modified}" if self.last_modified else "",
        ]
        parts.append(f"{self.length} bytes" if self.length is not None else "length unknown")
        return ", ".join(p for p in parts if p)


def ranged(url: str) -> bool:
    """Whether an attempt can start past byte 0 (a command's stdout cannot)."""
    return not url.startswith("pipe:")


def open_source(url: str, start: int, wait: float, known: Version | None) -> "Command | Http | ObjectStore":
    """An attempt at `url`'s bytes from `start` (or from wherever the store answers), giving up on any
    step that takes longer than `wait` seconds; `known` is the version an earlier attempt read."""
    if url.startswith("pipe:"):
        return Command(url[len("pipe:") :], wait)
    if urlparse(url).scheme in HTTP_SCHEMES:
        return Http(url, start, wait, known)
    return ObjectStore(url, start, wait)


class Command:
    """A shell command's stdout, read with a timeout; its exit status decides whether the end is the end."""

    start = 0
    version = Version()

    def __init__(self, command: str, wait: float):
        self.stderr = tempfile.TemporaryFile()
        # its own process group: a hung `aws s3 cp ... -` under `sh -c` is stopped with its shell
        try:
            self.process = subprocess.Popen(
                command, shell=True, stdout=subprocess.PIPE, stderr=self.stderr, bufsize=0, start_new_session=True
            )
        except OSError as e:  # out of processes or descriptors for a moment: worth another try
            self.stderr.close()
            raise Failed(f"cannot start the command: {e}") from None
        self.fd = self.process.stdout.fileno()
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLIN | select.POLLHUP | select.POLLERR)

    def read(self, size: int, wait: float) -> bytes:
        # poll, not select: a rank of a large gloo or NCCL job holds descriptors past select's 1024
        if not self.poller.poll(wait * 1000):
            raise Failed(f"no byte for {wait:.3g} s: the command hangs", self._stderr_tail())
        data = os.read(self.fd, size)
        if data:
            return data
        try:  # the output ended: only a zero exit status says it is the shard's end
            status = self.process.wait(wait)
        except subprocess.TimeoutExpired:
            raise Failed(
                f"the command closed its output but had not exited {wait:.3g} s later", self._stderr_tail()
            ) from None
        if status != 0:
            raise Failed(_status_text(status), self._stderr_tail())
        return b""

    def _stderr_tail(self) -> str:
        self.stderr.seek(0, os.SEEK_END)
        size = self.stderr.tell()
        self.stderr.seek(max(0, size - 4096))
        lines = self.stderr.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(line.strip() for line in lines[-STDERR_LINES:])

    def close(self, wait: float) -> None:
        """Stop the command if it still runs (the reader may want no more of the shard); its status then
        means nothing. Waits `wait` seconds at most for it to go."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.stdout.close()
        try:
            self.process.wait(max(wait, 0.01))
        except subprocess.TimeoutExpired:  # stuck in the kernel (a dead mount): leave it, do not hang the reader
            pass
        self.stderr.close()


def _status_text(status: int) -> str:
    if status < 0:
        return f"the command was killed by signal {-status} ({signal.Signals(-status).name})"
    return f"the command exited with status {status}"


class Http:
    """An http(s) body from a byte offset: a Range request that names the version read before (If-Range),
    so that a changed object answers with all of itself instead of a piece of another version. The
    whole open (name resolution, connecting, every redirect, the headers) ends within `wait`."""

    def __init__(self, url: str, start: int, wait: float, known: Version | None):
        self.sockets: list[socket.socket] = []
        self.response = None
        headers = {}
        if start:
            headers["Range"] = f"bytes={start}-"
            validator = _if_range(known)
            if validator:
                headers["If-Range"] = validator
        opener = urllib.request.build_opener(_HttpHandler(wait, self.sockets), _HttpsHandler(wait, self.sockets))
        request = urllib.request.Request(url, headers=headers)
        try:
            self.response = within(wait, "connecting and reading the headers", opener.open, request, None, wait)
        except urllib.error.HTTPError as e:
            try:
                if e.code == 416:  # Range Not Satisfiable: `bytes */LENGTH` says where the object ends
                    self._past_the_end(e, start)
                    return
                final = 400 <= e.code < 500 and e.code not in TRANSIENT_HTTP
                retry_after = _retry_after(e.headers.get("Retry-After")) if e.headers else None
                said = f" (Retry-After: {e.headers.get('Retry-After')})" if retry_after is not None else ""
                raise Failed(
                    f"HTTP {e.code} {e.reason}{said}", final=final, retry_after=retry_after, status=e.code
                ) from None
            finally:
                e.close()  # its socket, now: kept alive through the failure's context it would wait for the GC
                self._close_sockets()
        except Failed:
            self._close_sockets()  # wakes the thread still waiting on them
            raise
        except (http.client.InvalidURL, ValueError) as e:  # no try can mend a url
            raise Failed(f"not a url to read: {e}", final=True) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            self._close_sockets()
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise Failed(f"no answer for {wait:.3g} s (connecting)") from None
            raise Failed(f"cannot connect: {reason}") from None
        self.final_url = self.response.geturl()  # after redirects: where a reopen asks first
        status, answer = self.response.status, self.response.headers
        length = answer.get("Content-Length")
        length = int(length) if length is not None and length.isdigit() else None
        chunked = "chunked" in (answer.get("Transfer-Encoding") or "").lower()
        if status == 206:
            match = CONTENT_RANGE.fullmatch((answer.get("Content-Range") or "").strip())
            if not match:
                self.close(0.0)
                raise Failed(
                    f"HTTP 206 with Content-Range {answer.get('Content-Range')!r}, not `bytes FIRST-LAST/LENGTH`",
                    final=True,
                )
            first, last, total = match.groups()
            self.start, self.end = int(first), int(last) + 1
            total_length = None if total == "*" else int(total)
        else:  # a 200: all of the object, whether the server ignores Range or the version changed (If-Range)
            self.start, self.end, total_length = 0, length, length
        # a body that may end early with no sign of it: a clean end is confirmed by a ranged request
        self.unsure_end = self.end is None and not chunked
        self.version = Version(answer.get("ETag"), answer.get("Last-Modified"), total_length)
        self.position = self.start

    def _past_the_end(self, error: urllib.error.HTTPError, start: int) -> None:
        match = UNSATISFIED_RANGE.fullmatch((error.headers.get("Content-Range") or "").strip())
        if not match:
            raise Failed(f"HTTP 416 for a read from byte {start}, the object's length not said", final=True) from None
        length = int(match.group(1))
        self.final_url, self.unsure_end = error.geturl(), False
        self.start = self.end = self.position = length  # nothing to read: the object ends there
        self.version = Version(error.headers.get("ETag"), error.headers.get("Last-Modified"), length)

    def read(self, size: int, wait: float) -> bytes:
        if self.response is None:
            return b""
        for sock in self.sockets:  # each read waits what is left of the reader's deadline at most
            try:
                sock.settimeout(wait)
            except OSError:
                pass
        try:
            data = self.response.read1(size)
        except (TimeoutError, socket.timeout):
            raise Failed(f"no byte for {wait:.3g} s") from None
        except (OSError, http.client.HTTPException) as e:
            raise Failed(f"the connection failed: {type(e).__name__}: {e}") from None
        if not data and self.end is not None and self.position < self.end:
            raise Failed(f"the connection closed at byte {self.position}, short of the body's end at {self.end}")
        if not data and self.end is not None and self.version.length is not None and self.end < self.version.length:
            raise AnswerEnded()
        self.position += len(data)
        return data

    def close(self, wait: float) -> None:
        if self.response is not None:
            self.response.close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self.sockets:
            try:
                sock.close()
            except OSError:
                pass


def _if_range(known: Version | None) -> str | None:
    """If-Range's validator: a strong ETag, else Last-Modified (RFC 9110 13.1.5: never a weak ETag)."""
    if known is None:
        return None
    if known.etag and not known.etag.startswith("W/"):
        return known.etag
    return known.last_modified


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds: delta-seconds or an HTTP date (RFC 9110 10.2.3)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _connect_within(seconds: float, address, timeout=None, source_address=None, *args):
    """socket.create_connection with the name resolved within `seconds` too: getaddrinfo has no timeout
    of its own, and a resolver that hangs would hold the reader past any deadline."""
    host, port = address
    answer: dict = {}

    def resolve() -> None:
        try:
            answer["infos"] = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        except OSError as e:
            answer["error"] = e

    resolver = threading.Thread(target=resolve, daemon=True)  # a resolver stuck for good is left behind
    resolver.start()
    resolver.join(seconds)
    if resolver.is_alive():
        raise TimeoutError(f"resolving {host} took longer than {seconds:g} s")
    if "error" in answer:
        raise answer["error"]
    error: OSError = OSError(f"{host} resolved to no address")
    for family, kind, proto, _, sockaddr in answer["infos"]:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(min(timeout, seconds) if isinstance(timeout, (int, float)) else seconds)
        try:
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
        except OSError as e:
            sock.close()
            error = e
            continue
        return sock
    raise error


class _WithinWait:
    """A connection that resolves names within the wait and hands its socket to the attempt, for the
    timeouts of later reads (on https the TLS socket: the plain one under it is detached)."""

    def __init__(self, *args, within: float, sockets: list, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_connection = functools.partial(_connect_within, within)
        self._sockets = sockets

    def connect(self):
        super().connect()
        self._sockets.append(self.sock)


class _HttpConnection(_WithinWait, http.client.HTTPConnection):
    pass


class _HttpsConnection(_WithinWait, http.client.HTTPSConnection):
    pass


class _HttpHandler(urllib.request.HTTPHandler):
    """urllib's handler (redirects, proxies) on connections that resolve names within the wait."""

    def __init__(self, within: float, sockets: list):
        super().__init__()
        self.within, self.sockets = within, sockets

    def http_open(self, req):
        return self.do_open(functools.partial(_HttpConnection, within=self.within, sockets=self.sockets), req)


class _HttpsHandler(urllib.request.HTTPSHandler):
    def __init__(self, within: float, sockets: list):
        super().__init__()
        self.within, self.sockets = within, sockets

    def https_open(self, req):
        connection = functools.partial(_HttpsConnection, within=self.within, sockets=self.sockets)
        return self.do_open(connection, req, context=self._context)


class ObjectStore:
    """An object store's file through fsspec (s3fs, gcsfs, huggingface_hub), read from an offset by ranged
    GETs. Every call runs in a thread of its own that is given up after the wait (`within`): the SDKs
    retry inside and have timeouts of their own, which the reader's deadline must not depend on. The
    open's steps share one wait."""

    def __init__(self, url: str, start: int, wait: float):
        self.url, self.file = url, None
        until = time.monotonic() + wait
        scheme = urlparse(url).scheme
        try:
            import fsspec

            fs, path = fsspec.core.url_to_fs(url)
        except ImportError as e:
            package = OBJECT_STORE_PACKAGES.get(scheme, "the fsspec backend")
            raise Failed(f"{scheme}:// needs {package} (pip install {package}): {e}", final=True) from None
        except ValueError as e:  # fsspec knows no such protocol
            raise Failed(f"fsspec cannot open this url: {e}", final=True) from None
        fs.invalidate_cache(path)  # details cached by an earlier attempt would hide a new version
        if isinstance(getattr(fs, "retries", None), int):  # s3fs's own retry loop: what an abandoned call
            fs.retries = 1  # may still do in its thread, once, not five times against a store that struggles
        self.file = self._within(until - time.monotonic(), "opening", fs.open, path, "rb", OBJECT_BLOCK)
        details = getattr(self.file, "details", None) or self._within(
            until - time.monotonic(), "details", fs.info, path
        )
        self.version = _store_version(details)  # the HEAD the file itself reads by, not a second one
        self._within(until - time.monotonic(), f"seeking to byte {start}", self.file.seek, start)
        self.start = start

    def _within(self, wait: float, what: str, call, *args):
        try:
            return within(wait, what, call, *args)
        except Failed:
            raise
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as error:
            raise Failed(f"{what}: {type(error).__name__}: {error}", final=True) from None
        except Exception as error:  # noqa: BLE001 - an SDK's errors are many; each is one failed attempt
            raise Failed(f"{what}: {type(error).__name__}: {error}") from None

    def read(self, size: int, wait: float) -> bytes:
        return self._within(wait, "reading", self.file.read, size)

    def close(self, wait: float) -> None:
        if self.file is not None:
            try:
                self._within(wait, "closing", self.file.close)
            except Failed:
                pass


def _store_version(info: dict) -> Version:
    """The version fields each fsspec backend reports: S3's VersionId or ETag, GCS's generation, the hub's
    blob id or LFS sha256, else an md5; the modification time; the size."""
    lfs = info.get("lfs") if isinstance(info.get("lfs"), dict) else {}
    etag = next(
        (
            str(value)
            for value in (info.get("VersionId"), info.get("generation"), lfs.get("sha256"), info.get("blob_id"))
            if value
        ),
        None,
    ) or next((str(info[key]) for key in ("ETag", "etag", "md5Hash") if info.get(key)), None)
    modified = next(
        (str(info[key]) for key in ("LastModified", "updated", "mtime", "last_modified") if info.get(key)), None
    )
    size = info.get("size")
    return Version(etag, modified, int(size) if size is not None else None)
