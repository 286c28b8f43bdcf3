"""Preprocessing split over processes the way img2dataset splits a download: one output per input
shard (or a few files: `latents encode --buckets` writes a tar per aspect-ratio bucket), written by one
process, and sealed by a stats file written last; a rerun or a requeue skips the sealed shards and
redoes the rest, and the index is written once every shard is sealed.

Who a process is comes from `--rank/--world`, else torchrun's RANK/WORLD_SIZE, else a SLURM array's
(its element's place in the array's index list) or srun's task variables; a launch that gives no
honest rank is refused, saying what to do. Shard i is rank i % world's: balanced, and a requeue with
another world size still finds the seals. A shard whose store fails is set aside and tried again after
the others; what still fails is named at the end. Under torchrun the ranks meet in a gloo barrier
after their parts and rank 0 writes the index; processes without a process group (a SLURM array,
`--rank/--world`) never wait: whichever finds every shard sealed after its part writes it, under a
lock (JobLock) that its heartbeat keeps and that is taken over only from a writer that is gone.

Everything here must hold on a folder shared by many hosts (NFS, Lustre): every temporary name carries
host, PID and a random token, and nothing relies on a lock being removed or on the hosts' clocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

from prunepipe.pipelines.data.remote import ShardReadError
from prunepipe.pipelines.data.shards import BadInputError
from prunepipe.pipelines.data.side_tables import write_json
from prunepipe.pipelines.writer_names import PROCESS_TOKEN, host_id, writer_tag, written_here

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
    """From the flags when given, else from the launcher's environment; alone without either. A
    launch whose environment gives no honest rank (an array of torchrun jobs, `sbatch -n4` without
    srun, a SLURM array whose index list its element cannot place) is refused, saying what to do."""
    env = os.environ
    if rank is not None or world is not None:
        if rank is None or world is None:
            raise ValueError("--rank and --world go together (e.g. --rank $SLURM_ARRAY_TASK_ID --world 64)")
        local = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
        found = JobRank(int(rank), int(world), local, launcher="flags")
    elif "RANK" in env and "WORLD_SIZE" in env:
        if "SLURM_ARRAY_TASK_ID" in env:
            # each array element is a torchrun job of its own: RANK counts the ranks of this element only,
            # so every element would take shards 0, W, 2W, ... and the others' shares would stay undone
            raise ValueError(
                f"an array of torchrun jobs (SLURM_ARRAY_TASK_ID={env['SLURM_ARRAY_TASK_ID']}, RANK={env['RANK']}, "
                f"WORLD_SIZE={env['WORLD_SIZE']}): torchrun's ranks are those of one array element, not of the "
                f"job; run one torchrun job (no --array), or one process per element with "
                f"`--rank $SLURM_ARRAY_TASK_ID --world N` (an array 0..N-1, no torchrun)"
            )
        found = JobRank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    elif "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        element, elements = _array_element(env)
        # an array element may run several srun tasks: each is a share of its own
        tasks, task = _srun_task(env)
        found = JobRank(element * tasks + task, elements * tasks, int(env.get("SLURM_LOCALID", 0)), "slurm-array")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        tasks, task = _srun_task(env)
        found = JobRank(task, tasks, int(env.get("SLURM_LOCALID", 0)), "srun")
    else:
        found = JobRank(0, 1)
    if found.world < 1 or not 0 <= found.rank < found.world:
        raise ValueError(f"need 0 <= rank < world, got rank {found.rank} of world {found.world} ({found.launcher})")
    return found


BATCH_STEP = "4294967294"  # SLURM_BATCH_SCRIPT: the step id of a batch script, where a SLURM version sets one


def _srun_task(env) -> tuple[int, int]:
    """(tasks, this task) of the SLURM step this process runs in. `sbatch -n4` runs its script once,
    not four times (srun starts the tasks), yet the script sees SLURM_NTASKS=4 and SLURM_PROCID=0:
    taken as one of four ranks, it would do a quarter of the job and wait for three that never come."""
    tasks = int(env.get("SLURM_NTASKS", 1))
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if tasks > 1 and step in (None, BATCH_STEP):
        raise ValueError(
            f"SLURM_NTASKS={tasks} but this is the batch script (no SLURM_STEP_ID): SLURM runs it once, not "
            f"{tasks} times; start the tasks with srun (`srun prunepipe latents encode ...` in the script), or "
            f"give this one process the whole job with --rank 0 --world 1"
        )
    return tasks, int(env.get("SLURM_PROCID", 0))


def _array_element(env) -> tuple[int, int]:
    """(this element's place in its array's index list, the list's length). SLURM tells an element
    its id, the list's min, max and count, and the step of a stepped range, not the list itself:
    `--array=0-63` and `--array=0-14:2` are placed from those alone, any other list (3,17,42; 1-5,9) from
    `scontrol show job` where scontrol is there, else refused."""
    task, count = int(env["SLURM_ARRAY_TASK_ID"]), int(env["SLURM_ARRAY_TASK_COUNT"])
    first = int(env.get("SLURM_ARRAY_TASK_MIN", 0))
    last = int(env.get("SLURM_ARRAY_TASK_MAX", first + count - 1))
    step = int(env.get("SLURM_ARRAY_TASK_STEP") or 0)
    if count == last - first + 1:
        return task - first, count
    if step > 0 and (last - first) % step == 0 and (last - first) // step + 1 == count and (task - first) % step == 0:
        return (task - first) // step, count
    job = env.get("SLURM_ARRAY_JOB_ID", "")
    indices, why = _scontrol_indices(job)
    if indices is not None and (len(indices), indices[0], indices[-1]) == (count, first, last) and task in indices:
        return indices.index(task), count
    if indices is not None:
        why = (
            f"`scontrol show job {job}` lists {len(indices)} indices from {indices[0]} to {indices[-1]}, not the "
            f"{count} from {first} to {last} of this element's environment (a finished element's record goes "
            f"after MinJobAge)"
        )
    raise ValueError(
        f"SLURM array element {task}: its array's indices are neither a range nor a stepped range "
        f"(SLURM_ARRAY_TASK_MIN={first}, MAX={last}, COUNT={count}, STEP={env.get('SLURM_ARRAY_TASK_STEP', 'unset')}) "
        f"and SLURM does not tell an element its place in such a list; {why}. Give the shares yourself: "
        f"`sbatch --array=0-{count - 1} --wrap 'prunepipe latents encode ... --rank $SLURM_ARRAY_TASK_ID "
        f"--world {count}'` (any split finishes the job: a rerun skips the sealed shards)"
    )


def _scontrol_indices(job: str) -> tuple[list[int] | None, str]:
    """The sorted indices of array job `job` from every record `scontrol show job` gives (each running or
    finished element has one, the pending ones share one: ArrayTaskId=5-9,11), or None and why not."""
    scontrol = shutil.which("scontrol")
    if not job or scontrol is None:
        return None, "scontrol is not on PATH" if job else "SLURM_ARRAY_JOB_ID is not set"
    try:
        shown = subprocess.run(
            [scontrol, "--oneliner", "show", "job", job], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        indices = sorted({i for spec in re.findall(r"\bArrayTaskId=(\S+)", shown) for i in array_indices(spec)})
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return None, f"`scontrol show job {job}` failed: {e}"
    if not indices:
        return None, f"`scontrol show job {job}` shows no ArrayTaskId"
    return indices, ""


def array_indices(spec: str) -> list[int]:
    """The indices of a SLURM array spec as sbatch --array and scontrol's ArrayTaskId write them:
    3,17,42 or 0-14:2 or 1-5,9, a throttle (%4) ignored."""
    found = []
    for part in spec.partition("%")[0].split(","):
        span, _, step = part.partition(":")
        low, _, high = span.partition("-")
        found += range(int(low), int(high or low) + 1, int(step or 1))
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
    """Where `output` is written before it is moved into place: OUTPUT.HOST.PID-TOKEN.partial, unique
    to this writer (the host id and a random token per process: containers on two hosts may share a
    PID), so that two processes given the same share by mistake never write one file, and ending in
    `.partial`, so that a killed writer's leftover never passes for a shard (`*.tar`) or a table (`*.npy`).
    The same in every call of one process, so that a failed write's leftover can be found and removed."""
    return f"{output}.{writer_tag(PROCESS_TOKEN)}.partial"


ABANDONED_HOURS = 24.0  # a partial of another host unchanged this long is a dead writer's


def remove_gone_partials(folder: str, abandoned_hours: float = ABANDONED_HOURS) -> None:
    """Remove the partial outputs in `folder` whose writers are provably gone: one of this host (host
    name and PID namespace) whose process is dead, at once; one of another host, whose processes this
    host cannot see, when it has not changed for `abandoned_hours` (a partial grows while it is written,
    and a writer that wrote nothing for a day is gone). One listing per process, not per shard: a folder
    of 1e5 shards is listed once. Names of older versions (OUTPUT.HOST.PID.partial and, for a table,
    OUTPUT.PID.partial) are judged the same way, the second as another host's."""
    host, now = socket.gethostname(), time.time()
    for name in os.listdir(folder):
        if not name.endswith(".partial"):
            continue
        here_pid = written_here(name, ".partial")
        if here_pid is None:  # an older version's name: OUTPUT.HOST.PID or OUTPUT.PID (a host may hold dots)
            written_as, _, pid = name[: -len(".partial")].rpartition(".")
            here_pid = (written_as.endswith(f".{host}"), int(pid)) if pid.isdigit() else (False, -1)
        here, pid = here_pid
        path = os.path.join(folder, name)
        try:
            if here and not _alive(pid):
                os.remove(path)
            elif not here and now - os.stat(path).st_mtime > abandoned_hours * 3600:
                os.remove(path)
        except FileNotFoundError:
            pass  # another process of the job removed it first


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_HASHED: dict[tuple, str] = {}  # (real path, size, mtime) -> sha256: each weight file hashed once per process


def model_files(folder: str) -> dict:
    """A model folder by what it holds, not where it is: its config.json (as JSON, less the
    `_name_or_path` a loader may write into it) and the sha256 of each weight file's bytes, by name.
    The same weights staged to $TMPDIR are the same model; new weights at the same path are not. Every
    byte is hashed (a 300 MB VAE in about a second), once per process; files beside them (a README) do
    not count."""
    found: dict = {"config": None, "weights": {}}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name == "config.json":
            with open(path) as f:
                config = json.load(f)
            config.pop("_name_or_path", None)
            found["config"] = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        elif name.endswith(WEIGHT_SUFFIXES) and os.path.isfile(path):
            found["weights"][name] = file_sha256(path)
    if not found["weights"]:
        raise FileNotFoundError(f"{folder}: no weight file ({', '.join(WEIGHT_SUFFIXES)}) to know the model by")
    return found


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes, once per process for a file unchanged since (size and mtime)."""
    status = os.stat(path)
    key = (os.path.realpath(path), status.st_size, status.st_mtime_ns)
    if key not in _HASHED:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _HASHED[key] = digest.hexdigest()
    return _HASHED[key]


# settings that earlier jobs put in their digest but that change no output: a seal whose settings differ
# from this job's in these alone is this job's (an encode stopped by a bad sample, retried with `skip`)
OUTPUT_NEUTRAL = ("on_bad_sample",)


def settings_digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _has_size(path: str, size) -> bool:
    try:
        return os.path.getsize(path) == size
    except OSError:
        return False


def seal_path(output: str) -> str:
    """OUT/shard-000003_stats.json for OUT/shard-000003.tar (or .npy)."""
    return os.path.splitext(output)[0] + SEAL_SUFFIX


class ShardJob:
    """The outputs of one job in `folder`, one per input shard (a file, or several sealed as one), and their seals."""

    def __init__(
        self,
        folder: str,
        settings: dict,
        rank: JobRank,
        *,
        what: str,
        command: str,
        abandoned_hours: float = ABANDONED_HOURS,
    ):
        self.folder, self.settings, self.rank, self.what, self.command = folder, settings, rank, what, command
        self.digest = settings_digest(settings)
        self.failed: dict[str, str] = {}  # output name -> why, for the shards set aside that failed again
        # beside the folder, not in it: embed removes its parts folder once the table is joined
        self.lock_folder = os.path.join(
            os.path.dirname(os.path.abspath(folder)), f".{os.path.basename(os.path.normpath(folder))}.locks"
        )
        os.makedirs(folder, exist_ok=True)
        remove_gone_partials(folder, abandoned_hours)
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
        """The seal of a finished output, or None when it must be made (again): when a file it covers is
        gone or has another size than it records (`output_bytes` of the output itself, or `files`, each
        file beside it by name). A seal of other settings is an error: mixing them would give a table no
        single command made."""
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
            if theirs and not set(differ) - set(OUTPUT_NEUTRAL):
                return self._intact(output, seal)
            raise ValueError(
                f"{path}: sealed by `{self.command}` with other settings ({', '.join(differ) or 'unknown'}"
                f" differ); rerun with the same settings to finish that job, or write to another --out"
            )
        return self._intact(output, seal)

    @staticmethod
    def _intact(output: str, seal: dict) -> dict | None:
        """`seal` when the files it covers are there at the sizes it records, else None (to be made again)."""
        files = seal.get("files")
        if isinstance(files, dict):  # the output is several files, each beside the nominal one
            folder = os.path.dirname(output)
            if not all(_has_size(os.path.join(folder, name), size) for name, size in files.items()):
                return None
            return seal
        if not _has_size(output, seal.get("output_bytes")):
            return None  # the output was removed or cut short since: its seal no longer holds
        return seal

    def seal(self, output: str, record: dict, files: list[str] | None = None) -> dict:
        """Seal a finished output (already in place): the seal is what says done, so it is written last.
        With `files` (beside `output`, which then only names the seal), the seal covers each of them
        (`files`: name -> bytes) instead of `output` itself (`output_bytes`)."""
        covered = (
            {"output_bytes": os.path.getsize(output)}
            if files is None
            else {"files": {os.path.basename(f): os.path.getsize(f) for f in files}}
        )
        seal = {
            **record,
            **covered,
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

    def work(self, todo: list[int], outputs: list[str], make: Callable[[int], None]) -> None:
        """make(shard) for each shard of `todo`, in order: it writes outputs[shard] and seals it. A shard
        whose store fails after its retries (an http 404, a bucket that answers 503 for minutes) is set
        aside and tried once more after the others, so one unreadable shard costs this rank that shard, not
        the rest of its share; what fails again stays unsealed, for `finish` to report once the rest is
        done. Bad data (and every other error) stops the job at once: it is the same on a second try."""
        set_aside = []
        for shard in todo:
            reason = self._attempt(make, shard, outputs[shard])
            if reason is not None:
                print(
                    f"prunepipe: {self.what}: {self.rank}: {os.path.basename(outputs[shard])} set aside, tried "
                    f"again after the others: {reason}",
                    flush=True,
                )
                set_aside.append(shard)
        for shard in set_aside:
            reason = self._attempt(make, shard, outputs[shard])
            if reason is not None:
                self.failed[os.path.basename(outputs[shard])] = reason

    def _attempt(self, make: Callable[[int], None], shard: int, output: str) -> str | None:
        """None when shard `shard` is done, else why its store failed."""
        try:
            make(shard)
            return None
        except BadInputError as e:
            if not store_failed(e):
                raise
            leftover = partial_path(output)  # what the failed write left
            if os.path.exists(leftover):
                os.remove(leftover)
            return str(e)

    def finish(self, outputs: list[str], write: Callable[[], str], wait_hours: float = WAIT_HOURS) -> str | None:
        """Write the job's result (`write`, returning its path) once every output is sealed: rank 0 after
        the barrier under torchrun; otherwise this process, when it finds every output sealed. Returns
        the path, or None when this process does not write it (and says why). Raises UnsealedShards
        naming the shards this rank set aside and could not read (after the barrier: no rank is left
        waiting for it), or, for rank 0 under torchrun, the shards left unsealed."""
        if self.rank.grouped:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("ShardJob.finish under torchrun needs join_group() first")
            # every rank's part is sealed, or set aside; a rank that is gone is named, after wait_hours at most
            dist.monitored_barrier(timeout=timedelta(hours=wait_hours), wait_all_ranks=True)
            written, missing = None, []
            if self.rank.rank == 0:  # the one writer by construction: no lock
                missing = self.unsealed(outputs)
                written = None if missing else write()
            dist.monitored_barrier(timeout=timedelta(hours=wait_hours), wait_all_ranks=True)  # the index is there
            dist.destroy_process_group()
            self._raise_failed()
            if missing:
                raise UnsealedShards(self._not_sealed(missing, outputs))
            return written
        missing = self.unsealed(outputs)
        if missing:
            print(f"prunepipe: {self.rank}: {self._not_sealed(missing, outputs)}", flush=True)
            self._raise_failed()
            return None
        lock = JobLock(self.lock_folder)
        if not lock.acquire():
            print(f"prunepipe: {self.rank}: another process is writing the index ({lock.describe()})", flush=True)
            return None
        try:
            return write()
        finally:
            lock.release()

    def _not_sealed(self, missing: list[str], outputs: list[str]) -> str:
        names = ", ".join(os.path.basename(m) for m in missing[:5]) + (", ..." if len(missing) > 5 else "")
        return (
            f"{self.what}: {len(missing)} of {len(outputs)} shard(s) not sealed yet ({names}); the index is "
            f"written by the task that seals the last one, or by a rerun of `{self.command}`"
        )

    def _raise_failed(self) -> None:
        if not self.failed:
            return
        named = list(self.failed.items())
        reasons = "; ".join(f"{name}: {why}" for name, why in named[:5]) + ("; ..." if len(named) > 5 else "")
        raise UnsealedShards(
            f"{self.what}: {self.rank}: {len(named)} shard(s) left unsealed, their store failed after its "
            f"retries and again when tried after the others ({reasons}); every other shard of this rank is "
            f"sealed: rerun `{self.command}` to try these again"
        )


class UnsealedShards(BadInputError):
    """A job that finished every shard it could read, and names those it could not."""


def store_failed(error: BaseException) -> bool:
    """A shard the store could not give (a remote read that failed after its retries: ShardReadError),
    not bad data: another try, later, may read it."""
    while error is not None:
        if isinstance(error, ShardReadError):
            return True
        error = error.__cause__
    return False


HEARTBEAT_SECONDS = 30.0  # how often a lock's holder touches its lock
STALE_BEATS = 4  # a holder whose lock missed this many beats is gone ...
MIN_STALE_SECONDS = 300.0  # ... and never sooner: an NFS client may show an mtime a minute old (acregmax)
KEEP_SECONDS = 86400.0  # a lock generation older than this, and not among the two newest, may be removed


class JobLock:
    """One writer at a time of a job's result, among processes that share nothing but a folder (the
    tasks of a SLURM array on NFS or Lustre). `folder` holds numbered generations (000000000000, ...);
    the newest says who holds the lock (state held: host, pid, token, heartbeat period) or that it is
    free. A generation is created whole, by a hard link of a file written before (the link fails when
    the name exists: atomic on a local disk, NFS and Lustre), and never changed after but for its mtime,
    which its holder's heartbeat thread touches every `heartbeat_seconds`.

    Why one holder at most: taking the lock, free or from a holder that is gone, is creating generation
    N+1 over the newest N, and of any number of processes that try, one creates it; each of the others
    finds N+1 there and judges it in turn (held and alive: refused). Nothing is removed or renamed to take
    a lock, so no taker can remove a lock another took meanwhile (check-then-remove takes a stale lock twice),
    and releasing is creating N+1 as free, which fails, leaving the lock as it is, when another took it over.
    A holder is gone when it is of this host (host name and PID namespace) and its process is dead, at
    once, or when its heartbeat is older than STALE_BEATS of its beats (MIN_STALE_SECONDS at least),
    whatever its age: a writer that holds the lock for hours while its heartbeat goes on is never taken
    over. A heartbeat is judged against the mtime of a file the judge has just written in the folder: the
    file system's clock, the one the heartbeats use on NFS, not the judge's.

    A new holder removes the generations older than KEEP_SECONDS, never the two newest: a generation number
    could then be created twice only by a process that saw the folder a day before its link."""

    def __init__(self, folder: str, *, heartbeat_seconds: float = HEARTBEAT_SECONDS, host: str | None = None):
        self.folder, self.heartbeat_seconds = folder, heartbeat_seconds
        self.host = host or host_id()  # another host's name only in tests: a host whose PIDs this one cannot see
        self.token = secrets.token_hex(8)
        self.generation: int | None = None  # the generation this process holds
        self.holder: dict | None = None  # who holds the lock, when `acquire` was refused
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> bool:
        """Take the lock if it is free or its holder is gone; False when a live holder has it (`holder`)."""
        os.makedirs(self.folder, exist_ok=True)
        self.token, self.holder = secrets.token_hex(8), None  # a token per taking: an earlier release's is not ours
        mine = self._written("held")
        try:
            now = os.stat(mine).st_mtime  # the file system's clock
            newest, missing = self._newest(), 0
            while self.generation is None:
                if newest >= 0:
                    found = self._read(newest)
                    if found is None:  # removed as old since it was listed (or unreadable): list again
                        missing += 1
                        if missing > 3:
                            raise RuntimeError(f"{self._path(newest)}: a lock generation listed but not readable")
                        newest = self._newest()
                        continue
                    record, beat = found
                    if record.get("token") == self.token and record.get("state") == "held":
                        # NFS: a retried LINK answered EEXIST, but the first one made it
                        self.generation = newest
                        break
                    if record.get("state") != "free" and not self._gone(record, beat, now):
                        self.holder = {**record, "generation": newest}
                        return False
                try:
                    os.link(mine, self._path(newest + 1))
                    self.generation = newest + 1
                except FileExistsError:
                    newest += 1  # another process made it first: judge theirs
        finally:
            os.remove(mine)
        path = self._path(self.generation)
        self._stop.clear()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(path,), name="prunepipe-lock-heartbeat", daemon=True
        )
        self._heartbeat.start()
        self._remove_old(now)
        return True

    def release(self) -> None:
        """Release the lock if this process still holds it; when another took it over meanwhile (this
        process was judged gone), say so and leave the other's lock as it is."""
        if self.generation is None:
            return
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        free = self._written("free")
        try:
            try:
                os.link(free, self._path(self.generation + 1))
            except FileExistsError:
                found = self._read(self.generation + 1)
                if found is None or found[0].get("token") != self.token:
                    print(
                        f"prunepipe: {self.folder}: the lock was taken over while this process held it (judged "
                        f"gone: no heartbeat for {max(STALE_BEATS * self.heartbeat_seconds, MIN_STALE_SECONDS):g} s); "
                        f"left to its new holder",
                        flush=True,
                    )
        finally:
            os.remove(free)
            self.generation = None

    def describe(self) -> str:
        holder = self.holder or {}
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", 0))))
        return f"{self.folder}: held by {holder.get('host')} pid {holder.get('pid')} since {since}"

    def _beat(self, path: str) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                os.utime(path)  # no times given: the file system's own clock (NFS sets the server's)
            except OSError:
                pass  # a beat missed: the next one may land

    def _path(self, generation: int) -> str:
        return os.path.join(self.folder, f"{generation:012d}")

    def _written(self, state: str) -> str:
        """A file holding this process's record in `state`, written whole, to be linked as a generation."""
        record = {
            "state": state,
            "host": self.host,
            "pid": os.getpid(),
            "token": self.token,
            "heartbeat_seconds": self.heartbeat_seconds,
            "since": time.time(),
        }
        path = os.path.join(self.folder, f"record.{writer_tag()}.partial")  # a killed taker's: remove_gone_partials
        with open(path, "w") as f:  # closed before it is linked: on NFS every client then reads it whole
            json.dump(record, f)
        return path

    def _newest(self) -> int:
        newest = max((int(name) for name in os.listdir(self.folder) if name.isdigit()), default=-1)
        while os.path.exists(self._path(newest + 1)):  # a listing may lag behind on NFS; a name does not
            newest += 1
        return newest

    def _read(self, generation: int) -> tuple[dict, float] | None:
        """(the record, its heartbeat: the mtime) of a generation; None when it is not there."""
        try:
            with open(self._path(generation)) as f:  # an open asks the server (NFS close-to-open): fresh
                beat = os.fstat(f.fileno()).st_mtime
                text = f.read()
        except FileNotFoundError:
            return None
        try:
            record = json.loads(text)
        except ValueError:
            record = {}  # never written so (a link of a whole file): judged by its heartbeat alone
        return (record if isinstance(record, dict) else {}), beat

    def _gone(self, record: dict, beat: float, now: float) -> bool:
        pid = record.get("pid")
        if record.get("host") == self.host and isinstance(pid, int) and not _alive(pid):
            return True
        period = record.get("heartbeat_seconds")
        period = float(period) if isinstance(period, (int, float)) and period > 0 else HEARTBEAT_SECONDS
        return now - beat > max(STALE_BEATS * period, MIN_STALE_SECONDS)

    def _remove_old(self, now: float) -> None:
        remove_gone_partials(self.folder)  # the records of takers killed before their link
        for name in os.listdir(self.folder):
            if name.isdigit() and int(name) < self.generation - 1:
                path = os.path.join(self.folder, name)
                try:
                    if now - os.stat(path).st_mtime > KEEP_SECONDS:
                        os.remove(path)
                except FileNotFoundError:
                    pass


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
