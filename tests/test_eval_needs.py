"""What an evaluation needs, as a specification: `prunepipe eval` names every missing piece in one message
before it loads a model; a tiny text-to-image run on unlabelled, web-like latents (photo crops at four
aspect ratios, bucketed) with no Inception weights on the machine writes every metric it can and says
why FID was left out; and FID compares with the images the latents' index.json records."""

from __future__ import annotations

import json
import os

import pytest
from eval_runs import one_torch_thread
from test_bucket_training import CONFIG, bucketed, overrides  # noqa: F401 (fixture)
from test_text_eval import clip  # noqa: F401 (fixture)

from prunepipe.launch.cli import main
from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.evaluation.needs import EvalNeedsError, plan_evaluation
from prunepipe.pipelines.training.loop import train

QUICK = ["fid.num_samples=4", "fid.sampler_steps=2", "fid.batch_size=4", "val_samples=8"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def web_run(bucketed, tmp_path_factory) -> str:  # noqa: F811
    """One pass of the tiny bucketed text-to-image recipe: no class labels anywhere in its data."""
    cfg = load_config(CONFIG, overrides(bucketed, str(tmp_path_factory.mktemp("runs")), "web", "num_passes=1"))
    train(cfg)
    return cfg.run_dir


@pytest.fixture
def no_inception(tmp_path, monkeypatch):
    """A torch hub folder without Inception weights, as on a machine that never downloaded them."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))


def test_every_missing_piece_is_named_in_one_message_before_anything_loads(tmp_path):
    run_cfg = load_config(CONFIG, ["data.train=/nowhere/train", "data.val=", f"runs_dir={tmp_path}", "name=r"])
    settings = load_eval_config(
        overrides=[
            f"clip_score.model={tmp_path / 'no_clip'}",
            f"fid.weights={tmp_path / 'no.pth'}",
            "fid.reference=val",
        ]
    )
    with pytest.raises(EvalNeedsError) as error:
        plan_evaluation(run_cfg, settings, run_dir=str(tmp_path))
    message = str(error.value)
    assert "5 missing piece(s), none yet evaluated" in message
    for piece in (
        f"a checkpoint: {tmp_path / 'checkpoints'} holds none yet",
        "held-out shards: data.val is empty",
        "eval.clip_score.model=",
        "fid.reference=val: data.val is empty",
        "fid.weights=",
    ):
        assert piece in message, piece
    assert isinstance(error.value, ValueError), "the CLI prints it as one error"


def test_a_text_run_on_web_latents_without_inception_weights_writes_what_it_can(
    web_run,
    bucketed,
    clip,
    no_inception,
    capsys,  # noqa: F811
):
    assert main(["eval", web_run, f"clip_score.model={clip}", *QUICK]) == 0
    printed = capsys.readouterr().out
    [path] = [line.split(": ", 1)[1] for line in printed.splitlines() if line.startswith("written: ")]
    with open(path) as f:
        record = json.load(f)
    assert set(record["metrics"]) == {"denoise_mse", "clip_score"}, "the held-out loss and CLIPScore, no FID"
    assert "fid" not in record["details"] and record["eval_config"]["fid"]["enabled"] is False
    skipped = record["details"]["fid_skipped"]
    assert "no Inception-v3 weights at" in skipped and "fid.weights=PATH" in skipped
    assert f"fid skipped: {skipped}" in printed
    assert "probe" not in json.dumps(record["details"]), "a diffusion run has no probe to skip"


def test_fid_of_a_text_run_on_latents_compares_with_the_images_their_index_records(web_run, bucketed):  # noqa: F811
    from prunepipe.pipelines.trained import evaluate_checkpoint

    images = ShardIndex.load(os.path.join(bucketed, "val")).meta["source"]
    assert ShardIndex.load(images).meta.get("latent_shape") is None, "index.json records the image shards"
    settings = load_eval_config(overrides=["fid.feature=module:test_text_eval:grey_features", *QUICK])
    record = evaluate_checkpoint(web_run, eval_cfg=settings, write=False)
    assert "fid" in record["metrics"] and "fid_skipped" not in record["details"]
    assert record["eval_config"]["fid"]["reference"] == images
