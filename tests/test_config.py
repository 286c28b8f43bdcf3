"""Config mistakes give one clear line naming the field and the accepted values, in one format for
every choice; a config is checked without its data (the data checks are apart); every shipped config
loads."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from prunepipe.pipelines.config import ConfigError, RunConfig, check_data, load_config, validate
from prunepipe.pipelines.config_schema import choices
from prunepipe.pipelines.evaluation.config import load_eval_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "mae_tiny_infobatch.yaml")


def data_overrides(digits_shards):
    return [f"data.train={digits_shards}/train", f"data.val={digits_shards}/val"]


def with_bases(config: str) -> str:
    """The config file's text after the texts of its `base:` files, nearest last."""
    written = open(config).read()
    base = re.search(r"^base: *(\S+)", written, re.M)
    return (with_bases(os.path.join(os.path.dirname(config), base.group(1))) if base else "") + written


@pytest.mark.parametrize("config", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))), ids=os.path.basename)
def test_every_shipped_config_loads(config, digits_shards):
    written = with_bases(config)  # the encoder's folder, checked when a run builds it (none for stored features)
    text = "conditioning: text" in written and "features: precomputed" not in written
    cfg = load_config(config, data_overrides(digits_shards) + (["ldm.text.encoder=encoder"] if text else []))
    assert cfg.task in ("mae", "ldm")
    if re.fullmatch(
        r"(mae|ldm|ldm_dit)(_tiny)?_(full|random|infobatch|ted|importance)\.yaml", os.path.basename(config)
    ):
        assert cfg.name == os.path.basename(config)[: -len(".yaml")]
        assert cfg.pruner["name"] in os.path.basename(config)


def test_overrides_reach_nested_fields_and_pruner_hparams(digits_shards):
    cfg = load_config(TINY, data_overrides(digits_shards) + ["num_passes=7", "pruner.prune_ratio=0.3", "optim.lr=0.01"])
    assert cfg.num_passes == 7 and cfg.pruner == {"name": "infobatch", "prune_ratio": 0.3, "delta": 0.875}
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
        ("optim.blr=-1", r"optim.blr must be >= 0, got -1.0 \(0 = use optim.lr\)"),
        ("score.momentum=1.0", r"score.momentum must be in \[0, 1\), got 1.0"),
    ],
)
def test_config_mistakes_name_the_field(override, expected, digits_shards):
    with pytest.raises(ConfigError, match=expected) as error:
        load_config(TINY, data_overrides(digits_shards) + [override])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "override, accepted",
    [
        ("mixed_precision=fp8", "auto, no, bf16, fp16"),
        ("data.crop=square", "center, random_resized"),
        ("score.normalise=bucket", "none, stratum_mean, stratum_zscore"),
        ("ldm.ddpm.prediction_type=sample", "epsilon, v_prediction"),
        ("ldm.conditioning=words", "none, class, text, ''"),
        ("mae.preset=vit_tiny", "'', vit_base, vit_large, vit_huge"),
        ("eval.fid.inception_dim=100", "64, 192, 768, 2048"),
        ("eval.fid.feature=dino", "inception, classifier, module:package.module:factory"),
        ("pruner.name=magic", "dedup, full, importance, infobatch, random, ted"),
    ],
)
def test_every_choice_mistake_reads_the_same(override, accepted, digits_shards):
    key, value = override.split("=")
    value = int(value) if value.isdigit() else value  # as YAML reads it
    expected = f"config: {key}={value!r} is not accepted; accepted: {accepted}"
    with pytest.raises(ConfigError) as error:
        load_config(TINY, data_overrides(digits_shards) + [override])
    assert str(error.value) == expected


def test_a_choice_set_in_python_is_checked_as_one_read_from_a_file(digits_shards):
    cfg = load_config(TINY, data_overrides(digits_shards))
    cfg.ldm = dataclasses.replace(cfg.ldm, backbone="vit")
    with pytest.raises(ConfigError, match=r"^config: ldm.backbone='vit' is not accepted; accepted: unet, dit$"):
        validate(cfg)


