"""metrics.jsonl after a resume: the resumed process moves what the killed one logged after its last
checkpoint into metrics_superseded.jsonl and marks where it continued from, so the file holds one
record per pass; the project's readers count each step once (the later record wins) in older files too."""

from __future__ import annotations

import json
import os
import shutil

from test_trainer import ROOT, TINY_MAE

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.report.runs import load_run, read_metrics
from prunepipe.pipelines.training.loop import train
from prunepipe.pipelines.training.metrics import SUPERSEDED_FILE, MetricsLog


def raw_lines(run_dir, name="metrics.jsonl") -> list[dict]:
    with open(os.path.join(run_dir, name)) as f:
        return [json.loads(line) for line in f]


def test_a_resumed_run_keeps_one_record_per_pass_and_marks_the_resume(digits_shards, tmp_path):
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
    assert [r["pass_index"] for r in lines if r["kind"] == "pass"] == [0, 1], "one record per pass"
    assert [r["optimizer_steps"] for r in lines[:at] if r["kind"] == "train"][-1] == 20
    steps = [r["optimizer_steps"] for r in lines if r["kind"] == "train"]
    assert steps == sorted(set(steps)), "each step logged once"
    moved = raw_lines(run_dir, SUPERSEDED_FILE)  # the killed process's records past step 20, kept aside
    assert marker["superseded"] == len(moved) and [r["pass_index"] for r in moved if r["kind"] == "pass"] == [0]
    assert [r["optimizer_steps"] for r in moved if r["kind"] == "train"] == [25, 30]

    kept = read_metrics(str(run_dir / "metrics.jsonl"))
    passes = [r for r in kept if r["kind"] == "pass"]
    assert [r["pass_index"] for r in passes] == [0, 1]
    assert passes == [r for r in lines if r["kind"] == "pass"]  # the file is as the reader reads it
    steps = [r["optimizer_steps"] for r in kept if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and 25 in steps and 30 in steps
    run = load_run(str(run_dir))
    assert [r["pass_index"] for r in run.trajectory] == [0, 1] and run.passes_done == 2
    assert run.optimizer_steps == passes[-1]["optimizer_steps"]


def test_a_resume_moves_what_the_stopped_process_logged_after_the_checkpoint_and_the_reader_agrees(tmp_path):
    log = MetricsLog(str(tmp_path), enabled=True)
    log.write({"kind": "train", "optimizer_steps": 10, "pass_index": 0, "loss": 1.0})
    log.write({"kind": "pass", "optimizer_steps": 20, "pass_index": 0, "train_loss": 0.9})
    log.write({"kind": "train", "optimizer_steps": 30, "pass_index": 1, "loss": 0.8})  # never logged again
    with open(log.path, "a") as f:
        f.write('{"kind": "train", "optimizer_st')  # the kill cut this line
    log.resumed(str(tmp_path / "checkpoints" / "step_000020"), optimizer_steps=20, pass_index=0, batch_in_pass=20)
    log.write({"kind": "pass", "optimizer_steps": 20, "pass_index": 0, "train_loss": 0.7})  # written again at 20
    log.write({"kind": "train", "optimizer_steps": 25, "pass_index": 1, "loss": 0.6})

    written = raw_lines(tmp_path)
    assert [(r["kind"], r["optimizer_steps"]) for r in written] == [
        ("train", 10),
        ("resume", 20),
        ("pass", 20),  # pass 0 closed at the checkpoint's step: written again, once in the file
        ("train", 25),
    ]
    assert written[2]["train_loss"] == 0.7 and written[1]["superseded"] == 3
    with open(tmp_path / SUPERSEDED_FILE) as f:
        moved = f.read().splitlines()
    assert [json.loads(line)["optimizer_steps"] for line in moved[:2]] == [20, 30]
    assert moved[2] == '{"kind": "train", "optimizer_st', "the line the kill cut, kept as it was"
    assert read_metrics(log.path) == written


def test_the_reader_keeps_the_later_record_in_a_file_that_kept_both(tmp_path):
    """Runs from before the resume moved anything: at the marker, the later record wins."""
    path = tmp_path / "metrics.jsonl"
    records = [
        {"kind": "train", "optimizer_steps": 10, "pass_index": 0, "loss": 1.0},
        {"kind": "pass", "optimizer_steps": 20, "pass_index": 0, "train_loss": 0.9},
        {"kind": "train", "optimizer_steps": 30, "pass_index": 1, "loss": 0.8},
        {"kind": "resume", "event": "resume", "from_step": 20, "optimizer_steps": 20, "pass_index": 0},
        {"kind": "pass", "optimizer_steps": 20, "pass_index": 0, "train_loss": 0.7},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    kept = read_metrics(str(path))
    assert [(r["kind"], r["optimizer_steps"]) for r in kept] == [("train", 10), ("resume", 20), ("pass", 20)]
    assert kept[2]["train_loss"] == 0.7
