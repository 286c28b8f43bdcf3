"""Preprocessing jobs on a shared file system and a real scheduler, as a specification: of many
processes that find one lock left by a killed writer exactly one takes it, a holder whose heartbeat
goes on is never taken over however old its lock, and no writer removes another's lock; a SLURM array
element finds its place in any index list (a range, a stepped range, a list through scontrol) or is
refused saying what to pass, as are an array of torchrun jobs and `sbatch -n4` without srun; every
temporary name is unique to host, process and call, so writers that share a PID (threads here, as
containers on two hosts would) all succeed; partials of writers that are gone are removed, on this
host and others; a shard whose store fails is set aside, tried again after the others and named at
the end, the rest sealed. Real processes, a real http server, no mocks."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from prunepipe.pipelines.data.shards import BadInputError, ShardIndex
from prunepipe.pipelines.data.side_tables import write_json
from prunepipe.tools.commands.embed import embed_shards
from prunepipe.tools.commands.shard_jobs import JobRank, ShardJob, job_rank, partial_path
from prunepipe.tools.commands.shards import write_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
DAY = 86400.0


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    """The digits at 16 px: a train split of 180 in 3 shards of 60."""
    out = tmp_path_factory.mktemp("images")
    write_shards("digits", str(out), size=16, shard_size=60, val_fraction=0.9)
    return str(out / "train")


# ---- locks -------------------------------------------------------------------------------------------

# N processes race, round after round, for an index lock that a killed writer left (through
# ShardJob.finish, whatever the lock's layout): a winner holds the lock until every racer has decided
RACE = r"""
import json, multiprocessing, os, sys, time
from prunepipe.tools.commands.shard_jobs import JobRank, ShardJob

base, racers, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def job(r, i):
    return ShardJob(os.path.join(base, f"round-{r}", "out"), {"round": r}, JobRank(i, racers, launcher="flags"),
                    what="race", command="race")

def killed_holding(r):
    # takes round r's lock, and every later round's inside it, then is killed holding them all
    job(r, 0).finish([], (lambda: killed_holding(r + 1)) if r + 1 < rounds else (lambda: os._exit(0)))

def racer(i, barrier, decided, results):
    for r in range(rounds):
        this = job(r, i)
        barrier.wait()
        won = False

        def write():
            nonlocal won
            won = True
            with decided[r].get_lock():
                decided[r].value += 1
            deadline = time.monotonic() + 60  # a hang guard only: every racer decides within milliseconds
            while decided[r].value < racers and time.monotonic() < deadline:
                time.sleep(0.0005)
            return "written"

        try:
            this.finish([], write)
            outcome = "won" if won else "refused"
        except Exception as e:
            outcome = f"error {type(e).__name__}: {e}"
        if not won:
            with decided[r].get_lock():
                decided[r].value += 1
        results.put([r, i, outcome])
        barrier.wait()

if __name__ == "__main__":
    child = os.fork()  # this process has imported the job code, and no thread runs yet
    if child == 0:
        sys.setrecursionlimit(20 * rounds + 1000)
        try:
            killed_holding(0)
        finally:
            os._exit(1)
    os.waitpid(child, 0)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(racers), context.Queue()
    decided = [context.Value("i", 0) for _ in range(rounds)]
    processes = [context.Process(target=racer, args=(i, barrier, decided, results)) for i in range(racers)]
    for p in processes:
        p.start()
    found = [results.get(timeout=120) for _ in range(racers * rounds)]
    for p in processes:
        p.join(60)
    with open(os.path.join(base, "results.json"), "w") as f:
        json.dump(found, f)
"""


def test_of_many_processes_racing_for_a_killed_writers_lock_exactly_one_takes_it(tmp_path):
    racers, rounds = 8, 200
    result = subprocess.run(
        [sys.executable, "-c", RACE, str(tmp_path), str(racers), str(rounds)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    found = json.load(open(tmp_path / "results.json"))
    errors = [outcome for _, _, outcome in found if outcome.startswith("error")]
    assert not errors, f"racers failed: {errors[:3]}"
    winners = {r: sorted(i for rr, i, outcome in found if rr == r and outcome == "won") for r in range(rounds)}
    assert all(len(won) == 1 for won in winners.values()), f"rounds with other than one winner: {winners}"


HOLD = """
import os, sys, time
from prunepipe.tools.commands.shard_jobs import JobLock
lock = JobLock(sys.argv[1], heartbeat_seconds=float(sys.argv[2]), host=sys.argv[3] or None)
assert lock.acquire()
print(lock.generation, flush=True)
if sys.argv[4] == "die":
    os._exit(0)  # killed while it holds the lock: no release
