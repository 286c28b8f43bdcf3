"""The pruner contract (docs/design.md, "Pruners"): decisions, weights, state.

Statistical claims use fixed seeds and state their tolerance: binomial tests at alpha = 1e-3 and
means within 4 standard errors.
"""

from __future__ import annotations

import io
import random as python_random

import numpy as np
import pytest
import scipy.stats
import torch

from prunepipe.pruning import (
    PRUNERS,
    TED,
    FrozenPlan,
    Full,
    Importance,
    InfoBatch,
    Pruner,
    Random,
    build_pruner,
    uniform_coin,
)

ALPHA = 1e-3  # significance level of every binomial / goodness-of-fit check in this file


def record_scores(pruner: Pruner, ids: np.ndarray, scores: np.ndarray) -> None:
    """Feed per-sample losses in batches of 256, as the trainer does."""
    for start in range(0, len(ids), 256):
        pruner.update(ids[start : start + 256], scores[start : start + 256])


def trained(name: str, num_samples: int = 5000, num_passes: int = 40, seed: int = 3, **hparams) -> Pruner:
    """A pruner with scores for most samples (two visits, so TED has scores too), planned at pass 12."""
    pruner = build_pruner(name, num_samples, num_passes, seed=seed, **hparams)
    rng = np.random.default_rng(11)
    ids = np.arange(num_samples)
    seen = ids[rng.random(num_samples) < 0.9]  # 10% stay unseen
    first = rng.exponential(1.0, num_samples).astype(np.float32)
    record_scores(pruner, seen, first[seen])
    pruner.on_step(0.5)
    pruner.on_step(0.5)
    record_scores(pruner, seen, (first * rng.uniform(0.2, 1.0, num_samples)).astype(np.float32)[seen])
    pruner.plan(12)
    return pruner


# ----------------------------------------------------------------------------------------------
# The coin
# ----------------------------------------------------------------------------------------------


def test_coin_is_uniform_and_a_pure_function_of_seed_epoch_id():
    ids = np.arange(200_000, dtype=np.int64)
    coin = uniform_coin(7, 3, ids)
    assert coin.dtype == np.float64 and coin.min() >= 0.0 and coin.max() < 1.0
    assert scipy.stats.kstest(coin, "uniform").pvalue > ALPHA
    order = np.random.default_rng(0).permutation(len(ids))
    np.testing.assert_array_equal(uniform_coin(7, 3, ids[order]), coin[order])
    # another pass_index or seed is another, uncorrelated coin
    for other in (uniform_coin(7, 4, ids), uniform_coin(8, 3, ids)):
        assert abs(np.corrcoef(coin, other)[0, 1]) < 4 / np.sqrt(len(ids))
        assert scipy.stats.kstest(other, "uniform").pvalue > ALPHA


def test_coin_separates_ids_beyond_float_precision():
    # 2**53 and 2**53 + 1 are the same float64: a coin that went through floats would agree on them
    ids = np.array([2**53, 2**53 + 1, 5_000_000_000, 5_000_000_001], dtype=np.int64)
    coin = uniform_coin(0, 0, ids)
    assert len(set(coin.tolist())) == 4


def test_pruners_never_touch_global_random_generators():
    numpy_state, python_state, torch_state = np.random.get_state(), python_random.getstate(), torch.get_rng_state()
    for name in PRUNERS:
        pruner = trained(name)
        pruner.weights(np.arange(5000))
        pruner.plan(13)
    assert python_random.getstate() == python_state
    assert torch.equal(torch.get_rng_state(), torch_state)
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1]) and after[2:] == numpy_state[2:]


# ----------------------------------------------------------------------------------------------
# Full and Random
# ----------------------------------------------------------------------------------------------


def test_full_keeps_everything_with_weight_one():
    pruner = trained("full")
    np.testing.assert_array_equal(pruner.weights(np.arange(5000)), np.ones(5000, np.float32))
    assert pruner.stats()["kept_fraction"] == 1.0


