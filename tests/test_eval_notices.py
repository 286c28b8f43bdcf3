"""What an evaluation tells its user: a sample count capped by the held-out captions is said once,
loudly, with why and how to change it; transformers' own bars and load reports stay out of the
output while its models load, and the project's own progress stays in."""

from __future__ import annotations

import os
import shutil

import pytest
from eval_runs import one_torch_thread, trained_task
from safetensors.torch import save_file
from test_text_eval import clip, text_run  # noqa: F401 (fixtures)
from test_text_to_image import captioned, encoder  # noqa: F401 (fixtures)

from prunepipe.pipelines.checkpoint.store import load_checkpoint_states
from prunepipe.pipelines.evaluation.clip_score import clip_score_metric
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.evaluation.runner import Evaluator
from prunepipe.pipelines.progress import progress
from prunepipe.pipelines.tasks.diffusion.text import TextEncoder


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def test_fid_samples_capped_by_the_held_out_captions_are_said_once_with_the_way_out(text_run, capsys):  # noqa: F811
    task, model, cfg = trained_task(text_run)
    overrides = [
        "fid.feature=module:test_text_eval:grey_features",
        "fid.num_samples=100",
        "fid.sampler_steps=1",
        "fid.batch_size=50",
        "val_samples=8",
        f"fid.stats_dir={os.path.dirname(text_run)}/stats",
    ]
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


def test_transformers_loads_are_quiet_and_leave_its_settings_and_the_projects_bars_alone(  # noqa: F811
    clip, encoder, tmp_path, capfd
):  # noqa: F811
    from transformers.utils import logging

    logging.set_verbosity_warning()
    logging.enable_progress_bar()  # the tiny models' writers turn it off
    capfd.readouterr()
    clip_score_metric(clip)
    TextEncoder(clip, max_length=8)  # the text tower of a full CLIP: its vision tower's tensors go unused
    TextEncoder(encoder, max_length=8)
    out, err = capfd.readouterr()
    for noise in ("Loading weights", "LOAD REPORT", "UNEXPECTED"):
        assert noise not in out + err, out + err
    assert logging.get_verbosity() == logging.WARNING and logging.is_progress_bar_enabled()
    bar = progress(3, desc="mine", every_seconds=0.0)
    bar.update(1)
    bar.close()
    assert "mine: 1/3 it" in capfd.readouterr().err

    # what would change results is still said, in one line: a tensor the weights lack starts random
    broken = str(tmp_path / "broken")
    shutil.copytree(encoder, broken)
    weights = load_checkpoint_states(broken)["model"]
    gone = sorted(weights)[0]
    del weights[gone]
    save_file(weights, os.path.join(broken, "model.safetensors"), metadata={"format": "pt"})
    TextEncoder(broken, max_length=8)
    out, err = capfd.readouterr()
    assert f"1 tensor(s) of CLIPTextModel are not in its weights and start random ({gone})" in out
    assert "LOAD REPORT" not in out + err
    logging.set_verbosity_warning()
