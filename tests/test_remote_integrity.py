"""The retrying reader against stores that lie, as a specification: every fault of the local fault
server (tools/fixtures/fault_server.py) and of `pipe:` commands either reads to the object's bytes,
byte for byte, or stops with ShardReadError naming the offset and the cause; never a spliced stream.
A stall blocks the reader no longer than data.remote.deadline_seconds, whatever it is made of."""

from __future__ import annotations

import logging
import random
import shlex
import sys
import time
import zlib

import pytest

from prunepipe.pipelines.data.remote import Expected, ReadRetry, ShardReadError, open_retrying
from prunepipe.pipelines.data.remote_sources import OBJECT_BLOCK
from prunepipe.tools.fixtures.fault_server import Fault, FaultServer

MIB = 1 << 20
QUICK = ReadRetry(retries=3, timeout_seconds=5.0, deadline_seconds=30.0, backoff_seconds=0.0)


@pytest.fixture(autouse=True)
def quiet_retries():
    logging.getLogger("prunepipe.pipelines.data.remote").setLevel(logging.ERROR)  # each planned failure warns


@pytest.fixture
def server():
    with FaultServer() as running:
        yield running


@pytest.fixture(scope="module")
def data() -> bytes:
    return random.Random(0).randbytes(MIB)


@pytest.fixture(scope="module")
def other() -> bytes:
    return random.Random(1).randbytes(MIB)


def read(url: str, retry: ReadRetry = QUICK, expected: Expected = Expected()) -> bytes:
    stream = open_retrying(url, retry, expected)
    try:
        return stream.read()
    finally:
        stream.close()


