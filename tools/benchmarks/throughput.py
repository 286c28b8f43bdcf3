"""Benchmark: the project's training loop against a bare loop, same model, batch and device, in one run.

The bare loop is written as the MAE and diffusers example scripts write theirs: the training images
decoded once into memory, batches cut from a torch.randperm, masks and noise from torch's global RNG,
AdamW, grad clipping and an EMA. The project loop is `train(cfg)` as users run it: shards read and
decoded by loader workers, per-sample randomness, the pruner fed every step, checkpoints (none due
in the timed passes). Both get the same optimizer, EMA, mixed precision and `cuda:` switches, so the
ratio is the cost of the machinery. Repeats alternate the two loops, so that other load on the
machine falls on both; each repeat's ratio pairs neighbouring runs, and the median of those ratios is
reported beside the median samples/s of each loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from diffusers.training_utils import EMAModel

from prunepipe.pipelines.config import RunConfig, load_config
from prunepipe.pipelines.data.splits import read_split
from prunepipe.pipelines.data.workers import loader_workers
from prunepipe.pipelines.report.runs import read_metrics
from prunepipe.pipelines.tasks.build import build_task
from prunepipe.pipelines.tasks.randomness import GeneratorDraws
from prunepipe.pipelines.training.device import build_optimizer, mixed_precision, place_model, set_backend_flags
from prunepipe.pipelines.training.loop import train

CONFIGS = {
    "mae": "configs/mae_tiny_full.yaml",
    "ldm": "configs/ldm_tiny_full.yaml",
    "dit": "configs/ldm_dit_tiny_full.yaml",
}
LATENTS_4x32x32 = ["ldm.space=latents", "ldm.in_channels=4", "ldm.sample_size=32", "data.resolution=32"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


@dataclass
class Figures:
    task: str
    device: str
    batch_size: int
    threads: int  # torch's intra-op threads, in both loops
    workers: int  # the project loop's loader workers
    steps: int  # timed steps of each loop, per repeat
    project: list[float]  # samples/s per repeat
    bare: list[float]

    def row(self) -> dict:
        project, bare = statistics.median(self.project), statistics.median(self.bare)
        ratios = [b / p for p, b in zip(self.project, self.bare)]
        return {
            "task": self.task,
            "device": self.device,
            "batch_size": self.batch_size,
            "threads": self.threads,
            "loader_workers": self.workers,
            "steps": self.steps,
            "project_samples_per_s": round(project, 1),
            "bare_samples_per_s": round(bare, 1),
            "project_ms_per_step": round(1000 * self.batch_size / project, 2),
            "bare_ms_per_step": round(1000 * self.batch_size / bare, 2),
            "ratio_project_over_bare_time": round(statistics.median(ratios), 3),
            "ratio_per_repeat": [round(r, 3) for r in ratios],
            "project_repeats": [round(v, 1) for v in self.project],
            "bare_repeats": [round(v, 1) for v in self.bare],
        }


# ----------------------------------------------------------------------------- the project loop
def project_samples_per_second(cfg: RunConfig) -> tuple[float, int]:
    """(samples/s, steps) of `train(cfg)` over its passes after the first (the first warms up)."""
    train(cfg)
    passes = [r for r in read_metrics(os.path.join(cfg.run_dir, "metrics.jsonl")) if r["kind"] == "pass"]
    timed = passes[1:]
    seconds = sum(b["wall_seconds"] - a["wall_seconds"] for a, b in zip(passes, timed))
    samples = timed[-1]["samples_forwarded"] - passes[0]["samples_forwarded"]
    steps = timed[-1]["optimizer_steps"] - passes[0]["optimizer_steps"]
    return samples / seconds, steps


# ----------------------------------------------------------------------------- the bare loop
class InMemoryBatch:
    """What the task's loss reads of a batch."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels


