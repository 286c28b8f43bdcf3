"""Importance-sampled timesteps (pipelines/tasks/timesteps.py) as a specification: uniform until
every timestep has its history of losses, then p_t proportional to sqrt(E[loss_t^2]) with a little
uniform mass; draws follow p_t; the weight 1/(T p_t) keeps the expected loss that of uniform t; the
table is state; in a task the pruner is scored without the importance weight."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from eval_runs import diffusion_config

from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask
from prunepipe.pipelines.tasks.diffusion.timesteps import LossSecondMomentSampler

T = 50


def warmed(losses_per_t: np.ndarray, history: int = 10) -> LossSecondMomentSampler:
    sampler = LossSecondMomentSampler(T, history=history)
    for _ in range(history):
        sampler.update(np.arange(T), np.arange(T), losses_per_t)
    return sampler


def history(sampler: LossSecondMomentSampler, timestep: int) -> list[float]:
    """The recorded losses of `timestep`, oldest first, read from the sampler's state: a ring per
    timestep, loss number k in slot k % history, `written` losses so far, the last `count` kept."""
    state = sampler.state_dict()
    kept, written = int(state["count"][timestep]), int(state["written"][timestep])
    ring = state["losses"][timestep].tolist()
    return [ring[(written - kept + k) % state["history"]] for k in range(kept)]


def test_uniform_until_every_timestep_has_its_history():
    sampler = LossSecondMomentSampler(T, history=3)
    sampler.update(np.arange(T - 1), np.arange(T - 1), np.ones(T - 1))  # one timestep never seen
    assert not sampler.warmed_up and np.allclose(sampler.probabilities(), 1 / T)
    t, weights = sampler.draw(torch.rand(1000, generator=torch.Generator().manual_seed(0)))
    assert torch.all(weights == 1.0) and t.min() >= 0 and t.max() < T


def test_probabilities_follow_the_second_moment_and_draws_follow_them():
    losses = np.linspace(0.1, 5.0, T)
    sampler = warmed(losses)
    p = sampler.probabilities()
    expected = losses / losses.sum() * (1 - 0.001) + 0.001 / T  # constant history: sqrt(E[l^2]) = l
    np.testing.assert_allclose(p, expected, rtol=1e-12)
    t, weights = sampler.draw(torch.rand(200_000, generator=torch.Generator().manual_seed(1)))
    counts = np.bincount(t.numpy(), minlength=T)
    assert scipy.stats.chisquare(counts, 200_000 * p).pvalue > 1e-3
    torch.testing.assert_close(weights, torch.from_numpy(1 / (T * p[t.numpy()])).float())


def test_weighted_losses_keep_the_uniform_expectation():
    rng = np.random.default_rng(2)
    losses = rng.exponential(1.0, T)
    sampler = warmed(losses)
    t, weights = sampler.draw(torch.rand(400_000, generator=torch.Generator().manual_seed(3)))
    estimate = weights.double().numpy() * losses[t.numpy()]
    standard_error = estimate.std() / np.sqrt(len(estimate))
    assert abs(estimate.mean() - losses.mean()) < 4 * standard_error
    assert estimate.std() < (losses[rng.integers(0, T, 400_000)]).std()  # and with less variance


def test_history_keeps_the_latest_losses_and_ignores_padding_and_nonfinite():
    sampler = LossSecondMomentSampler(T, history=2)
    sampler.update(np.array([0, 1, -1, 2]), np.array([4, 4, 4, 4]), np.array([1.0, 2.0, 99.0, np.nan]))
    sampler.update(np.array([3]), np.array([4]), np.array([3.0]))
    assert sampler.count[4] == 2 and history(sampler, 4) == [2.0, 3.0]


def test_state_round_trip_gives_the_same_draws():
    first = warmed(np.linspace(1, 2, T))
    second = LossSecondMomentSampler(T)
    second.load_state_dict(first.state_dict())
    u = torch.rand(64, generator=torch.Generator().manual_seed(4))
    for a, b in zip(first.draw(u), second.draw(u)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="history saved 10, configured 5"):
        LossSecondMomentSampler(T, history=5).load_state_dict(first.state_dict())


def test_a_task_weights_the_loss_and_scores_without_the_weight():
    task = DiffusionTask(
        diffusion_config(
            unet__block_out_channels=[16, 32],
            unet__norm_num_groups=8,
            num_train_timesteps=T,
            ddpm__timestep_sampling="loss_second_moment",
        ),
        image_size=16,
        channels=1,
    )
    sampler = task.timestep_sampler
    for _ in range(10):
        sampler.update(np.arange(T), np.arange(T), np.linspace(0.1, 5.0, T))
    from prunepipe.pipelines.data.batch import Batch

    batch = Batch(torch.arange(8), torch.ones(8), torch.rand(8, 1, 16, 16) * 2 - 1, torch.full((8,), -1))
    out = task.per_sample(task.model, batch, torch.Generator().manual_seed(5))
    p = torch.from_numpy(sampler.probabilities())
    torch.testing.assert_close(out.loss, out.score * (1 / (T * p[out.stratum])).float())
    task.observe(np.arange(8), out.stratum.numpy(), out.score.numpy())
    last = int(np.flatnonzero(out.stratum.numpy() == int(out.stratum[0]))[-1])  # the newest loss of that t
    assert history(sampler, int(out.stratum[0]))[-1] == pytest.approx(float(out.score[last]))
    with pytest.raises(ValueError, match="ldm.ddpm.timestep_sampling='uniformly' is not accepted"):
        DiffusionTask(diffusion_config(ddpm__timestep_sampling="uniformly"), image_size=16, channels=1)


def test_a_batch_is_recorded_as_one_loss_after_another():
    # the vectorised update against the plain definition: append each real, finite loss in batch
    # order to its timestep's history and keep the newest `history`
    rng = np.random.default_rng(6)
    sampler, reference = LossSecondMomentSampler(8, history=3), {t: [] for t in range(8)}
    for _ in range(20):
        t = rng.integers(0, 8, 30)  # repeats within a batch, more than `history` of some t
        losses = rng.exponential(1.0, 30)
        ids = np.where(rng.random(30) < 0.1, -1, np.arange(30))
        losses[rng.random(30) < 0.05] = np.nan
        sampler.update(ids, t, losses)
        for i, step, loss in zip(ids, t, losses):
            if i >= 0 and np.isfinite(loss):
                reference[int(step)] = (reference[int(step)] + [float(loss)])[-3:]
        assert all(history(sampler, step) == reference[step] for step in range(8))
    sampler.update(np.array([-1]), np.array([2]), np.array([1.0]))  # nothing real: nothing recorded
    assert history(sampler, 2) == reference[2]