def test_an_unquoted_yaml_no_is_named_as_the_boolean_it_became(digits_shards):
    with pytest.raises(ConfigError, match=r"mixed_precision=False is not accepted.*quote the word"):
        load_config(TINY, data_overrides(digits_shards) + ["mixed_precision=no"])
    assert load_config(TINY, data_overrides(digits_shards) + ["mixed_precision='no'"]).mixed_precision == "no"


def test_the_choices_are_the_values_their_readers_accept():
    from prunepipe.pipelines.data.augment import CROPS
    from prunepipe.pipelines.data.stream import BAD_SAMPLE_POLICIES
    from prunepipe.pipelines.tasks.diffusion.config import DDPMSettings, DiffusionConfig, DiTSettings, FlowSettings
    from prunepipe.pipelines.tasks.diffusion.dit import DIT_PRESETS
    from prunepipe.pipelines.tasks.diffusion.flow import FLOW_WEIGHTINGS
    from prunepipe.pipelines.tasks.diffusion.timesteps import TIMESTEP_SAMPLING
    from prunepipe.pipelines.tasks.mae import PRESETS, MAEConfig
    from prunepipe.pruning import NORMALISATIONS

    data, score = (type(getattr(RunConfig(), name)) for name in ("data", "score"))
    assert set(choices(data, "crop")) == set(CROPS)
    assert set(choices(data, "on_bad_sample")) == set(BAD_SAMPLE_POLICIES)
    assert set(choices(score, "normalise")) == set(NORMALISATIONS)
    assert choices(FlowSettings, "weighting") == FLOW_WEIGHTINGS
    assert choices(DDPMSettings, "timestep_sampling") == TIMESTEP_SAMPLING
    assert choices(DiTSettings, "preset") == DIT_PRESETS
    assert choices(MAEConfig, "preset") == ("", *PRESETS)
    assert choices(DiffusionConfig, "backbone") == ("unet", "dit")


def test_a_config_is_checked_without_its_data_and_the_data_checks_say_so(tmp_path):
    cfg = load_config(TINY, ["data.train=/nonexistent/shards", "data.val=/nonexistent/val"])
    assert cfg.data.train == "/nonexistent/shards"  # load_config opens no data file
    with pytest.raises(ConfigError, match=r"^data check: data.train='/nonexistent/shards'.*prunepipe shards write"):
        check_data(cfg)


def test_an_eval_config_is_loaded_as_a_run_config_is(tmp_path):
    (tmp_path / "base.yaml").write_text("val_samples: 64\nfid:\n  num_samples: 200\n")
    (tmp_path / "eval.yaml").write_text("base: base.yaml\nfid:\n  sampler_steps: 10\n")
    cfg = load_eval_config(path=str(tmp_path / "eval.yaml"), overrides=["fid.num_samples=300", "val="])
    assert (cfg.val_samples, cfg.fid.num_samples, cfg.fid.sampler_steps, cfg.val) == (64, 300, 10, "")
    with pytest.raises(ConfigError, match=r"^config: unknown key 'fid.samples'; accepted keys in fid: enabled"):
        load_eval_config(overrides=["fid.samples=3"])
    with pytest.raises(ConfigError, match=r"^config: weights='best' is not accepted; accepted: ema, raw$"):
        load_eval_config(overrides=["weights=best"])


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
        (["num_passes="], r"num_passes= is empty; num_passes is not a text field"),
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
        "num_passes=1",
        f"runs_dir={tmp_path}",
        "name=no_val",
        *TINY_MAE,
    ]
    assert cli_main(args) == 0
    assert "held-out" not in capsys.readouterr().out
    records = [json.loads(line) for line in open(tmp_path / "no_val" / "metrics.jsonl")]
    [summary] = [r for r in records if r["kind"] == "pass"]
    assert "held_out" not in summary and summary["samples_forwarded"] > 0