def test_a_range_answer_that_starts_at_byte_0_is_read_from_where_it_says(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", Fault("drop", at=300_000), Fault("lie_range"))
    assert read(url) == data, "the second answer's Content-Range says byte 0: its prefix is dropped, not spliced"
    assert server.statuses("a.tar") == [200, 206]


def test_a_resumed_read_names_the_version_it_read_and_resumes_on_the_overlap(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", Fault("drop", at=300_000))
    assert read(url) == data
    first, resumed = server.requests
    assert resumed["if_range"] == first_etag(server, "a.tar"), "If-Range carries the first answer's ETag"
    assert resumed["range"] == f"bytes={300_000 - 64 * 1024}-", "the last 64 KiB are read again and compared"


def first_etag(server, name: str) -> str:
    return server.objects[name].etag


def test_an_object_replaced_between_attempts_is_an_error_naming_both_versions(server, data, other):
    url = server.put("a.tar", data)
    old_etag = first_etag(server, "a.tar")
    server.fault("a.tar", Fault("drop", at=300_000), Fault("replace", data=other))
    with pytest.raises(ShardReadError) as caught:
        read(url)
    message = str(caught.value)
    assert "at byte 300000" in message and "changed between attempts" in message
    assert old_etag in message and first_etag(server, "a.tar") in message, "both versions are named"
    assert "not retried" in message


def test_an_object_replaced_on_a_server_without_validators_is_caught_by_its_bytes(server, data, other):
    url = server.put("a.tar", data, validators=False)
    server.fault("a.tar", Fault("drop", at=300_000), Fault("replace", data=other))
    with pytest.raises(ShardReadError, match=r"changed between attempts: its bytes \d+\.\.\d+ are not those"):
        read(url)


def test_an_object_replaced_before_any_byte_was_handed_out_is_read_whole_in_its_new_version(server, data, other):
    url = server.put("a.tar", data)
    server.fault("a.tar", Fault("drop", at=0), Fault("replace", data=other))
    assert read(url) == other


def test_a_server_that_ignores_range_is_read_to_the_same_bytes(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", Fault("drop", at=300_000), Fault("ignore_range"))
    assert read(url) == data
    assert server.statuses("a.tar") == [200, 200]


def test_a_server_that_ignores_range_and_serves_another_object_is_caught_by_the_prefix_checksum(server, data):
    changed = data[:1000] + bytes(1) + data[1001:]  # one byte of the prefix, before the compared overlap
    url = server.put("a.tar", data, validators=False)
    server.fault("a.tar", Fault("drop", at=300_000), Fault("replace", data=changed))
    server.fault("a.tar", standing=Fault("ignore_range"))
    with pytest.raises(ShardReadError, match=r"its first \d+ bytes are not those an earlier attempt handed out"):
        read(url)


def test_a_503_with_retry_after_waits_what_the_server_asks(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", Fault("busy", seconds=1))
    assert read(url) == data  # backoff_seconds=0: only Retry-After makes it wait
    busy, served = server.requests
    assert busy["status"] == 503 and served["time"] - busy["time"] >= 1.0


def test_a_retry_after_beyond_the_deadline_fails_at_once_saying_so(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", Fault("busy", seconds=120))
    with pytest.raises(ShardReadError, match=r"the server asks to wait 120 s, the stall reached data.remote.deadline"):
        read(url)
    assert server.statuses("a.tar") == [503], "no request within the wait it asked for"


def test_a_chunked_body_that_lost_only_its_terminator_ends_where_the_object_ends(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", Fault("no_terminator"))
    assert read(url) == data


def test_backoffs_are_jittered_so_workers_do_not_retry_in_lockstep():
    retry = ReadRetry(backoff_seconds=2.0, max_backoff_seconds=60.0)
    waits = [retry.backoff(3, random.Random(worker)) for worker in range(8)]
    assert all(0.0 <= wait <= 8.0 for wait in waits), "full jitter: below the doubled cap"
    assert len(set(waits)) == 8, "each worker draws its own wait"


def test_a_stall_stops_within_the_deadline_however_the_timeouts_add_up(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", standing=Fault("stall", at=100_000, seconds=60))
    retry = ReadRetry(retries=100, timeout_seconds=1.0, deadline_seconds=3.0, backoff_seconds=0.0)
    start = time.monotonic()
    with pytest.raises(
        ShardReadError,
        match=r"at byte \d+, the stall reached data.remote.deadline_seconds=3 .*attempt 1 at byte 100000: no byte for 1 s",
    ):
        read(url, retry)
    assert time.monotonic() - start < 3.0 * 1.5, "the deadline bounds the stall, not retries x timeout"


def test_a_link_that_drops_every_64_kib_is_a_stall_not_progress(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", standing=Fault("drop", at=64 * 1024))
    retry = ReadRetry(retries=1000, timeout_seconds=5.0, deadline_seconds=2.0, backoff_seconds=0.1)
    with pytest.raises(ShardReadError, match="data.remote.deadline_seconds=2"):
        read(url, retry)


def test_a_stream_that_runs_short_or_long_of_the_index_or_hashes_otherwise_is_an_error(server, data):
    url = server.put("a.tar", data)
    with pytest.raises(ShardReadError, match=f"the object is {MIB} bytes, the index lists {MIB - 10}"):
        read(url, expected=Expected(size=MIB - 10))
    crc = zlib.crc32(data)
    with pytest.raises(ShardReadError, match=f"the index lists {crc ^ 1:08x}"):
        read(url, expected=Expected(size=MIB, crc32=crc ^ 1))
    assert read(url, expected=Expected(size=MIB, crc32=crc)) == data


def test_a_pipe_command_that_sends_a_longer_object_than_the_index_says_is_an_error(tmp_path, data):
    path = tmp_path / "a.tar"
    path.write_bytes(data)
    with pytest.raises(ShardReadError, match=f"runs past the {MIB - 10} bytes the index lists"):
        read(f"pipe:cat {path}", expected=Expected(size=MIB - 10))


def pipe_script(tmp_path, body: str) -> str:
    script = tmp_path / "send.py"
    script.write_text(body)
    return f"pipe:{shlex.quote(sys.executable)} {shlex.quote(str(script))}"


def test_a_reopened_command_whose_prefix_changed_is_an_error_not_a_splice(tmp_path, data):
    (tmp_path / "a.tar").write_bytes(data)
    url = pipe_script(
        tmp_path,
        f"""import os, sys
data = open({str(tmp_path / "a.tar")!r}, "rb").read()
marker = {str(tmp_path / "once")!r}
if not os.path.exists(marker):
    open(marker, "w").close(); sys.stdout.buffer.write(data[:500000]); sys.exit(56)
sys.stdout.buffer.write(data[:1000] + b"X" + data[1001:])  # the same length, one byte else
""",
    )
    with pytest.raises(ShardReadError, match=r"changed between attempts: its first \d+ bytes are not those"):
        read(url)


def test_a_command_that_re_reads_its_prefix_slowly_stops_within_the_deadline(tmp_path, data):
    (tmp_path / "a.tar").write_bytes(data)
    url = pipe_script(
        tmp_path,
        f"""import os, sys, time
data = open({str(tmp_path / "a.tar")!r}, "rb").read()
marker = {str(tmp_path / "once")!r}
if not os.path.exists(marker):
    open(marker, "w").close(); sys.stdout.buffer.write(data[:600000]); sys.stdout.flush(); sys.exit(56)
for at in range(0, len(data), 16384):  # a slow link: each 16 KiB within the timeout, the prefix not
    sys.stdout.buffer.write(data[at:at + 16384]); sys.stdout.flush(); time.sleep(0.1)
""",
    )
    retry = ReadRetry(retries=5, timeout_seconds=1.0, deadline_seconds=2.0, backoff_seconds=0.0)
    start = time.monotonic()
    with pytest.raises(
        ShardReadError,
        match=r"the stall reached data.remote.deadline_seconds=2 .*a pipe: command re-reads the 600000 bytes",
    ):
        read(url, retry)
    assert time.monotonic() - start < 2.0 * 1.5


def test_a_healthy_stretch_after_a_failure_starts_a_new_stall(server):
    big = random.Random(2).randbytes(4 * MIB)
    url = server.put("big.tar", big)
    # a drop every 1.5 MiB: each attempt brings more than a stall's worth of new bytes before it fails
    server.fault("big.tar", *(Fault("drop", at=int(1.5 * MIB) + 64 * 1024) for _ in range(3)))
    assert read(url, ReadRetry(retries=1, timeout_seconds=5.0, deadline_seconds=30.0, backoff_seconds=0.0)) == big


@pytest.mark.parametrize("scheme", ["memory"])
def test_an_object_store_url_goes_through_fsspec_from_its_offset(scheme, data):
    import fsspec

    from prunepipe.pipelines.data.remote_sources import ObjectStore

    fs = fsspec.filesystem(scheme)
    fs.pipe("/bucket/a.tar", data)
    source = ObjectStore(f"{scheme}://bucket/a.tar", 300_000, 5.0)
    try:
        assert source.start == 300_000 and source.version.length == MIB
        assert source.read(1000, 5.0) == data[300_000:301_000], "read from the offset, not the start"
    finally:
        source.close(5.0)
        fs.rm("/bucket/a.tar")


@pytest.fixture
def s3(server):
    """s3:// urls answered by the fault server (path-style, anonymous): s3fs and botocore as on a cluster."""
    import fsspec

    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {"anon": True, "endpoint_url": server.url("").rstrip("/")}
    yield server
    if saved is None:
        fsspec.config.conf.pop("s3", None)
    else:
        fsspec.config.conf["s3"] = saved


BLOCK = OBJECT_BLOCK  # s3fs reads a block per ranged GET: the stall is in the second one


def test_an_s3_url_is_read_by_ranged_gets_through_s3fs(s3):
    pytest.importorskip("s3fs")
    big = random.Random(3).randbytes(BLOCK + MIB)
    s3.put("bucket/a.tar", big)
    s3.fault("bucket/a.tar", Fault("none"), Fault("stall", at=300_000, seconds=60))  # s3fs's retries do not end it
    retry = ReadRetry(retries=3, timeout_seconds=1.0, deadline_seconds=30.0, backoff_seconds=0.0)
    assert read("s3://bucket/a.tar", retry, Expected(size=len(big), crc32=zlib.crc32(big))) == big
    gets = [r["range"] for r in s3.requests if r["status"] == 206]
    first_end = int(gets[0].split("-")[1]) + 1  # what the first GET brought, all handed out before the stall
    assert gets[1].startswith(f"bytes={first_end}-")
    assert gets[2].startswith(f"bytes={first_end - 64 * 1024}-"), "the reopen reads from the offset, not byte 0"


def test_an_s3_object_replaced_between_attempts_is_an_error(s3):
    pytest.importorskip("s3fs")
    big, other = random.Random(3).randbytes(BLOCK + MIB), random.Random(4).randbytes(BLOCK + MIB)
    s3.put("bucket/a.tar", big)
    s3.fault("bucket/a.tar", Fault("none"), Fault("stall", at=300_000, seconds=60), Fault("replace", data=other))
    retry = ReadRetry(retries=3, timeout_seconds=1.0, deadline_seconds=30.0, backoff_seconds=0.0)
    with pytest.raises(ShardReadError, match="changed between attempts"):
        read("s3://bucket/a.tar", retry)


def test_a_shard_read_to_its_end_is_checked_against_the_index_crc_even_past_its_end_blocks(server, tmp_path):
    from prunepipe.pipelines.data.shards import BadInputError, read_shard
    from prunepipe.tools.commands.shards import write_shards

    write_shards("digits", str(tmp_path), size=8, shard_size=50, val_fraction=0.0)
    tar = sorted(p for p in (tmp_path / "train").iterdir() if p.suffix == ".tar")[0]
    data = tar.read_bytes()
    url = server.put("a.tar", data)
    right = Expected(size=len(data), crc32=zlib.crc32(data))
    assert len(list(read_shard(url, retry=QUICK, expected=right))) == 50
    with pytest.raises(BadInputError, match=f"shard {url}: reading ended at byte {len(data)}: the shard's CRC-32"):
        list(read_shard(url, retry=QUICK, expected=Expected(size=len(data), crc32=right.crc32 ^ 1)))


def test_a_trickle_that_never_trips_the_timeout_is_too_slow_and_ends_at_the_deadline(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", standing=Fault("trickle", seconds=0.2))  # a byte every 0.2 s, the timeout 1 s
    retry = ReadRetry(retries=100, timeout_seconds=1.0, deadline_seconds=3.0, backoff_seconds=0.0)
    start = time.monotonic()
    with pytest.raises(
        ShardReadError, match=r"the stall reached data.remote.deadline_seconds=3 .*too slow: \d+ bytes in"
    ):
        read(url, retry)
    assert time.monotonic() - start < 3.0 * 1.5


def test_a_body_of_no_stated_length_that_ends_early_is_resumed_not_taken_for_the_whole(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", Fault("no_length", at=300_000))  # closes as a whole body would: no sign of the cut
    assert read(url) == data
    assert server.statuses("a.tar") == [200, 206], "a ranged request asked whether the object ended there"


def test_a_body_of_no_stated_length_is_taken_whole_once_the_store_says_it_ends_there(server, data):
    url = server.put("a.tar", data)
    server.fault("a.tar", Fault("no_length", at=len(data)))
    assert read(url) == data
    assert server.statuses("a.tar") == [200, 206], "the check read the overlap and then the end"


def test_a_server_that_caps_each_range_answer_is_read_whole_without_failures(server):
    big = random.Random(5).randbytes(3 * MIB)
    url = server.put("big.tar", big, cap=256 * 1024)
    server.fault("big.tar", Fault("drop", at=100_000))
    retry = ReadRetry(retries=1, timeout_seconds=5.0, deadline_seconds=30.0, backoff_seconds=0.0)
    assert read(url, retry) == big, "each capped answer's end asks for the rest, none counted as a failure"


def test_a_reopen_asks_where_the_first_answer_came_from_not_the_redirector(server, data, other):
    server.put("mirror-1/a.tar", data)
    server.put("mirror-2/a.tar", other)  # the redirector sends a later request elsewhere
    server.put("a.tar", b"")
    server.fault(
        "a.tar",
        Fault("redirect", data=server.url("mirror-1/a.tar").encode()),
        standing=Fault("redirect", data=server.url("mirror-2/a.tar").encode()),
    )
    server.fault("mirror-1/a.tar", Fault("drop", at=300_000))
    assert read(server.url("a.tar")) == data
    assert server.statuses("mirror-1/a.tar") == [200, 206] and server.statuses("mirror-2/a.tar") == []


def test_a_url_no_try_can_mend_is_not_retried():
    with pytest.raises(ShardReadError, match="not retried"):
        read("http://127.0.0.1:notaport/a.tar")


def test_retry_after_gets_the_jitter_on_top_so_workers_that_met_one_503_spread_out():
    from prunepipe.pipelines.data.remote import RetryingStream
    from prunepipe.pipelines.data.remote_sources import Failed

    waits = []
    for worker in range(8):
        stream = RetryingStream("http://127.0.0.1:1/a.tar", ReadRetry(backoff_seconds=2.0), draw=random.Random(worker))
        slept = []
        stream._sleep = slept.append
        stream._failed(Failed("HTTP 503", retry_after=2.0), time.monotonic())
        waits += slept
    assert all(wait >= 2.0 for wait in waits) and len(set(waits)) == 8


def test_an_https_stall_stops_at_the_deadline_tls_sockets_included(tmp_path, data, monkeypatch):
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )
    monkeypatch.setattr(ssl, "_create_default_https_context", lambda: ssl.create_default_context(cafile=cert))
    with FaultServer(tls=(cert, key)) as server:
        url = server.put("a.tar", data)
        assert url.startswith("https://")
        server.fault("a.tar", standing=Fault("stall", at=100_000, seconds=60))
        retry = ReadRetry(retries=5, timeout_seconds=30.0, deadline_seconds=2.0, backoff_seconds=0.0)
        start = time.monotonic()
        with pytest.raises(ShardReadError, match="data.remote.deadline_seconds=2"):
            read(url, retry)
        assert time.monotonic() - start < 2.0 * 1.5, "the TLS socket is the one given the waits"
