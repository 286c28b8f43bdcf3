"""Preprocessing split over processes as a specification: `latents encode` on two torchrun ranks
(real gloo) writes each shard once and one index, the same bytes as one process; a SIGKILLed encode
resumes without redoing its sealed shards; bad samples are skipped, recorded and counted (or stop the
job, named); a caption falls back to img2dataset's json; `shards embed` shared by `--rank/--world`
processes that never meet gives one process's table, written by the one that seals the last shard."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import webdataset as wds
from eval_runs import tiny_vae
from PIL import Image
from test_distributed import free_port

from prunepipe.pipelines.data.shards import BadInputError, ShardIndex, read_shard
from prunepipe.pipelines.data.side_tables import open_embeddings
from prunepipe.tools.commands.embed import embed_shards
from prunepipe.tools.commands.latents import SKIPPED_FILE, encode_shards
from prunepipe.tools.commands.shards import write_shards
from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_text_encoder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    """The digits at 16 px: a train split of 180 in 3 shards of 60 (its index records size 16)."""
    out = tmp_path_factory.mktemp("images")
    write_shards("digits", str(out), size=16, shard_size=60, val_fraction=0.9)
    assert ShardIndex.load(str(out / "train")).counts.tolist() == [60, 60, 60]
    return str(out / "train")


@pytest.fixture(scope="module")
def vae(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("vae"))
    tiny_vae(3, 16).save_pretrained(folder)
    return folder


def encode_on_one_thread(*args, **kwargs) -> str:
    """encode_shards in this process on one thread, as each launched process runs (OMP_NUM_THREADS=1):
    a convolution's float sums follow the thread count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return encode_shards(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_process(images, vae, tmp_path_factory) -> str:
    """The images encoded by this process alone (the resolution from the index)."""
    out = str(tmp_path_factory.mktemp("one") / "latents")
    assert encode_on_one_thread(images, vae, out, batch_size=16) == os.path.join(out, "index.json")
    return out


def tars(folder: str) -> dict[str, bytes]:
    return {
        name: open(os.path.join(folder, name), "rb").read()
        for name in sorted(os.listdir(folder))
        if name.endswith(".tar")
    }


def seals(folder: str) -> dict[str, dict]:
    return {
        name: json.load(open(os.path.join(folder, name)))
        for name in sorted(os.listdir(folder))
        if name.endswith("_stats.json")
    }


def encode_command(images, vae, out, *extra) -> list[str]:
    return [
        "-m",
        "prunepipe.launch.cli",
        "latents",
        "encode",
        images,
        "--vae",
        vae,
        "--out",
        out,
        "--batch-size",
        "16",
        *extra,
    ]


def test_two_torchrun_ranks_write_each_shard_once_and_one_index(images, vae, one_process, tmp_path):
    out = str(tmp_path / "two")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        *encode_command(images, vae, out),
    ]
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    written = seals(out)
    assert [seal["rank"] for seal in written.values()] == [0, 1, 0], "shard i is rank i % 2's, written by it alone"
    assert all(seal["world"] == 2 for seal in written.values())
    assert output.count("sealed (") == 3, "three shards encoded in all, none twice"
    assert not [name for name in os.listdir(out) if "partial" in name or "tmp" in name or "lock" in name]
    assert tars(out) == tars(one_process), "the same bytes as one process"
    assert json.load(open(os.path.join(out, "index.json"))) == json.load(open(os.path.join(one_process, "index.json")))
    assert output.count("index.json") == 2, "one index, printed by rank 0: its line and the path"


