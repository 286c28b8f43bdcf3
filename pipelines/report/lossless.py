"""What "lossless" means, once, for `prunepipe compare` and `prunepipe bench lossless`: a pruned run
is lossless when it is worse than Full by at most K of Full's seed standard deviations, and it beats
Full of equal compute when it is better by more than K of them.

K = 2: a Full seed of its own falls within 2 standard deviations of Full's mean about 95% of the time
(normal run-to-run noise), so Full itself passes; at K = 1 a third of Full's own seeds would be
called lossy. Better than Full is always lossless.
"""

from __future__ import annotations

import math

LOSSLESS_K = 2.0


def is_lossless(worse_by: float, noise: float, k: float = LOSSLESS_K) -> bool:
    """`worse_by` (the pruned value's distance from Full in the metric's worse direction) within k x `noise`."""
    return bool(worse_by <= k * noise)


def beats(better_by: float, noise: float, k: float = LOSSLESS_K) -> bool:
    """Better than the reference by more than k x `noise` (Full of equal compute: the selection paid)."""
    return bool(better_by > k * noise)


def in_noise_units(worse_by: float, noise: float) -> float:
    """How much worse, in units of `noise` (negative = better); nan without a measured noise."""
    if worse_by is None or not noise or not math.isfinite(noise):
        return float("nan")
    return worse_by / noise
