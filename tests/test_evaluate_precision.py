"""One evaluation precision as a specification: a bf16 run's model, prepared by accelerate (whose
autocast forward survives `unwrap_model`), is evaluated in training at `eval.precision` (fp32 by
default) and gives exactly the numbers `prunepipe eval` gives; bf16 is applied alike in both paths;
every record states its precision, and `prunepipe compare` refuses to judge records of different
precisions against each other."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from eval_runs import ROOT, TINY_MAE, one_torch_thread, session_dir, tiny_run, trained_task

from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.evaluation.runner import Evaluator, weights_for_eval
from prunepipe.pipelines.report.compare import compare_runs
from prunepipe.pipelines.trained import evaluate_checkpoint

QUICK = ["probe.enabled=false", "val_samples=90"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture
def bf16_accelerator():
    """accelerate's Accelerator with bf16 on the CPU (it autocasts there too). Its state is one per
    process: reset before and after, as accelerate's own test cases do (AccelerateTestCase)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield Accelerator(mixed_precision="bf16", cpu=True)
    AcceleratorState._reset_state(True)


@pytest.fixture(scope="module")
def run_dir(digits_shards, tmp_path_factory) -> str:
    return tiny_run(
        digits_shards, session_dir(tmp_path_factory, "eval_runs"), "mae_tiny_full.yaml", "mae_full", ("num_passes=2",)
    )


def val_batches(cfg, batch_size=16):
    from prunepipe.pipelines.data.splits import read_split

    return read_split(
        cfg.data.val,
        resolution=cfg.data.resolution,
        channels=cfg.data.channels,
        batch_size=batch_size,
        max_samples=batch_size,
    )


def test_in_loop_evaluation_of_a_bf16_prepared_model_gives_the_fp32_numbers(run_dir, bf16_accelerator):
    task, model, cfg = trained_task(run_dir)
    quick = load_eval_config(overrides=QUICK)
    fp32 = Evaluator(cfg, quick, run_dir=run_dir).evaluate(task, model, write=False)
    prepared = bf16_accelerator.prepare(copy.deepcopy(model))
    unwrapped = bf16_accelerator.unwrap_model(prepared)  # what the training loop holds
    batch = next(iter(val_batches(cfg)))
    noise = torch.rand(len(batch.ids), task.num_patches, generator=torch.Generator().manual_seed(0))
    # the premise: accelerate's forward wrapper autocasts on the CPU and survives unwrap_model
    assert not torch.equal(unwrapped(batch.images, noise), model(batch.images, noise))

    in_loop = Evaluator(cfg, quick, run_dir=run_dir).evaluate(
        task, weights_for_eval(prepared, None, "raw"), write=False
    )
    assert in_loop["metrics"] == fp32["metrics"] and in_loop["precision"] == fp32["precision"] == "fp32"
    # the wrapper is only set aside while evaluating: training goes on in bf16
    assert torch.equal(unwrapped(batch.images, noise), bf16_accelerator.unwrap_model(prepared)(batch.images, noise))
    assert not torch.equal(unwrapped(batch.images, noise), model(batch.images, noise))


def test_bf16_is_applied_alike_in_training_and_in_prunepipe_eval(run_dir, bf16_accelerator):
    task, model, cfg = trained_task(run_dir)
    bf16 = load_eval_config(overrides=[*QUICK, "precision=bf16", "weights=raw"])
    offline = evaluate_checkpoint(run_dir, eval_cfg=bf16, write=False)
    in_loop = Evaluator(cfg, bf16, run_dir=run_dir).evaluate(
        task, weights_for_eval(bf16_accelerator.prepare(copy.deepcopy(model)), None, "raw"), write=False
    )
    assert in_loop["metrics"] == offline["metrics"] and offline["precision"] == "bf16"
    fp32 = evaluate_checkpoint(run_dir, eval_cfg=load_eval_config(overrides=[*QUICK, "weights=raw"]), write=False)
    # bf16 is really in force, PSNR and SSIM included (they are computed in fp32 from its reconstruction)
    for metric in ("masked_mse", "psnr", "ssim"):
        assert offline["metrics"][metric] != fp32["metrics"][metric]
        assert offline["metrics"][metric] == pytest.approx(fp32["metrics"][metric], rel=0.05)


