"""Compute saved at equal quality (pipelines/report/frontier.py) on synthetic frontiers with a known
answer: a run on the frontier saves 0, a run at 70% compute with Full's 100% quality saves 30%,
beyond the ends the saving is a bound, a frontier that gets worse is read through its envelope, and
the t interval covers the true mean saving at its nominal rate (the bootstrap does not, at few seeds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prunepipe.pipelines.report.frontier import (
    AT_LEAST,
    AT_MOST,
    EXACT,
    IsoQuality,
    fit_frontier,
    iso_quality,
    paired_difference,
    saving_summary,
    savings_over_seeds,
    seeds_needed,
    summarise_savings,
    t_interval,
)
from prunepipe.tools.benchmarks.interval_coverage import coverage

# Full of one seed: masked MSE (lower is better) at 50..100% of the schedule, improving throughout
FRONTIER = [(0.5, 0.30), (0.6, 0.27), (0.7, 0.25), (0.8, 0.235), (0.9, 0.225), (1.0, 0.22)]


def test_a_run_on_the_frontier_saves_nothing():
    for compute, value in FRONTIER[1:]:
        found = iso_quality(FRONTIER, compute, value, lower_is_better=True)
        assert found.kind == EXACT and found.saving == pytest.approx(0.0, abs=1e-12)
    # between two points: on the line joining them
    found = iso_quality(FRONTIER, 0.75, (0.25 + 0.235) / 2, lower_is_better=True)
    assert found.saving == pytest.approx(0.0, abs=1e-12) and found.monotone


def test_seventy_percent_compute_at_full_quality_saves_thirty_percent():
    found = iso_quality(FRONTIER, 0.7, 0.22, lower_is_better=True)
    assert (found.kind, found.iso_compute) == (EXACT, pytest.approx(1.0))
    assert found.saving == pytest.approx(0.30)
    # a higher-is-better metric the same way (PSNR)
    psnr = [(c, -v) for c, v in FRONTIER]
    assert iso_quality(psnr, 0.7, -0.22, lower_is_better=False).saving == pytest.approx(0.30)
    # halfway between 80% and 90% of the passes
    assert iso_quality(FRONTIER, 0.6, 0.23, lower_is_better=True).saving == pytest.approx(1 - 0.6 / 0.85)


def test_beyond_the_ends_the_saving_is_a_bound_never_extrapolated():
    better = iso_quality(FRONTIER, 0.7, 0.20, lower_is_better=True)  # better than Full at 100%
    assert (better.kind, better.iso_compute, better.saving) == (AT_LEAST, 1.0, pytest.approx(0.30))
    worse = iso_quality(FRONTIER, 0.7, 0.35, lower_is_better=True)  # worse than the cheapest Full
    assert (worse.kind, worse.iso_compute, worse.saving) == (AT_MOST, 0.5, pytest.approx(1 - 0.7 / 0.5))
    summary = summarise_savings([better, iso_quality(FRONTIER, 0.7, 0.19, True), better])
    assert summary["bound"] == AT_LEAST and summary["bounded"] == 3
    assert summary["verdict"].startswith("saves at least 30%") and "extend the frontier up" in summary["verdict"]
    mixed = summarise_savings([better, worse])
    assert mixed["bound"] == "mixed" and mixed["verdict"].startswith("not resolved")
    # a bound beside measured seeds is listed beside their interval, never averaged into it
    measured = [iso_quality(FRONTIER, 0.7, value, True) for value in (0.225, 0.22, 0.23)]
    beside = summarise_savings([*measured, better])
    assert beside["n"] == 3 and beside["bounded"] == 1
    assert beside["mean"] == pytest.approx(np.mean([m.saving for m in measured]))
    assert "; >=30% (bounds)" in beside["verdict"]
    # measured seeds that save, beside seeds no better than the cheapest Full: the interval leaves the
    # latter out, so it cannot carry the verdict alone
    saving = [iso_quality(FRONTIER, 0.7, value, True) for value in (0.23, 0.228, 0.232)]
    against = summarise_savings([*saving, worse, worse])
    assert against["low"] > 0 and against["verdict"].startswith("not resolved: the measured seeds save")
    assert "extend the frontier down" in against["verdict"]


def test_when_every_seed_is_a_bound_no_interval_is_printed():
    # the case that read "saves at least 38% [38%, 38%]": three identical lower bounds
    bounds = [iso_quality(FRONTIER, 0.62, 0.20 - 0.001 * seed, True) for seed in range(3)]
    assert {b.kind for b in bounds} == {AT_LEAST}
    summary = summarise_savings(bounds)
    assert summary["n"] == 0 and math.isnan(summary["low"]) and math.isnan(summary["high"])
    assert "[" not in summary["verdict"] and "no interval" in summary["verdict"]
    assert summary["verdict"].startswith("saves at least 38%")
    upper = summarise_savings([iso_quality(FRONTIER, 0.7, 0.31, True) for _ in range(3)])
    assert "[" not in upper["verdict"] and "extend the frontier down" in upper["verdict"]


def test_a_frontier_that_gets_worse_is_read_through_the_best_full_at_or_below_each_compute():
    # on redundant data judged on clean data, training longer can fit the copies: 90-100% worse than 80%
    bent = [(0.5, 0.30), (0.6, 0.27), (0.7, 0.25), (0.8, 0.235), (0.9, 0.24), (1.0, 0.245)]
    found = iso_quality(bent, 0.7, 0.238, lower_is_better=True)
    assert not found.monotone and found.kind == EXACT
    assert found.iso_compute == pytest.approx(0.7 + 0.1 * (0.25 - 0.238) / (0.25 - 0.235))
    # as good as Full at 100%: the best Full reached that at 80% already, not at 100%
    assert iso_quality(bent, 0.7, 0.245, True).iso_compute < 0.8
    # two runs at one compute count as their best
    assert iso_quality([(0.5, 0.3), (1.0, 0.25), (1.0, 0.2)], 0.7, 0.2, True).saving == pytest.approx(0.3)
    with pytest.raises(ValueError, match="not finite"):
        iso_quality([(0.5, float("nan"))], 0.7, 0.2, True)


def test_verdict_words_follow_the_interval():
    def seeds(*savings):
        return [IsoQuality(0.7, 0.7 / (1 - s), s, EXACT, True, 6) for s in savings]

    saves = summarise_savings(seeds(0.30, 0.28, 0.32, 0.29, 0.31))
    assert saves["low"] > 0 and saves["verdict"].startswith("saves 30% [")
    assert summarise_savings(seeds(0.1, -0.1, 0.05, -0.02))["verdict"].startswith("no saving detected (CI includes 0)")
    assert summarise_savings(seeds(-0.2, -0.25, -0.22))["verdict"].startswith("costs more than training less")
    one = summarise_savings(seeds(0.3))
    assert math.isnan(one["low"]) and "1 measured seed, no interval" in one["verdict"]
    # one measured seed that costs compute, or sits beside a bound the other way, shows no saving
    assert summarise_savings(seeds(-0.007))["verdict"].startswith("no saving shown: -0.7% (1 measured seed")
    upper = iso_quality(FRONTIER, 0.7, 0.35, lower_is_better=True)
    assert summarise_savings([*seeds(0.05), upper])["verdict"].startswith("no saving shown: 5.0%")


def test_paired_differences_use_only_the_seeds_both_runs_have():
    arm = {0: 1.0, 1: 2.0, 2: 3.0, 3: 9.0}
    full = {0: 1.5, 1: 2.4, 2: 3.6}  # seed 3 has no Full: left out, not guessed
    found = paired_difference(arm, full, lower_is_better=True)
    assert found["seeds"] == [0, 1, 2] and found["differences"] == pytest.approx([-0.5, -0.4, -0.6])
    assert found["reading"] == "better"  # paired: the seed effect (1, 2, 3) cancels
    assert paired_difference(arm, full, lower_is_better=False)["reading"] == "worse"
    mean, low, high = t_interval([-0.5, -0.4, -0.6])
    assert (found["mean"], found["low"], found["high"]) == pytest.approx((mean, low, high))


def test_seeds_needed_is_the_paired_t_tests_sample_size():
    # textbook sizes of a two-sided paired t test at 5% with 80% power: effect 1 -> 10 pairs, 0.5 -> 34
    assert seeds_needed(1.0, 1.0) == 10
    assert seeds_needed(-0.5, 1.0) == 34
    assert seeds_needed(0.0, 1.0) is None and seeds_needed(1e-6, 1.0) is None
    assert seeds_needed(1.0, 0.0) == 2


def test_the_t_interval_covers_the_true_saving_at_its_nominal_rate():
    found = coverage(seeds=5, experiments=600, rng_seed=3)
    assert 0.92 <= found["t"] <= 0.98, found
    # why the headline is the t interval: the percentile bootstrap is too narrow at 5 seeds
    assert found["bootstrap"] < found["t"] - 0.05, found


def test_the_frontier_is_one_shape_plus_a_level_per_seed():
    shape = {0.5: 0.30, 0.7: 0.25, 1.0: 0.22}
    levels = {0: 0.0, 1: 0.03, 2: -0.03}
    # seed 2 has no run at 70%: its level still comes from the lengths it shares
    frontiers = {s: [(c, v + u) for c, v in shape.items() if not (s == 2 and c == 0.7)] for s, u in levels.items()}
    model = fit_frontier(frontiers, lower_is_better=True)
    assert model.shape == pytest.approx(list(shape.values())) and model.monotone and not model.own
    assert [model.levels[s] for s in levels] == pytest.approx(list(levels.values()))
    assert model.curve(2)[1] == (0.7, pytest.approx(0.25 - 0.03))
    # each seed at 70% compute with its own seed's quality at 100%: 30% saved on every seed
    found = savings_over_seeds(frontiers, {s: (0.7, 0.22 + u) for s, u in levels.items()}, True)
    assert [a.saving for a in found.values()] == pytest.approx([0.3, 0.3, 0.3])
    assert [a.points for a in found.values()] == [3, 3, 2]
    # a seed that shares no length with the others keeps its own points
    alone = fit_frontier({**frontiers, 9: [(0.6, 0.5), (0.9, 0.4)]}, True)
    assert alone.own == {9: [(0.6, 0.5), (0.9, 0.4)]} and alone.curve(9) == [(0.6, 0.5), (0.9, 0.4)]


def test_a_shape_that_gets_worse_is_read_through_its_running_best_not_averaged_flat():
    # the seeds' mean at 90% is better than at 100%: Full reaches its best at 90%, and a run is read
    # against the best Full at or below its compute; the fitted shape, not the luckiest single run
    frontiers = {s: [(0.5, 0.30 + u), (0.9, 0.20 + u), (1.0, 0.22 + u)] for s, u in ((0, 0.0), (1, 0.01))}
    model = fit_frontier(frontiers, lower_is_better=True)
    assert not model.monotone and model.shape == pytest.approx([0.305, 0.205, 0.225])
    assert model.best_compute == 0.9
    [answer] = savings_over_seeds(frontiers, {0: (0.7, 0.205)}, True).values()
    assert answer.kind == EXACT and not answer.monotone  # Full at 90% is better than 0.205: it is reached
    assert answer.iso_compute == pytest.approx(0.5 + 0.4 * (0.30 - 0.205) / (0.30 - 0.20))
    psnr = fit_frontier({s: [(c, -v) for c, v in p] for s, p in frontiers.items()}, lower_is_better=False)
    assert psnr.shape == pytest.approx([-0.305, -0.205, -0.225]) and psnr.best_compute == 0.9


def longer_hurts_frontiers() -> dict[int, list[tuple[float, float]]]:
    """Full at 50, 75, 100 and 125% of the passes on redundant data judged on a clean held-out set:
    masked MSE rising with compute on every seed (means 0.206, 0.213, 0.223, 0.230 over 3 seeds)."""
    means = {0.5: 0.206, 0.75: 0.213, 1.0: 0.223, 1.25: 0.230}
    levels = {0: -0.002, 1: 0.0, 2: 0.002}
    noise = {(0, 0.75): 0.0005, (1, 1.0): -0.0004, (2, 0.5): 0.0003}
    return {seed: [(c, m + u + noise.get((seed, c), 0.0)) for c, m in means.items()] for seed, u in levels.items()}


def test_a_pruned_run_equal_to_the_cheapest_full_is_not_a_saving_when_longer_training_hurts():
    frontiers = longer_hurts_frontiers()
    model = fit_frontier(frontiers, True)
    cheapest = {seed: (0.77, model.curve(seed)[0][1]) for seed in frontiers}  # the fitted Full at 50%
    summary = saving_summary(frontiers, cheapest, lower_is_better=True)
    assert summary["hurts"] == "training longer hurts here: Full at 50% is best measured"
    assert all(s["kind"] == AT_MOST for s in summary["per_seed"]) and summary["n"] == 0
    assert summary["verdict"].startswith("not a saving") and "[" not in summary["verdict"]
    assert all(s["saving"] == pytest.approx(1 - 0.77 / 0.5) for s in summary["per_seed"])
    assert "extend the frontier down" in summary["note"] and "trained longer" not in summary["note"]
    # a touch worse than Full at 50%, as measured (0.207 against 0.206): not a saving either
    near = {seed: (0.77, model.curve(seed)[0][1] + 0.001) for seed in frontiers}
    assert saving_summary(frontiers, near, True)["verdict"].startswith("not a saving")
    # better than the best Full measured: every Full is beaten, and a longer Full would be worse still
    better = {seed: (0.77, model.curve(seed)[0][1] - 0.01) for seed in frontiers}
    beaten = saving_summary(frontiers, better, True)
    assert (
        beaten["verdict"].startswith("not resolved: better than every Full measured") and "[" not in beaten["verdict"]
    )
    assert "extend the frontier down" in beaten["verdict"] and "extend the frontier down" in beaten["note"]


def test_a_dip_that_the_longest_full_recovers_from_is_not_training_longer_hurting():
    # Full worse at 75% than at 50% on every seed, then best at 100%: the frontier is not monotone,
    # but training longer pays over the measured range, so no headline and the usual reading
    frontiers = {s: [(0.5, 0.30 + u), (0.75, 0.31 + u), (1.0, 0.20 + u)] for s, u in ((0, 0.0), (1, 0.01), (2, -0.01))}
    model = fit_frontier(frontiers, True)
    assert not model.monotone and not model.hurts and model.best_compute == 1.0
    better = {seed: (0.7, 0.19 + u) for seed, u in ((0, 0.0), (1, 0.01), (2, -0.01))}
    summary = saving_summary(frontiers, better, True)
    assert summary["hurts"] == "" and summary["best_full"] is None
    assert "extend the frontier up" in summary["verdict"] and "gets worse" not in summary["verdict"]


def test_reading_one_shape_over_the_seeds_is_less_noisy_than_each_seeds_own_points():
    # 5 seeds, Full at 8 lengths with run noise as large as a few passes of training; the pruned run
    # sits exactly on its seed's true curve at 85% compute, so every seed's true saving is the same
    rng = np.random.default_rng(0)
    lengths = np.linspace(0.5, 1.2, 8)
    truth = 1 - 0.7 / 0.85
    model_spread, own_spread = [], []
    for _ in range(40):
        levels = rng.normal(0, 0.5, 5)
        frontiers = {s: [(c, u - c + rng.normal(0, 0.03)) for c in lengths] for s, u in enumerate(levels)}
        runs = {s: (0.7, u - 0.85) for s, u in enumerate(levels)}
        model = [a.saving for a in savings_over_seeds(frontiers, runs, True).values()]
        own = [iso_quality(frontiers[s], 0.7, runs[s][1], True).saving for s in runs]
        model_spread.append(np.std(np.subtract(model, truth)))
        own_spread.append(np.std(np.subtract(own, truth)))
    assert np.mean(model_spread) < 0.6 * np.mean(own_spread)
    summary = saving_summary(frontiers, runs, True)
    assert summary["interval"] == "jackknife t" and summary["standard_error"] > 0


def test_a_longest_full_that_ties_the_best_is_not_training_longer_hurting():
    # held-out probe accuracy counts correct answers out of 270: Full at 75% and 100% tie on every
    # seed, and the least-squares fit leaves them 1e-16 apart; training longer did not hurt
    offsets = {0: 0, 1: 3, 2: -2}
    frontiers = {
        s: [(0.5, (160 + d) / 270), (0.75, (189 + d) / 270), (1.0, (189 + d) / 270)] for s, d in offsets.items()
    }
    model = fit_frontier(frontiers, lower_is_better=False)
    assert model.monotone and not model.hurts
    better = saving_summary(frontiers, {s: (0.7, (192 + d) / 270) for s, d in offsets.items()}, False)
    assert better["hurts"] == "" and better["best_full"] is None
    assert "extend the frontier up" in better["verdict"] and "gets worse" not in better["verdict"]


def test_a_longest_full_worse_only_within_seed_noise_is_not_training_longer_hurting():
    # the fitted Full is best at 73%, but one seed falls at 100%, one rises and one holds: the seeds'
    # paired differences do not show a worse longest Full, so nothing is claimed and the reading is the usual
    frontiers = {
        0: [(0.7, 0.689), (0.733, 0.689), (1.0, 0.656)],
        1: [(0.7, 0.711), (0.733, 0.722), (1.0, 0.733)],
        2: [(0.7, 0.656), (0.733, 0.667), (1.0, 0.667)],
    }
    model = fit_frontier(frontiers, lower_is_better=False)
    assert model.best_compute == 0.733 and model.rise["reading"] == "no difference detected"
    assert not model.hurts
    summary = saving_summary(frontiers, {s: (0.7, 0.80) for s in frontiers}, lower_is_better=False)
    assert summary["hurts"] == "" and "extend the frontier up" in summary["verdict"]
    # the same shape with every seed worse at 100% by the same amount is shown
    shown = {
        s: [(x, y - (0.04 if x == 1.0 else 0.0) + 0.01 * s) for x, y in ((0.7, 0.68), (0.733, 0.69), (1.0, 0.69))]
        for s in range(3)
    }
    assert fit_frontier(shown, lower_is_better=False).hurts
