"""How many loader workers decode for one rank: an explicit count, or `auto` (one per core this
process may use, shared by the ranks on the node, leaving the training process what it computes
with: one core beside an accelerator, its torch threads on a CPU).
The count shapes the pass layout (equal slices per rank and worker), so every rank must use the same
one: `agreed_loader_workers` computes each rank's `auto` and takes the smallest over the job
(uneven nodes or per-task CPU binding can give 7 / 5 / 0 workers, hence 308 / 310 / 312 steps per
pass, and the rank with more steps would hang). A run resumed under another count goes on as a segment
(docs/data.md): set an integer to reproduce a run on other machines.
"""

from __future__ import annotations

import os
import socket

AUTO = "auto"


def check_num_workers(value) -> int | str:
    """`auto` or an integer >= 0 (as typed in YAML or an override); anything else names the field."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        workers = int(value)
        if workers != float(value) or isinstance(value, bool):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"data.num_workers={value!r} is not accepted; accepted: auto or an integer >= 0") from None
    if workers < 0:
        raise ValueError(f"data.num_workers={workers} is not accepted; accepted: auto or an integer >= 0")
    return workers


def loader_workers(
    setting,
    processes_on_node: int | None = None,
    *,
    device_type: str = "cuda",
    compute_threads: int | None = None,
    cores: int | None = None,
) -> int:
    """Workers per rank: the integer setting, or for `auto` this rank's share of the cores it may use
    (`cores`, default its CPU affinity, divided by the `processes_on_node` that share them) minus
    what the training process computes with. On an accelerator that is one core, and every other core
    decodes: MAE at 224 px needs a loader worker per ~800 img/s of the GPU (docs/throughput.md), more
    than any fixed cap leaves a fast GPU. On a CPU it is torch's intra-op threads, which take every core they
    are given and spin between ops: a decoder beside them only waits for a core, and the step waits
    for it (measured: docs/throughput.md), so a CPU run decodes in-process unless cores are left."""
    setting = check_num_workers(setting)
    if setting != AUTO:
        return setting
    if processes_on_node is None:
        processes_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cores is None:
        cores = len(usable_cpus())
    share = cores // max(1, processes_on_node)
    if device_type != "cuda":
        import torch

        return max(0, share - (compute_threads or torch.get_num_threads()))
    return max(0, share - 1)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity: what SLURM's per-task binding or taskset gave it)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def sharing_processes(mine: tuple[str, set[int]], everyone: list[tuple[str, set[int]]]) -> int:
    """How many processes (this one included) run on this host on CPUs that overlap this one's.

    torchrun's ranks inherit one affinity and share it (8 ranks on 96 CPUs: 8); `srun
    --cpus-per-task=12` binds each task to 12 CPUs of its own (1 each), which `LOCAL_WORLD_SIZE`
    alone cannot tell apart from the first (it gave 12 // 8 - 1 = 0 workers)."""
    host, cpus = mine
    return max(1, sum(1 for other_host, other in everyone if other_host == host and other & cpus))


def agreed_loader_workers(setting, *, device_type: str = "cuda") -> int:
    """The loader workers every rank of the job uses: the setting, or each rank's `auto` (from the
    CPUs it may use and the processes sharing them, learnt with one all-gather) and then the smallest
    over all ranks, so that every rank lays out the pass alike. Every rank calls this at the same point."""
    import torch.distributed as dist

    from prunepipe.pipelines.ranks import rank_and_world

    setting = check_num_workers(setting)
    _, world = rank_and_world()
    if setting != AUTO or world == 1:
        return loader_workers(setting, 1, device_type=device_type)
    mine = (socket.gethostname(), usable_cpus())
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    local = loader_workers(setting, sharing_processes(mine, everyone), device_type=device_type, cores=len(mine[1]))
    return agree_worker_count(local)


def agree_worker_count(local: int) -> int:
    """The smallest of every rank's `local` count (one all-reduce): no rank is given more decoders
    than it has cores for, and all lay out the pass alike."""
    import torch
    import torch.distributed as dist

    from prunepipe.pipelines.ranks import collective_device

    count = torch.tensor([local], dtype=torch.int64, device=collective_device())
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())
