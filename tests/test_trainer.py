"""The training loop as a specification: exact resume after SIGKILL, atomic checkpoints, pruned
passes forward exactly what their plans keep, and non-finite losses never reach the optimizer."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import webdataset as wds

from prunepipe.pipelines.checkpoint.store import latest_checkpoint, load_checkpoint_states, resolve_resume
from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.tasks.build import build_task
from prunepipe.pipelines.tasks.diffusion.from_export import load_pipeline, sample
from prunepipe.pipelines.tasks.mae import load_exported_encoder
from prunepipe.pipelines.training.loop import NonFiniteLossError, train
from prunepipe.pipelines.training.schedule import learning_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small enough for seconds per run on 2 CPU cores, large enough that InfoBatch prunes.
TINY_MAE = [
    "mae.embed_dim=32",
    "mae.depth=1",
    "mae.num_heads=2",
    "mae.decoder_embed_dim=32",
    "mae.decoder_depth=1",
    "mae.decoder_num_heads=2",
    "data.batch_size=64",
    "data.val_batches=1",
]
TINY_LDM = [
    "ldm.unet.block_out_channels=[16,32]",
    "ldm.unet.norm_num_groups=8",
    "data.batch_size=64",
    "data.val_batches=1",
    "data.resolution=16",
]


def overrides(digits_shards, tmp_path, name, extra):
    return [
        f"data.train={digits_shards}/train",
        f"data.val={digits_shards}/val",
        f"runs_dir={tmp_path}",
        f"name={name}",
        "log_every=5",
        *extra,
    ]


def run_cli(config, args, **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "prunepipe.launch.cli", "train", config, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def final_state(run_dir):
    checkpoint = latest_checkpoint(run_dir)
    weights = load_checkpoint_states(checkpoint)["model"]
    pruner = load_checkpoint_states(checkpoint, read_model=False)["pruner"]  # tables read from their files
    return checkpoint, weights, pruner


def assert_states_equal(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_states_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b or (a != a and b != b), f"{path}: {a} != {b}"


@pytest.mark.parametrize(
    "config, extra",
    [
        ("mae_tiny_infobatch.yaml", TINY_MAE),
        # slow: the kill and the requeue are mae-infobatch's; TED's state resumes bitwise in-process below
        pytest.param("ldm_tiny_ted.yaml", TINY_LDM + ["pruner.ramp=0.5"], marks=pytest.mark.slow),
        pytest.param("ldm_dit_tiny_infobatch.yaml", ["data.val_batches=1"], marks=pytest.mark.slow),
    ],
    ids=["mae-infobatch", "ldm-ted", "dit-flow-infobatch"],
)
def test_sigkill_after_checkpoint_then_resume_is_bitwise_identical(config, extra, digits_shards, tmp_path):
    config = os.path.join(ROOT, "configs", config)
    base = ["num_passes=4", *extra]
    straight = run_cli(config, overrides(digits_shards, tmp_path, "straight", base))
    out = straight.communicate(timeout=600)[0]
    assert straight.returncode == 0, out
    total_steps = json.loads(open(tmp_path / "straight" / "metrics.jsonl").readlines()[-1])["optimizer_steps"]
    half = total_steps // 2

    killed_args = overrides(digits_shards, tmp_path, "killed", base + [f"checkpoint.every_steps={half}"])
    killed = run_cli(config, killed_args)
    target = tmp_path / "killed" / "checkpoints" / f"step_{half:06d}"
    deadline = time.time() + 300
    while not target.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert latest_checkpoint(str(tmp_path / "killed")) == str(target)

    resumed = run_cli(config, killed_args + ["checkpoint.resume=latest"])
    out = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, out
    assert f"resumed from {target}" in out

    _, weights_a, pruner_a = final_state(str(tmp_path / "straight"))
    _, weights_b, pruner_b = final_state(str(tmp_path / "killed"))
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        assert torch.equal(weights_a[key], weights_b[key]), f"weight {key} differs after resume"
    assert_states_equal(pruner_a, pruner_b)
    export = tmp_path / "killed" / "export"
    if "mae" in str(config):  # the exports load where users will load them
        assert load_exported_encoder(str(export)).patch_embed is not None
    elif "dit" in str(config):
        assert sample(str(export), 1, 2, torch.Generator().manual_seed(0)).shape == (1, 1, 16, 16)
    else:
        image = load_pipeline(str(export))(batch_size=1, num_inference_steps=2, output_type="np").images
        assert image.shape == (1, 16, 16, 3)


def test_checkpoint_half_written_when_killed_is_never_picked(digits_shards, tmp_path):
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        overrides(
            digits_shards, tmp_path, "torn", TINY_MAE + ["num_passes=2", "max_steps=10", "checkpoint.every_steps=5"]
        ),
    )
    train(cfg)
    good = latest_checkpoint(cfg.run_dir)
    # What a kill during a save leaves: the temporary folder with a truncated file.
    torn = os.path.join(os.path.dirname(good), ".tmp-step_999999")
    shutil.copytree(good, torn)
    with open(os.path.join(torn, "__0_0.distcp"), "r+b") as f:
        f.truncate(100)
    assert latest_checkpoint(cfg.run_dir) == good
    assert resolve_resume("latest", cfg.run_dir) == good
    cfg.max_steps, cfg.checkpoint.resume = 0, "latest"
    train(cfg)
    assert not os.path.exists(torn), "the next save removes a torn checkpoint"
    assert int(os.path.basename(latest_checkpoint(cfg.run_dir))[5:]) > int(os.path.basename(good)[5:])


def test_infobatch_forwards_exactly_what_its_plans_keep(digits_shards, tmp_path):
    runs = {}
    for name in ("mae_tiny_full", "mae_tiny_infobatch"):
        cfg = load_config(
            os.path.join(ROOT, "configs", f"{name}.yaml"),
            overrides(digits_shards, tmp_path, name, TINY_MAE + ["num_passes=4"]),
        )
        train(cfg)
        runs[name] = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    full = [r for r in runs["mae_tiny_full"] if r["kind"] == "pass"]
    pruned = [r for r in runs["mae_tiny_infobatch"] if r["kind"] == "pass"]
    forwarded = np.diff([0] + [r["samples_forwarded"] for r in pruned])
    for record, count in zip(pruned, forwarded):
        assert count == record["kept_samples"] - record["tail"], "forwarded != kept by the plan"
    n = ShardIndex.load(f"{digits_shards}/train").num_samples
    assert pruned[0]["kept_samples"] == n, "the first pass has seen nothing, so it prunes nothing"
    assert pruned[1]["steps_in_pass"] < full[1]["steps_in_pass"], "pruned passes are shorter"
    for a, b in zip(full, pruned):
        assert a["lr_at_pass_start"] == b["lr_at_pass_start"], "the LR schedule follows pass progress"
    assert pruned[-1]["samples_forwarded"] < full[-1]["samples_forwarded"]


def test_learning_rate_follows_pass_progress(digits_shards):
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [f"data.train={digits_shards}/train", "data.val=''", "num_passes=10", "optim.warmup_passes=2", "optim.lr=1.0"],
    )
    assert learning_rate(cfg, 0.0) == 0.0 and learning_rate(cfg, 1.0) == pytest.approx(0.5)
    assert learning_rate(cfg, 2.0) == pytest.approx(1.0) and learning_rate(cfg, 10.0) == pytest.approx(0.0)
    assert learning_rate(cfg, 6.0) == pytest.approx(0.5)


def write_latent_shards(folder, n: int, nan_at: int) -> str:
    """Latent shards (as `prunepipe latents encode` writes) with one sample holding NaN."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    path = os.path.join(folder, "shard-000000.tar")
    with wds.TarWriter(path) as sink:
        for i in range(n):
            latent = rng.standard_normal((4, 8, 8)).astype(np.float32)
            if i == nan_at:
                latent[0, 0, 0] = np.nan
            buffer = io.BytesIO()
            np.save(buffer, latent)
            sink.write({"__key__": f"lat{i:04d}", "latent.npy": buffer.getvalue()})
    ShardIndex.write(folder, [(path, n)], latent_shape=[4, 8, 8])  # as `prunepipe latents encode` records
    return folder


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nonfinite_loss_stops_or_skips_and_never_reaches_the_pruner(tmp_path, policy):
    shards = write_latent_shards(str(tmp_path / "latents"), 64, nan_at=37)
    cfg = load_config(
        os.path.join(ROOT, "configs", "ldm_tiny_full.yaml"),
        [
            f"data.train={shards}",
            "data.val=''",
            f"runs_dir={tmp_path}",
            f"name={policy}",
            "num_passes=2",
            "data.batch_size=8",
            "ldm.space=latents",
            "ldm.unet.block_out_channels=[16,32]",
            f"on_nonfinite_loss={policy}",
        ],
    )
    if policy == "stop":
        with pytest.raises(NonFiniteLossError, match=r"step \d+ \(pass 1/2, batch \d+\).*sample ids \[37\]"):
            train(cfg)
        return
    summary = train(cfg)
    assert summary["skipped_nonfinite"] == 2, "one skipped batch per pass"
    assert summary["pruner"]["nonfinite_losses"] == 0, "the pruner never saw the NaN"
    assert summary["samples_forwarded"] == 2 * (64 - 8)