@pytest.mark.parametrize("keep", [0.2, 0.7])
def test_random_keeps_with_probability_k_and_weight_one_over_k(keep):
    pruner = Random(20_000, 10, seed=5, keep=keep)
    pruner.plan(2)
    weights = pruner.weights(np.arange(20_000))
    kept = weights > 0
    assert set(np.unique(weights).tolist()) == {0.0, float(np.float32(1 / keep))}
    assert scipy.stats.binomtest(int(kept.sum()), len(kept), keep).pvalue > ALPHA
    assert pruner.stats()["kept_this_pass"] == int(kept.sum())


# ----------------------------------------------------------------------------------------------
# InfoBatch
# ----------------------------------------------------------------------------------------------


def infobatch_on_fixed_scores(prune_ratio: float, num_samples: int = 20_000):
    """InfoBatch planned on an exponential score table with 20% unseen samples."""
    pruner = InfoBatch(num_samples, 100, seed=2, prune_ratio=prune_ratio)
    rng = np.random.default_rng(4)
    scores = rng.exponential(2.0, num_samples).astype(np.float32)
    seen = rng.random(num_samples) >= 0.2
    record_scores(pruner, np.flatnonzero(seen), scores[seen])
    pruner.plan(7)
    below = seen & (scores.astype(np.float64) < scores[seen].astype(np.float64).mean())
    return pruner, pruner.weights(np.arange(num_samples)), scores, seen, below


@pytest.mark.parametrize("prune_ratio", [0.3, 0.5, 0.8])
def test_infobatch_skips_below_mean_samples_with_probability_r(prune_ratio):
    pruner, weights, _, _, below = infobatch_on_fixed_scores(prune_ratio)
    skipped = int(np.count_nonzero(weights[below] == 0))
    assert scipy.stats.binomtest(skipped, int(below.sum()), prune_ratio).pvalue > ALPHA
    assert pruner.stats()["skipped_this_pass"] == skipped
    assert pruner.stats()["below_threshold"] == int(below.sum())


@pytest.mark.parametrize("prune_ratio", [0.3, 0.5, 0.8])
def test_infobatch_never_skips_above_mean_or_unseen_samples(prune_ratio):
    _, weights, _, seen, below = infobatch_on_fixed_scores(prune_ratio)
    assert np.all(weights[~below] == 1.0)
    assert np.all(weights[~seen] == 1.0)


@pytest.mark.parametrize("prune_ratio", [0.3, 0.5, 0.8])
def test_infobatch_weights_are_exactly_one_over_one_minus_r_and_one(prune_ratio):
    _, weights, _, _, below = infobatch_on_fixed_scores(prune_ratio)
    kept_below = weights[below][weights[below] > 0]
    assert len(kept_below) > 0
    assert np.all(kept_below == np.float32(1.0 / (1.0 - prune_ratio)))
    assert weights.dtype == np.float32


def test_infobatch_threshold_is_the_mean_of_seen_scores():
    pruner, _, scores, seen, _ = infobatch_on_fixed_scores(0.5)
    assert pruner.stats()["threshold"] == pytest.approx(scores[seen].astype(np.float64).mean(), rel=1e-12)


def test_infobatch_compares_with_the_exact_mean_not_a_float32_rounding_of_it():
    # mean(1, 1 + 2**-23) = 1 + 2**-24 is not a float32 and rounds to 1.0: a float32 comparison
    # would call the sample scored 1.0 "not below the mean"
    pruner = InfoBatch(2, 10, prune_ratio=0.5)
    pruner.update(np.array([0, 1]), np.array([1.0, 1.0 + 2**-23], dtype=np.float32))
    pruner.plan(1)
    assert pruner.stats()["below_threshold"] == 1


