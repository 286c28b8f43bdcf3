"""Models past one GPU: parallel.strategy=fsdp and hsdp (FSDP2) against ddp on real gloo ranks started by
torchrun, checkpoints that every rank writes and any world size reads (torch.distributed.checkpoint), a
SIGKILL mid-pass and its requeue, and the rollback that resumes the live branch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from test_distributed import LAUNCHERS, TIMEOUT, TINY_MAE, free_port
from test_text_to_image import captioned, encoder, tiny  # noqa: F401 (fixtures)
from test_trainer import assert_states_equal, write_latent_shards

from prunepipe.pipelines.checkpoint.sharded import MODEL, OPTIMIZER, read_whole
from prunepipe.pipelines.checkpoint.store import (
    ABANDONED_PREFIX,
    checkpoints_dir,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint_states,
)
from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.training.loop import train
from prunepipe.tools.benchmarks.rehearse_cluster import kill_node

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
STRATEGIES = {"ddp": [], "fsdp": ["parallel.strategy=fsdp"], "hsdp": ["parallel.strategy=hsdp", "parallel.replicas=2"]}
# InfoBatch prunes from pass 2; two micro-batches a step; a NaN sample whose micro-batch is skipped every pass
COMMON = ["num_passes=2", "optim.grad_accum=2", "checkpoint.every_steps=4", "data.num_workers=0", "log_every=100"]
RELATIVE = 1e-5


def torchrun(nproc: int, config: str, args: list[str]) -> subprocess.Popen:
    command = [*LAUNCHERS["torchrun"](nproc, free_port()), "-m", "prunepipe.launch.cli", "train", config, *args]
    return subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finished(process: subprocess.Popen) -> str:
    output = process.communicate(timeout=TIMEOUT)[0]
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> dict:
    """Latent shards of 96 samples, sample 37 holding NaN, and clean held-out latents."""
    root = tmp_path_factory.mktemp("latents")
    return {
        "train": write_latent_shards(str(root / "train"), 96, nan_at=37),
        "val": write_latent_shards(str(root / "val"), 17, nan_at=-1),  # 2 ranks: shares of 2 batches and 1
    }


def dit_args(latents: dict, runs: str, name: str) -> list[str]:
    return [
        f"data.train={latents['train']}",
        f"data.val={latents['val']}",
        "data.val_batches=3",
        f"runs_dir={runs}",
        f"name={name}",
        "ldm.space=latents",
        "data.batch_size=8",
        "on_nonfinite_loss=skip",
        *COMMON,
    ]


DIT = os.path.join(ROOT, "configs", "ldm_dit_tiny_infobatch.yaml")


def assert_close(a: dict, b: dict, what: str) -> None:
    """Every tensor of `a` within RELATIVE of `b`'s, measured against the whole state's norm (a key bias's
    gradient is zero in exact arithmetic: its values are rounding noise of 1e-10, not a relative scale)."""
    assert a.keys() == b.keys(), what
    scale = max(float(torch.stack([v.float().norm() for v in b.values()]).norm()), 1e-12)
    worst = max(float((a[k].float() - b[k].float()).norm()) for k in a) / scale
    assert worst <= RELATIVE, f"{what}: relative difference {worst:.2e}"


def assert_near(a, b, path: str) -> None:
    """Pruner states alike: the same keys, counts and flags, scores (losses) within RELATIVE."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_near(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)) and not all(isinstance(x, (int, float)) for x in a):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_near(x, y, f"{path}[{i}]")
    elif isinstance(a, (np.ndarray, torch.Tensor, list, tuple, float)):
        x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        assert x.shape == y.shape and np.allclose(x, y, rtol=RELATIVE, atol=1e-7, equal_nan=True), path
    else:
        assert a == b, path


def assert_same_run(run_a: str, run_b: str) -> None:
    a, b = (load_checkpoint_states(latest_checkpoint(r)) for r in (run_a, run_b))
    assert_close(a["model"], b["model"], "weights")
    ema_a, ema_b = (dict(enumerate(s["ema"]["shadow_params"])) for s in (a, b))
    assert_close(ema_a, ema_b, "EMA")
    assert_near(a["pruner"], b["pruner"], "pruner")
    for key in ("pass_index", "optimizer_steps", "samples_forwarded", "skipped_nonfinite"):
        assert a["position"][key] == b["position"][key], key