def bare_samples_per_second(
    cfg: RunConfig, images: torch.Tensor, labels: torch.Tensor, device: torch.device, steps: int, warmup: int
) -> float:
    """Samples/s of the example-script loop over `steps` steps after `warmup` ones."""
    torch.manual_seed(cfg.seed)
    task = build_task(cfg)
    set_backend_flags(cfg, device)
    model = place_model(cfg, task.model, device)
    optimizer = build_optimizer(cfg, model, device)
    ema = EMAModel(model.parameters(), decay=cfg.ema_decay, use_ema_warmup=True)
    ema.to(device)
    precision = mixed_precision(cfg)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
        if precision != "no"
        else nullcontext()
    )
    if device.type == "cuda":
        images, labels = images.pin_memory(), labels.pin_memory()
    generator = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
    batch_size = cfg.data.batch_size
    start, done = 0.0, 0
    for step, index in zip(range(warmup + steps), shuffled_batches(len(images), batch_size)):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        batch = InMemoryBatch(images[index].to(device, non_blocking=True), labels[index].to(device, non_blocking=True))
        with autocast:
            loss = task.per_sample(model, batch, GeneratorDraws(generator, batch_size)).loss.float().mean()
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.step(model.parameters())
        done += step >= warmup
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return done * batch_size / (time.perf_counter() - start)


def shuffled_batches(count: int, batch_size: int):
    """Index batches of torch.randperm epochs, the last short batch dropped, without end."""
    while True:
        yield from torch.randperm(count)[: count - count % batch_size].split(batch_size)


