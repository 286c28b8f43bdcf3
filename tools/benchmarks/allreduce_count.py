"""How many gradient all-reduces DDP runs per optimizer step under gradient accumulation.

The tiny MAE behind torch's DDP, its micro-batches driven by the loop's GradientAccumulation
(pipelines/training/accumulation.py: forward and backward under `no_sync` unless the micro-batch ends
an optimizer step), every bucket all-reduce counted by a DDP comm hook. Expected: no all-reduce for
a micro-batch inside a group, one bucket set (every bucket once) for the one that ends it, the last
short group of the pass included. NCCL on a GPU, gloo on a CPU; one process by itself (world size 1:
DDP's reducer and the backend still run), or N under torchrun.
Usage: python -m prunepipe.tools.benchmarks.allreduce_count [--grad-accum 4] [--micro-batches 10] [--json FILE]
       torchrun --nproc-per-node=2 -m prunepipe.tools.benchmarks.allreduce_count ...      (exit 1 when a count is off)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from prunepipe.pipelines.data.batch import Batch
from prunepipe.pipelines.tasks.mae import MAEConfig, MAETask
from prunepipe.pipelines.tasks.randomness import SampleRandomness
from prunepipe.pipelines.training.accumulation import GradientAccumulation
from prunepipe.pipelines.training.parallel import ModelParallel

# The tiny MAE of configs/mae_tiny_base.yaml, narrowed as the distributed tests narrow it
TINY_MAE = MAEConfig(
    patch_size=8, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2
)
SIZE, CHANNELS = 32, 3


class DDPOnly:
    """The three things GradientAccumulation asks of accelerate, answered by the DDP model itself.
    accelerate wraps a model in DDP only for more than one process, and its `no_sync` is a no-op then;
    here DDP is there at any world size, so `no_sync` must be DDP's own."""

    def __init__(self, world: int):
        self.num_processes = world

    @staticmethod
    def no_sync(model: DistributedDataParallel):
        return model.no_sync()

    @staticmethod
    def backward(loss: torch.Tensor) -> None:
        loss.backward()


def join_process_group() -> tuple[int, int, torch.device]:
    """torch.distributed from torchrun's environment, or a group of one process on a free local port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local % torch.cuda.device_count())  # several ranks may share one GPU
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def bucket_count(model: DistributedDataParallel) -> int:
    """How many buckets DDP's last backward reduced into: its first layout (parameters in reverse
    order, the first bucket up to 1 MiB) until it rebuilds them, after the first synchronised
    backward, in the order the gradients became ready. Read from DDP's logging data."""
    data = model._get_ddp_logging_data()  # noqa: SLF001 - the only place DDP tells its bucket layout
    sizes = data.get("rebuilt_bucket_sizes") or data["bucket_sizes"]  # comma-separated bytes per bucket
    return len(str(sizes).split(","))


def count(grad_accum: int, micro_batches: int, batch_size: int, bucket_mb: float) -> dict:
    """Run `micro_batches` micro-batches of one pass; all-reduces per micro-batch and the verdict."""
    rank, world, device = join_process_group()
    torch.manual_seed(0)
    task = MAETask(TINY_MAE, image_size=SIZE, channels=CHANNELS)
    model = DistributedDataParallel(
        task.model.to(device), bucket_cap_mb=bucket_mb, device_ids=[device.index] if device.type == "cuda" else None
    )
    calls = {"all_reduces": 0}

    def counting_hook(state, bucket):
        calls["all_reduces"] += 1
        return allreduce_hook(None, bucket)  # DDP's own all-reduce, averaged over the world

    model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accumulation = GradientAccumulation(DDPOnly(world), model, grad_accum, ModelParallel("ddp", model, DDPOnly(world)))
    per_micro, is_step_of, buckets_held = [], [], []
    for micro in range(micro_batches):
        is_step, group_size = accumulation.group(micro, micro_batches)
        ids = torch.arange(batch_size, dtype=torch.int64) + (micro * world + rank) * batch_size
        images = torch.rand(batch_size, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(micro))
        batch = Batch(ids, torch.ones(batch_size), images * 2 - 1, torch.full((batch_size,), -1)).to(device)
        before = calls["all_reduces"]
        with accumulation.sync_context(is_step):
            losses = task.per_sample(model, batch, SampleRandomness(0, 0, batch.ids)).loss.float()
            accumulation.backward((losses * batch.weights).mean() / group_size)
        if is_step:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            accumulation.stepped()
        if device.type == "cuda":
            torch.cuda.synchronize()  # the hook has been called by now; counting needs no wait, printing does
        per_micro.append(calls["all_reduces"] - before)
        is_step_of.append(is_step)
        buckets_held.append(bucket_count(model))
    steps = sum(is_step_of)
    # no all-reduce inside a group; at its end each of DDP's buckets exactly once
    ok = all(
        n == (held if step else 0) and (n > 0 or not step) for n, held, step in zip(per_micro, buckets_held, is_step_of)
    )
    verdict = {
        "backend": dist.get_backend(),
        "world_size": world,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "grad_accum": grad_accum,
        "micro_batches": micro_batches,
        "optimizer_steps": steps,
        "bucket_cap_mb": bucket_mb,
        "all_reduces_per_micro_batch": per_micro,
        "steps_at": [i for i, s in enumerate(is_step_of) if s],
        "all_reduces_total": sum(per_micro),
        "ddp_buckets_per_micro_batch": buckets_held,
        "one_bucket_set_per_step": ok,
    }
    dist.destroy_process_group()
    return verdict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=10, help="of one pass; 10 with 4 ends in a short group")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=0.05,
        help="DDP's bucket_cap_mb, small so that the tiny model fills several buckets",
    )
    parser.add_argument("--json", help="write the verdict here (rank 0)")


def run_from_args(args) -> int:
    verdict = count(args.grad_accum, args.micro_batches, args.batch_size, args.bucket_mb)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(verdict, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(verdict, f, indent=1)
    return 0 if verdict["one_bucket_set_per_step"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
