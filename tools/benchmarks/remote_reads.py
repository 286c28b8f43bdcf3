"""`prunepipe bench remote`: what the retrying reader of `pipe:` shards costs and what it survives,
side by side in one run on the same shards.

1. Throughput: every member of every shard read through `pipe:cat SHARD`, by webdataset's gopen and
   by the retrying stream (pipelines/data/remote.py), interleaved rounds, the median of each.
2. A command that dies half-way through each shard once (curl's exit 56): the retrying stream gives
   the same samples, byte for byte; the time beside a clean read.
3. A command that hangs after its first bytes: when the timeout fires, and the message.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import statistics
import sys
import tempfile
import time

import webdataset as wds

from prunepipe.pipelines.data.remote import ReadRetry, open_retrying
from prunepipe.pipelines.data.shards import BadInputError, ShardIndex, read_shard
from prunepipe.pipelines.data.tar_reader import TarMembers

# A transfer command that dies half-way through its shard the first time it runs for it (curl's exit
# 56 and its message, as a connection reset gives them), and streams all of it after that.
FLAKY = """\
import os, sys
tar, marker = sys.argv[1], sys.argv[2]
data = open(tar, "rb").read()
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.stdout.buffer.write(data[:len(data) // 2])
    sys.stdout.flush()
    print("curl: (56) Recv failure: Connection reset by peer", file=sys.stderr)
    sys.exit(56)
sys.stdout.buffer.write(data)
"""


def read_all(stream) -> int:
    """Bytes of every member of one tar stream."""
    members, total = TarMembers(stream), 0
    for _ in members.members():
        total += len(members.read())
    stream.close()
    return total


def throughput(urls: list[str], rounds: int) -> dict:
    openers = {
        "webdataset gopen": lambda url: wds.gopen(url, "rb"),
        "retrying stream": lambda url: open_retrying(url, ReadRetry()),
    }
    times: dict[str, list[float]] = {name: [] for name in openers}
    size = 0
    for _ in range(rounds):
        for name, opener in openers.items():
            start = time.perf_counter()
            size = sum(read_all(opener(url)) for url in urls)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "megabytes": size / 1e6,
        "seconds": medians,
        "ratio": medians["retrying stream"] / medians["webdataset gopen"],
    }


def samples_of(url: str, retry: ReadRetry) -> list[tuple]:
    return [tuple(sorted((k, v) for k, v in s.items() if k != "__url__")) for _, s in read_shard(url, retry=retry)]


def flaky(paths: list[str], work: str) -> dict:
    script = os.path.join(work, "flaky.py")
    with open(script, "w") as f:
        f.write(FLAKY)
    retry = ReadRetry(backoff_seconds=0.0)
    start = time.perf_counter()
    clean = [samples_of(f"pipe:cat {shlex.quote(p)}", retry) for p in paths]
    clean_s = time.perf_counter() - start
    start = time.perf_counter()
    resumed = [
        samples_of("pipe:" + " ".join(map(shlex.quote, (sys.executable, script, p, f"{p}.failed-once"))), retry)
        for p in paths
    ]
    flaky_s = time.perf_counter() - start
    return {
        "shards": len(paths),
        "identical": resumed == clean,
        "clean_seconds": clean_s,
        "flaky_seconds": flaky_s,
        "failed_once": sum(os.path.exists(f"{p}.failed-once") for p in paths),
    }


def hanging(path: str, timeout: float) -> dict:
    retry = ReadRetry(retries=1, timeout_seconds=timeout, backoff_seconds=0.0)
    start = time.perf_counter()
    try:
        samples_of(f"pipe:head -c 20000 {shlex.quote(path)}; sleep 600", retry)
        message = "(no error)"
    except BadInputError as e:
        message = str(e)
    return {"seconds": time.perf_counter() - start, "bound": retry.worst_case_seconds(), "message": message}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=8, help="digits shards of --per-shard samples")
    parser.add_argument("--per-shard", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved throughput rounds (median)")
    parser.add_argument("--timeout", type=float, default=2.0, help="data.remote.timeout_seconds of the hang")


def run_from_args(args) -> int:
    from prunepipe.tools.commands.shards import write_shards

    logging.getLogger("prunepipe.pipelines.data.remote").setLevel(logging.ERROR)  # each planned failure would warn
    with tempfile.TemporaryDirectory() as work:
        train = write_shards("digits", work, size=32, shard_size=args.per_shard, val_fraction=0.0)["train"]
        paths = list(ShardIndex.load(train).urls)[: args.shards]
        rate = throughput([f"pipe:cat {shlex.quote(p)}" for p in paths], args.rounds)
        print(f"throughput, {len(paths)} shards, {rate['megabytes']:.1f} MB through pipe:cat, median of {args.rounds}:")
        for name, seconds in rate["seconds"].items():
            print(f"  {name:18s} {seconds * 1e3:8.1f} ms  {rate['megabytes'] / seconds:7.1f} MB/s")
        print(f"  retrying / gopen time: {rate['ratio']:.2f}")
        result = flaky(paths, work)
        print(
            f"a command dying half-way through each shard once: {result['failed_once']} of {result['shards']} "
            f"failed once; samples identical to a clean read: {result['identical']}; "
            f"{result['flaky_seconds']:.2f} s against {result['clean_seconds']:.2f} s clean"
        )
        hang = hanging(paths[0], args.timeout)
        print(
            f"a hanging command (timeout {args.timeout:g} s, 1 retry): stopped after {hang['seconds']:.2f} s "
            f"(bound {hang['bound']:.1f} s): {hang['message']}"
        )
    return 0
