"""Evaluation of text-conditional runs as a specification, offline from local weights: a tiny
text DiT trained from img2dataset shards is sampled from the held-out captions; FID compares the
samples with those captions' own images, and CLIPScore (torchmetrics' own metric, with a tiny random
CLIPModel saved with save_pretrained and loaded by path) with the captions; the numbers do not
depend on the number of ranks, CLIPScore pairs each image with its own caption, and a missing CLIP
folder is named by its setting."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn as nn
from eval_runs import one_torch_thread, trained_task
from test_evaluate_ranks import join_group, leave, results_of, run_ranks
from test_text_to_image import CONFIG, captioned, config, encoder  # noqa: F401 (fixtures)
from torchmetrics.multimodal.clip_score import CLIPScore

from prunepipe.pipelines.config import ConfigError, check_data, load_config
from prunepipe.pipelines.data.splits import read_captions
from prunepipe.pipelines.evaluation.clip_score import clip_score_metric, load_clip, scoring
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.evaluation.fid import uint8_rgb
from prunepipe.pipelines.evaluation.runner import Evaluator
from prunepipe.pipelines.evaluation.sampling import generate_images
from prunepipe.pipelines.trained import evaluate_checkpoint
from prunepipe.pipelines.training.loop import train
from prunepipe.tools.commands.captioned import digit_caption
from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_clip

SAMPLES = 12  # generated images (and held-out captions) per evaluation


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


class GreyFeatures(nn.Module):
    """Float [0, 1] images -> their grey level at 4 x 4, [N, 16]: a stand-in FID feature network with
    no weights (torchmetrics probes it with a 3-channel image first)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return nn.functional.adaptive_avg_pool2d(images.float().mean(dim=1, keepdim=True), 4).flatten(1)


def grey_features(weights=None) -> nn.Module:
    return GreyFeatures()


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> str:
    """A tiny random CLIPModel (both towers) and its processor, saved by path as a downloaded CLIP is."""
    return write_tiny_clip(
        str(tmp_path_factory.mktemp("clip")),
        [digit_caption(label) for label in range(10)],
        image_size=16,
        patch_size=4,
        hidden_size=16,
        projection_dim=8,
        max_length=8,
    )


@pytest.fixture(scope="module")
def text_run(captioned, encoder, tmp_path_factory) -> str:  # noqa: F811
    cfg = config(captioned, encoder, tmp_path_factory.mktemp("runs"), "t2i_eval", "num_passes=2")
    train(cfg)
    return cfg.run_dir


def settings(clip: str, stats: str, *extra: str) -> list[str]:
    return [
        "fid.feature=module:test_text_eval:grey_features",
        f"fid.num_samples={SAMPLES}",
        "fid.sampler_steps=2",
        "fid.guidance_scale=2.0",
        "fid.batch_size=5",
        "val_samples=32",
        f"clip_score.model={clip}",
        *([f"fid.stats_dir={stats}"] if stats else []),
        *extra,
    ]


# ----------------------------------------------------------------------------- FID and CLIPScore
def test_a_text_runs_checkpoint_gets_fid_against_its_captions_images_and_clip_score(text_run, clip, tmp_path):
    record = evaluate_checkpoint(text_run, eval_cfg=load_eval_config(overrides=settings(clip, str(tmp_path))))
    metrics, details = record["metrics"], record["details"]
    print(
        f"text run after 2 passes: fid {metrics['fid']:.3f}, clip_score {metrics['clip_score']:.3f}, "
        f"denoise_mse {metrics['denoise_mse']:.4f}"
    )
    assert set(metrics) == {"denoise_mse", "fid", "clip_score"}
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["fid"] > 0
    # the real set is the held-out images of the captions sampled: the first SAMPLES of val
    assert details["fid_samples"] == details["fid_reference_samples"] == details["clip_score_samples"] == SAMPLES
    assert details["held_out_captions"] == SAMPLES and details["fid_guidance_scale"] == 2.0
    assert f"_{SAMPLES}_" in os.path.basename(details["fid_reference_cache"])
    assert details["clip_score_model"] == os.path.abspath(clip)
    with open(record["path"]) as f:
        assert json.load(f)["metrics"] == metrics


def test_clip_score_is_torchmetrics_value_of_the_samples_against_their_captions(text_run, clip):
    task, model, cfg = trained_task(text_run)
    captions = read_captions(cfg.data.val, SAMPLES)
    assert captions == [digit_caption(label) for label in _val_labels(SAMPLES)]
    eval_cfg = load_eval_config(overrides=settings(clip, "", "fid.enabled=false"))
    evaluated = Evaluator(cfg, eval_cfg, run_dir=text_run).evaluate(task, model, write=False)["metrics"]
    assert "fid" not in evaluated  # CLIPScore alone draws the samples itself

    images = torch.cat(
        list(
            generate_images(
                task, model, num_images=SAMPLES, steps=2, seed=0, batch_size=5, guidance_scale=2.0, captions=captions
            )
        )
    )
    direct = CLIPScore(model_name_or_path=lambda: load_clip(clip))
    direct.update(uint8_rgb(images), captions)
    assert evaluated["clip_score"] == pytest.approx(float(direct.compute()), rel=1e-5)
    # the same number from the raw transformers CLIPModel: 100 x the cosine, averaged, floored at 0
    assert evaluated["clip_score"] == pytest.approx(max(float(_cosines(clip, images, captions).mean()), 0), abs=1e-3)


