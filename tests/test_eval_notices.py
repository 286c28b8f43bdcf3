"""What an evaluation tells its user: a sample count capped by the held-out captions is said once,
loudly, with why and how to change it."""

from __future__ import annotations

import os

import pytest
from eval_runs import one_torch_thread, trained_task
from test_text_eval import text_run  # noqa: F401 (fixture)
from test_text_to_image import captioned, encoder  # noqa: F401 (fixtures)

from pipelines.evaluation.config import load_eval_config
from pipelines.evaluation.runner import Evaluator


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def test_fid_samples_capped_by_the_held_out_captions_are_said_once_with_the_way_out(text_run, capsys):  # noqa: F811
    task, model, cfg = trained_task(text_run)
    overrides = ["fid.feature=module:test_text_eval:grey_features", "fid.num_samples=100", "fid.sampler_steps=1",
                 "fid.batch_size=50", "val_samples=8", f"fid.stats_dir={os.path.dirname(text_run)}/stats"]
    evaluator = Evaluator(cfg, load_eval_config(overrides=overrides), run_dir=text_run)
    capsys.readouterr()
    details = evaluator.evaluate(task, model, write=False)["details"]
    said = capsys.readouterr().out
    # the val split holds 64 captioned samples
    assert details["fid_samples"] == details["held_out_captions"] == 64 and details["fid_samples_requested"] == 100
    [line] = [line for line in said.splitlines() if "fid.num_samples=100" in line]
    assert "64 held-out captions of " + cfg.data.val in line and "data.val (or the eval setting val=DIR)" in line
    assert "at least 100 samples" in line and "fid.num_samples=64" in line
    evaluator.evaluate(task, model, write=False)
    assert "fid.num_samples" not in capsys.readouterr().out, "said once a run"
