"""Evaluation on every rank as a specification, with real torch.distributed processes on
gloo and a short process-group timeout: each rank evaluates its share of the held-out images and of
the probe's images, the shares combine to the single-process numbers on every rank, an evaluation
longer than the timeout completes where rank 0 evaluating alone makes the others time out, and FID
settings or cache files that could split the ranks fail or succeed on all of them alike."""

from __future__ import annotations

import json
import os
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from eval_runs import ROOT, feature_net, one_torch_thread, session_dir, tiny_run, trained_task

from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.evaluation.runner import Evaluator, eval_config_of

# The process group's timeout in the tests that do not measure one (a hang guard, long enough for a
# loaded 2-core machine); NCCL's default is 10 minutes.
TIMEOUT_S = 120
LIMIT_S = 600  # a hang fails the test instead of blocking the suite


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def run_ranks(target, world: int, *args) -> None:
    """`world` real processes running target(rank, world, *args); fails when one raises or when they
    have not all ended after LIMIT_S seconds. Forked, not spawned: each rank starts from this process's
    imports instead of paying ~7 s of its own (torch, diffusers, ...) on the 2 cores; the ranks still
    hold their own memory and process group, and the evaluators keep nothing in memory between calls
    (the FID cache is files), so no rank inherits a result."""
    context = mp.start_processes(target, args=(world, *args), nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + LIMIT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks still running after {LIMIT_S} s: a hang")


def join_group(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)  # several processes on a 2-core machine
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S)
    )


def leave(rank: int, out: str, outcome: dict) -> None:
    """Record this rank's outcome, then exit without interpreter teardown: a gloo group torn down at
    exit while a peer is already gone aborts the process now and then (SIGABRT) after its work is done."""
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    os._exit(0)


def results_of(out, world: int) -> list[dict]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


# ----------------------------------------------------------------------------- the same numbers
def _evaluate_runs(rank, world, init_file, jobs, out):
    join_group(rank, world, init_file)
    records = {}
    for name, (run_dir, overrides) in jobs.items():
        task, model, cfg = trained_task(run_dir)
        eval_cfg = load_eval_config(eval_config_of(cfg), overrides=list(overrides))
        records[name] = Evaluator(cfg, eval_cfg, run_dir=run_dir).evaluate(task, model, write=False)
        dist.barrier()  # the training loop's next collective
    dist.destroy_process_group()
    leave(rank, out, records)


@pytest.fixture(scope="module")
def runs(digits_shards, tmp_path_factory) -> dict:
    """A tiny MAE (reconstruction and the few-shot probe of its config) and a tiny DDPM (held-out
    denoising loss and FID of 8 samples in the digits classifier's features), each with its settings."""
    runs_dir = session_dir(tmp_path_factory, "eval_runs")
    classifier = feature_net(
        digits_shards, os.path.join(session_dir(tmp_path_factory, "eval_nets"), "digits.safetensors")
    )
    mae = tiny_run(digits_shards, runs_dir, "mae_tiny_full.yaml", "mae_full", ("num_passes=2",))
    ldm = tiny_run(digits_shards, runs_dir, "ldm_tiny_full.yaml", "ldm_full", ("num_passes=1",))
    fid = [
        "fid.feature=classifier",
        f"fid.weights={classifier}",
        "fid.num_samples=8",
        "fid.sampler_steps=2",
        "fid.reference=val",
        "val_samples=60",
    ]
    return {"mae": (mae, ()), "ldm": (ldm, tuple(fid))}