def test_a_killed_encode_resumes_without_redoing_sealed_shards(digits_shards, vae, tmp_path):
    # 12 shards of 15 images in batches of 1: slow enough to be killed between seals
    from eval_runs import digit_shards

    images = digit_shards(digits_shards, tmp_path / "images", shards=12, per_shard=15)
    out = str(tmp_path / "latents")
    run = [sys.executable, *encode_command(images, vae, out, "--resolution", "16", "--batch-size", "1")]
    process = subprocess.Popen(run, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT
    while not seals(out) if os.path.isdir(out) else True:
        assert process.poll() is None and time.monotonic() < deadline, "the encode ended before its first seal"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = seals(out)
    assert 1 <= len(before) < 12, f"{len(before)} shards sealed when killed"
    assert not os.path.exists(os.path.join(out, "index.json"))
    stamps = {name: os.stat(os.path.join(out, name[: -len("_stats.json")] + ".tar")).st_mtime_ns for name in before}

    result = subprocess.run(run, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert f"{len(before)} sealed earlier" in result.stdout
    assert result.stdout.count("sealed (") == 12 - len(before), "only the unsealed shards were encoded"
    for name, stamp in stamps.items():
        assert os.stat(os.path.join(out, name[: -len("_stats.json")] + ".tar")).st_mtime_ns == stamp, f"{name} redone"
    clean = str(tmp_path / "clean")
    encode_on_one_thread(images, vae, clean, resolution=16, batch_size=1)
    assert tars(out) == tars(clean)
    assert not [name for name in os.listdir(out) if name.endswith(".partial")]


def img2dataset_shard(path, samples: list[tuple[str, bytes, dict, str | None]]) -> None:
    """(key, jpg bytes, json metadata, txt or None) as img2dataset writes them."""
    with wds.TarWriter(path) as sink:
        for key, jpg, meta, text in samples:
            sample = {"__key__": key, "jpg": jpg, "json": json.dumps(meta)}
            if text is not None:
                sample["txt"] = text
            sink.write(sample)


def jpeg(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def messy(tmp_path_factory) -> tuple[str, str]:
    """Two img2dataset shards of 6: key 000003's JPEG is cut off, 000004 has no caption at all, and
    000008 has its caption only in its json. Returns (the indexed folder, a tiny text encoder)."""
    from prunepipe.tools.commands.shards import index_shards

    folder = tmp_path_factory.mktemp("messy")
    words = ["a", "photo", "of", "noise"]
    samples = []
    for i in range(12):
        key, caption = f"{i:09d}", f"a photo of noise {i}"
        data, meta, text = jpeg(i), {"key": f"{i:09d}", "status": "success", "caption": caption}, caption
        if i == 3:
            data = data[: len(data) // 3]
        if i == 4:
            meta, text = {"key": key, "status": "success"}, None
        if i == 8:
            text = None
        samples.append((key, data, meta, text))
        words.append(str(i))
    for shard in range(2):
        img2dataset_shard(str(folder / f"{shard:05d}.tar"), samples[shard * 6 : (shard + 1) * 6])
    index_shards([str(folder)], str(folder), workers=1)
    encoder = write_tiny_text_encoder(
        str(tmp_path_factory.mktemp("encoder")), [" ".join(words)], hidden_size=16, layers=1, max_length=8
    )
    return str(folder), encoder


def test_skipped_samples_are_recorded_and_counted_and_stop_names_shard_and_key(messy, vae, tmp_path):
    folder, encoder = messy
    with pytest.raises(BadInputError, match=r"00000\.tar key '000000003'.*--on-bad-sample stop"):
        encode_shards(folder, vae, str(tmp_path / "stopped"), resolution=16, text_encoder=encoder)

    out = str(tmp_path / "skipped")
    index_path = encode_shards(folder, vae, out, resolution=16, text_encoder=encoder, on_bad_sample="skip")
    skipped = json.load(open(os.path.join(out, SKIPPED_FILE)))
    assert [entry["key"] for entry in skipped["samples"]] == ["000000003", "000000004"]
    assert skipped["count"] == 2
    assert "cannot decode" in skipped["samples"][0]["reason"] and "no caption" in skipped["samples"][1]["reason"]
    index = ShardIndex.load(index_path)
    assert index.counts.tolist() == [4, 6] and index.meta["skipped"] == 2
    assert index.meta["text_encoder"]["max_length"] == 8, "the caption length from the encoder"
    keys = [sample["__key__"] for url in index.urls for _, sample in read_shard(url)]
    assert "000000008" in keys, "a caption in the json alone is a caption"
    assert [s["failed_to_decode"] for s in seals(out).values()] == [2, 0]


def test_an_encode_stopped_by_a_bad_sample_continues_when_retried_with_skip_into_the_same_out(messy, vae, tmp_path):
    from prunepipe.tools.commands.shards import index_shards

    folder, encoder = messy
    clean_first = str(tmp_path / "images")  # the clean shard first: it is sealed before the bad one stops the job
    index_shards([os.path.join(folder, "00001.tar"), os.path.join(folder, "00000.tar")], clean_first, workers=1)
    out = str(tmp_path / "latents")
    with pytest.raises(BadInputError, match=r"00000\.tar key '000000003'.*--on-bad-sample stop; skip leaves"):
        encode_shards(clean_first, vae, out, resolution=16, text_encoder=encoder)
    [(name, sealed)] = seals(out).items()
    assert sealed["on_bad_sample"] == "stop" and not sealed["skipped"]
    written = tars(out)

    # the retry the error suggests: the sealed shard is this job's (the policy changes no output), not redone
    index = ShardIndex.load(
        encode_shards(clean_first, vae, out, resolution=16, text_encoder=encoder, on_bad_sample="skip")
    )
    assert tars(out)[name.replace("_stats.json", ".tar")] == written[name.replace("_stats.json", ".tar")]
    assert seals(out)[name] == sealed, "the shard sealed under stop was kept, not encoded again"
    assert index.counts.tolist() == [6, 4] and index.meta["skipped"] == 2
    assert len({seal["settings_digest"] for seal in seals(out).values()}) == 1


def test_embed_shared_by_processes_that_never_meet_gives_one_process_table(images, tmp_path, capsys):
    whole = embed_shards(images, "phash", name="whole", batch_size=16)
    capsys.readouterr()
    assert embed_shards(images, "phash", name="split", batch_size=16, rank=1, world=2) is None, (
        "shard 0 and 2 are rank 0's and unsealed: the table waits"
    )
    said = capsys.readouterr().out
    assert "2 of 3 shard(s) not sealed yet (shard-000000.npy, shard-000002.npy)" in said, said
    assert "written by the task that seals the last one" in said
    from test_job_storage import hold_and_die

    lock = os.path.join(images, "embeddings", ".split.parts.locks")
    hold_and_die(lock)  # a writer killed while it held the lock
    path = embed_shards(images, "phash", name="split", batch_size=16, rank=0, world=2)
    assert open(path, "rb").read() == open(whole, "rb").read()
    from prunepipe.tools.commands.shard_jobs import JobLock

    after = JobLock(lock)
    assert after.acquire(), f"the gone writer's lock taken over, then released ({after.describe()})"
    after.release()
    table = open_embeddings(images, "split")
    assert table.header["missing"]["count"] == 0 and len(table) == 180
    assert not os.path.exists(os.path.join(images, "embeddings", "split.parts"))
    # a requeue of either task after the join finds the table whole: it neither redoes nor removes it
    assert embed_shards(images, "phash", name="split", batch_size=16, rank=1, world=2) == path
    assert open(path, "rb").read() == open(whole, "rb").read()


def test_an_array_element_running_several_srun_tasks_gives_each_a_share(monkeypatch):
    from prunepipe.tools.commands.shard_jobs import job_rank

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "13")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "10")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MAX", "13")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # srun's tasks, not the batch script
    ranks = set()
    for task in range(8):
        monkeypatch.setenv("SLURM_PROCID", str(task))
        found = job_rank()
        assert found.world == 32
        ranks.add(found.rank)
    assert ranks == set(range(24, 32)), "element 3 of 4, its 8 tasks: ranks 24..31, none shared"


def test_embed_stops_on_a_bad_sample_when_asked(tmp_path):
    from test_embeddings import noise_image, png, write_split

    samples = [{"__key__": f"s{i:04d}", "png": png(noise_image(i))} for i in range(8)]
    samples[5] = {"__key__": "s0005", "png": b"not an image"}
    split = write_split(tmp_path / "split", samples, shard_size=4)
    with pytest.raises(BadInputError, match=r"shard-000001\.tar key 's0005'.*--on-bad-sample stop"):
        embed_shards(split, "phash", batch_size=4, on_bad_sample="stop")


def test_a_rerun_removes_the_partials_of_writers_that_are_gone_and_only_those(tmp_path):
    from prunepipe.tools.commands.shard_jobs import JobRank, ShardJob

    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    left = {
        "gone": f"shard-000001.tar.{host}.{gone.pid}.partial",
        "alive": f"shard-000002.tar.{host}.{os.getpid()}.partial",
        "elsewhere": f"shard-000003.tar.other.host.{gone.pid}.partial",
    }
    for name in left.values():
        (tmp_path / name).write_bytes(b"half a tar")
    ShardJob(str(tmp_path), {"vae": "v"}, JobRank(0, 1), what="latents encode", command="prunepipe latents encode")
    assert not (tmp_path / left["gone"]).exists(), "a killed writer's leftover on this host is removed"
    assert (tmp_path / left["alive"]).exists() and (tmp_path / left["elsewhere"]).exists(), (
        "a live writer's, and another host's (whose writers this host cannot see), are left"
    )


def test_latents_encode_sets_an_unreadable_shard_aside_and_names_it_after_sealing_the_rest(images, vae, tmp_path):
    from test_job_storage import sealed_parts, serving, split_served

    out = str(tmp_path / "latents")
    with serving(images, gone={"shard-000000.tar"}) as (base, requests):
        split = split_served(images, tmp_path / "split", {0: f"{base}/shard-000000.tar"})
        with pytest.raises(BadInputError, match=r"1 shard\(s\) left unsealed.*shard-000000\.tar: .*HTTP 404"):
            encode_shards(split, vae, out, batch_size=16)
    assert len(requests["shard-000000.tar"]) == 2, "tried once more after the others"
    assert sealed_parts(out) == ["shard-000001_stats.json", "shard-000002_stats.json"], "the rest sealed"
    assert not os.path.exists(os.path.join(out, "index.json"))
    assert not [name for name in os.listdir(out) if name.endswith(".partial")]


def test_a_vae_and_text_encoder_are_known_by_their_files_not_their_folders(messy, vae, tmp_path):
    folder, encoder = messy
    out = str(tmp_path / "latents")
    common = dict(resolution=16, on_bad_sample="skip", world=2)
    assert encode_shards(folder, vae, out, text_encoder=encoder, rank=1, **common) is None
    # the same files staged elsewhere ($TMPDIR on the node of a requeue): the same job, continued
    staged_vae, staged_encoder = str(tmp_path / "tmp" / "vae"), str(tmp_path / "tmp" / "encoder")
    shutil.copytree(vae, staged_vae)
    shutil.copytree(encoder, staged_encoder)
    index_path = encode_shards(folder, staged_vae, out, text_encoder=staged_encoder, rank=0, **common)
    assert index_path == os.path.join(out, "index.json")
    assert len({seal["settings_digest"] for seal in seals(out).values()}) == 1


def test_new_weights_at_the_same_path_are_another_vae(images, tmp_path):
    import torch

    folder = str(tmp_path / "vae")
    tiny_vae(3, 16).save_pretrained(folder)
    out = str(tmp_path / "latents")
    assert encode_shards(images, folder, out, batch_size=16, rank=1, world=2) is None
    before = {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}
    retrained = tiny_vae(3, 16)
    with torch.no_grad():
        next(retrained.parameters()).add_(0.5)
    retrained.save_pretrained(folder)  # the same config, the same path, other weights
    after = {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}
    assert before["config.json"] == after["config.json"] and before != after
    with pytest.raises(ValueError, match=r"shard-000001_stats\.json: sealed by .* with other settings \(vae differ\)"):
        encode_shards(images, folder, out, batch_size=16, rank=0, world=2)


def test_latents_encode_over_a_lying_store_writes_the_same_bytes_or_names_url_offset_and_cause(
    images, vae, one_process, tmp_path
):
    from prunepipe.pipelines.data.remote import ReadRetry
    from prunepipe.tools.commands.shard_jobs import UnsealedShards
    from prunepipe.tools.fixtures.fault_server import Fault, FaultServer

    index = ShardIndex.load(images)
    names = [os.path.basename(url) for url in index.urls]
    quick = ReadRetry(retries=3, timeout_seconds=5.0, deadline_seconds=30.0, backoff_seconds=0.0)
    with FaultServer() as server:
        for url, name in zip(index.urls, names):
            server.put(name, open(url, "rb").read())
        served = str(tmp_path / "served")
        os.makedirs(served)
        ShardIndex.write(
            served,
            [
                (server.url(n), int(c), int(s), int(k))
                for n, c, s, k in zip(names, index.counts, index.sizes, index.crcs)
            ],
            **index.meta,
        )
        half = int(index.sizes[0]) // 2
        server.fault(names[0], Fault("drop", at=half), Fault("lie_range"))
        server.fault(names[1], Fault("busy", seconds=0), Fault("drop", at=half), Fault("ignore_range"))
        server.fault(names[2], Fault("no_terminator"))
        out = str(tmp_path / "lying")
        encode_on_one_thread(served, vae, out, batch_size=16, retry=quick)
        assert tars(out) == tars(one_process), "every latent as from the local images"

        other = open(index.urls[2], "rb").read()
        server.fault(names[1], Fault("drop", at=half), *(Fault("replace", data=other) for _ in range(2)))
        with pytest.raises(UnsealedShards) as caught:
            encode_on_one_thread(served, vae, str(tmp_path / "replaced"), batch_size=16, retry=quick)
    message = str(caught.value)
    assert server.url(names[1]) in message and re.search(r"at byte \d+", message), message
    assert "changed between attempts" in message or "changed since it was indexed" in message, message
    written = sorted(n for n in os.listdir(tmp_path / "replaced") if n.endswith(".tar"))
    assert written == ["shard-000000.tar", "shard-000002.tar"], "the other shards are sealed"


def test_latents_encode_reads_remote_shards_with_the_retry_settings_it_is_given(images, vae, tmp_path):
    from prunepipe.launch.cli import main
    from prunepipe.tools.fixtures.fault_server import Fault, FaultServer

    index = ShardIndex.load(images)
    with FaultServer() as server:
        served = str(tmp_path / "served")
        os.makedirs(served)
        for url in index.urls:
            server.put(os.path.basename(url), open(url, "rb").read())
        ShardIndex.write(
            served, [(server.url(os.path.basename(u)), int(c)) for u, c in zip(index.urls, index.counts)], **index.meta
        )
        for name in map(os.path.basename, index.urls):  # two for the first run (its read, its retry at the end)
            server.fault(name, *(Fault("drop", at=1000) for _ in range(3)))
        flags = ["--vae", vae, "--batch-size", "16", "--read-timeout", "5"]
        assert main(["latents", "encode", served, "--out", str(tmp_path / "none"), *flags, "--read-retries", "0"]) != 0
        assert main(["latents", "encode", served, "--out", str(tmp_path / "one"), *flags, "--read-retries", "1"]) == 0
    # the first run: its read and the retry after the others, no reopen; the second: a read and one reopen
    assert len(server.statuses(os.path.basename(index.urls[0]))) == 4
