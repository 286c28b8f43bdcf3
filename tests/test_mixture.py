"""Mixtures as a specification: each source gives a pass exactly what its rule says, whatever the
ranks and loader workers; ids stay global; a resume goes on bitwise and refuses another mixture; and
per-source scores keep InfoBatch from starving the source of smaller losses."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from test_trainer import ROOT, TINY_MAE, assert_states_equal, final_state

from prunepipe.pipelines.config import ConfigError, check_data, load_config
from prunepipe.pipelines.data.mixture import Mixture, parse_sources, permuted
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pipelines.training.loop import train
from prunepipe.pipelines.training.sources import SourceStrata
from prunepipe.pruning import InfoBatch, ScoreNormaliser


def two_sources(digits_shards, a: str = "weight: 3", b: str = "weight: 1") -> str:
    """digits' train split and its val split as two sources of one mixture (an override's value)."""
    return (
        f"data.train=[{{name: train, path: {digits_shards}/train, {a}}}, "
        f"{{name: held, path: {digits_shards}/val, {b}}}]"
    )


def mixture_of(digits_shards, a: str = "weight: 3", b: str = "weight: 1", samples_per_pass: int = 0) -> Mixture:
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [two_sources(digits_shards, a, b), "data.val=", f"data.samples_per_pass={samples_per_pass}"],
    )
    return Mixture.load(cfg.data.train, samples_per_pass=cfg.data.samples_per_pass)


def test_the_draw_permutation_is_a_bijection_and_differs_per_pass():
    for size in (1, 2, 3, 17, 1000, 4097):
        places = [permuted(np.arange(size), size, seed=0, pass_index=p, source=1) for p in (0, 1)]
        for place in places:
            assert np.array_equal(np.sort(place), np.arange(size)), f"not a permutation of {size}"
        if size > 16:
            assert not np.array_equal(places[0], places[1]), "each pass draws other samples"
    # a pure function: any subset of ids asked in any order gets the same places
    ids = np.random.default_rng(0).permutation(1000)[:100]
    assert np.array_equal(permuted(ids, 1000, 0, 3, 2), permuted(np.arange(1000), 1000, 0, 3, 2)[ids])


def test_each_rule_gives_exact_counts_and_ids_stay_global(digits_shards):
    weighted = mixture_of(digits_shards, samples_per_pass=1000)
    n_train, n_held = (int(n) for n in weighted.sizes)
    assert weighted.per_pass().tolist() == [750, 250]
    assert weighted.source_of(np.array([0, n_train - 1, n_train, n_train + n_held - 1])).tolist() == [0, 0, 1, 1]
    repeated = mixture_of(digits_shards, "repeat: 0.5", "repeat: 2.25")
    assert repeated.per_pass().tolist() == [round(0.5 * n_train), round(2.25 * n_held)]
    draw = repeated.draw(seed=0, pass_index=0)
    assert draw.full == (0, 2) and draw.partial == (round(0.5 * n_train), round(2.25 * n_held) - 2 * n_held)
    counted = mixture_of(digits_shards, "count: 100", "count: 0")
    assert counted.per_pass().tolist() == [100, 0]


def drawn_ids(mixture: Mixture, world: int, workers: int, passes: int) -> list[np.ndarray]:
    """Every id each pass forwards over `world` ranks of `workers` loader workers, sorted."""
    streams = [
        ShardStream(mixture.index, batch_size=32, seed=0, rank=r, world_size=world, mixture=mixture, shuffle_buffer=64)
        for r in range(world)
    ]
    drawn = []
    for pass_index in range(passes):
        loaders = [stream.pass_loader(pass_index, None, num_workers=workers) for stream in streams]
        drawn.append(np.sort(np.concatenate([batch.ids.numpy() for loader in loaders for batch in loader])))
    for stream in streams:
        stream.close()
    return drawn


def test_a_3_to_1_mixture_forwards_each_source_exactly_its_share_over_8_passes(digits_shards):
    mixture = mixture_of(digits_shards, samples_per_pass=512)  # 384 + 128 a pass: no tail at 4 slots of 32
    one_rank = drawn_ids(mixture, world=1, workers=0, passes=8)
    two_ranks_two_workers = drawn_ids(mixture, world=2, workers=2, passes=8)
    for pass_index, (ids, other) in enumerate(zip(one_rank, two_ranks_two_workers)):
        assert (ids >= 0).all(), "no padding: every slot holds whole batches"
        assert np.bincount(mixture.source_of(ids), minlength=2).tolist() == [384, 128], f"pass {pass_index + 1}"
        # the draw is a function of (seed, pass): the same samples under any layout
        assert np.array_equal(ids, other), f"pass {pass_index + 1}: 2 ranks x 2 workers drew other samples"
    assert not np.array_equal(one_rank[0], one_rank[1]), "each pass draws other samples"


def test_a_source_repeated_within_a_pass_is_walked_twice(digits_shards):
    mixture = mixture_of(digits_shards, "count: 56", "repeat: 2")  # 56 + 2 x 180 = 26 batches of 16
    stream = ShardStream(mixture.index, batch_size=16, seed=0, mixture=mixture, shuffle_buffer=64)
    ids = np.concatenate([b.ids.numpy() for b in stream.pass_loader(0, None)])
    held = ids[mixture.source_of(ids) == 1]
    counts = np.bincount(held - int(mixture.offsets[1]), minlength=int(mixture.sizes[1]))
    layout = stream.layout(0, None, 0)
    assert layout.kept_per_source.tolist() == [56, 2 * int(mixture.sizes[1])]
    assert layout.tail == 0 and (counts == 2).all(), "each held sample twice in the pass"


def test_each_walk_of_a_repeated_sample_draws_its_own_flip_and_noise(digits_shards):
    """A sample walked twice in a pass is two augmentations, not one seen twice: its second walk's
    draws are keyed apart from its id, and a source taken once draws by its ids as it always did."""
    from prunepipe.pipelines.data.decode import SampleDecoder
    from prunepipe.pipelines.data.mixture import WALK_SHIFT
    from prunepipe.pipelines.tasks.randomness import SampleRandomness

    mixture = mixture_of(digits_shards, "count: 56", "repeat: 2")
    decoder = SampleDecoder(32, 3, hflip=True, seed=0)
    stream = ShardStream(mixture.index, batch_size=16, seed=0, mixture=mixture, shuffle_buffer=64, decoder=decoder)
    images, keys = {}, {}
    for batch in stream.pass_loader(0, None):
        noise = SampleRandomness(0, 0, batch.draw_ids).randn(4)
        for i, (sample, key) in enumerate(zip(batch.ids.tolist(), batch.draw_ids.tolist())):
            images.setdefault(sample, []).append(batch.images[i])
            keys.setdefault(sample, []).append((key, noise[i]))
    twice = [s for s in keys if len(keys[s]) == 2]
    assert len(twice) == int(mixture.sizes[1]) and all(mixture.source_of(np.array(twice)) == 1)
    for sample in twice:
        (a, noise_a), (b, noise_b) = sorted(keys[sample], key=lambda k: k[0])
        assert (a, b) == (sample, sample + (1 << WALK_SHIFT)), "walk 0 by its id, walk 1 apart"
        assert not torch.equal(noise_a, noise_b)
    flipped_once = sum(not torch.equal(*images[s]) for s in twice)
    assert 0.3 < flipped_once / len(twice) < 0.7, "each walk tosses its own flip coin"
    once = [s for s in keys if len(keys[s]) == 1]
    assert all(keys[s][0][0] == s for s in once), "a sample taken once draws by its id"


def test_mixture_mistakes_name_the_source_and_field(digits_shards):
    with pytest.raises(ValueError, match=r"data.train\[1\]: give one of weight, repeat, count, not weight and count"):
        parse_sources([{"path": "a", "weight": 1}, {"path": "b", "weight": 1, "count": 3}])
    with pytest.raises(ValueError, match="give every source a weight"):
        parse_sources([{"path": "a", "weight": 1}, {"path": "b", "repeat": 1}])
    with pytest.raises(ValueError, match=r"source name 'x' is given twice"):
        parse_sources([{"name": "x", "path": "a"}, {"name": "x", "path": "b"}])
    with pytest.raises(ConfigError, match=r"data check: data.train\[1\].path='/nowhere' holds no index.json"):
        check_data(
            load_config(
                os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
                [f"data.train=[{{path: {digits_shards}/train}}, {{path: /nowhere}}]", "data.val="],
            )
        )
    with pytest.raises(ConfigError, match="score.per_source=true normalises"):
        load_config(
            os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
            [two_sources(digits_shards), "data.val=", "score.per_source=true"],
        )


def mixture_run(digits_shards, tmp_path, name: str, config: str, extra: list[str]):
    return load_config(
        os.path.join(ROOT, "configs", config),
        [
            two_sources(digits_shards),
            # held-out sources named as the train sources they judge (here the first batches of each)
            f"data.val=[{{name: train, path: {digits_shards}/train}}, {{name: held, path: {digits_shards}/val}}]",
            "data.samples_per_pass=512",
            f"runs_dir={tmp_path}",
            f"name={name}",
            "log_every=4",
            *TINY_MAE,
            *extra,
        ],
    )


def test_a_full_run_over_a_mixture_forwards_each_source_its_rule_and_reports_it(digits_shards, tmp_path):
    cfg = mixture_run(digits_shards, tmp_path, "full", "mae_tiny_full.yaml", ["num_passes=8"])
    train(cfg)
    passes = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl")) if '"pass"' in line]
    assert len(passes) == 8
    for number, record in enumerate(passes, start=1):
        sources = record["sources"]
        assert {k: v["drawn"] for k, v in sources.items()} == {"train": 384, "held": 128}
        assert {k: v["forwarded"] for k, v in sources.items()} == {"train": 384 * number, "held": 128 * number}
        assert record["tail"] == 0 and record["steps_in_pass"] == 8
        assert set(record["held_out_by_source"]) == {"train", "held"}


def test_a_pruned_mixture_stopped_mid_pass_resumes_bitwise_and_refuses_another_mixture(digits_shards, tmp_path):
    base = ["num_passes=4", "checkpoint.every_steps=4", "score.normalise=stratum_mean", "score.per_source=true"]
    config = "mae_tiny_infobatch.yaml"
    train(mixture_run(digits_shards, tmp_path, "straight", config, [*base, "max_steps=28"]))
    train(mixture_run(digits_shards, tmp_path, "resumed", config, [*base, "max_steps=20"]))  # pass 3, 4 steps in
    train(mixture_run(digits_shards, tmp_path, "resumed", config, [*base, "max_steps=28", "checkpoint.resume=latest"]))
    (_, weights_a, pruner_a), (_, weights_b, pruner_b) = (
        final_state(tmp_path / "straight"),
        final_state(tmp_path / "resumed"),
    )
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert_states_equal(pruner_a, pruner_b)
    changed = mixture_run(
        digits_shards, tmp_path, "resumed", config, [*base, two_sources(digits_shards, b="weight: 2")]
    )
    changed.checkpoint.resume = "latest"
    with pytest.raises(ValueError, match=r"another mixture of data.train: source 'held': weight 1.0 -> 2.0"):
        train(changed)


def test_per_source_scores_keep_infobatch_from_starving_the_source_of_small_losses(digits_shards):
    """Source 0's losses are 10x source 1's. On raw losses InfoBatch's mean threshold lies above every
    loss of source 1, which is then pruned at the full rate while source 0 is barely touched; with
    the scores normalised per source each source loses about r of its below-mean half."""
    mixture = mixture_of(digits_shards, samples_per_pass=0)
    n = mixture.index.num_samples
    ids = np.arange(n)
    rng = np.random.default_rng(0)
    losses = rng.uniform(0.5, 1.5, n).astype(np.float32) * np.where(mixture.source_of(ids) == 0, 10.0, 1.0)
    skipped = {}
    for per_source in (False, True):
        strata = SourceStrata(mixture, task_strata=0, per_source=per_source)
        normalise = "stratum_mean" if per_source else "none"
        scorer = ScoreNormaliser(normalise, strata.num_strata, buckets=strata.buckets(1), momentum=0.0)
        pruner = InfoBatch(n, 10, seed=0, prune_ratio=0.5)
        pruner.plan(0)
        pruner.update(ids, scorer(ids, losses, strata(ids, None)))
        pruner.plan(1)
        weights = pruner.weights(ids)
        skipped[per_source] = [float((weights[mixture.source_of(ids) == k] == 0).mean()) for k in (0, 1)]
    raw, fair = skipped[False], skipped[True]
    assert raw[1] > 0.4 and raw[1] > 2 * raw[0], f"without per-source scores source 1 starves: {raw}"
    for k in (0, 1):  # about half of each source is below its own mean, and r = 0.5 of those is skipped
        assert 0.18 < fair[k] < 0.32, f"source {k} skipped {fair[k]:.2f} with per-source scores"


def test_compare_shows_each_source_of_a_mixture_side_by_side(digits_shards, tmp_path):
    from prunepipe.pipelines.report.compare import compare_runs

    for name, config in (("full", "mae_tiny_full.yaml"), ("pruned", "mae_tiny_infobatch.yaml")):
        train(mixture_run(digits_shards, tmp_path, name, config, ["num_passes=3"]))
    report = compare_runs(
        [str(tmp_path / "full")], [str(tmp_path / "pruned")], out=str(tmp_path / "report"), plots=False
    )
    full, pruned = report["sources"]["full"], report["sources"]["pruned"]
    assert full["train"]["forwarded"] == 3 * 384 and full["held"]["forwarded"] == 3 * 128
    assert pruned["train"]["kept"] < pruned["train"]["drawn"] == 384, "InfoBatch pruned the train source"
    assert set(full["train"]["held_out"]) == {"masked_mse"}
    table = report["markdown"].split("## Per source")[1]
    assert "| train | 1,152 |" in table and "| held | 384 |" in table


@pytest.mark.slow  # three torchrun launches of 2 ranks x 2 loader workers, about 70 s on 2 cores
def test_a_mixture_on_two_gloo_ranks_of_two_workers_stopped_mid_pass_resumes_bitwise(digits_shards, tmp_path):
    """Killed by max_steps mid-pass (the SIGKILL and requeue of a node: the cluster rehearsal's --mixture)."""
    from test_distributed import launch

    common = [
        two_sources(digits_shards),
        "data.val=",
        "data.samples_per_pass=512",
        "data.batch_size=32",
        "data.num_workers=2",
        "checkpoint.every_steps=3",
        "score.normalise=stratum_mean",
        "score.per_source=true",
        "num_passes=3",
        f"runs_dir={tmp_path}",
        *TINY_MAE[:-2],  # batch size and held-out batches are set here
    ]
    launch(2, "mae_tiny_infobatch.yaml", [*common, "name=straight"])
    launch(2, "mae_tiny_infobatch.yaml", [*common, "name=resumed", "max_steps=15"])  # pass 2, 7 steps in
    output = launch(2, "mae_tiny_infobatch.yaml", [*common, "name=resumed", "checkpoint.resume=latest"])
    assert "resumed from" in output and "step_000015" in output
    (_, weights_a, pruner_a), (_, weights_b, pruner_b) = (
        final_state(tmp_path / "straight"),
        final_state(tmp_path / "resumed"),
    )
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert_states_equal(pruner_a, pruner_b)


def test_a_single_folder_run_resumes_from_its_shards_moved_elsewhere(digits_shards, tmp_path):
    import shutil

    moved = tmp_path / "scratch" / "train"
    shutil.copytree(f"{digits_shards}/train", moved)  # a requeue that stages the shards to a node's scratch disk
    base = [f"runs_dir={tmp_path}", "name=moved", "data.val=", "checkpoint.every_steps=5", *TINY_MAE]
    config = os.path.join(ROOT, "configs", "mae_tiny_full.yaml")
    train(load_config(config, [f"data.train={digits_shards}/train", *base, "max_steps=5"]))
    train(load_config(config, [f"data.train={moved}", *base, "max_steps=8", "checkpoint.resume=latest"]))
    assert final_state(tmp_path / "moved")[0].endswith("step_000008")


def test_a_pass_walking_a_source_twice_is_not_split_into_segments_on_another_layout(digits_shards, tmp_path):
    def run(*extra):
        return mixture_run(
            digits_shards,
            tmp_path,
            "twice",
            "mae_tiny_full.yaml",
            ["num_passes=2", "data.val=", "checkpoint.every_steps=3", "data.samples_per_pass=0", *extra],
        )

    # 3:1 of both sources' 1,797 samples a pass: 449 of the 180 held ones, walked twice whole and once in part
    train(run("max_steps=3"))
    resumed = run("data.num_workers=1", "checkpoint.resume=latest")
    with pytest.raises(ValueError, match="walks a source more than once .* cannot be split"):
        train(resumed)