time.sleep(3600)
"""


def hold_and_die(folder: str) -> None:
    """Leave `folder`'s lock held by a writer of this host that is gone."""
    subprocess.run([sys.executable, "-c", HOLD, folder, "30", "", "die"], env=ENV, check=True, timeout=TIMEOUT)


def generation_file(folder: str, generation: int) -> str:
    return os.path.join(folder, f"{generation:012d}")


def test_a_holder_whose_heartbeat_goes_on_keeps_its_lock_however_old_and_a_silent_one_loses_it(tmp_path):
    from prunepipe.tools.commands.shard_jobs import JobLock

    folder = str(tmp_path / "lock")
    # a holder on another host (its PID means nothing here): only its heartbeat says it is alive
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, folder, "0.05", "node-a", "hold"], env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        generation = int(holder.stdout.readline())
        path = generation_file(folder, generation)
        old = time.time() - 2 * DAY  # as if it had held the lock for two days, its last beat two days ago
        os.utime(path, (old, old))
        deadline = time.monotonic() + TIMEOUT
        while os.stat(path).st_mtime <= old + 1:  # its heartbeat touches it again
            assert holder.poll() is None and time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.01)
        taker = JobLock(folder)
        assert not taker.acquire(), "a holder whose heartbeat goes on is never taken over"
        assert taker.holder["host"] == "node-a" and "node-a" in taker.describe()
    finally:
        holder.kill()
        holder.wait()
    os.utime(path, (old, old))  # killed: its heartbeat stopped two days ago
    taker = JobLock(folder)
    assert taker.acquire(), "a holder of another host silent for longer than its beats allow is gone"
    assert taker.generation == generation + 1
    taker.release()


def test_a_writer_never_removes_a_lock_another_took_over_from_it(tmp_path, capsys):
    from prunepipe.tools.commands.shard_jobs import JobLock

    folder = str(tmp_path / "lock")
    # a writer judged gone while it writes (another host's, its beats stalled past the limit) ...
    slow = JobLock(folder, heartbeat_seconds=3600, host="node-a")
    assert slow.acquire()
    old = time.time() - DAY
    os.utime(generation_file(folder, slow.generation), (old, old))
    # ... is taken over by one that is alive
    taker = JobLock(folder)
    assert taker.acquire()
    slow.release()  # the slow writer finishes and releases: the taker's lock must stay
    assert "taken over" in capsys.readouterr().out
    third = JobLock(folder)
    assert not third.acquire(), "the taker still holds the lock"
    assert third.holder["token"] == taker.token
    taker.release()
    assert third.acquire(), "released by its holder, the lock is free"
    third.release()


# ---- SLURM ---------------------------------------------------------------------------------------------

SLURM_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_MIN",
    "SLURM_ARRAY_TASK_MAX",
    "SLURM_ARRAY_TASK_COUNT",
    "SLURM_ARRAY_TASK_STEP",
)


@pytest.fixture
def slurm(monkeypatch, tmp_path):
    """Set a launcher's environment from scratch; PATH holds only a folder without scontrol."""
    for name in SLURM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))

    def set_env(**variables):
        for name, value in variables.items():
            if value is None:
                monkeypatch.delenv(name)
            else:
                monkeypatch.setenv(name, str(value))

    return set_env


def test_a_stepped_slurm_array_element_takes_its_place_in_the_range(slurm):
    slurm(SLURM_ARRAY_JOB_ID=100, SLURM_ARRAY_TASK_MIN=0, SLURM_ARRAY_TASK_MAX=14, SLURM_ARRAY_TASK_COUNT=8)
    slurm(SLURM_ARRAY_TASK_STEP=2)  # --array=0-14:2
    ranks = set()
    for task in range(0, 15, 2):
        slurm(SLURM_ARRAY_TASK_ID=task)
        found = job_rank()
        assert found.world == 8 and found.launcher == "slurm-array"
        ranks.add(found.rank)
    assert ranks == set(range(8))
    slurm(SLURM_ARRAY_TASK_ID=6)
    assert job_rank().rank == 3


