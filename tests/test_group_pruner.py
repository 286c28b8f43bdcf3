"""The dedup pruner (docs/pruning.md, "dedup"): each near-duplicate group gives about per_group members
a pass, a rotation that comes round to every member, weights that keep the duplicated or the
deduplicated expectation as chosen, the pass's kept fraction held at `keep`, annealing, exact
resume, and its group table: the known groups of the redundant shards, shared once per node,
agreed on by every rank and named in the checkpoint."""

from __future__ import annotations

import glob
import io
import json
import math
import os

import numpy as np
import pytest
import torch
from test_accumulation import run_two_ranks  # pytest puts tests/ on the path
from test_trainer import assert_states_equal, final_state

from prunepipe.pipelines.config import ConfigError, check_data, load_config
from prunepipe.pipelines.data.group_table import group_table_path, open_group_table, write_group_table
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.training.loop import train
from prunepipe.pruning import Dedup, build_pruner, uniform_coin
from prunepipe.pruning.groups import fill_group_sizes
from prunepipe.tools.fixtures.known_groups import known_groups, original_key, split_keys, write_known_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUP_SIZES = (2, 5, 13, 40)  # 100 groups of each, beside 2,000 samples without near-duplicates
SINGLES, PER_SIZE = 2000, 100


# ----------------------------------------------------------------------------------------------
# Groups spread over the ids, as a crawl's copies are
# ----------------------------------------------------------------------------------------------


