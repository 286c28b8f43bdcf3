"""Training augmentations, each drawn from a stream of its own keyed by (seed, pass, id): the flip coin.

Every draw is a pure function of (seed, epoch, id), so any worker layout and a resumed run augment
alike, and each purpose salts the seed, so that no draw is the pruners' keep coin
(`uniform_coin(seed, epoch, id)`, pruning/base.py): with the same number, every kept InfoBatch
sample of weight > 1 was flipped (issue 21). Runs in the loader workers, on the host.
"""

from __future__ import annotations

import numpy as np

from pruning.base import uniform_coin

# Salts for the seed, one per purpose: the SplitMix64 key of (seed ^ salt, epoch) starts a stream
# unrelated to the keep coin's (seed, epoch) and to each other's. ASCII of the purpose's name.
_FLIP_SALT = 0x68666C6970  # "hflip"


def flip_coin(seed: int, epoch: int, ids: np.ndarray) -> np.ndarray:
    """bool per id: mirror this sample in pass `epoch` (probability 1/2, independent of its keep coin)."""
    return uniform_coin(seed ^ _FLIP_SALT, epoch, np.asarray(ids, dtype=np.int64)) < 0.5