# Pass `pass_index` is pruned iff pass_index < num_passes * delta, computed exactly on delta as written.
ANNEALING_CASES = [
    # (num_passes, delta, first full pass)
    (8, 0.875, 7),  # 7.0 exactly: passes 0-6 pruned, the last (1 - delta) * 8 = 1 pass full
    (200, 0.875, 175),  # the paper's setting: 25 full passes (the reference code anneals 24)
    (10, 0.875, 9),  # 8.75: passes 0-8 pruned
    (100, 0.55, 55),  # 100 * 0.55 is 55.00000000000001 in floats: a float ceil would give 56
    (90, 0.7, 63),  # 62.99999999999999 in floats
    (3, 0.5, 2),  # 1.5
    (100, 0.29, 29),  # 28.999999999999996 in floats
    (10, 0.1, 1),
    (4, 1.0, 4),  # never anneal
    (4, 0.0, 0),  # never prune
]


@pytest.mark.parametrize("num_passes,delta,first_full", ANNEALING_CASES)
def test_infobatch_annealing_passes_are_full_with_weight_one(num_passes, delta, first_full):
    pruner = InfoBatch(2000, num_passes, seed=1, prune_ratio=0.5, delta=delta)
    record_scores(pruner, np.arange(2000), np.linspace(0.0, 1.0, 2000, dtype=np.float32))
    for pass_index in range(num_passes):
        pruner.plan(pass_index)
        weights = pruner.weights(np.arange(2000))
        if pass_index >= first_full:
            np.testing.assert_array_equal(weights, np.ones(2000, np.float32), err_msg=f"pass {pass_index}")
            assert pruner.stats()["annealing"]
        else:
            # ~1000 below-mean samples each skipped with probability 0.5: never none
            assert np.count_nonzero(weights == 0) > 0, f"pass {pass_index} should be pruned"


def test_pruned_so_far_adds_passes_and_replanning_a_pass_replaces_it():
    pruner = trained("infobatch")
    first = pruner.stats()["skipped_this_pass"]
    pruner.plan(12)  # the same pass again, e.g. after a resume
    assert pruner.stats()["pruned_so_far"] == first
    pruner.plan(13)
    assert pruner.stats()["pruned_so_far"] == first + pruner.stats()["skipped_this_pass"]


# ----------------------------------------------------------------------------------------------
# Unbiasedness
# ----------------------------------------------------------------------------------------------


def least_squares_gradients(num_samples: int = 400, dim: int = 3):
    """Per-sample gradients g_i = (x_i . theta - y_i) x_i and losses of a least-squares problem."""
    rng = np.random.default_rng(21)
    features = rng.normal(size=(num_samples, dim))
    targets = features @ np.array([1.0, -2.0, 0.5]) + rng.normal(scale=0.7, size=num_samples)
    theta = np.zeros(dim)
    residuals = features @ theta - targets
    return residuals[:, None] * features, 0.5 * residuals**2


def scored_pruner(name: str, losses: np.ndarray, num_passes: int) -> Pruner:
    """A pruner whose scores are fixed: two visits (TED needs two), then plans only."""
    pruner = build_pruner(name, len(losses), num_passes, seed=9)
    ids = np.arange(len(losses))
    pruner.update(ids, losses.astype(np.float32))
    pruner.on_step(1.0)
    # a loss drop that varies per sample, so TED's pruned set is a proper subset
    pruner.update(ids, (losses * np.linspace(0.2, 1.0, len(losses))).astype(np.float32))
    return pruner