def test_fsdp_and_hsdp_train_the_tiny_dit_as_ddp_does(latents, tmp_path):
    # the evaluator after pass 2 on the EMA weights; held-out shares of unequal length on the two ranks
    evaluated = ["eval.every_passes=2", "eval.fid.enabled=false", "eval.val_samples=17"]
    finished(torchrun(2, DIT, dit_args(latents, str(tmp_path), "ddp") + evaluated))
    for name in ("fsdp", "hsdp"):  # one launch at a time: two CPU cores
        output = finished(torchrun(2, DIT, dit_args(latents, str(tmp_path), name) + evaluated + STRATEGIES[name]))
        assert "pass 2/2" in output
        assert_same_run(str(tmp_path / "ddp"), str(tmp_path / name))
    records = {name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in STRATEGIES}
    record = [r for r in records["fsdp"] if r["kind"] == "pass"][-1]
    assert record["skipped_nonfinite"] == 2, "the NaN sample's micro-batch skipped in both passes"
    # every rank gathered whole weights for the held-out forwards, its share as long as it is
    evals = {name: [r for r in runs if r["kind"] == "eval"] for name, runs in records.items()}
    for name in ("fsdp", "hsdp"):
        passes = [r for r in records[name] if r["kind"] == "pass"]
        ddp_passes = [r for r in records["ddp"] if r["kind"] == "pass"]
        assert np.allclose(
            [p["held_out"]["denoise_mse"] for p in passes],
            [p["held_out"]["denoise_mse"] for p in ddp_passes],
            rtol=1e-4,
        )
        assert len(evals[name]) == 1 and np.isclose(
            evals[name][0]["details"]["denoise_mse"], evals["ddp"][0]["details"]["denoise_mse"], rtol=1e-4
        ), "the EMA weights evaluated whole"
    # the export of a sharded run, read whole from its checkpoint, holds what the ddp run exported
    from safetensors.torch import load_file

    exported = [
        load_file(tmp_path / name / "export/transformer/diffusion_pytorch_model.safetensors") for name in STRATEGIES
    ]
    assert_close(exported[1], exported[0], "exported EMA weights")


@pytest.mark.slow  # a run and two launches of two ranks, about a minute on 2 cores
def test_init_weights_fills_each_ranks_shards_under_fsdp_as_ddp_loads_them_whole(latents, tmp_path):
    train(load_config(DIT, [*dit_args(latents, str(tmp_path), "source"), "num_passes=1"]))
    init = [f"init.weights={tmp_path / 'source'}", "max_steps=2", "ema_warmup=none"]
    for name in ("ddp", "fsdp"):
        output = finished(torchrun(2, DIT, dit_args(latents, str(tmp_path), name) + init + STRATEGIES[name]))
        assert "tensors loaded; live weights from" in output
    assert_same_run(str(tmp_path / "ddp"), str(tmp_path / "fsdp"))


@pytest.mark.slow  # six launches of two ranks, about 3 minutes on 2 cores
@pytest.mark.parametrize("config", ["mae_tiny_infobatch.yaml", "ldm_t2i_tiny.yaml"], ids=["mae", "pixart"])
def test_fsdp_and_hsdp_train_mae_and_pixart_as_ddp_does(config, digits_shards, tmp_path, request):
    if config.startswith("ldm_t2i"):
        pairs, text = request.getfixturevalue("captioned"), request.getfixturevalue("encoder")
        data = [f"data.train={pairs}/train", f"data.val={pairs}/val", *tiny(text), "pruner.name=infobatch"]
    else:
        data = [f"data.train={digits_shards}/train", f"data.val={digits_shards}/val", *TINY_MAE]
    base = [*data, "data.val_batches=1", f"runs_dir={tmp_path}", "data.batch_size=32", *COMMON]
    for name, extra in STRATEGIES.items():
        finished(torchrun(2, os.path.join(ROOT, "configs", config), [*base, f"name={name}", *extra]))
    for name in ("fsdp", "hsdp"):
        assert_same_run(str(tmp_path / "ddp"), str(tmp_path / name))