def test_latent_shards_tell_the_unet_their_shape(tmp_path):
    shards = write_latent_shards(str(tmp_path / "latents"), 8, nan_at=-1)
    cfg = load_config(
        os.path.join(ROOT, "configs", "ldm_full.yaml"),
        [f"data.train={shards}", "ldm.unet.block_out_channels=[16,32,32,32]", "ldm.unet.norm_num_groups=8"],
    )
    task = build_task(cfg)
    assert (task.in_channels, task.sample_size) == (4, 8), "data.resolution=256 describes images, not latents"


def test_periodic_evaluation_is_logged_every_e_passes(digits_shards, tmp_path):
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_infobatch.yaml"),
        overrides(
            digits_shards,
            tmp_path,
            "evaluated",
            TINY_MAE + ["num_passes=3", "eval.every_passes=2", "eval.val_samples=64", "eval.probe.train_samples=200"],
        ),
    )
    train(cfg)
    records = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["pass_index"] for r in evals] == [1], "after the second pass only"
    assert {"masked_mse", "psnr", "probe_accuracy"} <= set(evals[0]["metrics"])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_undecodable_samples_goes_on_where_it_stopped(digits_shards, tmp_path, workers):
    """Undecodable samples read for already-trained batches are skipped on resume with those batches,
    so the resumed run trains the very batches the uninterrupted run trained."""
    from eval_runs import digit_shards

    shards = tmp_path / "shards"
    digit_shards(digits_shards, shards, shards=3, per_shard=64, broken=lambda shard, position: position % 16 == 3)
    cut = shards / "1.tar"  # and one shard cut short after indexing: its lost samples are met while reading
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 3])
    index = json.loads((shards / "index.json").read_text())  # as an index without sizes (img2dataset's) has it:
    for entry in index["shards"]:  # with them, the cut shard is refused whole at open (tests/test_shard_checksums.py)
        entry.pop("bytes", None), entry.pop("crc32", None)
    (shards / "index.json").write_text(json.dumps(index))
    config = os.path.join(ROOT, "configs", "mae_tiny_full.yaml")
    common = [
        f"data.train={shards}",
        "data.val=''",
        f"runs_dir={tmp_path}",
        "num_passes=2",
        "data.batch_size=16",
        f"data.num_workers={workers}",
        "data.on_bad_sample=skip",
        "data.shuffle_buffer=8",
        "checkpoint.every_steps=1000",
        *TINY_MAE[:-2],
    ]
    straight = train(load_config(config, common + ["name=straight"]))
    steps_per_pass = straight["steps_in_pass"]
    stop_at = steps_per_pass + steps_per_pass // 2 + 1  # well into the second pass
    train(load_config(config, common + ["name=stopped", f"max_steps={stop_at}"]))
    resumed = train(load_config(config, common + ["name=stopped", "checkpoint.resume=latest"]))

    assert straight["bad_samples"] == resumed["bad_samples"] > 0, "each bad sample counted once, resumed or not"
    assert straight["samples_forwarded"] == resumed["samples_forwarded"]
    assert np.isfinite(straight["train_loss"]) and np.isfinite(resumed["train_loss"]), "padding-only batches"
    _, weights_a, _ = final_state(str(tmp_path / "straight"))
    _, weights_b, _ = final_state(str(tmp_path / "stopped"))
    for key in weights_a:
        assert torch.equal(weights_a[key], weights_b[key]), f"weight {key} differs after resume"


