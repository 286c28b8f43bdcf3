"""Training augmentations, each drawn from a stream of its own keyed by (seed, pass, id): the flip
coin and MAE's random resized crop (torchvision's RandomResizedCrop, bicubic).

Every draw is a pure function of (seed, pass_index, id), so any worker layout and a resumed run augment
alike, and each purpose salts the seed, so that no draw is the pruners' keep coin
(`uniform_coin(seed, pass_index, id)`, pruning/base.py): with the same number, every kept InfoBatch
sample of weight > 1 would be flipped. Runs in the loader workers, on the host.
"""

from __future__ import annotations

import math

import numpy as np

from prunepipe.pruning.splitmix import uniform_coin

CROPS = ("center", "random_resized")
CROP_RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's default aspect range, which MAE keeps
CROP_ATTEMPTS = 10  # torchvision's tries before its centre-crop fallback

# Salts for the seed, one per purpose: the SplitMix64 key of (seed ^ salt, pass_index) starts a stream
# unrelated to the keep coin's (seed, pass_index) and to each other's. ASCII of the purpose's name.
_FLIP_SALT = 0x68666C6970  # "hflip"
_CROP_SALT = 0x63726F70  # "crop"
_DRAWS_PER_CROP = 4 * CROP_ATTEMPTS  # scale, log-ratio, top, left per attempt


def flip_coin(seed: int, pass_index: int, ids: np.ndarray) -> np.ndarray:
    """bool per id: mirror this sample in pass `pass_index` (probability 1/2, independent of its keep coin)."""
    return uniform_coin(seed ^ _FLIP_SALT, pass_index, np.asarray(ids, dtype=np.int64)) < 0.5


def crop_uniforms(seed: int, pass_index: int, sample_id: int) -> np.ndarray:
    """float64 [CROP_ATTEMPTS, 4]: the crop's uniforms of one sample, element e of id i being number
    i * 40 + e of the crop stream (a bijection for ids below 2**58)."""
    draws = sample_id * _DRAWS_PER_CROP + np.arange(_DRAWS_PER_CROP, dtype=np.int64)
    return uniform_coin(seed ^ _CROP_SALT, pass_index, draws).reshape(CROP_ATTEMPTS, 4)


def random_resized_crop_box(
    width: int, height: int, scale: tuple[float, float], uniforms: np.ndarray, ratio: tuple[float, float] = CROP_RATIO
) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width) as torchvision's `RandomResizedCrop.get_params` chooses
    them, with its random numbers replaced by `uniforms` ([attempts, 4] in [0, 1)): up to ten tries
    of an area fraction in `scale` and a log-uniform aspect ratio, else a centre crop at the nearest
    allowed ratio."""
    area = width * height
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for u_scale, u_ratio, u_top, u_left in uniforms:
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u_scale)
        aspect = math.exp(log_low + (log_high - log_low) * u_ratio)
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w
