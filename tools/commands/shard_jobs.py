"""Preprocessing split over processes the way img2dataset splits a download: one output per input
shard, written by one process, and sealed by a stats file written last; a rerun or a requeue skips
the sealed shards and redoes the rest, and the index is written once every shard is sealed.

Who a process is comes from `--rank/--world`, else torchrun's RANK/WORLD_SIZE, else a SLURM array's
or srun's task variables. Shard i is rank i % world's: balanced, and a requeue with another world
size still finds the seals. Under torchrun the ranks meet in a gloo barrier after their parts and
rank 0 writes the index; processes without a process group (a SLURM array, `--rank/--world`) never
wait: whichever finds every shard sealed after its part writes it, under a lock file.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

from prunepipe.pipelines.data.side_tables import write_json

SEAL_SUFFIX = "_stats.json"  # img2dataset's NNNNN_stats.json beside NNNNN.tar: `shards index` reads it too
WAIT_HOURS = 6.0  # how long a torchrun rank waits in the final barrier for the slowest rank's part


@dataclass(frozen=True)
class JobRank:
    """This process's place in a preprocessing job."""

    rank: int
    world: int
    local_rank: int = 0
    launcher: str = "alone"  # alone | torchrun | slurm-array | srun | flags

    @property
    def grouped(self) -> bool:
        """Started by torchrun with peers: the ranks can meet in a barrier."""
        return self.launcher == "torchrun" and self.world > 1

    def mine(self, shards: int) -> list[int]:
        return list(range(self.rank, shards, self.world))

    def __str__(self) -> str:
        return f"rank {self.rank}/{self.world}"


def job_rank(rank: int | None = None, world: int | None = None) -> JobRank:
    """From the flags when given, else from the launcher's environment; alone without either."""
    env = os.environ
    if rank is not None or world is not None:
        if rank is None or world is None:
            raise ValueError("--rank and --world go together (e.g. --rank $SLURM_ARRAY_TASK_ID --world 64)")
        local = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
        found = JobRank(int(rank), int(world), local, launcher="flags")
    elif "RANK" in env and "WORLD_SIZE" in env:
        found = JobRank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    elif "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        # an array element may run several srun tasks: each is a share of its own
        first = int(env.get("SLURM_ARRAY_TASK_MIN", 0))
        tasks, task = int(env.get("SLURM_NTASKS", 1)), int(env.get("SLURM_PROCID", 0))
        found = JobRank(
            (int(env["SLURM_ARRAY_TASK_ID"]) - first) * tasks + task,
            int(env["SLURM_ARRAY_TASK_COUNT"]) * tasks,
            int(env.get("SLURM_LOCALID", 0)),
            "slurm-array",
        )
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        found = JobRank(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "srun")
    else:
        found = JobRank(0, 1)
    if found.world < 1 or not 0 <= found.rank < found.world:
        raise ValueError(f"need 0 <= rank < world, got rank {found.rank} of world {found.world} ({found.launcher})")
    return found


def job_device(rank: JobRank) -> str:
    """This rank's device: its node-local GPU, or the one GPU a per-task binding left it, or the CPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    device = rank.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    return f"cuda:{device}"


def partial_path(output: str) -> str:
    """Where `output` is written before it is moved into place: unique to this writer, so that two
    processes given the same share by mistake never write one file, and ending in `.partial`, so that
    a killed writer's leftover never passes for a shard (`*.tar`) or a table (`*.npy`)."""
    return f"{output}.{socket.gethostname()}.{os.getpid()}.partial"