@pytest.mark.parametrize("name", ["random", "infobatch", "ted", "importance"])
def test_pruners_keep_the_expected_gradient(name):
    gradients, losses = least_squares_gradients()
    full_gradient = gradients.sum(axis=0)
    num_passes = 2000
    pruner = scored_pruner(name, losses, num_passes=10 * num_passes)
    ids = np.arange(len(losses))
    estimates, unweighted = [], []
    for pass_index in range(num_passes // 2, num_passes // 2 + num_passes):  # past TED's ramp, before annealing
        pruner.plan(pass_index)
        weights = pruner.weights(ids).astype(np.float64)
        estimates.append(weights @ gradients)
        unweighted.append((weights > 0) @ gradients)  # pruning without rescaling: biased
    estimates, unweighted = np.array(estimates), np.array(unweighted)
    assert pruner.stats()["kept_fraction"] < 0.9  # it did prune
    standard_error = estimates.std(axis=0, ddof=1) / np.sqrt(num_passes)
    assert np.all(np.abs(estimates.mean(axis=0) - full_gradient) < 4 * standard_error)
    # the same check has the power to see the bias of dropping samples without reweighting
    unweighted_error = unweighted.std(axis=0, ddof=1) / np.sqrt(num_passes)
    assert np.any(np.abs(unweighted.mean(axis=0) - full_gradient) > 4 * unweighted_error)


# ----------------------------------------------------------------------------------------------
# Determinism and state
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRUNERS))
def test_weights_do_not_depend_on_order_or_chunking_of_ids(name):
    pruner = trained(name)
    ids = np.arange(5000)
    everything = pruner.weights(ids)
    order = np.random.default_rng(1).permutation(5000)
    np.testing.assert_array_equal(pruner.weights(order), everything[order])
    chunks = np.array_split(order, [1, 2, 300, 301, 2999])
    np.testing.assert_array_equal(np.concatenate([pruner.weights(chunk) for chunk in chunks]), everything[order])
    np.testing.assert_array_equal(pruner.weights(torch.from_numpy(order)), everything[order])


@pytest.mark.parametrize("name", sorted(PRUNERS))
def test_two_instances_with_equal_state_decide_the_same(name):
    first, second = trained(name), trained(name)
    np.testing.assert_array_equal(first.weights(np.arange(5000)), second.weights(np.arange(5000)))
    assert first.stats() == second.stats()


def only_tensors_numbers_and_strings(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(key, str) and only_tensors_numbers_and_strings(item) for key, item in value.items())
    return value is None or isinstance(value, (torch.Tensor, np.ndarray, bool, int, float, str))


@pytest.mark.parametrize("name", sorted(PRUNERS))
def test_state_dict_round_trip_through_torch_save_gives_identical_plans(name):
    original = trained(name)
    state = original.state_dict()
    assert only_tensors_numbers_and_strings(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored = build_pruner(name, 5000, 40, seed=3)
    restored.load_state_dict(torch.load(buffer, weights_only=True))

    ids = np.arange(5000)
    assert restored.pass_index == original.pass_index == 12
    np.testing.assert_array_equal(restored.weights(ids), original.weights(ids))
    assert restored.stats() == original.stats()
    # and they keep agreeing: same updates, next pass
    rng = np.random.default_rng(5)
    losses = rng.exponential(1.0, 5000).astype(np.float32)
    for pruner in (original, restored):
        pruner.on_step(0.25)
        record_scores(pruner, ids, losses)
        pruner.plan(13)
    np.testing.assert_array_equal(restored.weights(ids), original.weights(ids))
    assert restored.stats() == original.stats()


@pytest.mark.parametrize("name", sorted(PRUNERS))
def test_state_takes_at_most_16_bytes_per_sample_with_the_frozen_plan(name):
    pruner = trained(name)
    state = pruner.state_dict()
    per_sample = [tensor for tensor in state["tables"].values()]
    for plan_table in ("candidate_bits", "keep_probs"):
        if state["plan"][plan_table] is not None:
            per_sample.append(state["plan"][plan_table])
    assert all(tensor.shape in ((5000,), (625,)) for tensor in per_sample)  # per sample, or a bit per sample
    assert sum(tensor.numel() * tensor.element_size() for tensor in per_sample) / 5000 <= 16


def test_loaded_state_is_a_copy():
    original = trained("infobatch")
    restored = build_pruner("infobatch", 5000, 40, seed=3)
    restored.load_state_dict(original.state_dict())
    restored.update(np.array([0]), np.array([123.0], np.float32))
    assert original.tables()["score"][0] != 123.0


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("seed", dict(seed=4)),
        ("hparams", dict(seed=3, prune_ratio=0.4)),
        ("num_samples", dict(seed=3, num_samples=4999)),
    ],
)
def test_loading_a_state_saved_with_another_config_names_the_field(field, kwargs):
    state = trained("infobatch").state_dict()
    num_samples = kwargs.pop("num_samples", 5000)
    with pytest.raises(ValueError, match=field):
        InfoBatch(num_samples, 40, **kwargs).load_state_dict(state)


