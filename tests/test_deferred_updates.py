"""Scores reach the pruner one step late so that the step never waits for the device, and
nothing else changes: every checkpoint holds the pruner state immediate updates would have left, the
pruner gets step k's scores only after step k+1's forward began, and a NaN still stops the run
naming its step and sample ids. On CUDA, a few steps run with any device-to-host wait an error."""

from __future__ import annotations

import os

import pytest
import torch
from test_trainer import assert_states_equal, write_latent_shards  # pytest puts tests/ on the path

from prunepipe.pipelines.checkpoint.store import complete_checkpoints, load_checkpoint_states
from prunepipe.pipelines.config import ConfigError, load_config
from prunepipe.pipelines.data.shards import BadInputError
from prunepipe.pipelines.tasks.mae import MAETask
from prunepipe.pipelines.training import loop
from prunepipe.pipelines.training.deferred import DeferredRecords
from prunepipe.pruning import build_pruner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MAE = [
    "mae.embed_dim=32",
    "mae.depth=1",
    "mae.num_heads=2",
    "mae.decoder_embed_dim=32",
    "mae.decoder_depth=1",
    "mae.decoder_num_heads=2",
    "data.batch_size=64",
    "data.val=",
    "data.num_workers=0",
]


def tiny_cfg(digits_shards, tmp_path, name, config="mae_tiny_infobatch.yaml", extra=()):
    return load_config(
        os.path.join(ROOT, "configs", config),
        [f"data.train={digits_shards}/train", f"runs_dir={tmp_path}", f"name={name}", *TINY_MAE, *extra],
    )


def checkpoint_states(run_dir) -> dict:
    """step folder name -> (pruner state, model weights) of every checkpoint the run kept."""

    states = {}
    for folder in complete_checkpoints(run_dir):
        pruner = load_checkpoint_states(folder, read_model=False)["pruner"]  # tables read from their files
        states[os.path.basename(folder)] = (pruner, load_checkpoint_states(folder)["model"])
    return states


def test_records_are_consumed_lag_records_late_and_all_at_a_drain():
    seen = []
    records = DeferredRecords(seen.append, lag=2)
    for k in range(5):
        records.push(k)
        assert seen == list(range(max(0, k - 1)))
    records.drain()
    assert seen == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="lag must be >= 0"):
        DeferredRecords(seen.append, lag=-1)


@pytest.mark.parametrize("config", ["mae_tiny_infobatch.yaml", "mae_tiny_ted.yaml"], ids=["infobatch", "ted"])
def test_deferred_updates_leave_the_pruner_state_of_immediate_ones_at_every_checkpoint(
    digits_shards, tmp_path, monkeypatch, config
):
    # every 7 steps: checkpoints inside passes, not only at their ends
    extra = ["num_passes=3", "checkpoint.every_steps=7", "checkpoint.keep=100"]
    loop.train(tiny_cfg(digits_shards, tmp_path, "deferred", config, extra))
    monkeypatch.setattr(loop, "SCORE_LAG", 0)
    loop.train(tiny_cfg(digits_shards, tmp_path, "immediate", config, extra))
    deferred, immediate = checkpoint_states(tmp_path / "deferred"), checkpoint_states(tmp_path / "immediate")
    assert len(deferred) >= 8 and deferred.keys() == immediate.keys()
    for step in deferred:
        assert_states_equal(deferred[step][0], immediate[step][0], f"{step} pruner")
        assert_states_equal(deferred[step][1], immediate[step][1], f"{step} model")
    assert deferred[max(deferred)][0]["counters"]["recorded_losses"] > 0  # the states compared hold scores


class Recording:
    """Events in order: ('forward', step) when a step's forward pass starts, ('update', step) when
    the pruner receives that step's scores. Steps are told apart by their first sample id."""

    def __init__(self):
        self.events, self.step_of_id = [], {}