def decoded_train_set(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Every training image decoded once, as the example scripts hold their data."""
    batches = list(
        read_split(
            cfg.data.train,
            resolution=cfg.data.resolution,
            channels=cfg.data.channels,
            batch_size=256,
            desc="decoding for the bare loop",
        )
    )
    return torch.cat([b.images for b in batches]), torch.cat([b.labels for b in batches])


# ----------------------------------------------------------------------------- data for a size
def ensure_data(task: str, size: str, data: str | None, scratch: str) -> str:
    """The train shards to read: `data`, or digits written under `scratch` (at 224 px for MAE at the
    GPU size), or for ldm at the GPU size random 4x32x32 latents standing in for encoded images."""
    if data:
        return data
    if task in ("ldm", "dit") and size == "gpu":
        from prunepipe.tools.benchmarks.latent_shards import write_random_latents

        return write_random_latents(os.path.join(scratch, "latents"), count=2048, shape=(4, 32, 32))
    from prunepipe.tools.commands.shards import write_shards

    pixels = 224 if size == "gpu" else 32
    folder = os.path.join(scratch, f"digits{pixels}")
    if not os.path.exists(os.path.join(folder, "train", "index.json")):
        write_shards("digits", folder, size=pixels)
    return os.path.join(folder, "train")


SIZES = {
    # what CI and a laptop can run: the tiny configs as they are
    "tiny": {"mae": [], "ldm": [], "dit": []},
    # MAE ViT-B/16 at 224 px, the latent-diffusion UNet of configs/ldm_base.yaml and DiT-B/2 (flow,
    # unconditional) on 4x32x32 latents
    "gpu": {
        "mae": ["mae.preset=vit_base", "data.resolution=224", "mae.norm_pix_loss=true"],
        "dit": [
            *LATENTS_4x32x32,
            "ldm.dit.preset=DiT-B/2",
            "ldm.dit.depth=0",
            "ldm.dit.width=0",
            "ldm.dit.heads=0",
            "ldm.num_classes=0",
            "optim.lr=1e-4",
        ],
        "ldm": [
            *LATENTS_4x32x32,
            "ldm.unet.block_out_channels=[128,256,512,512]",
            "ldm.unet.layers_per_block=2",
            "ldm.unet.norm_num_groups=32",
            "ldm.unet.down_block_types=[DownBlock2D,AttnDownBlock2D,AttnDownBlock2D,DownBlock2D]",
            "ldm.unet.up_block_types=[UpBlock2D,AttnUpBlock2D,AttnUpBlock2D,UpBlock2D]",
        ],
    },
    # every code path at the smallest size, for a test of the GPU script on a CPU
    "smoke": {
        "mae": [
            "mae.embed_dim=32",
            "mae.depth=1",
            "mae.num_heads=2",
            "mae.decoder_embed_dim=32",
            "mae.decoder_depth=1",
            "mae.decoder_num_heads=2",
        ],
        "ldm": ["ldm.unet.block_out_channels=[16,32]", "data.resolution=16"],
        "dit": ["ldm.dit.depth=1"],
    },
}


def bench_config(
    task: str, size: str, train_dir: str, runs_dir: str, name: str, passes: int, overrides: list[str]
) -> RunConfig:
    return load_config(
        os.path.join(ROOT, CONFIGS[task]),
        [
            f"data.train={train_dir}",
            "data.val=",
            f"runs_dir={runs_dir}",
            f"name={name}",
            f"num_passes={passes}",
            "checkpoint.every_steps=1000000",
            "log_every=1000000",
            "data.num_workers=auto",
            *SIZES[size][task],
            *overrides,
        ],
    )


def run_bench(
    tasks: list[str],
    *,
    size: str = "tiny",
    passes: int = 3,
    repeats: int = 3,
    data: str | None = None,
    overrides: list[str] = (),
    scratch: str | None = None,
    say=print,
) -> list[dict]:
    """One row per task: samples/s of each loop (median of `repeats`) and their ratio."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = scratch or tmp
        for task in tasks:
            train_dir = ensure_data(task, size, data if len(tasks) == 1 else None, scratch)
            cfg = bench_config(task, size, train_dir, os.path.join(tmp, "runs"), f"{task}_0", passes, list(overrides))
            images, labels = decoded_train_set(cfg)
            workers = loader_workers(cfg.data.num_workers, device_type=device.type)
            figures = Figures(task, str(device), cfg.data.batch_size, torch.get_num_threads(), workers, 0, [], [])
            for r in range(repeats):
                cfg = bench_config(
                    task, size, train_dir, os.path.join(tmp, "runs"), f"{task}_{r}", passes, list(overrides)
                )
                rate, steps = project_samples_per_second(cfg)
                figures.project.append(rate)
                figures.steps = steps
                figures.bare.append(
                    bare_samples_per_second(
                        cfg, images, labels, device, steps=steps, warmup=max(2, steps // (passes - 1))
                    )
                )
                say(f"{task} repeat {r + 1}/{repeats}: project {rate:.1f} samples/s, bare {figures.bare[-1]:.1f}")
            rows.append(figures.row())
            say(format_row(rows[-1]))
    return rows


def format_row(row: dict) -> str:
    return (
        f"{row['task']} on {row['device']} ({row['threads']} torch threads, {row['loader_workers']} loader "
        f"workers), batch {row['batch_size']}, {row['steps']} timed steps: project "
        f"{row['project_samples_per_s']} samples/s ({row['project_ms_per_step']} ms/step), bare "
        f"{row['bare_samples_per_s']} samples/s ({row['bare_ms_per_step']} ms/step), "
        f"project/bare time {row['ratio_project_over_bare_time']}x (repeats: "
        f"{', '.join(f'{r}x' for r in row['ratio_per_repeat'])})"
    )


# ----------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--task",
        choices=("mae", "ldm", "dit", "both", "all"),
        default="mae",
        help="both: mae and ldm (the UNet); all: mae, ldm and dit",
    )
    parser.add_argument(
        "--size",
        choices=tuple(SIZES),
        default="tiny",
        help="tiny: the tiny configs; gpu: MAE ViT-B/16 at 224 px and the base UNet on 4x32x32 "
        "latents; smoke: the smallest models, to check the command runs",
    )
    parser.add_argument("--passes", type=int, default=3, help="passes per project run; the first warms up")
    parser.add_argument("--repeats", type=int, default=3, help="alternating project / bare repeats (median)")
    parser.add_argument(
        "--data", help="train shards (a folder with index.json); default: digits written to a temporary folder"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for both loops (0: torch's default); with data.num_workers=auto "
        "a CPU run's loader workers get the cores the threads leave",
    )
    parser.add_argument("--json", help="also write the rows here as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for both loops")


def run_from_args(args) -> None:
    if args.passes < 2 or args.repeats < 1:
        raise ValueError(
            f"--passes must be >= 2 (the first warms up) and --repeats >= 1, got {args.passes}, {args.repeats}"
        )
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = {"both": ["mae", "ldm"], "all": ["mae", "ldm", "dit"]}.get(args.task, [args.task])
    rows = run_bench(
        tasks, size=args.size, passes=args.passes, repeats=args.repeats, data=args.data, overrides=args.overrides
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"written: {args.json}")