def test_a_slurm_array_of_a_list_is_placed_by_scontrol_or_refused_saying_what_to_pass(slurm, tmp_path):
    # --array=3,17,42: SLURM says min, max and count, not the list (and no step)
    slurm(SLURM_ARRAY_JOB_ID=100, SLURM_ARRAY_TASK_MIN=3, SLURM_ARRAY_TASK_MAX=42, SLURM_ARRAY_TASK_COUNT=3)
    slurm(SLURM_ARRAY_TASK_ID=17)
    with pytest.raises(ValueError, match=r"scontrol is not on PATH.*--rank \$SLURM_ARRAY_TASK_ID --world 3"):
        job_rank()
    scontrol = tmp_path / "bin" / "scontrol"
    # a scheduler's answer: the finished and running elements a record each, the pending ones one together
    scontrol.write_text(
        "#!/bin/sh\n"
        '[ "$4" = 100 ] || exit 1\n'
        'echo "JobId=101 ArrayJobId=100 ArrayTaskId=3 JobState=COMPLETED"\n'
        'echo "JobId=102 ArrayJobId=100 ArrayTaskId=17 JobState=RUNNING"\n'
        'echo "JobId=100 ArrayJobId=100 ArrayTaskId=42%4 JobState=PENDING"\n'
    )
    scontrol.chmod(0o755)
    found = {}
    for task in (3, 17, 42):
        slurm(SLURM_ARRAY_TASK_ID=task)
        found[task] = (job_rank().rank, job_rank().world)
    assert found == {3: (0, 3), 17: (1, 3), 42: (2, 3)}
    # an element whose siblings' records are gone (MinJobAge) is not guessed
    slurm(SLURM_ARRAY_TASK_COUNT=4, SLURM_ARRAY_TASK_ID=17)
    with pytest.raises(ValueError, match=r"lists 3 indices from 3 to 42, not the 4 from 3 to 42"):
        job_rank()


def test_an_array_of_torchrun_jobs_and_sbatch_tasks_without_srun_are_refused_saying_why(slurm):
    slurm(SLURM_ARRAY_TASK_ID=2, SLURM_ARRAY_TASK_MIN=0, SLURM_ARRAY_TASK_MAX=3, SLURM_ARRAY_TASK_COUNT=4)
    slurm(RANK=1, WORLD_SIZE=8)
    with pytest.raises(ValueError, match=r"an array of torchrun jobs.*ranks are those of one array element"):
        job_rank()
    slurm(RANK=None, WORLD_SIZE=None, SLURM_ARRAY_TASK_ID=None)
    slurm(SLURM_NTASKS=4, SLURM_PROCID=0)  # sbatch -n4, the script itself
    with pytest.raises(ValueError, match=r"SLURM_NTASKS=4 but this is the batch script.*srun"):
        job_rank()
    slurm(SLURM_STEP_ID=0, SLURM_PROCID=3)  # srun's task 3
    assert (job_rank().rank, job_rank().world, job_rank().launcher) == (3, 4, "srun")


# ---- temporary names -----------------------------------------------------------------------------------


def test_temporary_names_carry_host_and_pid_and_differ_at_every_call():
    from prunepipe.pipelines.writer_names import host_id, temporary_name

    first, second = temporary_name("/x/index.json"), temporary_name("/x/index.json")
    assert first != second
    for name in (first, second, partial_path("/x/shard-000001.tar")):
        assert f".{socket.gethostname()}" in name and f".{os.getpid()}-" in name and host_id() in name
    assert partial_path("/x/a.tar").endswith(".partial")


def all_at_once(count: int, work) -> list[BaseException]:
    """`work(i)` on `count` threads of this process (one PID, as containers on two hosts may share),
    started together; the errors they raised."""
    barrier, errors = threading.Barrier(count), []

    def run(i):
        barrier.wait()
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - every failure is the test's finding
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_writers_that_share_a_pid_all_write_the_settings_file_and_the_index(tmp_path):
    for round in range(5):
        folder = tmp_path / f"round-{round}"
        settings = {"vae": "v", "rows": list(range(2000))}  # a settings file of some size: writes overlap

        def start_job(i):
            ShardJob(str(folder), settings, JobRank(i, 16, launcher="flags"), what="latents encode", command="x")

        assert not all_at_once(16, start_job), "every rank starts its job"
        (written,) = [name for name in os.listdir(folder) if name.startswith("job-")]
        assert json.load(open(folder / written))["settings"] == settings

        def write_index(i):
            ShardIndex.write(str(folder), [(f"shard-{k:06d}.tar", 10) for k in range(500)], written_by=i)

        assert not all_at_once(16, write_index), "every rank that seals a last shard writes the index"
        assert len(ShardIndex.load(str(folder))) == 500
        assert not all_at_once(16, lambda i: write_json(str(folder / "seal.json"), settings))
        assert sorted(os.listdir(folder)) == sorted([written, "index.json", "seal.json"]), "no temporary left"