def test_normalised_scores_reach_the_pruner_and_leave_the_training_loss_alone(digits_shards, tmp_path):
    runs = {}
    for normalise in ("none", "stratum_mean"):
        cfg = load_config(
            os.path.join(ROOT, "configs", "ldm_tiny_infobatch.yaml"),
            overrides(
                digits_shards,
                tmp_path,
                normalise,
                [*TINY_LDM, "num_passes=4", "max_steps=25", f"score.normalise={normalise}"],
            ),
        )
        train(cfg)
        runs[normalise] = final_state(cfg.run_dir)
    (_, raw_weights, raw_pruner), (checkpoint, weights, pruner) = runs["none"], runs["stratum_mean"]
    assert all(torch.equal(raw_weights[k], weights[k]) for k in raw_weights)  # pass 1 trains on the same loss
    raw_scores, scores = raw_pruner["tables"]["score"].numpy(), pruner["tables"]["score"].numpy()
    seen = pruner["tables"]["seen"].numpy().astype(bool)
    assert not np.array_equal(raw_scores[seen], scores[seen])
    assert 0.5 < float(scores[seen].mean()) < 1.5  # a loss over its timestep's running mean (which lags)
    spread = lambda x: float(x.std() / x.mean())  # noqa: E731
    assert spread(scores[seen]) < spread(raw_scores[seen])  # the timestep's share of the spread is gone
    normaliser = torch.load(os.path.join(checkpoint, "score_normaliser.pt"), weights_only=True)
    assert normaliser["score_normaliser"] == "stratum_mean" and int(normaliser["seen"].sum()) == seen.sum()