def spread_groups(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(group id per sample: its group's smallest id, group size per sample) of the layout above."""
    labels = np.concatenate(
        [np.arange(SINGLES)]
        + [SINGLES + i * PER_SIZE + np.repeat(np.arange(PER_SIZE), size) for i, size in enumerate(GROUP_SIZES)]
    )
    labels = labels[np.random.default_rng(seed).permutation(len(labels))]
    first: dict[int, int] = {}
    group_of = np.array([first.setdefault(label, i) for i, label in enumerate(labels.tolist())], dtype=np.int32)
    sizes = np.zeros(len(group_of), dtype=np.int32)
    fill_group_sizes(group_of, sizes)
    return group_of, sizes


N = SINGLES + PER_SIZE * sum(GROUP_SIZES)


def grouped(num_passes: int = 400, seed: int = 2, sizes: np.ndarray | None = None, **hparams) -> Dedup:
    pruner = Dedup(N, num_passes, seed=seed, **hparams)
    pruner.use_groups(spread_groups()[1] if sizes is None else sizes, digest="layout-0", source="spread_groups(0)")
    return pruner


def scored(pruner: Dedup, seen_share: float = 1.0) -> np.ndarray:
    """Record an exponential score for a share of the samples; returns which were seen."""
    rng = np.random.default_rng(7)
    seen = rng.random(N) < seen_share
    ids = np.flatnonzero(seen)
    pruner.update(ids, rng.exponential(1.0, N).astype(np.float32)[ids])
    return seen


def kept_over_passes(pruner: Dedup, passes: range) -> np.ndarray:
    """bool [passes, N]: kept in each pass."""
    kept = []
    for pass_index in passes:
        pruner.plan(pass_index)
        kept.append(pruner.weights(np.arange(N)) > 0)
    return np.array(kept)


# ----------------------------------------------------------------------------------------------
# The groups' share: about per_group members a pass, every member in turn
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_group", [1.0, 2.5])
def test_each_group_gives_per_group_members_a_pass_in_expectation(per_group):
    group_of, sizes = spread_groups()
    pruner = grouped(sizes=sizes, keep=0.01, per_group=per_group)  # no scores: only the groups prune
    kept = kept_over_passes(pruner, range(40))
    assert pruner.stats()["per_group"] == per_group  # not raised: the groups keep more than 1%
    assert kept[:, sizes == 1].all(), "a sample without near-duplicates is always kept by its group"
    for size in GROUP_SIZES:
        members = sizes == size
        per_pass = np.array(
            [np.bincount(group_of[members][row[members]], minlength=N)[np.unique(group_of[members])] for row in kept]
        )  # [passes, groups]: members kept per group
        expected = min(size, per_group)
        assert abs(per_pass.mean() - expected) < 0.03 * expected, (size, per_pass.mean())
        assert per_pass.std() > 0 or size <= per_group  # a rotation per member, not a fixed choice


@pytest.mark.parametrize("per_group", [1.0, 2.5])
def test_over_ceil_n_over_m_passes_every_member_is_kept(per_group):
    _, sizes = spread_groups()
    pruner = grouped(sizes=sizes, keep=0.01, per_group=per_group)
    passes = 60
    kept = kept_over_passes(pruner, range(passes))
    shares = pruner.frozen_plan.group_probs.astype(np.float64)
    coins = np.array([uniform_coin(5, pass_index, np.arange(N)) < shares for pass_index in range(passes)])
    independent_missed = 0
    for size in GROUP_SIZES:
        window = math.ceil(size / per_group)
        members = np.flatnonzero(sizes == size)
        for start in range(passes - window + 1):
            assert kept[start : start + window, members].any(axis=0).all(), (size, start)
            independent_missed += int((~coins[start : start + window, members].any(axis=0)).sum())
    assert independent_missed > 0, "independent coins at the same probabilities miss members in such windows"


def test_static_keeps_the_same_members_every_pass_and_never_the_others():
    group_of, sizes = spread_groups()
    rotating, static = (grouped(sizes=sizes, keep=0.01, static=flag) for flag in (False, True))
    kept = {
        name: kept_over_passes(pruner, range(max(GROUP_SIZES)))
        for name, pruner in (("rotating", rotating), ("static", static))
    }
    assert (kept["static"] == kept["static"][0]).all(), "a static deduplication keeps one fixed subset"
    np.testing.assert_array_equal(kept["static"][0], kept["rotating"][0])  # the rotation's pass 0, frozen
    grouped_members = sizes > 1
    never = ~kept["static"][:, grouped_members].any(axis=0)
    assert never.mean() > 0.5, "most near-duplicates are never seen statically"
    assert kept["rotating"][:, grouped_members].any(axis=0).all(), "in ceil(n / m) passes the rotation shows each"
    assert abs(kept["static"].mean() - kept["rotating"].mean()) < 0.02, "the same compute either way"
    # the plan says so, through a checkpoint too
    buffer = io.BytesIO()
    torch.save(static.state_dict(), buffer)
    buffer.seek(0)
    restored = grouped(sizes=sizes, keep=0.01, static=True)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert not restored.frozen_plan.rotate
    restored.plan(max(GROUP_SIZES) + 1)
    np.testing.assert_array_equal(restored.weights(np.arange(N)) > 0, kept["static"][0])


def test_rotation_keeps_each_sample_its_share_of_the_passes():
    _, sizes = spread_groups()
    pruner = grouped(sizes=sizes, keep=0.01)
    kept = kept_over_passes(pruner, range(120))
    shares = pruner.frozen_plan.group_probs.astype(np.float64)  # 1/size, rounded up to a float16
    assert np.all((shares >= 1 / sizes) & (shares < (1 / sizes) * (1 + 1e-3)))
    # a step of s past a window of width s: over K passes floor(K s) or ceil(K s) hits, never more apart
    assert np.all(np.abs(kept.mean(axis=0) - shares) < 1 / 120)


# ----------------------------------------------------------------------------------------------
# Weights: the duplicated or the deduplicated expectation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_rescale", [True, False])
def test_expected_weight_per_group_member_follows_group_rescale(group_rescale):
    _, sizes = spread_groups()
    pruner = grouped(sizes=sizes, keep=0.25, group_rescale=group_rescale)  # the groups keep 30%: scores prune too
    scored(pruner)
    passes = 300
    total = np.zeros(N)
    for pass_index in range(passes):
        pruner.plan(pass_index)  # the same scores every pass: only the coins and the rotation move
        total += pruner.weights(np.arange(N))
    assert abs(pruner.stats()["expected_keep"] - 0.25) < 2e-3
    mean_weight = total / passes
    for size in (1, *GROUP_SIZES):
        members = mean_weight[sizes == size]
        # duplicated: every sample's expected weight is 1; deduplicated: a group of n weighs min(n, 1)
        expected = 1.0 if group_rescale else min(1.0, 1.0 / size)
        error = 4 * members.std(ddof=1) / math.sqrt(len(members)) + 0.01 * expected
        assert abs(members.mean() - expected) < error, (size, members.mean(), expected)


def test_without_any_rescale_kept_samples_weigh_one():
    pruner = grouped(keep=0.25, rescale=False, group_rescale=False)
    scored(pruner)
    pruner.plan(3)
    weights = pruner.weights(np.arange(N))
    assert set(np.unique(weights)) == {0.0, 1.0}


# ----------------------------------------------------------------------------------------------
# The kept fraction: `keep`, whoever removes what
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("then", ["importance", "infobatch"])
@pytest.mark.parametrize("keep", [0.25, 0.6])  # 0.25: the scores remove some of the groups' 30%; 0.6: m rises
def test_the_kept_fraction_meets_keep(then, keep):
    pruner = grouped(keep=keep, then=then)
    scored(pruner, seen_share=0.9)
    kept = kept_over_passes(pruner, range(1, 6))
    stats = pruner.stats()
    assert abs(stats["expected_keep"] - keep) < 2e-3, stats
    assert abs(kept.mean() - keep) < 4 * math.sqrt(keep * (1 - keep) / kept.size) + 2e-3
    assert (stats["per_group"] > 1.0) == (keep > 0.3)  # raised only where the groups alone keep too little
    assert (stats["scale"] is not None) == (then == "importance" and keep < 0.3)


def test_infobatch_skips_at_most_prune_ratio_and_says_what_it_keeps():
    pruner = grouped(keep=0.05, then="infobatch", prune_ratio=0.5)
    scored(pruner)
    pruner.plan(1)
    stats = pruner.stats()
    assert stats["below_skip"] == 0.5 and stats["expected_keep"] > 0.05  # the bound wins over keep
    probs = pruner.frozen_plan.keep_probs
    assert set(np.unique(probs).tolist()) == {0.5, 1.0}


def test_unseen_samples_are_kept_by_their_scores_and_still_take_turns_in_their_groups():
    _, sizes = spread_groups()
    pruner = grouped(sizes=sizes, keep=0.25)
    seen = scored(pruner, seen_share=0.5)
    pruner.plan(1)
    plan = pruner.frozen_plan
    assert np.all(plan.keep_probs[~seen] == 1.0) and np.any(plan.keep_probs[seen] < 1.0)
    np.testing.assert_array_equal(plan.group_probs[~seen] < 1.0, sizes[~seen] > 1)
    kept = pruner.weights(np.arange(N)) > 0
    assert kept[~seen & (sizes == 1)].all()
    assert not kept[~seen & (sizes == 40)].all()
    assert pruner.stats()["threshold"] > 0  # the mean of the seen scores only


def test_the_first_pass_prunes_by_groups_alone():
    pruner = grouped(keep=0.25)
    pruner.plan(0)
    assert np.all(pruner.frozen_plan.keep_probs == 1.0)
    assert abs(pruner.stats()["expected_keep"] - 0.3) < 2e-3  # the groups' 30%: no scores yet


def test_annealing_passes_are_full_with_weight_one():
    pruner = grouped(num_passes=8, keep=0.25, delta=0.5)
    scored(pruner)
    pruner.plan(3)
    assert pruner.stats()["kept_fraction"] < 0.3 and not pruner.stats()["annealing"]
    for pass_index in range(4, 8):
        pruner.plan(pass_index)
        np.testing.assert_array_equal(pruner.weights(np.arange(N)), np.ones(N, np.float32))
        assert pruner.stats()["annealing"] and pruner.stats()["kept_fraction"] == 1.0


# ----------------------------------------------------------------------------------------------
# State: exact resume, and only with the same group table
# ----------------------------------------------------------------------------------------------


def test_state_round_trip_mid_run_gives_identical_plans_and_keeps_agreeing():
    original = grouped(keep=0.4, momentum=0.5)
    scored(original)
    original.plan(5)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = grouped(keep=0.4, momentum=0.5)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    ids = np.arange(N)
    np.testing.assert_array_equal(restored.weights(ids), original.weights(ids))
    assert restored.stats() == original.stats()
    assert restored.frozen_plan.keep_probs.dtype == restored.frozen_plan.group_probs.dtype == np.float16
    losses = np.random.default_rng(3).exponential(1.0, len(ids[::3])).astype(np.float32)
    for pruner in (original, restored):
        pruner.update(ids[::3], losses)
        pruner.plan(6)
    np.testing.assert_array_equal(restored.weights(ids), original.weights(ids))


def test_a_state_saved_with_another_group_table_is_refused_naming_both():
    original = grouped(keep=0.4)
    scored(original)
    original.plan(1)
    other = Dedup(N, 400, seed=2, keep=0.4)
    other.use_groups(spread_groups(seed=1)[1], digest="layout-1", source="spread_groups(1)")
    with pytest.raises(ValueError, match=r"spread_groups\(0\).*layout-0.*spread_groups\(1\).*layout-1"):
        other.load_state_dict(original.state_dict())
    with pytest.raises(ValueError, match=r"layout-0.*this run has none"):
        Dedup(N, 400, seed=2, keep=0.4).load_state_dict(original.state_dict())


def test_sizes_that_are_not_a_group_table_s_are_refused():
    pruner = Dedup(5, 4)
    with pytest.raises(ValueError, match=r"int32\[5\]"):
        pruner.use_groups(np.ones(5, np.int64), digest="x", source="test")
    with pytest.raises(ValueError, match="not a whole number of such groups"):
        pruner.use_groups(np.array([3, 3, 1, 1, 1], np.int32), digest="x", source="test")
    with pytest.raises(ValueError, match=r"sample 2 has group id 7"):
        fill_group_sizes(np.array([0, 0, 7, 3, 3]), np.zeros(5, np.int32))


def test_then_and_its_hyper_parameters_are_checked():
    with pytest.raises(ValueError, match="dedup: then must be one of importance, infobatch"):
        build_pruner("dedup", 10, 4, then="ted")
    with pytest.raises(ValueError, match=r"dedup: per_group must be in \(0.0"):
        build_pruner("dedup", 10, 4, per_group=0)


# ----------------------------------------------------------------------------------------------
# The group table of the redundant shards, and the loop
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redundant(tmp_path_factory) -> str:
    """Redundant shards at 16 px (216 train samples, 124 of them in 16 groups) with their known groups."""
    from prunepipe.tools.commands.shards import write_shards

    out = tmp_path_factory.mktemp("redundant")
    write_shards("redundant", str(out), size=16, shard_size=100, crops_per_photo=8, redundant_originals=16)
    write_known_groups(str(out / "train"))
    return str(out)


def test_known_groups_put_each_original_with_its_copies(redundant):
    train = os.path.join(redundant, "train")
    keys, groups = split_keys(train), known_groups(train)
    assert len(groups) == ShardIndex.load(train).num_samples == len(keys) == 216
    roots = [original_key(key) for key in keys]
    for sample_id, group in enumerate(groups):
        assert group <= sample_id and groups[group] == group, "a group is named by its smallest id"
        assert roots[group] == roots[sample_id]
    by_root = {root: groups[i] for i, root in enumerate(roots)}
    assert len(set(by_root.values())) == len(by_root), "different originals are different groups"
    copies = sum("_dup" in key for key in keys)
    sizes = np.bincount(groups, minlength=len(groups))
    assert copies == 108 and int((sizes > 1).sum()) == 16 and int(sizes[sizes > 1].sum()) == copies + 16
    table = open_group_table(group_table_path("known", train), len(groups), train)
    np.testing.assert_array_equal(table.group_of, groups)
    assert table.header["index"]["num_samples"] == 216 and table.header["grouped_samples"] == 124


TINY_MAE = [
    "mae.embed_dim=32",
    "mae.depth=1",
    "mae.num_heads=2",
    "mae.decoder_embed_dim=32",
    "mae.decoder_depth=1",
    "mae.decoder_num_heads=2",
    "data.batch_size=32",
    "data.val=",
    "data.num_workers=0",
    "data.resolution=16",
    "data.channels=3",
    "log_every=5",
]


def dedup_cfg(redundant, tmp_path, name, extra=()):
    return load_config(
        os.path.join(ROOT, "configs", "mae_tiny_importance.yaml"),
        [
            f"data.train={redundant}/train",
            f"runs_dir={tmp_path}",
            f"name={name}",
            "pruner.name=dedup",
            "pruner.groups=known",
            "pruner.keep=0.6",
            *TINY_MAE,
            *extra,
        ],
    )


def test_the_loop_trains_dedup_and_resumes_bitwise(redundant, tmp_path):
    base = ["num_passes=4", "checkpoint.every_steps=5"]
    train(dedup_cfg(redundant, tmp_path, "straight", base))
    stop_at = 10
    train(dedup_cfg(redundant, tmp_path, "resumed", [*base, f"max_steps={stop_at}"]))
    train(dedup_cfg(redundant, tmp_path, "resumed", [*base, "checkpoint.resume=latest"]))
    (_, weights_a, pruner_a), (_, weights_b, pruner_b) = (
        final_state(tmp_path / "straight"),
        final_state(tmp_path / "resumed"),
    )
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert_states_equal(pruner_a, pruner_b)
    table = open_group_table(group_table_path("known", f"{redundant}/train"), 216)
    assert pruner_a["scalars"]["groups_digest"] == table.digest and pruner_a["scalars"]["groups_source"] == table.path
    passes = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl") if '"pass"' in line]
    assert [p["pruner"]["per_group"] > 1 for p in passes] == [True] * 4  # 60% needs more than 1 per group
    assert all(abs(p["pruner"]["expected_keep"] - 0.6) < 5e-3 for p in passes)


def test_resuming_with_another_group_table_is_refused_naming_both(redundant, tmp_path):
    train(dedup_cfg(redundant, tmp_path, "run", ["num_passes=2", "max_steps=3", "checkpoint.every_steps=3"]))
    other = write_group_table(
        os.path.join(redundant, "train", "groups", "singles.npy"),
        np.arange(216, dtype=np.int32),
        {"made_by": "test: every sample its own group"},
    )
    resumed = dedup_cfg(
        redundant, tmp_path, "run", ["num_passes=2", "pruner.groups=singles", "checkpoint.resume=latest"]
    )
    with pytest.raises(
        ValueError,
        match=rf"group table {os.path.join(redundant, 'train', 'groups', 'known.npy')}.*"
        rf"this run has {other}",
    ):
        train(resumed)


def test_group_table_mistakes_name_the_field_or_the_file(redundant, tmp_path):
    with pytest.raises(ConfigError, match=r"pruner.groups='known' is read by pruner.name=dedup only, not importance"):
        dedup_cfg(redundant, tmp_path, "x", ["pruner.name=importance"])
    with pytest.raises(ConfigError, match=r"pruner.name=dedup needs pruner.groups"):
        dedup_cfg(redundant, tmp_path, "x", ["pruner.groups="])
    with pytest.raises(
        ConfigError, match=r"data check: pruner.groups='missing': no group table at .*groups/missing.npy"
    ):
        check_data(dedup_cfg(redundant, tmp_path, "x", ["pruner.groups=missing"]))
    short = write_group_table(
        os.path.join(redundant, "train", "groups", "short.npy"), np.arange(215, dtype=np.int32), {}
    )
    with pytest.raises(ValueError, match=rf"{short}: 215 group ids, but .*index.json indexes 216 samples"):
        train(dedup_cfg(redundant, tmp_path, "x", ["pruner.groups=groups/short.npy"]))


def test_a_group_table_made_for_another_shard_list_is_refused(redundant, tmp_path):
    """Same sample count, shards listed in another order: the ids name other samples."""
    import shutil

    moved = tmp_path / "train"
    shutil.copytree(os.path.join(redundant, "train"), moved)
    write_known_groups(str(moved))
    index = json.loads((moved / "index.json").read_text())
    open_group_table(group_table_path("known", str(moved)), 216, shards_dir=str(moved))  # made for it: fine
    index["shards"][0]["url"] = "renamed-" + index["shards"][0]["url"]
    (moved / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"known.json: made for another shard list"):
        open_group_table(group_table_path("known", str(moved)), 216, shards_dir=str(moved))


TWO_RANKS = """
import hashlib, json, os, sys
sys.path.insert(0, sys.argv[1])
import numpy as np, torch.distributed as dist
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.training.groups import use_group_table
from prunepipe.pipelines.training.node_tables import local_rank_and_size, run_token
from prunepipe.pruning import build_pruner, gather_batch

TRAIN, OTHER = {train!r}, {other!r}
dist.init_process_group("gloo")
rank = dist.get_rank()
local_rank, local_size = local_rank_and_size()
index = ShardIndex.load(TRAIN)
N = index.num_samples
token = run_token()
make = lambda: build_pruner("dedup", N, 6, seed=1, keep=0.4, then="infobatch")
shared, alone = make(), make()
_, digest = use_group_table(shared, "known", TRAIN, index, rank=rank, local_rank=local_rank, local_size=local_size,
                            token=token)
use_group_table(alone, "known", TRAIN, index, rank=rank)  # the sizes in this process's own memory
sizes = shared._group_size
report = {{"token": token, "digest": digest, "mapped": type(sizes).__name__,
          "read_only": not sizes.flags.writeable, "plans": [], "same_as_alone": True}}
rng = np.random.default_rng(rank)  # each rank its own batches; the gathered batch is the same everywhere
ids = np.arange(N)
for pass_index in range(5):
    for pruner in (shared, alone):
        pruner.plan(pass_index)
    weights = shared.weights(ids)
    report["plans"].append(hashlib.sha256(weights.tobytes()).hexdigest())
    report["same_as_alone"] &= bool(np.array_equal(weights, alone.weights(ids)))
    for _ in range(4):
        batch, losses, _ = gather_batch(rng.integers(0, N, 16), rng.exponential(1.0, 16).astype(np.float32))
        for pruner in (shared, alone):
            pruner.update(batch, losses)
report["pruned"] = shared.stats()["pruned_so_far"]
try:  # rank 1 names another table: every rank refuses, none waits for the others
    use_group_table(make(), OTHER if rank == 1 else "known", TRAIN, index, rank=rank, local_rank=local_rank,
                    local_size=local_size, token=token + "b")
    report["mismatch"] = None
except RuntimeError as e:
    report["mismatch"] = str(e)
print(json.dumps(report), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


def test_two_ranks_share_one_group_table_plan_alike_and_refuse_different_tables(redundant, tmp_path):
    train_dir = os.path.join(redundant, "train")
    other = write_group_table(os.path.join(train_dir, "groups", "alone.npy"), np.arange(216, dtype=np.int32), {})
    reports = run_two_ranks(TWO_RANKS.format(train=train_dir, other=other), tmp_path)
    assert reports[0]["digest"] == reports[1]["digest"]
    assert [r["mapped"] for r in reports] == ["memmap", "memmap"] and all(r["read_only"] for r in reports)
    assert not glob.glob(f"/dev/shm/prunepipe-{reports[0]['token']}-*"), "the shared files are unlinked once mapped"
    assert reports[0]["plans"] == reports[1]["plans"] and all(r["same_as_alone"] for r in reports)
    assert reports[0]["pruned"] > 0
    for report in reports:
        assert "the ranks hold different group tables" in report["mismatch"]
        assert f"rank 1: {other}" in report["mismatch"] and "rank 0: " in report["mismatch"]


def test_two_ranks_train_dedup_through_the_loop_with_one_plan(redundant, tmp_path):
    from test_distributed import debug_file, launch, passes_of

    output = launch(
        2,
        "mae_tiny_importance.yaml",
        [
            f"data.train={redundant}/train",
            "data.val=''",
            f"runs_dir={tmp_path}",
            "name=ddp",
            "num_passes=2",
            "debug_sync=true",
            "pruner.name=dedup",
            "pruner.groups=known",
            "pruner.keep=0.6",
            *[o for o in TINY_MAE if not o.startswith(("data.val=", "log_every"))],
        ],
    )
    run_dir = str(tmp_path / "ddp")
    assert output.count("near-duplicate groups: ") == 1 and "pruner tables: one copy per node" in output
    for record in passes_of(run_dir):
        digests = [open(debug_file(run_dir, "digest", record["pass_index"], 2, r) + ".txt").read() for r in range(2)]
        assert digests[0] == digests[1], "the ranks' plans (group shares included) or scores differ"
        ids = [np.load(debug_file(run_dir, "ids", record["pass_index"], 2, r) + ".npy") for r in range(2)]
        assert len(ids[0]) == len(ids[1]) and not set(ids[0]) & set(ids[1])
        assert abs(record["pruner"]["expected_keep"] - 0.6) < 5e-3