def test_weights_before_plan_and_out_of_range_ids_are_errors():
    pruner = InfoBatch(10, 5)
    with pytest.raises(RuntimeError, match="plan"):
        pruner.weights(np.arange(3))
    pruner.plan(0)
    with pytest.raises(ValueError, match="outside"):
        pruner.weights(np.array([10]))
    with pytest.raises(ValueError, match="outside"):
        pruner.update(np.array([10]), np.array([1.0]))


# ----------------------------------------------------------------------------------------------
# Large ids, low precision, non-finite losses
# ----------------------------------------------------------------------------------------------

HUGE = 5_000_000_100


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.parametrize("cls", [InfoBatch, TED, Importance])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_losses_at_ids_near_5e9_in_half_precision_are_recorded_at_the_right_id(cls, dtype):
    before = resident_bytes()
    try:
        pruner = cls(HUGE, 10)
    except MemoryError:  # np.zeros needs lazy (overcommitted) pages for a 5e9-entry table
        pytest.skip("this machine refuses a lazily allocated 5e9-entry table")
    ids = torch.tensor([5_000_000_000, 5_000_000_001, 5_000_000_099, 4_999_999_999 - 2**31], dtype=torch.int64)
    losses = torch.tensor([1.5, 0.333, 7.0, 2.0], dtype=dtype)  # 0.333 is inexact in both dtypes
    pruner.update(ids, losses)
    tables, at = pruner.tables(), ids.numpy()
    expected = losses.float().numpy()
    if cls in (InfoBatch, Importance):
        np.testing.assert_array_equal(tables["score"][at], expected)
        assert tables["seen"][at].all() and not tables["seen"][5_000_000_002]
    else:
        np.testing.assert_array_equal(tables["last_loss"][at], expected)
        assert (tables["visits"][at] == 1).all() and tables["visits"][5_000_000_002] == 0
    assert resident_bytes() - before < 64 << 20  # untouched pages of the tables cost nothing


def test_a_frozen_plan_decides_for_ids_near_5e9():
    plan = FrozenPlan(seed=0, pass_index=3, num_samples=HUGE, keep_prob=0.5, candidates=None)  # Random's plan
    ids = np.arange(5_000_000_000, 5_000_000_100)
    weights = plan.weights(ids)
    assert set(np.unique(weights).tolist()) == {0.0, 2.0}
    assert scipy.stats.binomtest(int(np.count_nonzero(weights)), 100, 0.5).pvalue > ALPHA
    np.testing.assert_array_equal(plan.weights(ids[::-1]), weights[::-1])


