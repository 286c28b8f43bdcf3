"""Remote shards as a specification: a `pipe:` command or http(s) url whose read fails is reopened at
the byte reached, so a run over flaky shards trains to the same weights as one over clean files; a
read that keeps failing or hangs stops within its budget with the url, offset, exit status and the
command's stderr; and a run under data.on_bad_sample=skip stops once it has lost more samples than
data.max_bad_samples."""

from __future__ import annotations

import os
import re
import shlex
import sys
import time

import pytest
from eval_runs import digit_shards

from prunepipe.pipelines.checkpoint.store import latest_checkpoint, load_checkpoint_states
from prunepipe.pipelines.config import ConfigError, check_data, load_config
from prunepipe.pipelines.data.remote import ReadRetry
from prunepipe.pipelines.data.shards import BadInputError, ShardIndex, read_shard
from prunepipe.tools.benchmarks.remote_reads import FLAKY  # a transfer command that dies half-way through a shard once
from prunepipe.tools.fixtures.fault_server import Fault, FaultServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "mae_tiny_full.yaml")
TINY_MAE = [
    "mae.embed_dim=32",
    "mae.depth=1",
    "mae.num_heads=2",
    "mae.decoder_embed_dim=32",
    "mae.decoder_depth=1",
    "mae.decoder_num_heads=2",
    "data.val=",
    "data.shuffle_buffer=16",
]
QUICK = ReadRetry(retries=2, timeout_seconds=5.0, backoff_seconds=0.0)


@pytest.fixture(scope="module")
def local_shards(digits_shards, tmp_path_factory) -> str:
    """Three local shards of 48 digits."""
    return digit_shards(digits_shards, tmp_path_factory.mktemp("local"), shards=3, per_shard=48)


def pipe_index(local: str, folder, command) -> str:
    """index.json in `folder` naming each shard of `local` as `pipe:` + command(tar path)."""
    index = ShardIndex.load(local)
    os.makedirs(folder, exist_ok=True)
    ShardIndex.write(
        str(folder), [(f"pipe:{command(url)}", int(count)) for url, count in zip(index.urls, index.counts)]
    )
    return str(folder)


def keys_of(url: str, retry: ReadRetry = QUICK) -> list[str]:
    return [sample["__key__"] for _, sample in read_shard(url, retry=retry)]


