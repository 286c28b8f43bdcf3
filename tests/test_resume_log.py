"""metrics.jsonl after a resume: the resumed process marks where it continued from, and the project's
readers count each step once (the later record wins), so plots and comparisons never count the
steps a killed process logged after its last checkpoint twice."""

from __future__ import annotations

import json
import os
import shutil

from test_trainer import ROOT, TINY_MAE

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.report.runs import load_run, read_metrics
from prunepipe.pipelines.training.loop import train
from prunepipe.pipelines.training.metrics import MetricsLog


def raw_lines(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_resumed_run_marks_the_resume_and_readers_keep_the_latest_record_per_step(digits_shards, tmp_path):
    config = os.path.join(ROOT, "configs", "mae_tiny_full.yaml")
    base = [
        f"data.train={digits_shards}/train",
        f"data.val={digits_shards}/val",
        f"runs_dir={tmp_path}",
        "name=run",
        "num_passes=2",
        "log_every=5",
        "checkpoint.every_steps=10",
        "checkpoint.keep=3",
        *TINY_MAE,
    ]
    train(load_config(config, [*base, "max_steps=30"]))  # pass 1 ends before step 30: its record is logged
    run_dir = tmp_path / "run"
    # killed after logging step 30 but before its checkpoint was sealed: the run resumes from step 20
    shutil.rmtree(run_dir / "checkpoints" / "step_000030")
    train(load_config(config, [*base, "checkpoint.resume=latest"]))

    lines = raw_lines(run_dir)
    [marker] = [r for r in lines if r["kind"] == "resume"]
    assert marker["event"] == "resume" and marker["from_step"] == 20 and marker["pass_index"] == 0
    assert marker["batch_in_pass"] == 20 and marker["checkpoint"].endswith("step_000020")
    assert isinstance(marker["time"], float)
    at = lines.index(marker)
    assert [r["pass_index"] for r in lines if r["kind"] == "pass"] == [0, 0, 1]  # pass 1 logged by both processes
    assert [r["optimizer_steps"] for r in lines[:at] if r["kind"] == "train"][-2:] == [25, 30]

    kept = read_metrics(str(run_dir / "metrics.jsonl"))
    passes = [r for r in kept if r["kind"] == "pass"]
    assert [r["pass_index"] for r in passes] == [0, 1]
    assert passes[0] == next(r for r in lines[at:] if r["kind"] == "pass")  # the resumed process's record
    steps = [r["optimizer_steps"] for r in kept if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and 25 in steps and 30 in steps
    run = load_run(str(run_dir))
    assert [r["pass_index"] for r in run.trajectory] == [0, 1] and run.passes_done == 2
    assert run.optimizer_steps == passes[-1]["optimizer_steps"]


def test_the_marker_drops_what_the_stopped_process_logged_after_the_checkpoint_and_the_later_record_wins(tmp_path):
    log = MetricsLog(str(tmp_path), enabled=True)
    log.write({"kind": "train", "optimizer_steps": 10, "pass_index": 0, "loss": 1.0})
    log.write({"kind": "pass", "optimizer_steps": 20, "pass_index": 0, "train_loss": 0.9})
    log.write({"kind": "train", "optimizer_steps": 30, "pass_index": 1, "loss": 0.8})  # never logged again
    with open(log.path, "a") as f:
        f.write('{"kind": "train", "optimizer_st')  # the kill cut this line
    log.resumed(str(tmp_path / "checkpoints" / "step_000020"), optimizer_steps=20, pass_index=0, batch_in_pass=20)
    log.write({"kind": "pass", "optimizer_steps": 20, "pass_index": 0, "train_loss": 0.7})  # written again at 20
    log.write({"kind": "train", "optimizer_steps": 25, "pass_index": 1, "loss": 0.6})

    with open(log.path) as f:
        assert f.read().splitlines()[3] == '{"kind": "train", "optimizer_st'  # the marker has a line of its own
    kept = read_metrics(log.path)
    assert [(r["kind"], r["optimizer_steps"]) for r in kept] == [
        ("train", 10),
        ("resume", 20),
        ("pass", 20),
        ("train", 25),
    ]
    assert kept[2]["train_loss"] == 0.7