def test_nonfinite_losses_are_not_recorded_and_are_counted():
    pruner = InfoBatch(6, 10)
    pruner.update(np.array([0, 1, 2, 3]), np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    nan, inf = float("nan"), float("inf")
    losses = torch.tensor([nan, inf, -inf, nan, 9.0, nan], dtype=torch.bfloat16)
    pruner.update(torch.tensor([0, 1, 2, 4, 5, -1]), losses)
    tables = pruner.tables()
    np.testing.assert_array_equal(tables["score"][:4], [1.0, 2.0, 3.0, 4.0])  # earlier losses survive
    np.testing.assert_array_equal(tables["seen"].astype(bool), [True, True, True, True, False, True])
    assert pruner.stats()["nonfinite_losses"] == 4  # the padding id -1 is not a sample
    pruner.plan(1)
    assert pruner.stats()["threshold"] == pytest.approx((1 + 2 + 3 + 4 + 9) / 5)
    assert pruner.stats()["below_threshold"] == 3


def test_padding_ids_are_ignored_and_repeated_ids_keep_their_last_loss():
    pruner = InfoBatch(4, 10)
    pruner.update(np.array([1, -1, 1, 2, -7]), np.array([5.0, 6.0, 7.0, 8.0, 9.0], np.float32))
    tables = pruner.tables()
    np.testing.assert_array_equal(tables["score"], [0.0, 7.0, 8.0, 0.0])
    np.testing.assert_array_equal(tables["seen"].astype(bool), [False, True, True, False])


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


def test_build_pruner_by_config_name():
    assert isinstance(build_pruner("full", 10, 2), Full)
    pruner = build_pruner("InfoBatch", 10, 2, seed=4, prune_ratio=0.25, delta=0.5)
    assert isinstance(pruner, InfoBatch) and pruner.hparams == {
        "prune_ratio": 0.25,
        "delta": 0.5,
        "rescale": True,
        "momentum": 0.0,
    }
    assert pruner.seed == 4 and pruner.first_full_pass == 1


def test_unknown_pruner_name_lists_the_accepted_names():
    with pytest.raises(ValueError, match="accepted names: dedup, full, importance, infobatch, random, ted"):
        build_pruner("infobach", 10, 2)


def test_unknown_hyper_parameter_lists_the_accepted_ones():
    with pytest.raises(
        ValueError, match=r"no hyper-parameter 'prune_rate'; accepted: prune_ratio, delta, rescale, momentum"
    ):
        build_pruner("infobatch", 10, 2, prune_rate=0.5)
    with pytest.raises(ValueError, match="accepted: none"):
        build_pruner("full", 10, 2, keep=0.5)


@pytest.mark.parametrize(
    "name,hparams,field",
    [
        ("infobatch", dict(prune_ratio=1.0), "prune_ratio"),
        ("infobatch", dict(delta=1.5), "delta"),
        ("random", dict(keep=0.0), "keep"),
        ("ted", dict(explore=0.0), "explore"),
        ("ted", dict(target=float("nan")), "target"),
        ("importance", dict(p_min=0.0), "p_min"),
        ("importance", dict(keep=1.5), "keep"),
    ],
)
def test_out_of_range_hyper_parameter_names_field_and_range(name, hparams, field):
    with pytest.raises(ValueError, match=rf"{name}: {field} must be in"):
        build_pruner(name, 10, 2, **hparams)


def test_a_flag_hyper_parameter_must_be_true_or_false():
    with pytest.raises(ValueError, match="infobatch: rescale must be true or false, got 'no'"):
        build_pruner("infobatch", 10, 2, rescale="no")


# ----------------------------------------------------------------------------------------------
# rescale: false
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, hparams", [("infobatch", {}), ("random", {"keep": 0.6}), ("ted", {}), ("importance", {})]
)
def test_without_rescaling_the_same_samples_are_kept_at_weight_one(name, hparams):
    rescaled, plain = trained(name, **hparams), trained(name, rescale=False, **hparams)
    ids = np.arange(5000)
    with_weights, without = rescaled.weights(ids), plain.weights(ids)
    np.testing.assert_array_equal(with_weights > 0, without > 0)  # the same coins decide
    assert set(np.unique(without).tolist()) <= {0.0, 1.0} and (with_weights > 1).any()
    assert plain.stats()["kept_fraction"] == rescaled.stats()["kept_fraction"]


# ----------------------------------------------------------------------------------------------
# importance
# ----------------------------------------------------------------------------------------------