# ---- leftover partials ---------------------------------------------------------------------------------


def partial_of_a_writer_gone(output: str) -> str:
    """The partial name a writer of this host used for `output`, that writer now gone."""
    script = (
        "import sys; from prunepipe.tools.commands.shard_jobs import partial_path; print(partial_path(sys.argv[1]))"
    )
    name = subprocess.run([sys.executable, "-c", script, output], env=ENV, capture_output=True, text=True, check=True)
    return os.path.basename(name.stdout.strip())


def test_partials_of_writers_gone_are_removed_on_this_host_and_others_and_only_those(images, tmp_path):
    split = tmp_path / "split"
    shutil.copytree(images, split)
    folder = split / "embeddings"
    folder.mkdir()
    left = {
        "killed join": partial_of_a_writer_gone(str(folder / "phash.npy")),  # this host, its process dead
        "older killed join": "phash.npy.4141.partial",  # an older version's name, no host: by its age
        "other host, silent": "other.npy.node-b.cluster.4242-89abcdef.partial",  # unchanged for two days
        "other host, writing": "other.npy.node-b.cluster.4343-89abcdef.partial",  # changed just now
        "alive": os.path.basename(partial_path(str(folder / "third.npy"))),  # this host, its process alive
    }
    for what, name in left.items():
        (folder / name).write_bytes(b"half a table")
        if what in ("older killed join", "other host, silent"):
            old = time.time() - 2 * DAY
            os.utime(folder / name, (old, old))
    embed_shards(str(split), "phash", batch_size=60)
    there = set(os.listdir(folder))
    assert not {left["killed join"], left["older killed join"], left["other host, silent"]} & there
    assert {left["other host, writing"], left["alive"]} <= there

    # the same rule in a job's folder, the hours of another host's silence a setting
    job_folder = tmp_path / "job"
    job_folder.mkdir()
    hours_ago = {"two hours": 2, "half an hour": 0.5}
    for what, hours in hours_ago.items():
        name = job_folder / f"shard-{int(hours * 10):06d}.tar.node-b.77-0123abcd.partial"
        name.write_bytes(b"half a tar")
        os.utime(name, (time.time() - hours * 3600,) * 2)
    ShardJob(str(job_folder), {}, JobRank(0, 1), what="latents encode", command="x", abandoned_hours=1)
    assert sorted(n for n in os.listdir(job_folder) if n.endswith(".partial")) == [
        "shard-000005.tar.node-b.77-0123abcd.partial"
    ], "another host's partial silent for 2 h of 1 allowed goes, one silent for half an hour stays"


# ---- a shard whose store fails -------------------------------------------------------------------------


@contextlib.contextmanager
def serving(folder: str, gone: set[str] = frozenset(), once: set[str] = frozenset(), watch=None):
    """http://127.0.0.1:PORT/NAME for every file of `folder`: a 404 for the names in `gone` always and
    for those in `once` at their first request. Yields (base url, requests: name -> what `watch()` said
    at each request)."""
    requests: dict[str, list] = {}
    failed_once: set[str] = set()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.lstrip("/")
            requests.setdefault(name, []).append(watch() if watch else None)
            if name in gone or (name in once and name not in failed_once):
                failed_once.add(name)
                self.send_error(404)
                return
            data = open(os.path.join(folder, name), "rb").read()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


def split_served(images: str, out, served: dict[int, str]) -> str:
    """A split of `images`' shards, those in `served` (shard -> url) read from there, its index by hand."""
    index = ShardIndex.load(images)
    os.makedirs(out)
    shards = [
        {"url": served.get(k, os.path.abspath(url)), "num_samples": int(count)}
        for k, (url, count) in enumerate(zip(index.urls, index.counts))
    ]
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump({"shards": shards, "size": 16}, f)
    return str(out)


def sealed_parts(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith("_stats.json")) if os.path.isdir(folder) else []


