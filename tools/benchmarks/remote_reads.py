"""`prunepipe bench remote`: what the retrying reader of `pipe:` shards costs and what it survives,
side by side in one run on the same shards.

1. Throughput: every member of every shard read through `pipe:cat SHARD`, by webdataset's gopen and
   by the retrying stream (pipelines/data/remote.py), interleaved rounds, the median of each.
2. A command that dies half-way through each shard once (curl's exit 56): the retrying stream gives
   the same samples, byte for byte; the time beside a clean read.
3. Stalls of every kind (a hung command, a command whose reopen re-reads its prefix slowly, an http
   connection that stalls after each reopen, a link that drops every 64 KiB, a server that ignores
   Range and stalls re-sending): when each read stopped against data.remote.deadline_seconds.
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


SLOW_PREFIX = """\
import os, sys, time
data, marker = open(sys.argv[1], "rb").read(), sys.argv[2]
if not os.path.exists(marker):  # the first run dies past the middle, the next ones crawl from byte 0
    open(marker, "w").close()
    sys.stdout.buffer.write(data[: len(data) * 3 // 4])
    sys.exit(56)
for at in range(0, len(data), 2048):  # 20 kB/s: no timeout fires, the prefix takes many seconds
    sys.stdout.buffer.write(data[at : at + 2048]); sys.stdout.flush(); time.sleep(0.1)
"""


def stalls(path: str, work: str, deadline: float) -> list[dict]:
    """Each stall case against data.remote.deadline_seconds: when the read stopped, and its message."""
    from prunepipe.tools.fixtures.fault_server import Fault, FaultServer

    data = open(path, "rb").read()
    slow = os.path.join(work, "slow_prefix.py")
    with open(slow, "w") as f:
        f.write(SLOW_PREFIX)
    many = ReadRetry(retries=1000, timeout_seconds=1.0, deadline_seconds=deadline, backoff_seconds=0.1)
    cases = []
    with FaultServer() as server:
        plans = {
            "pipe: command hangs after 20,000 bytes": (f"pipe:head -c 20000 {shlex.quote(path)}; sleep 600", None),
            "pipe: reopen re-reads its prefix slowly": (
                "pipe:" + " ".join(map(shlex.quote, (sys.executable, slow, path, f"{path}.slow-once"))),
                None,
            ),
            "http: connection stalls after each reopen's first 100 kB": (
                "stall",
                Fault("stall", at=100_000, seconds=600),
            ),
            "http: link drops every 64 KiB": ("drops", Fault("drop", at=64 * 1024)),
            "http: server ignores Range, stalls re-sending": ("ignores", None),
        }
        server.put("ignores", data, ranges=False)
        server.fault(
            "ignores", Fault("drop", at=len(data) * 3 // 4), standing=Fault("stall", at=len(data) // 2, seconds=600)
        )
        for name, (url, standing) in plans.items():
            if not url.startswith("pipe:"):
                if standing is not None:
                    server.put(url, data)
                    server.fault(url, standing=standing)
                url = server.url(url)
            start = time.perf_counter()
            try:
                samples_of(url, many)
                message = "(no error)"
            except BadInputError as e:
                message = str(e)
            cases.append({"case": name, "seconds": time.perf_counter() - start, "message": message})
    return cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=8, help="digits shards of --per-shard samples")
    parser.add_argument("--per-shard", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved throughput rounds (median)")
    parser.add_argument("--deadline", type=float, default=4.0, help="data.remote.deadline_seconds of the stall cases")


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
        print(f"stalls against data.remote.deadline_seconds={args.deadline:g} (timeout 1 s, 1000 retries):")
        for case in stalls(paths[0], work, args.deadline):
            reason = case["message"].split("reading failed at byte")[-1][:110]
            print(
                f"  {case['case']:55s} stopped after {case['seconds']:5.2f} s = {case['seconds'] / args.deadline:.2f} "
                f"of the deadline: ...at byte{reason}..."
            )
    return 0