def importance_on_fixed_scores(num_samples: int = 20_000, unseen: int = 0, **hparams) -> tuple[Importance, np.ndarray]:
    pruner = Importance(num_samples, 40, seed=5, **hparams)
    scores = np.random.default_rng(2).exponential(1.0, num_samples).astype(np.float32)
    record_scores(pruner, np.arange(unseen, num_samples), scores[unseen:])
    pruner.plan(3)
    return pruner, scores


@pytest.mark.parametrize("keep, alpha", [(0.5, 1.0), (0.7, 0.5), (0.3, 2.0)])
def test_importance_meets_the_target_kept_fraction(keep, alpha):
    pruner, _ = importance_on_fixed_scores(keep=keep, alpha=alpha, p_min=0.05)
    p, _ = pruner.keep_probabilities()
    assert p.mean(dtype=np.float64) == pytest.approx(keep, abs=1e-5)  # c solves the target in expectation
    kept = int(np.count_nonzero(pruner.weights(np.arange(20_000))))
    assert scipy.stats.binomtest(kept, 20_000, keep).pvalue > ALPHA or abs(kept / 20_000 - keep) < 0.01
    assert pruner.stats()["kept_this_pass"] == kept


def test_importance_keeps_high_scores_more_and_weights_them_one_over_p():
    pruner, scores = importance_on_fixed_scores(keep=0.5, alpha=1.0, p_min=0.1)
    p, scale = pruner.keep_probabilities()
    order = np.argsort(scores)
    assert np.all(np.diff(p[order]) >= 0)  # monotone in the score
    assert p.min() == pytest.approx(0.1) and p.max() == 1.0  # clipped at p_min and at 1
    inside = (p > 0.1) & (p < 1.0)
    np.testing.assert_allclose(p[inside], scale * scores[inside] / scores.mean(), rtol=1e-5)
    weights = pruner.weights(np.arange(20_000))
    kept = weights > 0
    np.testing.assert_allclose(weights[kept], 1.0 / p[kept], rtol=1e-6)


def test_importance_with_alpha_zero_is_random_pruning_and_unseen_samples_are_kept():
    pruner, _ = importance_on_fixed_scores(unseen=2000, keep=0.7, alpha=0.0, p_min=0.05)
    p, _ = pruner.keep_probabilities()
    np.testing.assert_array_equal(p[:2000], 1.0)  # unseen: always kept, weight 1
    np.testing.assert_array_equal(pruner.weights(np.arange(2000)), 1.0)
    expected = (0.7 * 20_000 - 2000) / 18_000
    np.testing.assert_allclose(p[2000:], expected, rtol=1e-5)  # one probability for every seen sample


def test_importance_keeps_p_min_when_the_target_is_below_it_and_anneals():
    pruner, _ = importance_on_fixed_scores(keep=0.05, p_min=0.2, delta=0.5)
    assert pruner.stats()["expected_keep"] == pytest.approx(0.2, abs=1e-6)
    pruner.plan(20)  # ceil(40 * 0.5): full data from here
    np.testing.assert_array_equal(pruner.weights(np.arange(20_000)), 1.0)
    assert pruner.stats()["annealing"]


@pytest.mark.parametrize("cls", [InfoBatch, Importance])
def test_momentum_averages_a_sample_s_score_over_its_visits(cls):
    plain, smooth = cls(4, 10), cls(4, 10, momentum=0.75)
    for pruner in (plain, smooth):
        pruner.update(np.array([0, 1]), np.array([4.0, 2.0], np.float32))
        pruner.update(np.array([0, 2]), np.array([8.0, 6.0], np.float32))
    np.testing.assert_array_equal(plain.tables()["score"][:3], [8.0, 2.0, 6.0])  # the last loss
    np.testing.assert_allclose(smooth.tables()["score"][:3], [0.75 * 4 + 0.25 * 8, 2.0, 6.0])  # first visit: as is
    with pytest.raises(ValueError, match=rf"{cls.name}: momentum must be in \[0.0, 1.0\)"):
        cls(4, 10, momentum=1.0)
