"""How many loader workers decode for one rank: an explicit count, or `auto` (one per core this
process may use, shared by the ranks on the node, leaving the training process what it computes
with: one core beside an accelerator, its torch threads on a CPU).
The count shapes the pass layout (equal slices per rank and worker), so a run resumed under another
count goes on as a segment (docs/data.md): set an integer to reproduce a run on other machines.
"""

from __future__ import annotations

import os

AUTO = "auto"
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
