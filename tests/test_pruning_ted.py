"""TED: what its score measures, whom it prunes first, its schedule and
its exploration slice. Binomial checks at alpha = 1e-3, counts within 4 standard deviations.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from prunepipe.pruning import TED

ALPHA = 1e-3


def test_score_is_the_loss_drop_per_unit_of_learning_rate_mass_smoothed_over_visits():
    ted = TED(3, 10, momentum=0.5)
    sample = np.array([0])
    ted.update(sample, np.array([2.0], np.float32))
    ted.on_step(0.25)
    ted.on_step(0.75)  # learning-rate mass 1.0 since the first visit
    ted.update(sample, np.array([1.5], np.float32))
    assert ted.tables()["score"][sample][0] == pytest.approx(0.5)  # (2.0 - 1.5) / 1.0: the first score is the rate
    ted.on_step(0.5)
    ted.update(sample, np.array([1.5], np.float32))  # no drop over a mass of 0.5
    assert ted.tables()["score"][sample][0] == pytest.approx(0.5 * 0.5 + 0.5 * 0.0)
    ted.on_step(2.0)
    ted.update(sample, np.array([2.5], np.float32))  # the loss rose: forgetting, a negative rate
    assert ted.tables()["score"][sample][0] == pytest.approx(0.5 * 0.25 + 0.5 * (-1.0 / 2.0))


def test_a_visit_without_an_optimizer_step_in_between_measures_nothing():
    ted = TED(2, 10)
    ted.on_step(0.1)
    ted.update(np.array([0]), np.array([2.0], np.float32))
    ted.update(np.array([0]), np.array([1.0], np.float32))  # same learning-rate mass: no rate to take
    tables = ted.tables()
    assert tables["visits"][0] == 1 and tables["last_loss"][0] == 2.0 and tables["score"][0] == 0.0


def test_a_visit_too_soon_after_the_last_measurement_keeps_the_anchor():
    ted = TED(2, 10, min_span=0.5)
    sample = np.array([0])
    ted.plan(0)
    for _ in range(10):
        ted.on_step(0.1)  # pass 0 has a learning-rate mass of 1.0
    ted.update(sample, np.array([3.0], np.float32))
    ted.plan(1)
    ted.on_step(0.1)
    ted.update(sample, np.array([2.0], np.float32))  # 0.1 after the first visit: below 0.5 * 1.0
    assert ted.tables()["visits"][sample][0] == 1 and ted.tables()["last_loss"][sample][0] == 3.0
    for _ in range(5):
        ted.on_step(0.1)
    ted.update(sample, np.array([2.4], np.float32))  # 0.6 after the anchor: measured from it
    assert ted.tables()["visits"][sample][0] == 2
    assert ted.tables()["score"][sample][0] == pytest.approx((3.0 - 2.4) / 0.6, rel=1e-5)


def test_samples_without_two_visits_are_never_pruned():
    ted = TED(300, 10, ramp=0.0, target=0.5)
    ids = np.arange(300)
    ted.update(ids[:200], np.full(200, 3.0, np.float32))  # 100..199 seen once, 200..299 never
    ted.on_step(1.0)
    ted.update(ids[:100], np.linspace(0.0, 2.0, 100, dtype=np.float32))  # 0..99 scored
    ted.plan(1)
    weights = ted.weights(ids)
    assert np.all(weights[100:] == 1.0)
    assert ted.stats()["pruned_set"] == 100 and ted.stats()["scored_samples"] == 100  # capped by what is scored


def test_recording_losses_without_reporting_learning_rates_is_an_error():
    ted = TED(10, 10)
    ted.update(np.arange(10), np.ones(10, np.float32))
    with pytest.raises(RuntimeError, match=r"on_step\(lr\)"):
        ted.plan(5)


@pytest.mark.parametrize("num_passes,ramp,delta", [(20, 0.25, 0.875), (7, 0.5, 0.9), (10, 0.0, 1.0)])
def test_kept_fraction_target_ramps_linearly_from_one_to_target_then_anneals(num_passes, ramp, delta):
    ted = TED(10, num_passes, target=0.6, ramp=ramp, delta=delta)
    for pass_index in range(num_passes + 2):
        if pass_index >= math.ceil(round(num_passes * delta, 9)):
            expected = 1.0
        elif ramp == 0:
            expected = 0.6
        else:
            expected = 1.0 - 0.4 * min(1.0, pass_index / (ramp * num_passes))
        assert ted.kept_fraction_target(pass_index) == pytest.approx(expected), f"pass {pass_index}"


def test_equal_scores_are_broken_by_a_coin_not_by_id():
    ted = TED(4000, 10, ramp=0.0, target=0.8, explore=0.5)
    ids = np.arange(4000)
    ted.update(ids, np.ones(4000, np.float32))
    ted.on_step(1.0)
    ted.update(ids, np.ones(4000, np.float32))  # every score is exactly 0
    ted.plan(1)
    pruned_set = np.flatnonzero(ted.weights(ids) != 1.0)
    # 1600 of 4000 chosen uniformly: the mean id is 2000 +- 4 * 1155 / sqrt(1600) * sqrt(1 - 0.4)
    assert len(pruned_set) == 1600
    assert abs(pruned_set.mean() - 1999.5) < 4 * 1154.7 / math.sqrt(1600) * math.sqrt(0.6)


# ----------------------------------------------------------------------------------------------
# A synthetic run: group A is learned through the others, group B is not
# ----------------------------------------------------------------------------------------------

NUM_SAMPLES, NUM_EPOCHS, TARGET, RAMP, EXPLORE, DELTA = 2000, 20, 0.7, 0.25, 0.1, 0.875
FIRST_FULL_PASS = 18  # ceil(20 * 0.875) = ceil(17.5)


def simulate_internal_generalization():
    """Train-loop stand-in: each pass visits the kept samples in batches of 50 at lr 0.01. Group A's
    loss falls 0.1 per unit of learning-rate mass whether or not it is visited; group B's stays put.
    Returns the pruner, the group mask and, per pass: weights, stats, last losses before and after."""
    ted = TED(NUM_SAMPLES, NUM_EPOCHS, seed=1, target=TARGET, ramp=RAMP, explore=EXPLORE, delta=DELTA)
    rng = np.random.default_rng(0)
    ids = np.arange(NUM_SAMPLES)
    group_a = ids % 2 == 0
    base_loss = rng.uniform(2.0, 3.0, NUM_SAMPLES)
    lr, lr_mass, passes = 0.01, 0.0, []
    for pass_index in range(NUM_EPOCHS):
        ted.plan(pass_index)
        weights, stats = ted.weights(ids), ted.stats()
        last_loss_before = ted.tables()["last_loss"][ids]  # indexed by an array: a copy
        visit_order = rng.permutation(np.flatnonzero(weights > 0))
        for batch in np.array_split(visit_order, max(1, len(visit_order) // 50)):
            losses = base_loss[batch] - 0.1 * lr_mass * group_a[batch] + rng.normal(0.0, 0.003, len(batch))
            ted.update(batch, losses.astype(np.float32))
            ted.on_step(lr)
            lr_mass += lr
        passes.append((weights, stats, last_loss_before, ted.tables()["last_loss"][ids]))
    return ted, group_a, passes


@pytest.fixture(scope="module")
def run():
    return simulate_internal_generalization()


def test_ted_prunes_the_group_learned_through_the_others_first(run):
    _, group_a, passes = run
    for pass_index, (weights, stats, _, _) in enumerate(passes):
        pruned_set = weights != 1.0
        assert not np.any(pruned_set & ~group_a), f"pass {pass_index} pruned a sample of group B"
        if 2 <= pass_index < FIRST_FULL_PASS:
            assert stats["skipped_this_pass"] > 0, f"pass {pass_index} should prune"


def test_kept_fraction_follows_the_schedule(run):
    _, _, passes = run
    for pass_index, (weights, stats, _, _) in enumerate(passes):
        kept = int(np.count_nonzero(weights))
        if pass_index < 2 or pass_index >= FIRST_FULL_PASS:
            # nothing is scored before two visits (passes 0, 1); full data when annealing
            assert kept == NUM_SAMPLES, f"pass {pass_index}"
            continue
        target = 1.0 - (1.0 - TARGET) * min(1.0, pass_index / (RAMP * NUM_EPOCHS))
        assert stats["kept_fraction_target"] == pytest.approx(target)
        pruned_set = int(np.count_nonzero(weights != 1.0))
        spread = math.sqrt(pruned_set * EXPLORE * (1 - EXPLORE))  # kept count is binomial in the pruned set
        assert abs(kept - target * NUM_SAMPLES) <= 4 * spread + 1, f"pass {pass_index}: kept {kept}"


def test_pruned_samples_come_back_through_the_exploration_slice_and_are_remeasured(run):
    _, _, passes = run
    readmitted_total = pruned_set_total = 0
    for pass_index, (weights, _, last_loss_before, last_loss_after) in list(enumerate(passes))[2:FIRST_FULL_PASS]:
        pruned_set = weights != 1.0
        readmitted = pruned_set & (weights > 0)
        assert np.all(weights[readmitted] == np.float32(1 / EXPLORE))
        # re-measured: a whole skipped pass of learning-rate mass lies behind a sample skipped last pass
        returning = readmitted & (passes[pass_index - 1][0] == 0)
        assert np.all(last_loss_after[returning] != last_loss_before[returning])
        skipped = weights == 0
        np.testing.assert_array_equal(last_loss_after[skipped], last_loss_before[skipped])
        readmitted_total += int(readmitted.sum())
        pruned_set_total += int(pruned_set.sum())
    assert scipy.stats.binomtest(readmitted_total, pruned_set_total, EXPLORE).pvalue > ALPHA
    # and a sample skipped in one pass is visited again in a later one
    skipped_at_5 = passes[5][0] == 0
    visited_later = np.any([weights[skipped_at_5] > 0 for weights, *_ in passes[6:FIRST_FULL_PASS]], axis=0)
    # 12 passes, each re-admitting 10% of the pruned set: most come back
    assert visited_later.mean() > 0.5
