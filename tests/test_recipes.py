"""The published recipes as a specification: the learning-rate schedule (DiT's constant rate), MAE's
base learning rate scaled by the effective batch, an EMA whose warmup follows pass progress (so a
pruned run's EMA is comparable with the full run's) or is off (DiT), and
the real configs (`configs/ldm_dit_*.yaml`, `configs/mae_*.yaml`) say what their comments claim."""

from __future__ import annotations

import json
import os

import pytest

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.training.loop import train
from prunepipe.pipelines.training.schedule import learning_rate, with_peak_learning_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
# A MAE small enough for a pass in seconds on 2 CPU cores.
TINY_MAE = [
    "mae.embed_dim=32",
    "mae.depth=1",
    "mae.num_heads=2",
    "mae.decoder_embed_dim=32",
    "mae.decoder_depth=1",
    "mae.decoder_num_heads=2",
    "data.batch_size=64",
]


def tiny(digits_shards, *overrides: str):
    return load_config(
        os.path.join(CONFIGS, "mae_tiny_full.yaml"),
        [f"data.train={digits_shards}/train", "data.val=", "num_passes=10", *overrides],
    )


def test_a_constant_schedule_holds_the_peak_rate_after_its_warmup(digits_shards):
    cfg = tiny(digits_shards, "optim.schedule=constant", "optim.lr=1.0", "optim.warmup_passes=2", "optim.min_lr=0.1")
    assert learning_rate(cfg, 0.0) == 0.0 and learning_rate(cfg, 1.0) == pytest.approx(0.5)
    assert [learning_rate(cfg, p) for p in (2.0, 5.5, 9.99, 10.0)] == [1.0] * 4, "no decay, min_lr unused"
    cosine = tiny(digits_shards, "optim.lr=1.0", "optim.warmup_passes=2")
    assert learning_rate(cosine, 6.0) == pytest.approx(0.5) and learning_rate(cosine, 10.0) == pytest.approx(0.0)


def test_blr_sets_the_peak_rate_from_the_effective_batch_once_and_records_it(digits_shards, tmp_path, capsys):
    cfg = tiny(
        digits_shards,
        *TINY_MAE,
        "num_passes=1",
        "optim.blr=0.04",
        "optim.lr=5.0",
        "optim.grad_accum=2",
        "optim.warmup_passes=0",
        "optim.schedule=constant",
        f"runs_dir={tmp_path}",
        "name=blr",
        "log_every=1",
    )
    peak = 0.04 * (1 * 64 * 2) / 256  # world x data.batch_size x optim.grad_accum, over 256
    assert with_peak_learning_rate(cfg, 1, announce=False).optim.lr == pytest.approx(peak)
    assert with_peak_learning_rate(cfg, 8, announce=False).optim.lr == pytest.approx(8 * peak)
    summary = train(cfg)
    out = capsys.readouterr().out
    assert out.count("peak lr 0.02 = optim.blr 0.04 x effective batch 128 (1 ranks x 64 x 2 accumulated)") == 1
    assert summary["peak_lr"] == pytest.approx(peak)
    lines = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    rates = [line["lr"] for line in lines if line["kind"] == "train"]
    assert rates and rates == pytest.approx([peak] * len(rates)), "optim.lr=5 is not used"
    assert "blr: 0.04" in open(os.path.join(cfg.run_dir, "config.yaml")).read(), "config.yaml is what was asked"
    assert cfg.optim.lr == 5.0, "the caller's config is left as it was"


def test_the_ema_warmup_follows_pass_progress_so_pruned_and_full_runs_average_alike(digits_shards, tmp_path):
    """InfoBatch takes fewer steps per pass; at each pass end its EMA decay is still the full run's."""
    passes = {}
    for name in ("mae_tiny_full", "mae_tiny_infobatch"):
        cfg = load_config(
            os.path.join(CONFIGS, f"{name}.yaml"),
            [
                f"data.train={digits_shards}/train",
                "data.val=",
                f"runs_dir={tmp_path}",
                f"name={name}",
                "num_passes=3",
                "ema_decay=0.9999",
                *TINY_MAE,
            ],
        )
        train(cfg)
        passes[name] = [
            line for line in map(json.loads, open(os.path.join(cfg.run_dir, "metrics.jsonl"))) if line["kind"] == "pass"
        ]
    full, pruned = passes["mae_tiny_full"], passes["mae_tiny_infobatch"]
    assert sum(p["steps_in_pass"] for p in pruned) < sum(p["steps_in_pass"] for p in full), "InfoBatch pruned"
    assert [p["ema_decay"] for p in pruned] == [p["ema_decay"] for p in full]
    # the decay of a full run's step count: 1 - (1 + n)^(-2/3), n = the full run's steps at that pass
    steps_per_pass = ShardIndex.load(f"{digits_shards}/train").num_samples / 64  # the full run's, batch 64
    for p in full:
        assert p["ema_decay"] == pytest.approx(1 - (1 + (p["pass_index"] + 1) * steps_per_pass) ** (-2 / 3))


def test_without_ema_warmup_the_decay_is_constant_from_the_first_step(digits_shards, tmp_path):
    cfg = load_config(
        os.path.join(CONFIGS, "mae_tiny_infobatch.yaml"),
        [
            f"data.train={digits_shards}/train",
            "data.val=",
            f"runs_dir={tmp_path}",
            "name=dit_ema",
            "num_passes=1",
            "ema_decay=0.9999",
            "ema_warmup=none",
            *TINY_MAE,
        ],
    )
    assert train(cfg)["ema_decay"] == 0.9999


