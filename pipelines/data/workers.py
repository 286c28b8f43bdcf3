"""How many loader workers decode for one rank: an explicit count, or `auto` (one per core this
process may use, shared by the ranks on the node, leaving one core to the training process itself).
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


def loader_workers(setting, processes_on_node: int | None = None) -> int:
    """Workers per rank: the integer setting, or for `auto` the cores of this node's share minus one
    (at most MAX_AUTO_WORKERS); 0 when a rank has a single core, where a worker would only compete."""
    setting = check_num_workers(setting)
    if setting != AUTO:
        return setting
    if processes_on_node is None:
        processes_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(MAX_AUTO_WORKERS, cores // max(1, processes_on_node) - 1))
