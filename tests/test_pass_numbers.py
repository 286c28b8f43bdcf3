"""Every pass number a user reads is 1-based, "pass k/N": the bar, the pass line, the resume line,
the errors naming a step, and the eval record of a checkpoint; records keep the 0-based `pass_index`."""

from __future__ import annotations

import os
import re

from test_trainer import ROOT, TINY_MAE

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.progress import pass_label, position_label
from prunepipe.pipelines.report.runs import read_metrics
from prunepipe.pipelines.trained import evaluate_checkpoint
from prunepipe.pipelines.training.loop import train


def test_labels_are_one_based():
    assert pass_label(0, 40) == "pass 1/40" and pass_label(39, 40) == "pass 40/40"
    assert position_label(5, 3, 40) == "pass 6/40, batch 3"  # 3 batches into the sixth pass
    assert position_label(5, 0, 40) == "after pass 5/40"  # 5 passes done
    assert position_label(0, 0, 40) == "before pass 1/40"


def test_the_resume_line_and_the_pass_line_name_the_same_pass(digits_shards, tmp_path, capsys):
    config = os.path.join(ROOT, "configs", "mae_tiny_full.yaml")
    base = [
        f"data.train={digits_shards}/train",
        f"data.val={digits_shards}/val",
        f"runs_dir={tmp_path}",
        "name=run",
        "num_passes=2",
        "checkpoint.every_steps=20",
        *TINY_MAE,
    ]  # 25 steps a pass
    train(load_config(config, [*base, "max_steps=20"]))
    capsys.readouterr()
    train(load_config(config, [*base, "checkpoint.resume=latest"]))
    out = capsys.readouterr().out
    resumed = next(line for line in out.splitlines() if line.startswith("resumed from"))
    assert resumed.endswith(": pass 1/2, batch 20, step 20"), resumed
    assert re.search(r"^pass 1/2: kept", out, re.M) and re.search(r"^pass 2/2: kept", out, re.M), out
    assert not re.search(r"\bpass 0\b", out), out

    # the final checkpoint is between passes (2 done): its eval record is after pass 2/2, pass_index 1
    # (0-based), as the pass record of the same step
    record = evaluate_checkpoint(
        str(tmp_path / "run"),
        eval_cfg=load_eval_config(overrides=["probe.enabled=false", "val_samples=64"]),
        write=False,
    )
    [last] = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "pass"][-1:]
    assert record["pass"] == "after pass 2/2"
    assert record["pass_index"] == last["pass_index"] == 1 and record["optimizer_steps"] == last["optimizer_steps"]