def test_a_command_that_dies_mid_stream_once_per_shard_trains_to_the_same_weights(local_shards, tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    markers = tmp_path / "failed"
    markers.mkdir()
    flaky = pipe_index(
        local_shards,
        tmp_path / "flaky",
        lambda url: " ".join(
            map(shlex.quote, (sys.executable, str(script), url, str(markers / os.path.basename(url))))
        ),
    )
    common = [
        f"runs_dir={tmp_path}",
        "num_passes=2",
        "data.batch_size=16",
        "data.num_workers=1",
        "data.remote.backoff_seconds=0",
        "checkpoint.every_steps=1000",
        *TINY_MAE,
    ]
    from prunepipe.pipelines.training.loop import train

    train(load_config(CONFIG, [*common, "name=clean", f"data.train={local_shards}"]))
    train(load_config(CONFIG, [*common, "name=flaky", f"data.train={flaky}"]))
    assert len(os.listdir(markers)) == 3, "every shard's command failed once"
    clean = load_checkpoint_states(latest_checkpoint(str(tmp_path / "clean")))["model"]
    resumed = load_checkpoint_states(latest_checkpoint(str(tmp_path / "flaky")))["model"]
    assert clean.keys() == resumed.keys()
    for name in clean:
        assert clean[name].equal(resumed[name]), f"{name} differs after the reads resumed"


def http_index(local: str, folder, server: FaultServer) -> str:
    """index.json in `folder` naming each shard of `local` as served by `server` (the same name)."""
    index = ShardIndex.load(local)
    for url in index.urls:
        server.put(os.path.basename(url), open(url, "rb").read())
    os.makedirs(folder, exist_ok=True)
    ShardIndex.write(str(folder), [(server.url(os.path.basename(u)), int(c)) for u, c in zip(index.urls, index.counts)])
    return str(folder)


def test_training_over_a_lying_store_reads_the_same_samples_or_stops_naming_url_offset_and_cause(
    local_shards, tmp_path
):
    common = [
        f"runs_dir={tmp_path}",
        "num_passes=1",
        "data.batch_size=16",
        "data.num_workers=1",
        "data.remote.backoff_seconds=0",
        "checkpoint.every_steps=1000",
        *TINY_MAE,
    ]
    from prunepipe.pipelines.training.loop import train

    train(load_config(CONFIG, [*common, "name=clean", f"data.train={local_shards}"]))
    clean = load_checkpoint_states(latest_checkpoint(str(tmp_path / "clean")))["model"]
    names = [os.path.basename(url) for url in ShardIndex.load(local_shards).urls]
    with FaultServer() as server:
        served = http_index(local_shards, tmp_path / "http", server)
        half = len(open(ShardIndex.load(local_shards).urls[0], "rb").read()) // 2
        server.fault(names[0], Fault("drop", at=half), Fault("lie_range"))  # answers bytes 0- to a ranged request
        server.fault(names[1], Fault("busy", seconds=0), Fault("drop", at=half), Fault("ignore_range"))
        server.fault(names[2], Fault("no_terminator"))
        train(load_config(CONFIG, [*common, "name=lying", f"data.train={served}"]))
        lying = load_checkpoint_states(latest_checkpoint(str(tmp_path / "lying")))["model"]
        assert all(clean[k].equal(lying[k]) for k in clean), "every sample was read as the local file holds it"

        other = open(ShardIndex.load(local_shards).urls[2], "rb").read()
        server.fault(names[1], Fault("drop", at=half), Fault("replace", data=other))  # replaced mid-read
        with pytest.raises(BadInputError) as caught:
            train(load_config(CONFIG, [*common, "name=replaced", f"data.train={served}"]))
    message = str(caught.value)
    assert server.url(names[1]) in message and f"at byte {half}" in message
    assert "the object changed between attempts" in message and "the store now serves" in message


def test_a_command_that_always_fails_stops_naming_url_offset_status_and_stderr(local_shards, tmp_path):
    url = ShardIndex.load(local_shards).urls[0]
    command = (
        f"pipe:head -c 5000 {shlex.quote(url)}; echo 'curl: (56) Recv failure: Connection reset by peer' >&2; exit 56"
    )
    with pytest.raises(BadInputError) as caught:
        keys_of(command)
    message = str(caught.value)
    assert command in message
    assert "exited with status 56" in message and "Connection reset by peer" in message
    assert len(re.findall(r"attempt \d+ at byte", message)) == 3, "the first read and its 2 retries, each reported"
    assert "gave up after 3 attempt(s) in this stall (data.remote.retries=2)" in message
    assert "at byte 5000" in message, "the offset the reads reached"
    assert "corrupt" not in message, "a network fault is not reported as bad data"


def test_a_hanging_command_stops_within_its_timeout(local_shards):
    url = ShardIndex.load(local_shards).urls[0]
    retry = ReadRetry(retries=1, timeout_seconds=1.0, backoff_seconds=0.0)
    start = time.monotonic()
    with pytest.raises(BadInputError, match=r"no byte for 1 s: the command hangs") as caught:
        keys_of(f"pipe:head -c 5000 {shlex.quote(url)}; sleep 120", retry)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"{elapsed:.1f} s: the timeout did not fire"
    assert len(re.findall(r"attempt \d+ at byte 5000: no byte for 1 s", str(caught.value))) == 2, "each timed out"


def test_a_reader_with_descriptors_past_select_s_limit_still_reads(local_shards):
    # a rank of a large gloo or NCCL job holds more than 1024 descriptors; select() cannot watch them
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard descriptor limit {hard} leaves no room past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        url = ShardIndex.load(local_shards).urls[0]
        assert keys_of(f"pipe:cat {shlex.quote(url)}") == keys_of(url)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_reader_that_stops_early_does_not_wait_for_the_command(local_shards):
    url = ShardIndex.load(local_shards).urls[0]
    start = time.monotonic()
    for position, sample in read_shard(f"pipe:cat {shlex.quote(url)}; sleep 120", retry=QUICK):
        break  # the rest of the shard is another reader's
    assert time.monotonic() - start < 30, "closing the shard stopped its command"


def test_a_command_that_ends_short_of_an_earlier_read_is_not_retried(local_shards, tmp_path):
    url = ShardIndex.load(local_shards).urls[0]
    marker = tmp_path / "second"
    # the first run dies after 8000 bytes, the next ones send a shorter (changed) object
    command = (
        f"pipe:if [ -e {marker} ]; then head -c 1000 {shlex.quote(url)}; "
        f"else touch {marker}; head -c 8000 {shlex.quote(url)}; exit 7; fi"
    )
    with pytest.raises(BadInputError, match="changed between attempts") as caught:
        keys_of(command)
    assert len(re.findall(r"attempt \d+ at byte", str(caught.value))) == 2, "no retry can read a shard that changed"


def test_an_http_shard_whose_connection_drops_resumes_with_a_range_request(local_shards):
    index = ShardIndex.load(local_shards)
    with FaultServer() as server:
        for url in index.urls:
            name = os.path.basename(url)
            data = open(url, "rb").read()
            server.put(name, data)
            server.fault(name, Fault("drop", at=len(data) // 2))  # the first connection, half-way through
            assert keys_of(server.url(name)) == keys_of(url)
            assert server.statuses(name) == [200, 206], "resumed by a Range request"


def test_skipping_stops_once_more_samples_are_lost_than_the_budget(digits_shards, tmp_path):
    broken = digit_shards(
        digits_shards, tmp_path / "broken", shards=2, per_shard=48, broken=lambda shard, position: position % 8 == 0
    )  # 6 bad samples a shard
    from prunepipe.pipelines.training.loop import train

    common = [
        f"runs_dir={tmp_path}",
        f"data.train={broken}",
        "num_passes=1",
        "data.batch_size=16",
        "data.num_workers=0",
        "data.on_bad_sample=skip",
        *TINY_MAE,
    ]
    train(load_config(CONFIG, [*common, "name=within", "data.max_bad_samples=12"]))
    with pytest.raises(
        BadInputError, match=r"more than data.max_bad_samples=5; the latest: shard .* key .*cannot decode"
    ):
        train(load_config(CONFIG, [*common, "name=beyond", "data.max_bad_samples=5"]))


def test_a_retry_budget_longer_than_the_collective_timeout_is_refused_for_remote_shards(local_shards, tmp_path):
    remote = pipe_index(local_shards, tmp_path / "remote", lambda url: f"cat {shlex.quote(url)}")
    with pytest.raises(
        ConfigError,
        match=r"data.remote.deadline_seconds=600 lets one shard read stall that long, not less than "
        r"dist_timeout_seconds=400",
    ):
        check_data(load_config(CONFIG, [f"data.train={remote}", "data.val=", "dist_timeout_seconds=400"]))
    check_data(
        load_config(
            CONFIG,
            [f"data.train={remote}", "data.val=", "dist_timeout_seconds=400", "data.remote.deadline_seconds=300"],
        )
    )
    local = load_config(CONFIG, [f"data.train={local_shards}", "data.val=", "dist_timeout_seconds=400"])
    check_data(local)  # nothing retried
