"""Distributed pruned training with real torch.distributed processes: 2 ranks on gloo, started
by torchrun inside the tests, each run under a hard timeout (a hang fails instead of blocking)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from eval_runs import digit_shards

from prunepipe.pipelines.checkpoint.store import latest_checkpoint, load_checkpoint_states
from prunepipe.pipelines.data.layout import pass_layout
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.tools.commands.shards import write_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MAE = [
    "mae.embed_dim=32",
    "mae.depth=1",
    "mae.num_heads=2",
    "mae.decoder_embed_dim=32",
    "mae.decoder_depth=1",
    "mae.decoder_num_heads=2",
    "data.val_batches=1",
]
TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHERS = {
    "torchrun": lambda n, port: [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={n}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
    ],
    # accelerate's flag for several local processes; on a machine without GPUs they use gloo
    "accelerate": lambda n, port: [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        f"--num_processes={n}",
        f"--main_process_port={port}",
    ],
}


def launch(nproc: int, config: str, args: list[str], launcher: str = "torchrun") -> str:
    """`torchrun --nproc-per-node N -m prunepipe.launch.cli train CONFIG ARGS`; returns its output."""
    command = [
        *LAUNCHERS[launcher](nproc, free_port()),
        "-m",
        "prunepipe.launch.cli",
        "train",
        os.path.join(ROOT, "configs", config),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def five_shards(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("five")
    write_shards("digits", str(out), size=32, shard_size=324, val_fraction=0.1)
    assert len(ShardIndex.load(str(out / "train"))) == 5
    return str(out)


def passes_of(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"pass"' in line]


def trained_from_its_first_model(cfg):
    """Train `cfg`; returns (the held-out metrics of the model the run starts from, its pass records)."""
    from prunepipe.pipelines.tasks.build import build_task
    from prunepipe.pipelines.training.data import load_held_out
    from prunepipe.pipelines.training.loop import train

    torch.manual_seed(cfg.seed)  # the initial model of the run, as train() builds it
    task = build_task(cfg)
    held_out = [batch for part in load_held_out(cfg, task).values() for batch in part]  # every source's
    before = task.held_out(task.model, held_out, seed=cfg.eval.seed)
    train(cfg)
    return before, passes_of(cfg.run_dir)


def assert_held_out_flow_loss_fell(before: dict, records: list[dict]) -> dict:
    """The last pass's held-out metrics, its flow loss below 0.8 of the first model's (printed per pass)."""
    after = records[-1]["held_out"]
    print(
        f"held-out flow loss: {before['denoise_mse']:.4f} before, "
        + ", ".join(f"{r['held_out']['denoise_mse']:.4f}" for r in records)
        + " after each pass"
    )
    assert after["denoise_mse"] < 0.8 * before["denoise_mse"]
    return after


def debug_file(run_dir, what, pass_index, world, rank=None):
    name = f"{what}_pass{pass_index:04d}_world{world}" + ("" if rank is None else f"_rank{rank}")
    return os.path.join(run_dir, "debug", name)


def test_two_ranks_infobatch_equal_steps_full_coverage_and_identical_scores(five_shards, tmp_path):
    output = launch(
        2,
        "mae_tiny_infobatch.yaml",
        [
            f"data.train={five_shards}/train",
            f"data.val={five_shards}/val",
            f"runs_dir={tmp_path}",
            "name=ddp",
            "num_passes=4",
            "data.batch_size=32",
            "debug_sync=true",
            *TINY_MAE,
        ],
    )
    run_dir = str(tmp_path / "ddp")
    records = passes_of(run_dir)
    assert len(records) == 4
    for record in records:
        pass_index = record["pass_index"]
        ids = [np.load(debug_file(run_dir, "ids", pass_index, 2, r) + ".npy") for r in range(2)]
        assert len(ids[0]) == len(ids[1]) == record["steps_in_pass"] * 32, "ranks took different step counts"
        union = np.concatenate(ids)
        assert len(np.unique(union)) == len(union), "an id was trained twice in one pass"
        kept = np.flatnonzero(np.load(debug_file(run_dir, "plan", pass_index, 2) + ".npy"))
        assert set(union) <= set(kept)
        assert len(kept) - len(union) == record["tail"] <= 2 * (0 + 1) * 32
        digests = [open(debug_file(run_dir, "digest", pass_index, 2, r) + ".txt").read() for r in range(2)]
        assert digests[0] == digests[1], "score tables or plans differ between ranks"
    assert records[1]["kept_fraction"] < 1.0, "InfoBatch pruned from the second pass on"
    assert "pruner tables: one copy per node" in output, "torchrun's two local ranks share one table"
    checkpoint = latest_checkpoint(run_dir)
    assert sorted(os.listdir(os.path.join(checkpoint, "pruner_tables"))) == ["score.npy", "seen.npy"]


def test_accelerate_launch_runs_the_same_command_on_two_ranks(five_shards, tmp_path):
    output = launch(
        2,
        "mae_tiny_infobatch.yaml",
        [
            f"data.train={five_shards}/train",
            "data.val=''",
            f"runs_dir={tmp_path}",
            "name=acc",
            "num_passes=1",
            "data.batch_size=32",
            "debug_sync=true",
            *TINY_MAE,
        ],
        launcher="accelerate",
    )
    ids = [np.load(debug_file(str(tmp_path / "acc"), "ids", 0, 2, r) + ".npy") for r in range(2)]
    assert len(ids[0]) == len(ids[1]) > 0 and not set(ids[0]) & set(ids[1])
    assert output.count("run folder:") == 1, "only rank 0 reports"


def train_here(config: str, args: list[str]) -> None:
    """`prunepipe train CONFIG ARGS` in this process: one rank, without a launch's ~10 s of process
    start and imports."""
    from prunepipe.pipelines.config import load_config
    from prunepipe.pipelines.training.loop import train

    train(load_config(os.path.join(ROOT, "configs", config), args))


def two_ranks_of_32_and_one_of_64(config: str, common: list[str], tmp_path) -> tuple[dict, dict]:
    """The final weights of `config` trained on 2 ranks of batch 32 (run "two") and on 1 rank of 64
    ("one", in this process), 3 optimizer steps each (a 64-sample set, 3 passes)."""
    launch(2, config, common + ["name=two", "data.batch_size=32"])
    train_here(config, common + ["name=one", "data.batch_size=64"])
    two = load_checkpoint_states(latest_checkpoint(str(tmp_path / "two")))["model"]
    one = load_checkpoint_states(latest_checkpoint(str(tmp_path / "one")))["model"]
    assert passes_of(str(tmp_path / "two"))[-1]["optimizer_steps"] == 3
    return two, one


def test_two_ranks_of_batch_b_equal_one_rank_of_batch_2b(digits_shards, tmp_path):
    # 64 samples: with batch 32 on 2 ranks or 64 on 1, every step sees the whole set, so the
    # averaged gradients (and per-sample masks, keyed by sample id) must agree.
    small = digit_shards(digits_shards, tmp_path / "small", shards=1, per_shard=64)
    common = [
        f"data.train={small}",
        "data.val=''",
        f"runs_dir={tmp_path}",
        "num_passes=3",
        "optim.warmup_passes=0",
        *TINY_MAE,
    ]
    two, one = two_ranks_of_32_and_one_of_64("mae_tiny_full.yaml", common, tmp_path)
    moved = 0
    for key in one:
        a, b = two[key], one[key]
        if key.endswith("attn.qkv.bias"):
            # The key bias shifts every logit of a softmax row equally: its true gradient is zero,
            # and Adam scales the float noise left in it (which differs with the reduction order)
            # up to whole steps. Compare the query and value biases only.
            third = len(a) // 3
            a, b = torch.cat([a[:third], a[2 * third :]]), torch.cat([b[:third], b[2 * third :]])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
        moved += 1
    assert moved > 10


def test_samples_lost_on_every_rank_are_counted_once_each(digits_shards, tmp_path):
    # Four shards of 32 with one undecodable image each: the ranks' contiguous slices split them,
    # so each rank meets its own; the run's count is their sum, in the log and the checkpoint.
    broken = digit_shards(
        digits_shards, tmp_path / "broken", shards=4, per_shard=32, broken=lambda shard, position: position == 5
    )
    run_dir = tmp_path / "lossy"
    output = launch(
        2,
        "mae_tiny_full.yaml",
        [
            f"data.train={broken}",
            "data.val=''",
            f"runs_dir={tmp_path}",
            "name=lossy",
            "num_passes=1",
            "data.batch_size=16",
            "data.on_bad_sample=skip",
            *TINY_MAE,
        ],
    )
    assert output.count("skipping 1 sample(s)") == 4, "each rank warns about the ones it met"
    assert passes_of(str(run_dir))[-1]["bad_samples"] == 4
    from prunepipe.pipelines.checkpoint.store import load_checkpoint_states

    assert load_checkpoint_states(latest_checkpoint(str(run_dir)))["position"]["bad_samples"] == 4


def test_two_rank_checkpoint_resumed_on_one_rank_finishes_the_pass_with_the_same_plan(five_shards, tmp_path, capsys):
    common = [
        f"data.train={five_shards}/train",
        "data.val=''",
        f"runs_dir={tmp_path}",
        "name=shrink",
        "num_passes=3",
        "data.batch_size=32",
        "debug_sync=true",
        "checkpoint.every_steps=1000",
        *TINY_MAE,
    ]
    index = ShardIndex.load(f"{five_shards}/train")
    first_pass_steps = pass_layout(index, None, seed=0, pass_index=0, world_size=2, num_workers=0, batch_size=32).steps
    launch(2, "mae_tiny_infobatch.yaml", common + [f"max_steps={first_pass_steps + 5}"])
    run_dir = str(tmp_path / "shrink")
    assert latest_checkpoint(run_dir).endswith(f"step_{first_pass_steps + 5:06d}")
    capsys.readouterr()
    train_here("mae_tiny_infobatch.yaml", common + ["checkpoint.resume=latest"])  # the one rank: this process
    assert "resumed from" in capsys.readouterr().out
    plan_two = np.load(debug_file(run_dir, "plan", 1, 2) + ".npy")
    plan_one = np.load(debug_file(run_dir, "plan", 1, 1) + ".npy")
    np.testing.assert_array_equal(plan_two, plan_one)  # the same frozen plan for pass 1
    before = np.concatenate([np.load(debug_file(run_dir, "ids", 1, 2, r) + ".npy") for r in range(2)])
    after = np.load(debug_file(run_dir, "ids", 1, 1, 0) + ".npy")
    assert len(before) == 2 * 5 * 32
    assert not set(before) & set(after), "the resumed segment repeated samples of the pass"
    kept = set(np.flatnonzero(plan_one))
    assert set(after) <= kept
    assert len(kept) - len(before) - len(after) < 2 * 32, "the pass was finished up to a tail"
    assert passes_of(run_dir)[-1]["pass_index"] == 2