@pytest.fixture(scope="module")
def one_and_two_ranks(runs, tmp_path_factory):
    """(records of one process, records of each of two ranks) for the same runs and settings; the
    FID reference statistics are computed afresh in both (separate, empty caches)."""
    out = tmp_path_factory.mktemp("two_ranks")
    stats = {world: [f"fid.stats_dir={out / f'stats_{world}'}"] for world in (1, 2)}
    jobs = {
        world: {
            name: (run, (*overrides, *(stats[world] if name == "ldm" else ())))
            for name, (run, overrides) in runs.items()
        }
        for world in (1, 2)
    }
    single = {}
    for name, (run_dir, overrides) in jobs[1].items():
        task, model, cfg = trained_task(run_dir)
        single[name] = Evaluator(
            cfg, load_eval_config(eval_config_of(cfg), overrides=list(overrides)), run_dir=run_dir
        ).evaluate(task, model, write=False)
    run_ranks(_evaluate_runs, 2, str(out / "init"), jobs[2], str(out))
    return single, results_of(out, 2)


def test_mae_evaluation_on_two_ranks_equals_one_process_and_splits_the_images(one_and_two_ranks):
    single, ranks = one_and_two_ranks
    one = single["mae"]
    assert set(one["metrics"]) == {"masked_mse", "psnr", "ssim", "probe_accuracy"}
    assert ranks[0]["mae"]["metrics"] == ranks[1]["mae"]["metrics"]  # every rank ends with the same numbers
    for record in (r["mae"] for r in ranks):
        assert record["metrics"].keys() == one["metrics"].keys()
        for metric, value in one["metrics"].items():
            assert record["metrics"][metric] == pytest.approx(value, rel=1e-6), metric
        for key in ("num_samples", "probe_train_samples", "probe_val_samples", "probe_feature_dim"):
            assert record["details"][key] == one["details"][key], key
        assert record["details"]["num_samples_by_rank"] == [90, 90]  # the 180 val images, half each
        assert record["details"]["probe_images_by_rank"] == [899, 898]  # 1,617 train and 180 val images
        assert record["ranks"] == 2


def test_diffusion_evaluation_on_two_ranks_equals_one_process(one_and_two_ranks):
    single, ranks = one_and_two_ranks
    one = single["ldm"]
    assert set(one["metrics"]) == {"denoise_mse", "fid"}
    assert ranks[0]["ldm"]["metrics"] == ranks[1]["ldm"]["metrics"]
    for record in (r["ldm"] for r in ranks):
        assert record["metrics"]["denoise_mse"] == pytest.approx(one["metrics"]["denoise_mse"], rel=1e-6)
        assert record["metrics"]["fid"] == pytest.approx(one["metrics"]["fid"], rel=1e-4)
        assert record["details"]["num_samples_by_rank"] == [30, 30] and record["details"]["num_samples"] == 60
        assert record["details"]["fid_samples"] == 8
        for key in (k for k in one["details"] if k.startswith("denoise_mse_t")):
            assert record["details"][key] == pytest.approx(one["details"][key], rel=1e-6), key


# ----------------------------------------------------------------------------- no rank works alone
# An MAE at 48 px (36 patches) of width 192 and depth 2, randomly initialised, judged on the 1,617
# train digits as its held-out set: reconstruction of all of them, and the probe's features of them
# twice (as its train and its val images). 12 s in one process on one core of the 2-core test machine
# at load average 1 (64 px and depth 4 took 24 s there, 33 to 41 s at load 4 to 7): the timeout below
# is three quarters of it, so the proportions, not the seconds, make the test.
SLOW_MAE = [
    "data.resolution=48",
    "mae.embed_dim=192",
    "mae.depth=2",
    "mae.num_heads=3",
    "mae.decoder_embed_dim=128",
    "mae.decoder_depth=2",
    "mae.decoder_num_heads=4",
    "eval.batch_size=64",
]


def slow_mae(shards: str):
    """(task, run config) of the slow MAE; the same initial weights in every process, as the trainer's."""
    from prunepipe.pipelines.config import load_config
    from prunepipe.pipelines.tasks.build import build_task

    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [f"data.train={shards}/train", f"data.val={shards}/val", f"eval.val={shards}/train", *SLOW_MAE],
    )
    torch.manual_seed(cfg.seed)
    return build_task(cfg), cfg


