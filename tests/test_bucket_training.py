"""Text-to-image on aspect-ratio buckets end to end, as a specification: photo crops in four aspect
ratios -> `latents encode --buckets` -> latents at four shapes -> the tiny bucketed PixArt recipe
(configs/ldm_t2i_tiny_buckets.yaml) trains in batches of one bucket, reports each bucket, and a run
stopped mid-pass (killed, on two gloo ranks) resumes bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from test_distributed import LAUNCHERS, free_port
from test_trainer import ROOT, assert_states_equal, final_state

from prunepipe.pipelines.checkpoint.store import latest_checkpoint
from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.training.loop import train
from prunepipe.tools.benchmarks.rehearse_cluster import kill_node
from prunepipe.tools.fixtures.bucketed_photos import write_bucketed_photos

CONFIG = os.path.join(ROOT, "configs", "ldm_t2i_tiny_buckets.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory) -> str:
    """The recipe's data as its comment makes it, smaller: 8 crops of each photograph, 2 of each aspect."""
    return write_bucketed_photos(str(tmp_path_factory.mktemp("aspects")))


def overrides(latents: str, runs: str, name: str, *extra: str) -> list[str]:
    return [
        f"data.train={latents}/train",
        f"data.val={latents}/val",
        "data.batch_size=4",
        "data.val_batches=1",
        "num_passes=2",
        "checkpoint.every_steps=5",
        "pruner={name: infobatch, prune_ratio: 0.5, delta: 0.75}",  # pass 2 prunes: the plan shapes each bucket
        f"runs_dir={runs}",
        f"name={name}",
        *extra,
    ]


def test_a_bucketed_run_trains_on_four_shapes_and_stopped_mid_pass_resumes_bitwise(bucketed, tmp_path):
    index = ShardIndex.load(os.path.join(bucketed, "train"))
    used = sorted({index.bucket_shapes[b] for b in index.buckets})
    assert used == [(4, 12, 16), (4, 16, 16), (4, 16, 32), (4, 32, 16)], "4:3, 1:1, 2:1 and 1:2 crops"
    straight = load_config(CONFIG, overrides(bucketed, str(tmp_path), "straight"))
    train(straight)
    first = next(json.loads(line) for line in open(os.path.join(straight.run_dir, "metrics.jsonl")) if '"pass"' in line)
    buckets = first["buckets"]
    assert set(buckets) == {"32x32", "32x64", "64x32", "24x32"}
    assert sum(b["kept"] for b in buckets.values()) == index.num_samples, "pass 1 keeps everything"
    forwarded = sum(b["forwarded"] for b in buckets.values())
    assert forwarded == first["steps_in_pass"] * 4 == first["samples_forwarded"], "every batch is real and whole"
    assert first["tail"] == index.num_samples - forwarded <= 4 * 3, "at most batch - 1 left in each bucket"
    assert all(np.isfinite(b["train_loss"]) for b in buckets.values())

    # the export draws at a bucket's size in the stock pipeline, as its README says
    from diffusers import DiffusionPipeline

    export = os.path.join(straight.run_dir, "export")
    assert "height=24, width=32" in open(os.path.join(export, "README.md")).read()
    pipe = DiffusionPipeline.from_pretrained(export)
    drawn = pipe(
        "a wide crop of the coffee photograph, centre",
        height=32,
        width=64,
        num_inference_steps=2,
        max_sequence_length=16,
        use_resolution_binning=False,
        clean_caption=False,
        output_type="np",
    ).images
    assert drawn.shape == (1, 32, 64, 3) and np.isfinite(drawn).all()

    steps = json.loads(open(os.path.join(straight.run_dir, "metrics.jsonl")).readlines()[-1])["optimizer_steps"]
    stop_at = (first["steps_in_pass"] + steps) // 2  # mid-pass 2: the rest replays each bucket's stream exactly
    train(load_config(CONFIG, overrides(bucketed, str(tmp_path), "resumed", f"max_steps={stop_at}")))
    train(load_config(CONFIG, overrides(bucketed, str(tmp_path), "resumed", "checkpoint.resume=latest")))
    (_, weights_a, pruner_a), (_, weights_b, pruner_b) = (
        final_state(straight.run_dir),
        final_state(str(tmp_path / "resumed")),
    )
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert_states_equal(pruner_a, pruner_b)

    from prunepipe.pipelines.report.compare import compare_runs

    report = compare_runs([straight.run_dir], [str(tmp_path / "resumed")], out=str(tmp_path / "report"), plots=False)
    last = [json.loads(line) for line in open(os.path.join(straight.run_dir, "metrics.jsonl")) if '"pass"' in line][-1]
    assert {k: v["forwarded"] for k, v in report["buckets"]["straight"].items()} == {
        k: v["forwarded"] for k, v in last["buckets"].items()
    }
    assert abs(sum(v["share"] for v in report["buckets"]["resumed"].values()) - 1.0) < 1e-9
    assert "## Per aspect-ratio bucket" in report["markdown"] and "| 32x64 |" in report["markdown"]


def torchrun(args: list[str]) -> subprocess.Popen:
    command = [*LAUNCHERS["torchrun"](2, free_port()), "-m", "prunepipe.launch.cli", "train", CONFIG, *args]
    return subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


@pytest.mark.slow  # three torchrun launches of two gloo ranks, about 90 s on 2 cores
def test_a_bucketed_run_on_two_gloo_ranks_killed_mid_pass_resumes_bitwise(bucketed, tmp_path):
    """Equal steps on both ranks (a rank with fewer would leave the other in a collective: the run would
    hang, not finish), SIGKILL of the whole launch after a mid-pass checkpoint, a requeue with resume=latest."""
    straight = torchrun(overrides(bucketed, str(tmp_path), "straight", "data.num_workers=2"))
    output = straight.communicate(timeout=600)[0]
    assert straight.returncode == 0, output[-4000:]
    passes = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl") if '"pass"' in line]
    assert len(passes) == 2 and all(p["samples_forwarded"] > 0 for p in passes)
    assert passes[1]["samples_forwarded"] == (passes[0]["steps_in_pass"] + passes[1]["steps_in_pass"]) * 2 * 4

    args = overrides(bucketed, str(tmp_path), "killed", "data.num_workers=2")
    killed = torchrun(args)
    target = tmp_path / "killed" / "checkpoints" / f"step_{5 * (passes[0]['steps_in_pass'] // 5 + 1):06d}"
    deadline = time.time() + 300
    while not target.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    kill_node(killed)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert latest_checkpoint(str(tmp_path / "killed")) == str(target), "killed mid-pass 2, after its checkpoint"

    resumed = torchrun(args + ["checkpoint.resume=latest"])
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output[-4000:]
    assert f"resumed from {target}" in output
    (_, weights_a, pruner_a), (_, weights_b, pruner_b) = (
        final_state(str(tmp_path / "straight")),
        final_state(str(tmp_path / "killed")),
    )
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert_states_equal(pruner_a, pruner_b)


def test_bucketed_latents_are_refused_where_images_are_expected(bucketed, tmp_path):
    from prunepipe.pipelines.config import ConfigError, check_data

    cfg = load_config(CONFIG, overrides(bucketed, str(tmp_path), "pixels", "ldm.space=pixel"))
    with pytest.raises(ConfigError, match=r"bucketed by aspect ratio.*ldm.space=pixel"):
        check_data(cfg)