def straight_and_resumed(config, digits_shards, tmp_path, base, *, stop_at: int, end_at: int):
    """final_state of a run trained straight to step `end_at`, and of one stopped at `stop_at` (a
    checkpoint must fall there) and resumed from it to `end_at`, in-process."""
    train(load_config(config, overrides(digits_shards, tmp_path, "straight", [*base, f"max_steps={end_at}"])))
    train(load_config(config, overrides(digits_shards, tmp_path, "resumed", [*base, f"max_steps={stop_at}"])))
    train(
        load_config(
            config,
            overrides(digits_shards, tmp_path, "resumed", [*base, f"max_steps={end_at}", "checkpoint.resume=latest"]),
        )
    )
    return final_state(tmp_path / "straight"), final_state(tmp_path / "resumed")


@pytest.mark.parametrize("setting", ["score.normalise=stratum_zscore", "ldm.ddpm.timestep_sampling=loss_second_moment"])
def test_a_run_with_normalised_scores_or_sampled_timesteps_resumes_bitwise(digits_shards, tmp_path, setting):
    config = os.path.join(ROOT, "configs", "ldm_tiny_infobatch.yaml")
    # 1,000 timesteps x a history of 10 need 10,000 losses before importance sampling starts: a tiny
    # run of 45 steps never gets there, so this schedule has 20 timesteps
    base = [*TINY_LDM, "num_passes=4", setting, "ldm.num_train_timesteps=20", "checkpoint.every_steps=10"]
    (_, straight, straight_pruner), (_, resumed, resumed_pruner) = straight_and_resumed(
        config, digits_shards, tmp_path, base, stop_at=30, end_at=45
    )
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert_states_equal(straight_pruner["tables"], resumed_pruner["tables"])  # pass 2 pruned on the same scores


