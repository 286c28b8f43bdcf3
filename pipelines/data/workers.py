"""How many loader workers decode for one rank, and on which cores they and the training process run.

The count is an explicit integer or `auto` (one per core this process may use, shared by the ranks
on the node, leaving the training process what it computes with: one core beside an accelerator,
its torch threads on a CPU). It shapes the pass layout (equal slices per rank and worker), so a run
resumed under another count goes on as a segment (docs/data.md): set an integer to reproduce a run
on other machines.

The placement (`data.cpu_affinity`) keeps the training process's threads on cores of their own and
gives each worker one of the rest. Left to the scheduler, a decoder keeps landing on a core a torch
thread computes on, and every op of the step waits for it (docs/throughput.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

AUTO = "auto"
# auto: placed on CPU runs; always: on CUDA runs too; never: where the scheduler puts them (not on/off,
# which YAML reads as booleans)
AFFINITY = ("auto", "always", "never")
MAX_AUTO_WORKERS = 8  # past this, more decoders mostly cost memory and start-up


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


def loader_workers(setting, processes_on_node: int | None = None, *, device_type: str = "cuda",
                   compute_threads: int | None = None) -> int:
    """Workers per rank: the integer setting, or for `auto` this rank's share of the node's cores
    minus what the training process computes with. On an accelerator that is one core (at most
    MAX_AUTO_WORKERS workers). On a CPU it is torch's intra-op threads, which take every core they
    are given and spin between ops: a decoder beside them only waits for a core, and the step waits
    for it (measured: docs/throughput.md), so a CPU run decodes in-process unless cores are left."""
    setting = check_num_workers(setting)
    if setting != AUTO:
        return setting
    if processes_on_node is None:
        processes_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = cores // max(1, processes_on_node)
    if device_type != "cuda":
        import torch

        return max(0, min(MAX_AUTO_WORKERS, share - (compute_threads or torch.get_num_threads())))
    return max(0, min(MAX_AUTO_WORKERS, share - 1))


@dataclass(frozen=True)
class CorePlacement:
    training: tuple[int, ...]  # the cores of the training process's threads
    workers: tuple[int, ...]  # loader worker i runs on workers[i % len(workers)]


def place_cores(setting: str, num_workers: int, *, device_type: str, compute_threads: int, local_rank: int = 0,
                processes_on_node: int = 1) -> CorePlacement | None:
    """Split this rank's share of the node's cores: the first `compute_threads` (one on CUDA) for
    training, the others for its loader workers. None where nothing is placed: `never`, `auto` on
    CUDA (not measured there; the launcher's binding stands), no workers, or no core left over."""
    if setting not in AFFINITY:
        raise ValueError(f"data.cpu_affinity={setting!r} is not accepted; accepted: {', '.join(AFFINITY)}")
    if (setting == "never" or num_workers == 0 or (setting == "auto" and device_type == "cuda")
            or not hasattr(os, "sched_getaffinity")):
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // max(1, processes_on_node)
    mine = cores[local_rank * share:(local_rank + 1) * share]
    compute = 1 if device_type == "cuda" else max(1, compute_threads)
    if len(mine) <= compute:
        return None
    return CorePlacement(tuple(mine[:compute]), tuple(mine[compute:]))


def pin_this_process(cores: tuple[int, ...]) -> None:
    """Every thread of this process onto `cores`: torch's thread pool may already exist, and
    sched_setaffinity(0, ...) moves only the calling thread."""
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for task in tasks:
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