def remove_gone_partials(folder: str) -> None:
    """Remove the partial outputs of this host's writers that are gone (a killed encode's); one listing
    per process, not per shard: a folder of 1e5 shards is listed once."""
    host = socket.gethostname()
    for name in os.listdir(folder):
        if not name.endswith(".partial"):
            continue
        written_as, _, pid = name[: -len(".partial")].rpartition(".")  # OUTPUT.HOST . PID (a host may hold dots)
        if pid.isdigit() and written_as.endswith(f".{host}") and not _alive(int(pid)):
            os.remove(os.path.join(folder, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def settings_digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def seal_path(output: str) -> str:
    """OUT/shard-000003_stats.json for OUT/shard-000003.tar (or .npy)."""
    return os.path.splitext(output)[0] + SEAL_SUFFIX


class ShardJob:
    """The outputs of one job in `folder`, one per input shard, and their seals."""

    def __init__(self, folder: str, settings: dict, rank: JobRank, *, what: str, command: str):
        self.folder, self.settings, self.rank, self.what, self.command = folder, settings, rank, what, command
        self.digest = settings_digest(settings)
        os.makedirs(folder, exist_ok=True)
        remove_gone_partials(folder)
        # the settings in full, once per digest (a seal holds the digest: at 1e5 shards the list of
        # shards in every seal would be gigabytes); a mismatch's message reads the seal's file
        if not os.path.exists(self.settings_file(self.digest)):
            write_json(
                self.settings_file(self.digest),
                {"settings_digest": self.digest, "settings": settings, "command": command},
            )

    def settings_file(self, digest: str) -> str:
        return os.path.join(self.folder, f"job-{digest}.json")

    def sealed(self, output: str) -> dict | None:
        """The seal of a finished output, or None when it must be made (again). A seal of other settings
        is an error: mixing them would give a table no single command made."""
        path = seal_path(output)
        try:
            with open(path) as f:
                seal = json.load(f)
        except FileNotFoundError:
            return None
        except ValueError:
            return None  # a seal cut off mid-write: the shard is redone
        if seal.get("settings_digest") != self.digest:
            try:
                with open(self.settings_file(str(seal.get("settings_digest")))) as f:
                    theirs = json.load(f).get("settings", {})
            except (OSError, ValueError):
                theirs = {}
            ours = self.settings
            differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            raise ValueError(
                f"{path}: sealed by `{self.command}` with other settings ({', '.join(differ) or 'unknown'}"
                f" differ); rerun with the same settings to finish that job, or write to another --out"
            )
        if not os.path.exists(output) or os.path.getsize(output) != seal.get("output_bytes"):
            return None  # the output was removed or cut short since: its seal no longer holds
        return seal

    def seal(self, output: str, record: dict) -> dict:
        """Seal a finished output (already in place): the seal is what says done, so it is written last."""
        seal = {
            **record,
            "output_bytes": os.path.getsize(output),
            "settings_digest": self.digest,
            "rank": self.rank.rank,
            "world": self.rank.world,
            "host": socket.gethostname(),
            "written_by": "prunepipe",
        }
        write_json(seal_path(output), seal)
        return seal

    def unsealed(self, outputs: list[str]) -> list[str]:
        return [output for output in outputs if self.sealed(output) is None]

    def finish(self, outputs: list[str], write: Callable[[], str], wait_hours: float = WAIT_HOURS) -> str | None:
        """Write the job's result (`write`, returning its path) once every output is sealed: rank 0 after
        the barrier under torchrun; otherwise this process, when it finds every output sealed. Returns
        the path, or None when this process does not write it (and says why)."""
        if self.rank.grouped:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("ShardJob.finish under torchrun needs join_group() first")
            # every rank's part is sealed; a rank that is gone is named, after wait_hours at most
            dist.monitored_barrier(timeout=timedelta(hours=wait_hours), wait_all_ranks=True)
            written = None
            if self.rank.rank == 0:  # the one writer by construction: no lock
                written = self._write_if_sealed(outputs, write, raise_unsealed=True, lock=False)
            dist.monitored_barrier(timeout=timedelta(hours=wait_hours), wait_all_ranks=True)  # the index is there
            dist.destroy_process_group()
            return written
        return self._write_if_sealed(outputs, write, raise_unsealed=False)

    def _write_if_sealed(self, outputs, write, raise_unsealed: bool, lock: bool = True) -> str | None:
        missing = self.unsealed(outputs)
        if missing:
            names = ", ".join(os.path.basename(m) for m in missing[:5]) + (", ..." if len(missing) > 5 else "")
            message = (
                f"{self.what}: {len(missing)} of {len(outputs)} shard(s) not sealed yet ({names}); the "
                f"index is written by the task that seals the last one, or by a rerun of `{self.command}`"
            )
            if raise_unsealed:
                raise RuntimeError(message)
            print(f"prunepipe: {self.rank}: {message}", flush=True)
            return None
        if not lock:
            return write()
        lock_file = os.path.join(
            os.path.dirname(os.path.abspath(self.folder)), f".{os.path.basename(os.path.normpath(self.folder))}.lock"
        )
        if not _take(lock_file):
            print(f"prunepipe: {self.rank}: another process is writing the index ({lock_file})", flush=True)
            return None
        try:
            return write()
        finally:
            os.remove(lock_file)


def _take(lock: str) -> bool:
    """Create `lock` holding this host, pid and time, at once (a hard link of a file already written:
    no reader ever sees it empty); a lock left by a writer that is gone is taken over."""
    mine = f"{lock}.{socket.gethostname()}.{os.getpid()}"
    with open(mine, "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()} {time.time()}")
    try:
        for _ in range(2):
            try:
                os.link(mine, lock)
                return True
            except FileExistsError:
                if not _stale(lock):
                    return False
                os.remove(lock)
        return False
    finally:
        os.remove(mine)


def _stale(lock: str) -> bool:
    """A lock left by a process of this host that is gone (a killed writer), or older than an hour."""
    try:
        host, pid, since = open(lock).read().split()
    except (OSError, ValueError):
        return True
    if time.time() - float(since) > 3600:
        return True
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
        return False
    except ProcessLookupError:
        return True
    except PermissionError:
        return False


START_MINUTES = 30.0  # how long the ranks wait for each other to start and load their models


def join_group(rank: JobRank) -> None:
    """Under torchrun with peers: the gloo group of the job (CPU only, whatever the encoding device),
    and a barrier once this rank has loaded its models, so a rank that cannot start (a missing VAE
    on one node) fails the job before the others encode for hours. Call it after loading."""
    if not rank.grouped:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(minutes=START_MINUTES))
    dist.monitored_barrier(timeout=timedelta(minutes=START_MINUTES), wait_all_ranks=True)


class Progress:
    """One line per shard done, with this rank's rate: what a log file of a long job should show."""

    def __init__(self, rank: JobRank, what: str, shards: int, sealed_before: int):
        self.rank, self.what, self.shards, self.sealed_before = rank, what, shards, sealed_before
        self.done, self.samples, self.start = 0, 0, time.perf_counter()
        if rank.rank == 0 or rank.launcher != "torchrun":
            print(f"prunepipe: {what}: {rank}: {shards} shard(s) of mine, {sealed_before} sealed earlier", flush=True)

    def shard_done(self, name: str, samples: int, skipped: int) -> None:
        self.done += 1
        self.samples += samples
        rate = self.samples / max(time.perf_counter() - self.start, 1e-9)
        print(
            f"prunepipe: {self.what}: {self.rank}: {name} sealed ({self.done + self.sealed_before} of {self.shards} "
            f"of this rank), {samples} samples"
            + (f", {skipped} skipped" if skipped else "")
            + f", {rate:.1f} samples/s",
            flush=True,
        )