def test_clip_score_pairs_each_image_with_its_own_caption(clip):
    # a constructed case: each image given the caption CLIP itself ranks closest must score at least as
    # high as any other assignment (one where sums over pairs, unlike sums over a set, must differ)
    words = [digit_caption(label) for label in range(10)]
    images = torch.rand(6, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    table = torch.stack([_cosines(clip, images, [w] * len(images)) for w in words], dim=1)  # [image, caption]
    best = [words[int(i)] for i in table.argmax(dim=1)]
    worst = [words[int(i)] for i in table.argmin(dim=1)]
    sums = {}
    for name, captions in (("best", best), ("shuffled", best[1:] + best[:1]), ("worst", worst)):
        metric = clip_score_metric(clip)
        list(scoring([images[:4], images[4:]], metric, captions))
        sums[name] = float(metric.score)  # torchmetrics' own sum of per-pair scores, before the floor at 0
        torch.testing.assert_close(torch.tensor(sums[name]), _cosines(clip, images, captions).sum(), atol=1e-3, rtol=0)
    assert sums["best"] > sums["worst"] and sums["best"] >= sums["shuffled"]


def _cosines(clip: str, images: torch.Tensor, captions: list[str]) -> torch.Tensor:
    """100 x cos(image, caption) per pair, from transformers' CLIPModel and processor, outside torchmetrics."""
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(clip, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(clip, local_files_only=True)
    pixels = processor(images=list(uint8_rgb(images)), return_tensors="pt")["pixel_values"]
    tokens = processor(text=captions, return_tensors="pt", padding=True)
    with torch.no_grad():
        image = model.get_image_features(pixel_values=pixels).pooler_output
        text = model.get_text_features(**tokens).pooler_output
    return 100 * torch.nn.functional.cosine_similarity(image, text, dim=-1)


def _val_labels(count: int) -> list[int]:
    from sklearn.datasets import load_digits

    return [int(label) for label in load_digits().target[512 : 512 + count]]


def test_replication_of_a_text_run_is_capped_at_its_held_out_captions(text_run, tmp_path):
    # sample i is drawn from held-out caption i: val's 64 captions cap replication.num_samples=100 at 64
    task, model, cfg = trained_task(text_run)
    overrides = [
        "fid.enabled=false",
        "fid.sampler_steps=2",
        "fid.batch_size=32",
        "val_samples=8",
        "replication.enabled=true",
        "replication.num_samples=100",
        "replication.max_train=64",
        "replication.held_out_samples=16",
        "replication.neighbours=5",
        "replication.picture_pairs=0",
    ]
    details = Evaluator(cfg, load_eval_config(overrides=overrides), run_dir=text_run).evaluate(
        task, model, write=False
    )["details"]
    assert details["held_out_captions"] == details["replication_samples"] == 64
    assert details["replication_reused_fid_samples"] is False


# ----------------------------------------------------------------------------- ranks
def _evaluate_on_ranks(rank, world, init_file, run_dir, overrides, out):
    join_group(rank, world, init_file)
    task, model, cfg = trained_task(run_dir)
    record = Evaluator(cfg, load_eval_config(overrides=list(overrides)), run_dir=run_dir).evaluate(
        task, model, write=False
    )
    leave(rank, out, record["metrics"])


def test_two_ranks_measure_what_one_does(text_run, clip, tmp_path):
    # each rank samples captions rank, rank + 2, ... ; FID's and CLIPScore's sums add over ranks
    overrides = settings(clip, str(tmp_path / "stats"))
    task, model, cfg = trained_task(text_run)
    one = Evaluator(cfg, load_eval_config(overrides=overrides), run_dir=text_run).evaluate(task, model, write=False)
    run_ranks(_evaluate_on_ranks, 2, str(tmp_path / "init"), text_run, overrides, str(tmp_path))
    for metrics in results_of(tmp_path, 2):
        for name in ("fid", "clip_score", "denoise_mse"):
            assert metrics[name] == pytest.approx(one["metrics"][name], rel=1e-4), name


# ----------------------------------------------------------------------------- mistakes named
def test_a_missing_clip_folder_is_named_by_its_setting(text_run, tmp_path):
    task, model, cfg = trained_task(text_run)
    eval_cfg = load_eval_config(overrides=settings(str(tmp_path / "no_clip"), "", "fid.enabled=false"))
    with pytest.raises(FileNotFoundError, match=r"eval\.clip_score\.model=.*no_clip.*no such folder"):
        Evaluator(cfg, eval_cfg, run_dir=text_run).evaluate(task, model, write=False)
    # a folder that holds no CLIP
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"eval\.clip_score\.model=.*empty.*no transformers config"):
        load_clip(str(tmp_path / "empty"))


def test_a_text_run_evaluates_fid_and_clip_score_every_pass_and_its_config_mistakes_are_named(
    captioned, encoder, clip, tmp_path
):  # noqa: F811
    every = ["eval.every_passes=1", "eval.replication.enabled=true"]
    cfg = config(captioned, encoder, tmp_path, "ok", *every, f"eval.clip_score.model={clip}")
    assert cfg.eval.fid.enabled and cfg.eval.clip_score.model == clip
    with pytest.raises(ConfigError, match=r"data check: eval\.clip_score\.model=.*no such folder"):
        check_data(config(captioned, encoder, tmp_path, "bad", *every, f"eval.clip_score.model={tmp_path / 'none'}"))
    with pytest.raises(ConfigError, match=r"held-out captions and data\.val is empty"):
        config(captioned, encoder, tmp_path, "bad", *every, "data.val=")
    digits = os.path.join(os.path.dirname(CONFIG), "ldm_dit_tiny_full.yaml")
    with pytest.raises(ConfigError, match=r"eval\.clip_score\.model=.*ldm\.conditioning is class"):
        load_config(
            digits, [f"data.train={captioned}/train", f"data.val={captioned}/val", f"eval.clip_score.model={clip}"]
        )
