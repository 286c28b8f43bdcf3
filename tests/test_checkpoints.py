"""Checkpoints that survive storage faults, as a specification: every kind of file of the newest
checkpoint truncated, deleted or with a flipped bit is found by its manifest; `resume=latest` then
names the file and the reason, resumes from the checkpoint before and ends bitwise equal to an
uninterrupted run; `resume=PATH` on a damaged checkpoint fails naming the file; a save that the file
system refuses midway raises naming the path and leaves the previous checkpoint loadable; a checkpoint
whose manifest is gone counts as damaged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from eval_runs import TINY_MAE, one_torch_thread, session_dir

from prunepipe.launch.cli import main as cli_main
from prunepipe.pipelines.checkpoint.manifest import MANIFEST, verify
from prunepipe.pipelines.checkpoint.parts import is_part_file
from prunepipe.pipelines.checkpoint.store import (
    CheckpointError,
    checkpoints_dir,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint_states,
    resolve_resume,
)
from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.training.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "mae_tiny_infobatch.yaml")
STOP = 42  # the stopped run saves at 10, 20, 30, 40 and, when it stops, 42: the newest to damage
WEIGHTS = "__0_0.distcp"  # the model, AdamW and the EMA's weights as torch.distributed.checkpoint writes them
KINDS = (
    WEIGHTS,
    ".metadata",
    "pruner.pt",
    "ema.pt",
    "position.pt",
    "pruner_tables/score.npy",
    MANIFEST,
)
TABLE_FILES = ("pruner_tables/score.npy", "pruner_tables/seen.npy")  # InfoBatch's, written once by rank 0
DAMAGES = ("truncate", "delete", "flip")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def run_config(shards: str, runs_dir: str, name: str, *extra: str):
    # 3 passes: InfoBatch prunes passes 2 and 3, so the pruner's tables matter to the result
    return load_config(
        CONFIG,
        [
            f"data.train={shards}/train",
            f"data.val={shards}/val",
            f"runs_dir={runs_dir}",
            f"name={name}",
            "num_passes=3",
            "checkpoint.every_steps=10",
            "checkpoint.keep=10",
            "log_every=100",
            *TINY_MAE,
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def runs(digits_shards, tmp_path_factory) -> dict:
    """An uninterrupted run and one stopped after STOP steps, with checkpoints."""
    runs_dir = session_dir(tmp_path_factory, "checkpoint_runs")
    train(run_config(digits_shards, runs_dir, "straight"))
    train(run_config(digits_shards, runs_dir, "stopped", f"max_steps={STOP}"))
    return {
        "shards": digits_shards,
        "dir": runs_dir,
        "straight": os.path.join(runs_dir, "straight"),
        "stopped": os.path.join(runs_dir, "stopped"),
    }


def damage(path: str, how: str) -> None:
    """A storage fault: the file cut to 100 bytes, gone, or one bit of its middle byte flipped."""
    if how == "delete":
        os.remove(path)
        return
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[:100]
    else:
        data[len(data) // 2] ^= 0x10
    with open(path, "wb") as f:
        f.write(bytes(data))


def copy_of_stopped(runs: dict, name: str) -> str:
    copy = os.path.join(runs["dir"], name)
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(runs["stopped"], copy)
    return copy


def final_weights(run_dir: str) -> dict:
    return load_checkpoint_states(latest_checkpoint(run_dir))["model"]


def test_a_saved_checkpoint_has_a_manifest_that_verifies(runs):
    folders = complete_checkpoints(runs["stopped"])
    assert [os.path.basename(f) for f in folders] == [f"step_{s:06d}" for s in (10, 20, 30, 40, STOP)]
    for folder in folders:
        assert verify(folder).intact, verify(folder).describe()
        manifest = json.load(open(os.path.join(folder, MANIFEST)))
        assert set(manifest["files"]) == (set(KINDS) | set(TABLE_FILES)) - {MANIFEST}
        assert manifest["files"][WEIGHTS]["bytes"] == os.path.getsize(os.path.join(folder, WEIGHTS))


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_manifest_finds_every_damage_and_names_the_file(runs, kind, how, tmp_path):
    folder = str(tmp_path / "step_000042")
    shutil.copytree(latest_checkpoint(runs["stopped"]), folder)
    size = os.path.getsize(os.path.join(folder, kind))
    damage(os.path.join(folder, kind), how)
    verdict = verify(folder)
    assert not verdict.intact
    if kind == MANIFEST and how == "delete":
        assert verdict.problem == f"{MANIFEST} is missing"
    elif kind == MANIFEST:
        assert verdict.problem.startswith(f"{MANIFEST} is unreadable")
    elif how == "truncate":
        assert verdict.problem == f"{kind} is 100 bytes, manifest says {size}"
    elif how == "delete":
        assert verdict.problem == f"{kind} is missing (the manifest lists it)"
    else:
        assert verdict.problem.startswith(f"{kind} has CRC-32 ") and "its bytes changed" in verdict.problem


@pytest.mark.parametrize(
    "kind, how", [(k, d) for k in KINDS for d in DAMAGES], ids=[f"{k}-{d}" for k in KINDS for d in DAMAGES]
)
def test_resume_latest_skips_a_damaged_checkpoint_and_ends_bitwise_equal(runs, kind, how, capsys):
    run_dir = copy_of_stopped(runs, f"damaged_{kind}_{how}".replace(".", "_").replace("/", "_"))
    newest = latest_checkpoint(run_dir)
    size = os.path.getsize(os.path.join(newest, kind))
    damage(os.path.join(newest, kind), how)
    capsys.readouterr()
    train(run_config(runs["shards"], runs["dir"], os.path.basename(run_dir), "checkpoint.resume=latest"))
    out = capsys.readouterr().out
    if how == "truncate" and kind != MANIFEST:
        assert f"step_{STOP:06d}: {kind} is 100 bytes, manifest says {size}; resuming from step_000040" in out
    else:
        assert f"step_{STOP:06d}: " in out and "; resuming from step_000040" in out
    assert f"resumed from {os.path.join(checkpoints_dir(run_dir), 'step_000040')}:" in out
    straight, resumed = final_weights(runs["straight"]), final_weights(run_dir)
    assert straight.keys() == resumed.keys()
    assert all((straight[k] == resumed[k]).all() for k in straight), "the resumed run ended elsewhere"


def test_resume_from_a_named_damaged_checkpoint_fails_naming_the_file(runs):
    run_dir = copy_of_stopped(runs, "named_damaged")
    newest = latest_checkpoint(run_dir)
    damage(os.path.join(newest, WEIGHTS), "truncate")
    with pytest.raises(CheckpointError, match=rf"checkpoint.resume={newest}: {WEIGHTS} is 100 bytes, manifest says"):
        resolve_resume(newest, run_dir)
    args = [
        "train",
        CONFIG,
        f"data.train={runs['shards']}/train",
        f"data.val={runs['shards']}/val",
        f"runs_dir={runs['dir']}",
        "name=named_damaged",
        "num_passes=3",
        f"checkpoint.resume={newest}",
        *TINY_MAE,
    ]
    done = subprocess.run(
        [sys.executable, "-m", "prunepipe.launch.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"prunepipe: error: checkpoint.resume={newest}: {WEIGHTS}")


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(runs):
    run_dir = copy_of_stopped(runs, "all_damaged")
    for folder in complete_checkpoints(run_dir):
        damage(os.path.join(folder, WEIGHTS), "flip")
    with pytest.raises(CheckpointError, match=rf"no intact checkpoint \(step_000042: {WEIGHTS} has CRC-32"):
        resolve_resume("latest", run_dir)


def test_checkpoints_verify_lists_each_checkpoint(runs, capsys):
    run_dir = copy_of_stopped(runs, "verify_cli")
    damage(os.path.join(latest_checkpoint(run_dir), "ema.pt"), "delete")
    assert cli_main(["checkpoints", "verify", run_dir]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"step_{STOP:06d}: ema.pt is missing (the manifest lists it)"
    assert lines[1:5] == [f"step_{s:06d}: ok" for s in (40, 30, 20, 10)]
    assert lines[-1] == "5 checkpoint(s), 1 damaged; checkpoint.resume=latest takes step_000040"
    assert cli_main(["checkpoints", "verify", runs["straight"]]) == 0


def test_evaluating_latest_skips_a_damaged_checkpoint(runs, capsys):
    from prunepipe.pipelines.trained import evaluate_checkpoint

    run_dir = copy_of_stopped(runs, "eval_damaged")
    damage(os.path.join(latest_checkpoint(run_dir), WEIGHTS), "truncate")
    record = evaluate_checkpoint(run_dir, overrides=["probe.enabled=false", "val_samples=64"], write=False)
    assert record["optimizer_steps"] == 40
    assert "; evaluating step_000040" in capsys.readouterr().out


FSIZE_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from prunepipe.launch.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_save_the_file_system_refuses_midway_keeps_the_previous_checkpoint(runs):
    run_dir = copy_of_stopped(runs, "refused")
    before = latest_checkpoint(run_dir)
    sizes = {name: os.path.getsize(os.path.join(before, name)) for name in os.listdir(before)}
    # Files up to the parts' sizes may be written, the weights' (larger) may not: the save stops
    # after writing part of the checkpoint, as on a full disk.
    largest_part = max(size for name, size in sizes.items() if name != WEIGHTS)
    limit = (largest_part + sizes[WEIGHTS]) // 2
    assert largest_part < limit < sizes[WEIGHTS]
    args = [
        "train",
        CONFIG,
        f"data.train={runs['shards']}/train",
        f"data.val={runs['shards']}/val",
        f"runs_dir={runs['dir']}",
        "name=refused",
        "num_passes=3",
        "checkpoint.every_steps=10",
        "checkpoint.keep=1",
        "log_every=100",
        "checkpoint.resume=latest",
        *TINY_MAE,
    ]
    done = subprocess.run(
        [sys.executable, "-c", FSIZE_LIMITED, str(limit), *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stdout + done.stderr
    error = done.stderr.strip().splitlines()[-1]
    target = os.path.join(checkpoints_dir(run_dir), "step_000050")
    assert error.startswith(f"prunepipe: error: saving checkpoint {target} failed (")
    assert f"the previous checkpoints are untouched (newest: {before})" in error
    assert latest_checkpoint(run_dir) == before and len(complete_checkpoints(run_dir)) == 5  # keep=1 pruned nothing
    assert not [n for n in os.listdir(checkpoints_dir(run_dir)) if n.startswith(".tmp-")]  # the partial save is gone
    assert verify(before).intact
    assert load_checkpoint_states(before)["position"]["optimizer_steps"] == STOP


def test_a_reader_of_the_pruner_state_checks_only_the_files_it_reads(runs, tmp_path):
    from prunepipe.pipelines.report.plots import checkpoint_scores

    run_dir = copy_of_stopped(runs, "scores_only")
    newest, previous = complete_checkpoints(run_dir)[-1], complete_checkpoints(run_dir)[-2]
    damage(os.path.join(newest, WEIGHTS), "flip")  # not read for the histograms
    damage(os.path.join(previous, "pruner.pt"), "flip")  # read: that checkpoint is left out
    assert verify(newest, only=is_part_file).intact
    assert not verify(newest).intact
    steps = [s["optimizer_steps"] for s in checkpoint_scores(run_dir)]
    assert STOP in steps and 40 not in steps
    assert load_checkpoint_states(newest, read_model=False)["model"] is None
