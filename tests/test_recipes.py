"""The published recipes as a specification: the learning-rate schedule (DiT's constant rate), and
the real configs (`configs/ldm_dit_*.yaml`, `configs/mae_*.yaml`) say what their comments claim."""

from __future__ import annotations

import os

import pytest

from pipelines.config import load_config
from pipelines.training.loop import learning_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def tiny(digits_shards, *overrides: str):
    return load_config(os.path.join(CONFIGS, "mae_tiny_full.yaml"),
                       [f"data.train={digits_shards}/train", "data.val=", "passes=10", *overrides])


def test_a_constant_schedule_holds_the_peak_rate_after_its_warmup(digits_shards):
    cfg = tiny(digits_shards, "optim.schedule=constant", "optim.lr=1.0", "optim.warmup_passes=2", "optim.min_lr=0.1")
    assert learning_rate(cfg, 0.0) == 0.0 and learning_rate(cfg, 1.0) == pytest.approx(0.5)
    assert [learning_rate(cfg, p) for p in (2.0, 5.5, 9.99, 10.0)] == [1.0] * 4, "no decay, min_lr unused"
    cosine = tiny(digits_shards, "optim.lr=1.0", "optim.warmup_passes=2")
    assert learning_rate(cosine, 6.0) == pytest.approx(0.5) and learning_rate(cosine, 10.0) == pytest.approx(0.0)
