"""Per-sample draws on the batch's device (pipelines/tasks/randomness.py) as a specification: the
integer hash is SplitMix64 bit for bit, a sample's numbers depend on (seed, pass, draw, id, element)
only, never on its batch-mates or how the batch is cut, and they have the stated distributions."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch

from prunepipe.pipelines.tasks.randomness import SampleRandomness, hash_bits, per_sample_seeded
from prunepipe.pruning.splitmix import GAMMA, MIX_1, MIX_2

ALPHA = 1e-3  # KS tests on fixed seeds: a false alarm is 1 in 1000 if they were random


def splitmix_reference(key: int, ids: np.ndarray, elements: int) -> np.ndarray:
    """The same hash in numpy uint64, where wraparound is defined: the spec the tensor code must meet."""

    def mix(z):
        z = z.copy()
        with np.errstate(over="ignore"):
            z ^= z >> np.uint64(30)
            z *= np.uint64(MIX_1)
            z ^= z >> np.uint64(27)
            z *= np.uint64(MIX_2)
            z ^= z >> np.uint64(31)
        return z

    with np.errstate(over="ignore"):
        start = mix(ids.astype(np.uint64) * np.uint64(GAMMA) + np.uint64(key))
        steps = np.arange(1, elements + 1, dtype=np.uint64) * np.uint64(GAMMA)
        return mix(start[:, None] + steps[None, :])


def test_tensor_hash_is_splitmix64_bit_for_bit():
    ids = np.array([0, 1, 7, 2**31 + 5, 2**40 + 3, 10**12], dtype=np.int64)
    for key in (0, 12345, 2**63 + 99, 2**64 - 1):
        got = hash_bits(key, torch.from_numpy(ids), 33).numpy().view(np.uint64)
        np.testing.assert_array_equal(got, splitmix_reference(key, ids, 33))


def test_a_samples_draws_do_not_depend_on_batch_mates_or_chunking():
    ids = torch.arange(100, 164)
    whole = SampleRandomness(3, 2, ids)
    reference = [whole.rand(16), whole.randn(4, 8, 8), whole.randint(1000)]
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    for chunk in torch.split(order, 10):  # other batch-mates, other order, other batch size
        part = SampleRandomness(3, 2, ids[chunk])
        for got, want in zip([part.rand(16), part.randn(4, 8, 8), part.randint(1000)], reference):
            torch.testing.assert_close(got, want[chunk], rtol=0, atol=0)


def test_draws_differ_between_seeds_passes_draws_and_samples():
    ids = torch.arange(50)
    first = SampleRandomness(0, 0, ids).rand(32)
    for other in (SampleRandomness(1, 0, ids).rand(32), SampleRandomness(0, 1, ids).rand(32)):
        assert (other != first).float().mean() > 0.99
    draws = SampleRandomness(0, 0, ids)
    assert (draws.rand(32) != draws.rand(32)).float().mean() > 0.99  # the second call is a fresh stream
    assert len(torch.unique(first[:, 0])) == 50


def test_uniform_normal_and_integer_draws_have_their_distributions():
    draws = SampleRandomness(11, 4, torch.arange(2000))
    uniform = draws.rand(50).flatten().double().numpy()
    normal = draws.randn(50).flatten().double().numpy()
    integers = draws.randint(10).numpy()
    assert uniform.min() >= 0.0 and uniform.max() < 1.0
    assert scipy.stats.kstest(uniform, "uniform").pvalue > ALPHA
    assert scipy.stats.kstest(normal, "norm").pvalue > ALPHA
    assert abs(normal.mean()) < 4 / np.sqrt(len(normal)) and abs(normal.std() - 1) < 0.01
    assert scipy.stats.chisquare(np.bincount(integers, minlength=10)).pvalue > ALPHA


def test_held_out_noise_is_a_pure_function_of_seed_and_id():
    ids = np.array([5, 3, 9])
    a = per_sample_seeded((4, 2), ids, seed=7, normal=True)
    b = per_sample_seeded((4, 2), ids[::-1].copy(), seed=7, normal=True)
    torch.testing.assert_close(a, b.flip(0), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_equal_cpu_draws():
    ids = torch.arange(1000, 1256)
    cpu, cuda = SampleRandomness(2, 3, ids), SampleRandomness(2, 3, ids, "cuda")
    torch.testing.assert_close(cuda.rand(4, 32, 32).cpu(), cpu.rand(4, 32, 32), rtol=0, atol=0)
    torch.testing.assert_close(cuda.randn(4, 32, 32).cpu(), cpu.randn(4, 32, 32), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cuda.randint(1000).cpu(), cpu.randint(1000), rtol=0, atol=0)
