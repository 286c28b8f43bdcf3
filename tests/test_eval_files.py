"""`prunepipe eval` never replaces an earlier evaluation silently: with overwrite=False (the CLI
without --overwrite) an existing eval record of the same weights at the same step stops it before
anything is evaluated, naming the file and the flag; overwrite=True replaces it."""

from __future__ import annotations

import json
import os
import re

import pytest
from test_trainer import ROOT, TINY_MAE

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.evaluation.runner import EvalRecordExistsError
from prunepipe.pipelines.trained import evaluate_checkpoint
from prunepipe.pipelines.training.loop import train

QUICK = ["probe.enabled=false", "val_samples=64"]


def test_an_earlier_eval_record_is_kept_unless_overwrite_is_asked_for(digits_shards, tmp_path):
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [
            f"data.train={digits_shards}/train",
            f"data.val={digits_shards}/val",
            f"runs_dir={tmp_path}",
            "name=run",
            "num_passes=1",
            *TINY_MAE,
        ],
    )
    train(cfg)
    first = evaluate_checkpoint(cfg.run_dir, eval_cfg=load_eval_config(overrides=QUICK), overwrite=False)
    path = first["path"]
    assert os.path.basename(path) == f"step_{first['optimizer_steps']:06d}.json"
    with open(path) as f:
        kept = f.read()

    # refused before evaluating: this setting would fail the evaluation itself (no such shards)
    later = load_eval_config(overrides=[*QUICK, f"val={tmp_path}/no_such_shards"])
    with pytest.raises(EvalRecordExistsError, match=re.escape(path) + r".*masked_mse.*--overwrite") as error:
        evaluate_checkpoint(cfg.run_dir, eval_cfg=later, overwrite=False)
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)  # the CLI's one-line errors
    with open(path) as f:
        assert f.read() == kept

    raw = evaluate_checkpoint(
        cfg.run_dir, eval_cfg=load_eval_config(overrides=[*QUICK, "weights=raw"]), overwrite=False
    )  # another file: the raw weights' record
    assert raw["path"].endswith("_raw.json") and os.path.exists(path)
    replaced = evaluate_checkpoint(
        cfg.run_dir, eval_cfg=load_eval_config(overrides=[*QUICK, "val_samples=32"]), overwrite=True
    )
    with open(path) as f:
        assert replaced["path"] == path and json.load(f)["eval_config"]["val_samples"] == 32


def test_prunepipe_eval_refuses_to_replace_an_earlier_evaluation_without_overwrite(digits_shards, tmp_path, capsys):
    """The CLI's default keeps what `compare` reads; --overwrite replaces it."""
    from prunepipe.launch.cli import main as cli_main

    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [
            f"data.train={digits_shards}/train",
            f"data.val={digits_shards}/val",
            f"runs_dir={tmp_path}",
            "name=run",
            "num_passes=1",
            *TINY_MAE,
        ],
    )
    train(cfg)
    assert cli_main(["eval", cfg.run_dir, *QUICK]) == 0
    capsys.readouterr()
    assert cli_main(["eval", cfg.run_dir, *QUICK]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["eval", cfg.run_dir, *QUICK, "--overwrite"]) == 0
