"""The ranks of a job: who this process is among them, and the few collectives that make every rank
end with the same value or the same failure. The training loop uses them to agree on what each rank
read from its own node (a group table, an encoder, a plan); the evaluators to combine each rank's
share of the held-out samples, so no rank works alone while the others wait in a collective and an
evaluation longer than the process-group timeout (NCCL's default is 10 minutes) does not kill the
job. torch.distributed only: nothing else of the project.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
import torch
import torch.distributed as dist

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of torch.distributed when initialised, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collective_device() -> torch.device:
    """Where the process group's tensors must live: NCCL moves CUDA tensors only, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_over_ranks(local: dict, count_key: str = "num_samples") -> dict:
    """Means over every rank's samples from each rank's means over its own: every float value of
    `local` is a mean over `local[count_key]` samples (MSE, PSNR, SSIM, a grid mean of per-timestep
    MSEs), so it is weighted by that count, summed over ranks in float64 and divided by the total.
    Other values are kept; `{count_key}_by_rank` says how many samples each rank evaluated."""
    _, world = rank_and_world()
    if world == 1:
        return {**local, f"{count_key}_by_rank": [int(local[count_key])]}
    keys = [k for k, v in local.items() if isinstance(v, float)]
    count = int(local[count_key])
    row = torch.tensor([count, *(local[k] * count for k in keys)], dtype=torch.float64)
    rows = [torch.empty_like(row, device=collective_device()) for _ in range(world)]
    dist.all_gather(rows, row.to(collective_device()))
    table = torch.stack(rows).cpu()  # [world, 1 + len(keys)]: each rank's count and weighted sums
    by_rank = [int(c) for c in table[:, 0]]
    total = sum(by_rank)
    sums = table[:, 1:].sum(dim=0)
    combined = {k: float(s) / max(total, 1) for k, s in zip(keys, sums)}
    return {**local, **combined, count_key: total, f"{count_key}_by_rank": by_rank}


def counts_by_rank(count: int) -> list[int]:
    """Every rank's `count` (how many images it evaluated), in rank order."""
    _, world = rank_and_world()
    if world == 1:
        return [int(count)]
    return [int(n) for n in gather_rows(torch.tensor([count], dtype=torch.int64))]


def gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's rows [n_r, ...] (the same trailing shape and dtype everywhere, n_r may differ and
    be 0), concatenated in rank order on every rank. Sizes go first, then one padded all-gather."""
    _, world = rank_and_world()
    if world == 1:
        return rows
    device = collective_device()
    size = torch.tensor([len(rows)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    sizes = [int(s) for s in sizes]
    padded = torch.zeros((max(sizes), *rows.shape[1:]), dtype=rows.dtype, device=device)
    padded[: len(rows)] = rows.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:n] for g, n in zip(gathered, sizes)]).cpu()


def gather_in_index_order(ids: np.ndarray, *columns: np.ndarray) -> tuple[np.ndarray, ...]:
    """(ids, *columns) of every rank's samples, sorted by id: the arrays one process reading the
    whole split in index order would hold, whatever the world size."""
    _, world = rank_and_world()
    if world == 1:
        return (ids, *columns)
    gathered_ids = gather_rows(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))).numpy()
    order = np.argsort(gathered_ids, kind="stable")
    gathered = [gather_rows(torch.from_numpy(np.ascontiguousarray(c))).numpy()[order] for c in columns]
    return (gathered_ids[order], *gathered)


def decided_on_rank0(decide: Callable[[], T]) -> T:
    """Rank 0 runs `decide()` and every rank returns its answer (any picklable value), so no
    rank acts on a view of its own: a file that appears between two ranks' checks, or exists on one
    node's disk only, would send the ranks down different collectives. An exception raised on rank 0
    is raised on every rank, with rank 0's message."""
    rank, world = rank_and_world()
    if world == 1:
        return decide()
    message, failure = [None], None
    if rank == 0:
        try:
            message = [("ok", decide())]
        except Exception as error:  # the other ranks must leave with it too, not wait for rank 0
            failure, message = error, [("error", (type(error), str(error)))]
    dist.broadcast_object_list(message, src=0, device=collective_device())
    if failure is not None:
        raise failure
    kind, value = message[0]
    if kind == "error":
        error_type, text = value
        try:
            error = error_type(text)
        except TypeError:  # an exception type that wants more than a message
            error = RuntimeError(f"{error_type.__name__}: {text}")
        raise error
    return value


def on_every_rank(action: Callable[[], T]) -> T:
    """`action()` on every rank; if it raises on any rank, it raises on every rank, naming the ranks that
    failed and the first one's message. For what each rank loads from its own node's disk (feature
    weights): a file missing on one node would otherwise leave the other ranks in the next collective."""
    rank, world = rank_and_world()
    if world == 1:
        return action()
    failure, value = None, None
    try:
        value = action()
    except Exception as error:  # noqa: BLE001 - whatever it is, the other ranks must hear of it
        failure = error
    outcomes: list = [None] * world
    dist.all_gather_object(outcomes, None if failure is None else f"{type(failure).__name__}: {failure}")
    failed = [r for r, message in enumerate(outcomes) if message is not None]
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(f"rank {failed[0]} failed (ranks failing: {failed}): {outcomes[failed[0]]}")
    return value


def same_on_every_rank(key: str, shown: str, what: str) -> None:
    """Every rank holds the same `key`, or every rank raises, listing what each holds (`shown`): for
    what each rank read from its own node's disk (a table, an encoder), before anything depends on it."""
    rank, world = rank_and_world()
    if world == 1:
        return
    held: list = [None] * world
    dist.all_gather_object(held, (key, shown))
    if len({k for k, _ in held}) > 1:
        listed = "; ".join(f"rank {r}: {s}" for r, (_, s) in enumerate(held))
        raise RuntimeError(f"rank {rank}: the ranks hold different {what} ({listed}); every rank must hold the same")


def rank0_value(value: T) -> T:
    """Rank 0's `value` on every rank. For numbers every rank computed alike from the same arrays (the
    probe's fit): one record everywhere, even where two nodes' float arithmetic would differ."""
    _, world = rank_and_world()
    if world == 1:
        return value
    message = [value]
    dist.broadcast_object_list(message, src=0, device=collective_device())
    return message[0]