def test_a_ted_run_stopped_at_a_checkpoint_resumes_bitwise(digits_shards, tmp_path):
    config = os.path.join(ROOT, "configs", "ldm_tiny_ted.yaml")
    base = [*TINY_LDM, "num_passes=4", "pruner.ramp=0.5", "checkpoint.every_steps=10"]
    (_, straight, straight_pruner), (_, resumed, resumed_pruner) = straight_and_resumed(
        config, digits_shards, tmp_path, base, stop_at=30, end_at=45
    )
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert_states_equal(straight_pruner["tables"], resumed_pruner["tables"])


def test_the_pass_line_shows_the_held_out_mean_not_every_grid_point():
    from prunepipe.pipelines.training.metrics import format_pass

    held = {"denoise_mse": 0.25, **{f"flow_mse_s{s:03d}": 0.1 for s in range(5, 100, 10)}, "num_samples": 64}
    line = format_pass(
        {
            "pass_index": 0,
            "kept_fraction": 1.0,
            "steps_in_pass": 3,
            "train_loss": 0.5,
            "wall_seconds": 1.0,
            "held_out": held,
        },
        passes=2,
    )
    assert "denoise_mse 0.2500" in line and "flow_mse_s" not in line


@pytest.mark.parametrize("warmup", ["passes", "none"])
def test_the_ema_resumes_bitwise_whatever_its_warmup(digits_shards, tmp_path, warmup):
    config = os.path.join(ROOT, "configs", "mae_tiny_infobatch.yaml")
    base = [*TINY_MAE, "num_passes=3", f"ema_warmup={warmup}", "checkpoint.every_steps=10"]
    (straight_at, straight, _), (resumed_at, resumed, _) = straight_and_resumed(
        config, digits_shards, tmp_path, base, stop_at=30, end_at=45
    )  # step 30 is inside the pruned pass 2
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    ema_a = load_checkpoint_states(straight_at)["ema"]
    ema_b = load_checkpoint_states(resumed_at)["ema"]
    assert ema_a["optimization_step"] == ema_b["optimization_step"] == 45
    assert len(ema_a["shadow_params"]) == len(straight)
    assert all(torch.equal(a, b) for a, b in zip(ema_a["shadow_params"], ema_b["shadow_params"]))


def test_train_records_carry_samples_per_second_a_gpu_and_the_flops_of_a_sample(digits_shards, tmp_path):
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        overrides(digits_shards, tmp_path, "rates", TINY_MAE + ["num_passes=1", "max_steps=6", "log_every=2"]),
    )
    train(cfg)
    with open(os.path.join(cfg.run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if '"kind": "train"' in line]
    assert [r["optimizer_steps"] for r in lines] == [2, 4, 6]
    later = lines[1:]  # the first record has no earlier one to measure from
    assert all(r["samples_per_s_per_gpu"] > 0 for r in later)
    # counted once, on the first micro-batch; the same for every record; no MFU claimed off a known GPU
    assert len({r["flops_per_sample"] for r in later}) == 1 and later[0]["flops_per_sample"] > 0
    assert not any("mfu" in r for r in lines)


def test_mfu_peaks_match_the_device_name_and_claim_nothing_for_an_unknown_one():
    from prunepipe.pipelines.training.throughput import peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 4090") is None