def test_a_bf16_run_logs_the_numbers_prunepipe_eval_gives(digits_shards, tmp_path, bf16_accelerator):
    """The training loop's two call sites, end to end: the per-pass held-out loss and the evaluation
    every pass of a run trained in bf16 are fp32, as `prunepipe eval` measures the checkpoint."""
    from prunepipe.pipelines.config import load_config
    from prunepipe.pipelines.training.loop import train

    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [
            f"data.train={digits_shards}/train",
            f"data.val={digits_shards}/val",
            f"runs_dir={tmp_path}",
            "name=bf16",
            *TINY_MAE,
            "num_passes=1",
            "mixed_precision=bf16",
            "eval.every_passes=1",
            *[f"eval.{o}" for o in QUICK],
        ],
    )
    train(cfg)
    records = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    [in_loop] = [r for r in records if r["kind"] == "eval"]
    [pass_end] = [r for r in records if r["kind"] == "pass"]
    offline = evaluate_checkpoint(cfg.run_dir, write=False)
    assert in_loop["precision"] == offline["precision"] == "fp32"
    assert in_loop["metrics"] == offline["metrics"]
    # the pass record's held-out loss: the raw weights on the first data.val_batches batches
    held = cfg.data.val_batches * cfg.data.batch_size
    raw = evaluate_checkpoint(
        cfg.run_dir,
        eval_cfg=load_eval_config(overrides=["probe.enabled=false", f"val_samples={held}", "weights=raw"]),
        write=False,
    )
    assert pass_end["held_out"]["masked_mse"] == pytest.approx(raw["metrics"]["masked_mse"], rel=1e-12)


# ----------------------------------------------------------------------------- compare
def eval_run(root, name, pruner, precision, masked_mse):
    """A run folder with one pass record and one eval record of `precision`."""
    import yaml

    path = root / name
    (path / "eval").mkdir(parents=True)
    (path / "config.yaml").write_text(
        yaml.safe_dump({"name": name, "task": "mae", "seed": 0, "num_passes": 1, "pruner": {"name": pruner}})
    )
    (path / "metrics.jsonl").write_text(
        json.dumps(
            {
                "kind": "pass",
                "pass_index": 0,
                "optimizer_steps": 10,
                "samples_forwarded": 1000,
                "kept_fraction": 1.0,
                "wall_seconds": 10.0,
                "held_out": {"masked_mse": masked_mse, "num_samples": 100},
            }
        )
        + "\n"
    )
    record = {
        "kind": "eval",
        "weights": "ema",
        "precision": precision,
        "optimizer_steps": 10,
        "metrics": {"masked_mse": masked_mse},
    }
    (path / "eval" / "step_000010.json").write_text(json.dumps(record))
    return str(path)


def test_compare_refuses_records_of_different_precisions_naming_the_runs(tmp_path):
    full = eval_run(tmp_path, "full", "full", "fp32", 0.100)
    pruned = eval_run(tmp_path, "ib", "infobatch", "bf16", 0.101)
    with pytest.raises(ValueError, match="different precisions") as error:
        compare_runs([full], [pruned], out=str(tmp_path / "out"), plots=False)
    message = str(error.value)
    assert f"{full} (eval/step_000010.json): fp32" in message and f"{pruned} (eval/step_000010.json): bf16" in message
    # two known precisions: fp32, an evaluation's default, is the one asked for
    assert (
        f"Re-evaluate `prunepipe eval {pruned} precision=fp32`" in message and f"eval {full} precision" not in message
    )
    assert not os.path.exists(tmp_path / "out" / "report.md")
    same = eval_run(tmp_path, "ib_fp32", "infobatch", "fp32", 0.101)
    assert (
        compare_runs([full], [same], out=str(tmp_path / "ok"), plots=False)["equal_passes"]["ib_fp32"]["verdict"]
        == "lossless"
    )