def test_the_pruner_gets_step_k_scores_only_after_step_k_plus_1_forward_began(digits_shards, tmp_path, monkeypatch):
    log = Recording()

    class RecordingTask(MAETask):
        def per_sample(self, model, batch, generator):
            if int(batch.ids[0]) not in log.step_of_id:  # the first batch's FLOPs count forwards it once more
                step = len([e for e in log.events if e[0] == "forward"])
                log.step_of_id[int(batch.ids[0])] = step
                log.events.append(("forward", step))
            return super().per_sample(model, batch, generator)

    def recording_pruner(*args, **kwargs):
        pruner = build_pruner(*args, **kwargs)
        update = pruner.update

        def recorded_update(ids, scores):
            log.events.append(("update", log.step_of_id[int(ids[0])]))
            update(ids, scores)

        pruner.update = recorded_update
        return pruner

    cfg = tiny_cfg(digits_shards, tmp_path, "order", extra=["num_passes=1", "checkpoint.every_steps=1000"])
    monkeypatch.setattr(
        loop, "build_task", lambda c, **_: RecordingTask(c.mae, image_size=c.data.resolution, channels=c.data.channels)
    )
    monkeypatch.setattr(loop, "build_pruner", recording_pruner)
    loop.train(cfg)
    forwards = [e for e in log.events if e[0] == "forward"]
    updates = [e[1] for e in log.events if e[0] == "update"]
    assert updates == list(range(len(forwards))), "every step's scores, once each, in step order"
    for k in range(len(forwards) - 1):  # the last one is drained at the pass end
        assert log.events.index(("forward", k + 1)) < log.events.index(("update", k)), f"step {k} too early"


def test_a_nan_loss_still_stops_naming_the_step_and_the_sample_ids(tmp_path):
    shards = write_latent_shards(str(tmp_path / "latents"), 64, nan_at=45)
    cfg = load_config(
        os.path.join(ROOT, "configs", "ldm_tiny_full.yaml"),
        [
            f"data.train={shards}",
            "data.val=",
            f"runs_dir={tmp_path}",
            "name=nan",
            "num_passes=1",
            "data.batch_size=8",
            "ldm.space=latents",
            "ldm.unet.block_out_channels=[16,32]",
            "data.num_workers=0",
            "data.shuffle_buffer=1",
        ],
    )
    with pytest.raises(loop.NonFiniteLossError, match=r"at step 5 \(pass 1/1, batch 5\) for sample ids \[45\]"):
        loop.train(cfg)
    assert not complete_checkpoints(str(tmp_path / "nan")), "nothing after the NaN was saved"


def test_debug_device_sync_refuses_the_policy_that_must_wait(digits_shards, tmp_path):
    with pytest.raises(ConfigError, match="debug_device_sync=true .* on_nonfinite_loss=skip"):
        tiny_cfg(digits_shards, tmp_path, "x", extra=["debug_device_sync=true", "on_nonfinite_loss=skip"])


def test_a_label_out_of_range_stops_the_run_naming_its_sample_before_the_device_sees_it(digits_shards, tmp_path):
    # the digits carry labels 0-9: with 5 classes the decoder, on the host, names the first bad one
    cfg = tiny_cfg(
        digits_shards,
        tmp_path,
        "labels",
        "ldm_tiny_full.yaml",
        ["ldm.num_classes=5", "ldm.unet.block_out_channels=[16,32]", "data.resolution=16", "num_passes=1"],
    )
    with pytest.raises(
        BadInputError,
        match=r"shard .*\.tar key '.*': label [5-9] is out of range for 5 classes "
        r"\(ldm.num_classes; -1 = no label\)",
    ):
        loop.train(cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "config,classes",
    [("mae_tiny_infobatch.yaml", 0), ("ldm_tiny_full.yaml", 0), ("ldm_tiny_full.yaml", 10)],
    ids=["mae", "ldm", "ldm-classes"],
)
def test_cuda_steps_never_wait_for_the_device(digits_shards, tmp_path, config, classes):
    extra = [
        "num_passes=1",
        "max_steps=6",
        "checkpoint.every_steps=1000",
        "data.resolution=16",
        "ldm.unet.block_out_channels=[16,32]",
        "debug_device_sync=true",
        "data.num_workers=2",
    ]
    if classes:
        extra.append(f"ldm.num_classes={classes}")
    try:
        summary = loop.train(tiny_cfg(digits_shards, tmp_path, "strict", config, extra))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert summary == {} or summary["optimizer_steps"] == 6
