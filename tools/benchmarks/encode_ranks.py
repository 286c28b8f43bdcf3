"""`prunepipe bench encode`: `latents encode` on one process and on two torchrun ranks, side by side in
one run on the same shards and VAE, and a SIGKILLed encode's rerun: how many shards it redid.

The arms, each a fresh `prunepipe latents encode` command (process start and imports included):
one process on one thread, one process on every core (torch's intra-op threads), two ranks of one
thread each. Rounds alternate the arms; the medians are printed with their ratios. The VAE is a
randomly initialised AutoencoderKL of SD's layout at reduced width: the work per image, not the
weights, is what is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from prunepipe.tools.benchmarks.rehearse_cluster import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def make_vae(folder: str, width: int) -> None:
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(width, 2 * width, 2 * width),
        latent_channels=4,
        norm_num_groups=width // 4,
        sample_size=64,
    ).save_pretrained(folder)


def encode_command(images: str, vae: str, out: str, ranks: int) -> list[str]:
    launch = [sys.executable]
    if ranks > 1:
        launch += [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ranks}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
        ]
    return [
        *launch,
        "-m",
        "prunepipe.launch.cli",
        "latents",
        "encode",
        images,
        "--vae",
        vae,
        "--out",
        out,
        "--batch-size",
        "32",
    ]


def timed(command: list[str], threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError((result.stdout + result.stderr)[-3000:])
    return time.perf_counter() - start


def killed_and_rerun(images: str, vae: str, out: str, kill_after: int) -> dict:
    """Kill a one-process encode once `kill_after` shards are sealed; rerun it; what the rerun redid."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = encode_command(images, vae, out, 1)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def sealed() -> list[str]:
        return sorted(f for f in os.listdir(out) if f.endswith("_stats.json")) if os.path.isdir(out) else []

    while len(sealed()) < kill_after and process.poll() is None:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = sealed()
    stamps = {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in before}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    kept = sum(os.stat(os.path.join(out, name)).st_mtime_ns == stamp for name, stamp in stamps.items())
    return {
        "sealed_when_killed": len(before),
        "redone": result.stdout.count("sealed ("),
        "seals_untouched": kept,
        "rerun_seconds": seconds,
        "index": os.path.exists(os.path.join(out, "index.json")),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=8, help="digits shards of --per-shard images at --size px")
    parser.add_argument("--per-shard", type=int, default=200)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--width", type=int, default=32, help="the VAE's first block width")
    parser.add_argument("--rounds", type=int, default=3)


def run_from_args(args) -> int:
    from prunepipe.tools.commands.shards import write_shards

    with tempfile.TemporaryDirectory() as work:
        write_shards(
            "digits",
            work,
            size=args.size,
            shard_size=args.per_shard,
            val_fraction=1 - args.shards * args.per_shard / 1797 - 1e-9,
        )
        images = os.path.join(work, "train")
        count = json.load(open(os.path.join(images, "index.json")))["shards"]
        vae = os.path.join(work, "vae")
        make_vae(vae, args.width)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        arms = {
            "1 process, 1 thread": (1, 1),
            f"1 process, {cores} threads": (1, cores),
            "2 ranks, 1 thread each": (2, 1),
        }
        times: dict[str, list[float]] = {name: [] for name in arms}
        for round_ in range(args.rounds):
            for name, (ranks, threads) in arms.items():
                out = os.path.join(work, f"out-{round_}-{ranks}-{threads}")
                times[name].append(timed(encode_command(images, vae, out, ranks), threads))
        samples = sum(shard["num_samples"] for shard in count)
        print(
            f"latents encode of {samples} images at {args.size} px in {len(count)} shards, median of {args.rounds} "
            f"(process start and imports included):"
        )
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["1 process, 1 thread"]
        for name, seconds in medians.items():
            print(f"  {name:24s} {seconds:6.1f} s  {samples / seconds:6.1f} img/s  x{base / seconds:.2f}")
        rerun = killed_and_rerun(images, vae, os.path.join(work, "killed"), kill_after=len(count) // 2)
        print(
            f"SIGKILL once {rerun['sealed_when_killed']} of {len(count)} shards were sealed: the rerun encoded "
            f"{rerun['redone']} shard(s), left {rerun['seals_untouched']} seal(s) untouched, took "
            f"{rerun['rerun_seconds']:.1f} s and wrote the index: {rerun['index']}"
        )
    return 0