def test_an_unreadable_shard_is_set_aside_tried_again_after_the_others_and_named_at_the_end(images, tmp_path, capsys):
    split = tmp_path / "split"
    parts = str(split / "embeddings" / "phash.parts")
    with serving(images, gone={"shard-000000.tar"}, watch=lambda: sealed_parts(parts)) as (base, requests):
        split_served(images, split, {0: f"{base}/shard-000000.tar"})
        with pytest.raises(BadInputError) as raised:
            embed_shards(str(split), "phash", batch_size=60)
    message = str(raised.value)
    assert "1 shard(s) left unsealed" in message and "shard-000000.npy" in message and "HTTP 404" in message
    assert "rerun `prunepipe shards embed" in message
    assert "shard-000000.npy set aside, tried again after the others" in capsys.readouterr().out
    assert sealed_parts(parts) == ["shard-000001_stats.json", "shard-000002_stats.json"], "the rest sealed"
    assert requests["shard-000000.tar"] == [[], sealed_parts(parts)], "tried first, then again after the others"
    assert not [name for name in os.listdir(parts) if name.endswith(".partial")]


def test_a_shard_the_store_gives_when_tried_again_is_sealed_and_the_table_written(images, tmp_path):
    whole = embed_shards(images, "phash", name="whole", batch_size=60)
    split = tmp_path / "split"
    with serving(images, once={"shard-000001.tar"}) as (base, requests):
        split_served(images, split, {1: f"{base}/shard-000001.tar"})
        path = embed_shards(str(split), "phash", name="whole", batch_size=60)
    assert len(requests["shard-000001.tar"]) == 2
    assert np.array_equal(np.load(path), np.load(whole)), "the same rows as from local shards"


def test_the_command_exits_non_zero_with_the_summary_not_a_traceback(images, tmp_path):
    split = tmp_path / "split"
    with serving(images, gone={"shard-000002.tar"}) as (base, _):
        split_served(images, split, {2: f"{base}/shard-000002.tar"})
        command = [sys.executable, "-m", "prunepipe.launch.cli", "shards", "embed", str(split), "--model", "phash"]
        result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    assert "prunepipe: error: embed phash: rank 0/1: 1 shard(s) left unsealed" in result.stderr
    assert "shard-000002.npy: shard http://127.0.0.1" in result.stderr and "404" in result.stderr


# ---- what a job is known by ----------------------------------------------------------------------------


def test_embed_knows_its_model_by_its_weights_not_the_path_they_were_read_from(images, tmp_path, capsys):
    from prunepipe.pipelines.evaluation.features import SmallClassifier, save_classifier

    split = tmp_path / "split"
    shutil.copytree(images, split)
    first, staged, later = (str(tmp_path / where / "net.safetensors") for where in ("models", "tmp", "scratch"))
    os.makedirs(os.path.dirname(first))
    save_classifier(SmallClassifier(in_channels=3, widths=(4, 8)), first)
    for copy in (staged, later):
        os.makedirs(os.path.dirname(copy))
        shutil.copy(first, copy)
    embed = dict(name="net", batch_size=60, device="cpu")
    assert embed_shards(str(split), f"feature-net:{first}", rank=1, world=2, **embed) is None
    # the same weights staged elsewhere by the next task: the same job, continued and joined
    path = embed_shards(str(split), f"feature-net:{staged}", rank=0, world=2, **embed)
    assert path and json.load(open(path[: -len(".npy")] + ".json"))["weights"] == os.path.abspath(staged)
    capsys.readouterr()
    # a requeue after the join, from a third copy: the table is whole, nothing is redone
    assert embed_shards(str(split), f"feature-net:{later}", rank=1, world=2, **embed) == path
    assert "is complete, made with these settings" in capsys.readouterr().out


def test_a_seal_whose_settings_differ_only_in_the_bad_sample_policy_is_the_same_jobs(tmp_path):
    """Seals of jobs that put --on-bad-sample in their digest (which changes no output) still count."""
    folder, output = str(tmp_path / "out"), str(tmp_path / "out" / "shard-000000.tar")
    earlier = ShardJob(folder, {"vae": "v", "on_bad_sample": "stop"}, JobRank(0, 1), what="latents encode", command="x")
    with open(output, "wb") as f:
        f.write(b"a sealed tar")
    earlier.seal(output, {"skipped": []})
    now = ShardJob(folder, {"vae": "v"}, JobRank(0, 1), what="latents encode", command="x")
    assert now.digest != earlier.digest and now.sealed(output)["output_bytes"] == 12
    other = ShardJob(folder, {"vae": "w"}, JobRank(0, 1), what="latents encode", command="prunepipe latents encode")
    with pytest.raises(ValueError, match=r"other settings \(on_bad_sample, vae differ\)"):
        other.sealed(output)
