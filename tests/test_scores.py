"""Scores that measure the sample, not the timestep drawn with it (pruning/scores.py), as a
specification: on a synthetic diffusion-like case where each sample's difficulty is known and the
loss also scales strongly with the timestep, the last raw loss ranks samples by timestep; the
stratum-normalised score ranks them by difficulty. The statistics are state like a pruner's."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch

from prunepipe.pruning import InfoBatch, ScoreNormaliser

T = 1000


def synthetic_visits(num_samples=4000, visits=3, seed=0):
    """Per visit: (ids, losses, timesteps) with loss = difficulty * f(t) * small noise; f spans 100x."""
    rng = np.random.default_rng(seed)
    difficulty = rng.uniform(0.5, 2.0, num_samples)
    shape = lambda t: 0.01 + np.exp(-t / 150.0)  # noqa: E731 - high at small t, ~100x lower at large t
    for _ in range(visits):
        ids = rng.permutation(num_samples)
        t = rng.integers(0, T, num_samples)
        losses = difficulty[ids] * shape(t) * rng.lognormal(0.0, 0.05, num_samples)
        yield ids, losses.astype(np.float32), t, difficulty


def last_scores(kind: str) -> tuple[np.ndarray, np.ndarray]:
    normaliser = ScoreNormaliser(kind, T, buckets=20, momentum=0.99)
    pruner = InfoBatch(4000, 10)
    for ids, losses, t, difficulty in synthetic_visits():
        for start in range(0, len(ids), 256):  # batches, as the loop feeds them
            part = slice(start, start + 256)
            pruner.update(ids[part], normaliser(ids[part], losses[part], t[part]))
    return pruner.tables()["score"], difficulty


def test_raw_last_loss_ranks_by_timestep_normalised_score_by_difficulty():
    raw, difficulty = last_scores("none")
    by_mean, _ = last_scores("stratum_mean")
    by_z, _ = last_scores("stratum_zscore")
    rho = lambda score: scipy.stats.spearmanr(score, difficulty).statistic  # noqa: E731
    assert rho(raw) < 0.3  # mostly the timestep of the last visit
    assert rho(by_mean) > 0.85 and rho(by_z) > 0.85  # the sample itself


def test_the_pruner_then_prunes_easy_samples_not_late_timesteps():
    scores, difficulty = last_scores("stratum_mean")
    pruner = InfoBatch(4000, 10, prune_ratio=0.5)
    pruner.update(np.arange(4000), scores)
    pruner.plan(1)
    below = pruner.weights(np.arange(4000)) != 1.0  # the candidates: skipped (0) or rescaled (2)
    assert difficulty[below].mean() < 1.0 < difficulty[~below].mean()


def test_padding_and_nonfinite_losses_do_not_move_the_statistics():
    normaliser = ScoreNormaliser("stratum_mean", T, buckets=10)
    scores = normaliser(
        np.array([0, 1, -1, 2]), np.array([2.0, 4.0, 100.0, np.nan], np.float32), np.array([5, 6, 7, 8])
    )
    assert normaliser.mean[0] == pytest.approx(3.0)  # padding (-1) and NaN left out
    np.testing.assert_allclose(scores[:3], [2 / 3, 4 / 3, 100 / 3], rtol=1e-6)
    assert np.isnan(scores[3])  # still refused, and counted, by the pruner


def test_no_normalisation_passes_losses_through_and_strata_are_needed_otherwise():
    losses = np.array([1.0, 2.0], np.float32)
    np.testing.assert_array_equal(ScoreNormaliser("none")(np.arange(2), losses, None), losses)
    with pytest.raises(ValueError, match="needs a task that reports strata"):
        ScoreNormaliser("stratum_mean", T)(np.arange(2), losses, None)
    with pytest.raises(ValueError, match="score.normalise='bucket' is not accepted"):
        ScoreNormaliser("bucket", T)
    with pytest.raises(ValueError, match="stratum 1000 is outside 0..999"):
        ScoreNormaliser("stratum_mean", T)(np.arange(2), losses, np.array([3, 1000]))


def test_state_round_trip_and_a_mismatched_config_is_named():
    first = ScoreNormaliser("stratum_zscore", T, buckets=8)
    for ids, losses, t, _ in synthetic_visits(500, 1):
        first(ids, losses, t)
    state = first.state_dict()
    assert all(isinstance(v, (torch.Tensor, str, int, float)) for v in state.values())
    second = ScoreNormaliser("stratum_zscore", T, buckets=8)
    second.load_state_dict(state)
    ids, losses, t, _ = next(synthetic_visits(500, 1, seed=4))
    np.testing.assert_array_equal(first(ids, losses, t), second(ids, losses, t))
    with pytest.raises(ValueError, match="buckets: saved 8, configured 20"):
        ScoreNormaliser("stratum_zscore", T, buckets=20).load_state_dict(state)


def test_score_reliability_measures_the_share_of_variance_between_samples():
    """tools/benchmarks/score_noise.py: scores that are half sample and half draw have a between-sample
    share near 0.5, pure draw noise near 0; normalising within strata recovers a sample effect that
    a strong stratum effect hides."""
    from prunepipe.tools.benchmarks.score_noise import normalised, reliability

    rng = np.random.default_rng(0)
    draws, n = 8, 4000
    sample = rng.normal(size=n)
    half = reliability(sample + rng.normal(size=(draws, n)))
    noise = reliability(rng.normal(size=(draws, n)))
    assert half["between_share"] == pytest.approx(0.5, abs=0.03) and abs(noise["between_share"]) < 0.03
    assert half["rank_corr"] == pytest.approx(0.5, abs=0.05) and half["below_mean_agree"] > noise["below_mean_agree"]
    assert noise["below_mean_agree"] == pytest.approx(noise["chance"], abs=0.02)

    difficulty = rng.uniform(0.5, 2.0, n)
    t = rng.integers(0, T, (draws, n))
    losses = difficulty * (0.01 + np.exp(-t / 150.0)) * rng.lognormal(0.0, 0.05, (draws, n))
    raw, fixed = reliability(losses), reliability(normalised(losses, t, T))
    assert raw["between_share"] < 0.2 and fixed["between_share"] > 0.6
