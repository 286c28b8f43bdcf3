"""Config mistakes give one clear line naming the field and the accepted values; every shipped
config loads."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from prunepipe.pipelines.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "mae_tiny_infobatch.yaml")


def data_overrides(digits_shards):
    return [f"data.train={digits_shards}/train", f"data.val={digits_shards}/val"]


@pytest.mark.parametrize("config", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))), ids=os.path.basename)
def test_every_shipped_config_loads(config, digits_shards):
    text = "conditioning: text" in open(config).read()  # the encoder's folder, checked when a run builds it
    cfg = load_config(config, data_overrides(digits_shards) + (["ldm.text.encoder=encoder"] if text else []))
    assert cfg.task in ("mae", "ldm")
    if re.fullmatch(
        r"(mae|ldm|ldm_dit)(_tiny)?_(full|random|infobatch|ted|importance)\.yaml", os.path.basename(config)
    ):
        assert cfg.name == os.path.basename(config)[: -len(".yaml")]
        assert cfg.pruner["name"] in os.path.basename(config)


def test_overrides_reach_nested_fields_and_pruner_hparams(digits_shards):
    cfg = load_config(TINY, data_overrides(digits_shards) + ["passes=7", "pruner.prune_ratio=0.3", "optim.lr=0.01"])
    assert cfg.passes == 7 and cfg.pruner == {"name": "infobatch", "prune_ratio": 0.3, "delta": 0.875}
    assert cfg.optim.lr == 0.01 and cfg.data.batch_size == 64  # from the base file


@pytest.mark.parametrize(
    "override, expected",
    [
        ("data.batchsize=3", r"unknown key 'data.batchsize'.*batch_size"),
        ("data.batch_size=lots", r"data.batch_size"),
        ("task=gan", r"task='gan'.*mae, ldm"),
        ("data.on_bad_sample=ignore", r"data.on_bad_sample.*skip, stop|data.on_bad_sample.*stop, skip"),
        ("pruner.name=magic", r"pruner.name='magic'.*infobatch"),
        ("pruner.ratio=0.3", r"ratio.*accepted: prune_ratio"),
        ("pruner.prune_ratio=1.5", r"prune_ratio"),
        ("data.batch_size=0", r"data.batch_size must be >= 1"),
        ("data.train=/nonexistent/shards", r"data.train='/nonexistent/shards'.*prunepipe shards write"),
    ],
)
def test_config_mistakes_name_the_field(override, expected, digits_shards):
    with pytest.raises(ConfigError, match=expected) as error:
        load_config(TINY, data_overrides(digits_shards) + [override])
    assert "\n" not in str(error.value)


def test_required_shard_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match="data.train is required"):
        load_config(os.path.join(ROOT, "configs", "mae_full.yaml"))


def test_cli_prints_one_error_line(digits_shards):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prunepipe.launch.cli",
            "train",
            TINY,
            *data_overrides(digits_shards),
            "data.batchsize=3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prunepipe: error: config: unknown key 'data.batchsize'")


def test_an_empty_override_empties_a_text_field_in_order(digits_shards):
    cfg = load_config(TINY, data_overrides(digits_shards) + ["data.val="])
    assert cfg.data.val == ""  # no held-out data
    cfg = load_config(TINY, data_overrides(digits_shards) + ["data.val=", f"data.val={digits_shards}/val"])
    assert cfg.data.val == f"{digits_shards}/val"  # the later override wins


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["passes="], r"passes= is empty; passes is not a text field"),
        (["data.nope="], r"unknown key 'data.nope'.*val_batches"),
        (["data.val=", "eval.every_passes=2"], r"eval.every_passes=2 .* data.val is empty; set data.val=DIR or eval"),
    ],
)
def test_an_empty_override_that_cannot_apply_says_why(overrides, expected, digits_shards):
    with pytest.raises(ConfigError, match=expected):
        load_config(TINY, data_overrides(digits_shards) + overrides)


def test_training_without_held_out_data(digits_shards, tmp_path, capsys):
    from eval_runs import TINY_MAE

    from prunepipe.launch.cli import main as cli_main

    args = [
        "train",
        TINY,
        *data_overrides(digits_shards),
        "data.val=",
        "passes=1",
        f"runs_dir={tmp_path}",
        "name=no_val",
        *TINY_MAE,
    ]
    assert cli_main(args) == 0
    assert "held-out" not in capsys.readouterr().out
    records = [json.loads(line) for line in open(tmp_path / "no_val" / "metrics.jsonl")]
    [summary] = [r for r in records if r["kind"] == "pass"]
    assert "held_out" not in summary and summary["samples_forwarded"] > 0