CHECK_RESUMED = """
import sys, torch
from prunepipe.pipelines.checkpoint.sharded import EMA_WEIGHTS, MODEL, OPTIMIZER, read_whole
from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.training.loop import Trainer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

cfg = load_config(sys.argv[1], sys.argv[3:])
trainer = Trainer(cfg)  # resumes checkpoint.resume at this world size and strategy
whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
model = get_model_state_dict(trainer.model, options=whole)
optimizer = get_optimizer_state_dict(trainer.model, getattr(trainer.optimizer, "optimizer", trainer.optimizer), options=whole)
ema = {n: (s.full_tensor() if isinstance(s, DTensor) else s).cpu() for n, s in zip(trainer.state.parts[EMA_WEIGHTS].names, trainer.ema.shadow_params)}
if trainer.is_main:
    saved = {part: read_whole(sys.argv[2], part) for part in (MODEL, OPTIMIZER, EMA_WEIGHTS)}
    assert all(torch.equal(model[k], saved[MODEL][k]) for k in saved[MODEL]), "model"
    assert all(torch.equal(ema[k], saved[EMA_WEIGHTS][k]) for k in saved[EMA_WEIGHTS]), "ema"
    moments = {f"state.{name}.{key}": value for name, state in optimizer["state"].items() for key, value in state.items()}
    assert moments.keys() == saved[OPTIMIZER].keys() and all(torch.equal(moments[k].float(), saved[OPTIMIZER][k].float()) for k in moments), "optimizer"
    print("RESUMED STATE EQUALS THE SAVED ONE", flush=True)
trainer.train()
"""


def resume_elsewhere(nproc: int, checkpoint: str, args: list[str], tmp_path) -> str:
    script = tmp_path / "check_resumed.py"
    script.write_text(CHECK_RESUMED)
    prefix = [*LAUNCHERS["torchrun"](nproc, free_port())] if nproc > 1 else [sys.executable]
    command = [*prefix, str(script), DIT, checkpoint, *args, f"checkpoint.resume={checkpoint}"]
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        "\n".join(line for line in output.splitlines() if "[rank0]" in line)[-6000:] or output[-4000:]
    )
    assert "RESUMED STATE EQUALS THE SAVED ONE" in output
    return output