def _evaluate_then_meet(rank, world, init_file, shards, timeout_s, out):
    """Evaluate the slow MAE under a process group of `timeout_s`, then enter the collective the
    training loop enters next (the next step's gradient all-reduce); record what happened."""
    task, cfg = slow_mae(shards)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        record = Evaluator(cfg).evaluate(task, task.model, write=False)
        dist.barrier()
        outcome = {"met": True, "metrics": record["metrics"], "details": record["details"]}
    except RuntimeError as error:  # gloo's timeout (a DistBackendError), or a peer that gave up
        outcome = {"met": False, "error": str(error).splitlines()[0]}
    leave(rank, out, outcome)


def test_an_evaluation_longer_than_the_timeout_completes_when_every_rank_does_its_share(digits_shards, tmp_path):
    # The whole evaluation on rank 0 alone, in one process: its duration sets the timeout.
    task, cfg = slow_mae(digits_shards)
    start = time.perf_counter()
    one = Evaluator(cfg).evaluate(task, task.model, write=False)
    alone_s = time.perf_counter() - start
    # Three quarters of it: rank 0 evaluating alone would keep the other ranks in their next
    # collective for all of alone_s, past this timeout. Sharing the work, each rank waits only for the
    # difference between the two ranks' shares, however long each share takes; the quarter left over
    # is room for a loaded machine to run one rank's half later than the other's.
    timeout_s = 0.75 * alone_s
    print(f"one process: {alone_s:.1f} s, the process group's timeout: {timeout_s:.1f} s")
    run_ranks(_evaluate_then_meet, 2, str(tmp_path / "init"), digits_shards, timeout_s, str(tmp_path))
    ranks = results_of(tmp_path, 2)
    assert all(rank["met"] for rank in ranks), [rank.get("error") for rank in ranks]
    for rank in ranks:
        for metric, value in one["metrics"].items():
            assert rank["metrics"][metric] == pytest.approx(value, rel=1e-6), metric
        assert rank["details"]["num_samples_by_rank"] == [809, 808]  # 1,617 held-out images, half each
        assert rank["details"]["probe_images_by_rank"] == [1618, 1616]  # 809 + 809 and 808 + 808 of the probe
        assert rank["details"]["probe_val_samples"] == 1617 and rank["details"]["probe_train_samples"] == 100


# ----------------------------------------------------------------------------- FID alike on every rank
def _fid_outcome(rank, world, init_file, run_dir, overrides, workdir, out):
    """Evaluate the tiny DDPM's FID with `overrides`, from `workdir/rank{rank}` as working directory
    (a relative fid.stats_dir is then a node-local folder); record the result or the error."""
    join_group(rank, world, init_file)
    os.chdir(os.path.join(workdir, f"rank{rank}"))
    task, model, cfg = trained_task(run_dir)
    eval_cfg = load_eval_config(eval_config_of(cfg), overrides=list(overrides))
    try:
        record = Evaluator(cfg, eval_cfg, run_dir=run_dir).evaluate(task, model, write=False)
        outcome = {"fid": record["metrics"]["fid"], "cache": record["details"]["fid_reference_cache"]}
    except (ValueError, RuntimeError) as error:
        outcome = {"error": f"{type(error).__name__}: {error}"}
    dist.barrier()  # every rank is done with the others before any leaves
    leave(rank, out, outcome)


def fid_settings(digits_shards, tmp_path_factory, stats_dir: str, num_samples: int) -> list[str]:
    classifier = feature_net(
        digits_shards, os.path.join(session_dir(tmp_path_factory, "eval_nets"), "digits.safetensors")
    )
    return [
        "fid.feature=classifier",
        f"fid.weights={classifier}",
        f"fid.num_samples={num_samples}",
        "fid.sampler_steps=2",
        "fid.reference=val",
        f"fid.stats_dir={stats_dir}",
        "val_samples=30",
    ]