def load_config_text(name: str) -> str:
    with open(os.path.join(CONFIGS, name)) as f:
        return f.read()


def real_configs(family: str) -> list[str]:
    """configs/{family}_base.yaml and every real-scale file that inherits it (not the tiny ones)."""
    names = sorted(os.listdir(CONFIGS))
    found = [
        n
        for n in names
        if n.startswith(f"{family}_")
        and "tiny" not in n
        and n.endswith(".yaml")
        and (n == f"{family}_base.yaml" or load_config_text(n).startswith(f"base: {family}_base.yaml"))
    ]
    assert f"{family}_base.yaml" in found and len(found) >= 5, found
    return found


@pytest.mark.parametrize("name", real_configs("ldm_dit"))
def test_the_dit_configs_train_as_the_dit_paper(name, digits_shards):
    cfg = load_config(os.path.join(CONFIGS, name), [f"data.train={digits_shards}/train"])
    # AdamW at a constant 1e-4, no weight decay, no warmup, whatever the number of GPUs
    assert (cfg.optim.schedule, cfg.optim.warmup_passes, cfg.optim.blr) == ("constant", 0, 0)
    assert (cfg.optim.weight_decay, cfg.optim.betas) == (0.0, [0.9, 0.999])
    for world in (8, 64):
        at_scale = with_peak_learning_rate(cfg, world, announce=False)
        assert [learning_rate(at_scale, p) for p in (0.0, 0.5, cfg.num_passes / 2, cfg.num_passes)] == [1e-4] * 4
    assert (cfg.ema_decay, cfg.ema_warmup) == (0.9999, "none"), "EMA 0.9999 from the first step"
    assert (cfg.data.hflip, cfg.data.crop) == (True, "center"), "random flips, exact on latents (--flip)"
    assert cfg.data.batch_size * 8 == 256, "the paper's batch on 8 GPUs"


@pytest.mark.parametrize("name", real_configs("mae"))
def test_the_mae_configs_train_as_the_mae_paper(name, digits_shards):
    cfg = load_config(os.path.join(CONFIGS, name), [f"data.train={digits_shards}/train"])
    assert cfg.optim.blr == 1.5e-4 and cfg.data.batch_size == 256 and cfg.optim.grad_accum == 1
    for world, peak in ((16, 2.4e-3), (64, 9.6e-3)):  # 16 GPUs: the paper's batch of 4096
        at_scale = with_peak_learning_rate(cfg, world, announce=False)
        assert at_scale.optim.lr == pytest.approx(peak)
        assert learning_rate(at_scale, 20.0) == pytest.approx(peak / 2), "linear warmup over 40 passes"
        assert learning_rate(at_scale, 40.0) == pytest.approx(peak)
        assert learning_rate(at_scale, 420.0) == pytest.approx(peak / 2), "cosine, halfway"
        assert learning_rate(at_scale, cfg.num_passes) == pytest.approx(0.0)
    assert (cfg.optim.schedule, cfg.optim.warmup_passes, cfg.num_passes) == ("cosine", 40, 800)
    assert (cfg.optim.weight_decay, cfg.optim.betas) == (0.05, [0.9, 0.95])
    assert (cfg.data.crop, cfg.data.crop_scale, cfg.data.hflip) == ("random_resized", [0.2, 1.0], True)
    assert cfg.ema_warmup == "passes", "an EMA that pruned and full runs share pass for pass"


def test_the_text_to_image_config_trains_as_pixart_alpha(digits_shards, tmp_path):
    cfg = load_config(
        os.path.join(CONFIGS, "ldm_t2i_base.yaml"),
        [f"data.train={digits_shards}/train", f"ldm.text.encoder={tmp_path}"],
    )
    assert (cfg.ldm.backbone, cfg.ldm.dit.preset, cfg.ldm.conditioning, cfg.ldm.space) == (
        "dit",
        "DiT-B/2",
        "text",
        "latents",
    )
    assert (cfg.ldm.text.max_length, cfg.ldm.text.caption_dropout) == (120, 0.1), (
        "120 T5 tokens, 10% to the empty caption"
    )
    # AdamW at a constant 2e-5 after a short warmup, weight decay 0.03, gradient clip 0.01, whatever the GPUs
    assert (cfg.optim.schedule, cfg.optim.blr, cfg.optim.weight_decay, cfg.optim.grad_clip) == (
        "constant",
        0,
        0.03,
        0.01,
    )
    for world in (8, 64):
        at_scale = with_peak_learning_rate(cfg, world, announce=False)
        assert learning_rate(at_scale, cfg.optim.warmup_passes / 2) == pytest.approx(1e-5)
        assert [learning_rate(at_scale, p) for p in (cfg.optim.warmup_passes, cfg.num_passes / 2, cfg.num_passes)] == [
            2e-5
        ] * 3
    assert (cfg.ema_decay, cfg.ema_warmup) == (0.9999, "none")
    assert not cfg.data.hflip, "captions name left and right"
    assert (cfg.data.batch_size, cfg.data.resolution) == (32, 256)
