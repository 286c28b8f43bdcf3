"""`prunepipe bench throughput` and the GPU script as specifications: both loops run on the same model
and batch and report samples/s and their ratio; the script's every step runs on a CPU at the
smallest size. Never a timing threshold: the figures depend on the machine."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from prunepipe.pipelines.config import ConfigError, load_config
from prunepipe.pipelines.data.workers import loader_workers
from prunepipe.tools.benchmarks.throughput import run_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_runs_both_loops_on_the_same_batch_and_reports_their_ratio(digits_shards):
    lines = []
    [row] = run_bench(
        ["mae"],
        size="smoke",
        passes=2,
        repeats=1,
        data=f"{digits_shards}/train",
        overrides=["data.num_workers=1"],
        say=lines.append,
    )
    assert row["task"] == "mae" and row["device"] in ("cpu", "cuda") and row["batch_size"] == 64
    assert (row["threads"], row["loader_workers"]) == (torch.get_num_threads(), 1)
    assert row["steps"] == 25, "one timed pass of the 1617 digits in batches of 64"
    assert row["project_samples_per_s"] > 0 and row["bare_samples_per_s"] > 0
    ratio = row["bare_samples_per_s"] / row["project_samples_per_s"]
    assert row["ratio_project_over_bare_time"] == pytest.approx(ratio, rel=0.01)
    assert "project/bare time" in lines[-1]


def test_num_workers_takes_auto_or_a_count_and_names_the_field_otherwise(digits_shards):
    base = [f"data.train={digits_shards}/train"]
    assert load_config(None, [*base]).data.num_workers == "auto"
    assert load_config(None, [*base, "data.num_workers=3"]).data.num_workers == 3
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ConfigError, match=r"data.num_workers=.* accepted: auto or an integer >= 0"):
            load_config(None, [*base, f"data.num_workers={bad}"])
    assert loader_workers(2) == 2
    cores = len(os.sched_getaffinity(0))
    assert loader_workers("auto", processes_on_node=1) == max(0, min(8, cores - 1))
    assert loader_workers("auto", processes_on_node=cores) == 0, "a rank with one core decodes itself"
    # training on a CPU: the cores left beside torch's threads, none when they take them all
    assert loader_workers("auto", processes_on_node=1, device_type="cpu", compute_threads=cores) == 0
    assert loader_workers("auto", processes_on_node=1, device_type="cpu", compute_threads=1) == max(
        0, min(8, cores - 1)
    )


def test_cuda_switches_are_typed_config_fields(digits_shards):
    cfg = load_config(None, [f"data.train={digits_shards}/train"])
    assert (cfg.cuda.tf32, cfg.cuda.fused_adamw, cfg.cuda.channels_last, cfg.cuda.compile) == (True, True, True, False)
    with pytest.raises(ConfigError, match="cuda.tf32"):
        load_config(None, [f"data.train={digits_shards}/train", "cuda.tf32=sometimes"])
    with pytest.raises(ConfigError, match="unknown key 'cuda.fast'"):
        load_config(None, [f"data.train={digits_shards}/train", "cuda.fast=true"])


@pytest.mark.slow
def test_gpu_script_runs_every_step_on_a_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--cpu-smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.load(open(tmp_path / "throughput.json"))
    assert [r["task"] for r in rows] == ["mae", "ldm", "dit"]
    resume = json.load(open(tmp_path / "resume.json"))
    assert resume["bitwise_equal"] is True and resume["compared"] == ["model", "ema", "pruner"]
    for name, world in (("allreduce.json", 1), ("allreduce_two.json", 2)):  # gloo stands in for NCCL here
        counts = json.load(open(tmp_path / name))
        assert counts["world_size"] == world and counts["one_bucket_set_per_step"] is True
    report = open(tmp_path / "gpu.md").read()
    assert "| mae |" in report and "bitwise equal" in report and "one bucket set per optimizer step" in report