def test_fid_with_fewer_samples_than_ranks_raises_the_same_error_on_every_rank(
    runs, digits_shards, tmp_path_factory, tmp_path
):
    ldm, _ = runs["ldm"]
    for r in range(3):
        (tmp_path / f"rank{r}").mkdir()
    overrides = fid_settings(digits_shards, tmp_path_factory, str(tmp_path / "stats"), num_samples=2)
    run_ranks(_fid_outcome, 3, str(tmp_path / "init"), ldm, overrides, str(tmp_path), str(tmp_path))
    errors = [outcome.get("error") for outcome in results_of(tmp_path, 3)]
    assert (
        errors[0]
        == errors[1]
        == errors[2]
        == (
            "ValueError: eval config: fid.num_samples=2 is fewer than the 3 ranks evaluating (each rank generates "
            "num_samples / world images); use at least 3"
        )
    )


def test_a_fid_cache_only_rank_0_sees_serves_every_rank(runs, digits_shards, tmp_path_factory, tmp_path):
    # fid.stats_dir relative to each rank's working directory: a node-local disk, where rank 0's
    # node holds the reference statistics (from an earlier evaluation) and rank 1's does not. Ranks
    # that each looked for themselves would take different collectives.
    ldm, _ = runs["ldm"]
    for r in range(2):
        (tmp_path / f"rank{r}").mkdir()
    overrides = fid_settings(digits_shards, tmp_path_factory, "node_local_stats", num_samples=8)
    task, model, cfg = trained_task(ldm)
    cwd = os.getcwd()
    os.chdir(tmp_path / "rank0")
    try:  # one process writes the cache on "rank 0's node"
        single = Evaluator(cfg, load_eval_config(eval_config_of(cfg), overrides=overrides), run_dir=ldm).evaluate(
            task, model, write=False
        )
    finally:
        os.chdir(cwd)
    written = os.listdir(tmp_path / "rank0" / "node_local_stats")
    run_ranks(_fid_outcome, 2, str(tmp_path / "init"), ldm, overrides, str(tmp_path), str(tmp_path))
    outcomes = results_of(tmp_path, 2)
    for outcome in outcomes:
        assert "error" not in outcome, outcome["error"]
        assert outcome["fid"] == pytest.approx(single["metrics"]["fid"], rel=1e-4)
    assert not os.path.exists(tmp_path / "rank1" / "node_local_stats"), "rank 1 computed statistics of its own"
    assert os.listdir(tmp_path / "rank0" / "node_local_stats") == written


ONE_NODE_LACKS_A_FILE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch.distributed as dist
    from accelerate import Accelerator
    from prunepipe.pipelines.ranks import on_every_rank

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    weights = sys.argv[2] if rank == 0 else "/nonexistent/feature_net.safetensors"  # rank 1's node lacks it

    def load():
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"no feature weights at {weights}")
        return "loaded"

    try:
        outcome = on_every_rank(load)
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    dist.barrier()  # both ranks got here: neither waits in a collective the other never reaches
    print(json.dumps({"rank": rank, "outcome": outcome}), flush=True)
    dist.destroy_process_group()
    os._exit(0)
""")


def test_a_file_missing_on_one_node_stops_every_rank_naming_it(tmp_path):
    from test_accumulation import run_two_ranks

    present = tmp_path / "feature_net.safetensors"
    present.write_bytes(b"weights")
    program = ONE_NODE_LACKS_A_FILE.replace("sys.argv[2]", repr(str(present)))
    outcomes = {r["rank"]: r["outcome"] for r in run_two_ranks(program, tmp_path)}
    assert outcomes[1].startswith("FileNotFoundError: no feature weights at /nonexistent")
    assert outcomes[0].startswith("RuntimeError: rank 1 failed") and "/nonexistent" in outcomes[0]