def kill_after(process: subprocess.Popen, target) -> None:
    deadline = time.time() + TIMEOUT
    while not target.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    kill_node(process)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def test_a_fsdp_run_killed_mid_pass_resumes_bitwise_and_at_one_rank_under_ddp(latents, tmp_path):
    fsdp = STRATEGIES["fsdp"] + ["num_passes=4"]  # steps enough after the checkpoint for the kill to land
    finished(torchrun(2, DIT, dit_args(latents, str(tmp_path), "straight") + fsdp))
    args = dit_args(latents, str(tmp_path), "killed") + fsdp
    killed = torchrun(2, DIT, args)
    target = tmp_path / "killed" / "checkpoints" / "step_000008"  # mid-pass 2: 6 steps in pass 1
    kill_after(killed, target)
    assert latest_checkpoint(str(tmp_path / "killed")) == str(target)

    output = finished(torchrun(2, DIT, args + ["checkpoint.resume=latest"]))
    assert f"resumed from {target}" in output
    a, b = (load_checkpoint_states(latest_checkpoint(str(tmp_path / r))) for r in ("straight", "killed"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), "weights bitwise"
    assert all(torch.equal(x, y) for x, y in zip(a["ema"]["shadow_params"], b["ema"]["shadow_params"])), "EMA"
    assert_states_equal(a["pruner"], b["pruner"])
    del a["position"]["wall_seconds"], b["position"]["wall_seconds"]
    assert_states_equal(a["position"], b["position"])
    for part in (OPTIMIZER,):
        x, y = (read_whole(latest_checkpoint(str(tmp_path / r)), part) for r in ("straight", "killed"))
        assert all(torch.equal(x[k], y[k]) for k in x), "AdamW bitwise"

    # the same checkpoint at one rank under ddp: the state read is the state saved, and training goes on
    one = dit_args(latents, str(tmp_path), "one") + ["parallel.strategy=ddp", "num_passes=4"]
    resume_elsewhere(1, str(target), one, tmp_path)
    assert load_checkpoint_states(latest_checkpoint(str(tmp_path / "one")))["position"]["pass_index"] == 4


@pytest.mark.slow  # four gloo ranks on 2 cores
def test_a_fsdp_checkpoint_of_two_ranks_resumes_at_four(latents, tmp_path):
    args = dit_args(latents, str(tmp_path), "two") + STRATEGIES["fsdp"]
    finished(torchrun(2, DIT, args + ["max_steps=3"]))  # pass 1 of 2 ends at step 3 on two ranks
    checkpoint = latest_checkpoint(str(tmp_path / "two"))
    resume_elsewhere(4, checkpoint, dit_args(latents, str(tmp_path), "four") + STRATEGIES["fsdp"], tmp_path)
    assert load_checkpoint_states(latest_checkpoint(str(tmp_path / "four")))["position"]["pass_index"] == 2


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(latents, tmp_path, capsys):
    """A rollback (checkpoint.resume=an older step) moves the newer ones aside before the run saves again,
    so that a requeue's resume=latest continues the live branch and retention keeps its checkpoints."""

    def cfg(*extra):
        args = dit_args(latents, str(tmp_path), "rolled") + ["checkpoint.keep=3", *extra]
        return load_config(DIT, args)

    train(cfg())  # checkpoints at 4, 8 and the end, 11
    steps = [os.path.basename(f) for f in complete_checkpoints(str(tmp_path / "rolled"))]
    assert steps == ["step_000004", "step_000008", "step_000011"]
    back = os.path.join(checkpoints_dir(str(tmp_path / "rolled")), "step_000004")
    train(cfg(f"checkpoint.resume={back}", "max_steps=6", "checkpoint.every_steps=2"))  # the live branch: 6
    out = capsys.readouterr().out
    assert "rolled back to step_000004: 2 newer checkpoint(s) (step_000008, step_000011) moved to" in out
    live = [os.path.basename(f) for f in complete_checkpoints(str(tmp_path / "rolled"))]
    assert live == ["step_000004", "step_000006"], "retention counts the live branch only"
    aside = [n for n in os.listdir(checkpoints_dir(str(tmp_path / "rolled"))) if n.startswith(ABANDONED_PREFIX)]
    assert len(aside) == 1
    assert sorted(os.listdir(os.path.join(checkpoints_dir(str(tmp_path / "rolled")), aside[0]))) == [
        "step_000008",
        "step_000011",
    ]
    train(cfg("checkpoint.resume=latest"))  # the requeue: the live branch, not the abandoned step 11
    assert "resumed from " + os.path.join(checkpoints_dir(str(tmp_path / "rolled")), "step_000006") in (
        capsys.readouterr().out
    )


def test_a_checkpoint_of_the_previous_format_is_refused_naming_it(latents, tmp_path):
    from prunepipe.pipelines.checkpoint.manifest import write_manifest
    from prunepipe.pipelines.checkpoint.store import CheckpointError

    train(load_config(DIT, dit_args(latents, str(tmp_path), "old") + ["num_passes=1"]))
    folder = latest_checkpoint(str(tmp_path / "old"))
    weights = read_whole(folder, MODEL)
    for name in os.listdir(folder):
        if name.endswith(".distcp") or name == ".metadata":
            os.remove(os.path.join(folder, name))
    from safetensors.torch import save_file

    save_file(weights, os.path.join(folder, "model.safetensors"))  # as accelerate's save_state wrote it
    write_manifest(folder, 6)
    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    manifest["format"] = 1
    body = {key: manifest[key] for key in ("format", "step", "files")}
    from prunepipe.pipelines.checkpoint.manifest import _self_crc

    manifest["self_crc32"] = _self_crc(body)
    json.dump(manifest, open(os.path.join(folder, "manifest.json"), "w"))
    assert torch.equal(load_checkpoint_states(folder)["model"]["proj_out_2.weight"], weights["proj_out_2.weight"])
    with pytest.raises(CheckpointError, match=r"checkpoint format 1 \(accelerate's save_state.*init.weights="):
        train(load_config(DIT, dit_args(latents, str(tmp_path), "old") + ["checkpoint.resume=latest"]))
