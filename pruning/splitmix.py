"""SplitMix64 (Steele, Lea and Flood, 2014) as a counter-based hash: output n of a stream keyed by k is
mix64(k + n * GAMMA). One implementation for every draw the project makes without a generator: the
pruners' coins and the data stream's (numpy, `uniform_coin`) and the tasks' per-sample noise, masks and
timesteps (torch int64 tensors, pipelines/tasks/randomness.py), so that a decision is a pure function of
(seed, pass, id) on any rank, device or resume. Imports neither torch nor anything of the project: the
torch form uses only the operators tensors share with python ints.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # the Weyl increment (odd, so id -> id * GAMMA is a bijection modulo 2**64)
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB


def mix64(z: int) -> int:
    """The finaliser on one python int (exact 64-bit wraparound)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX_1) & MASK64
    z = ((z ^ (z >> 27)) * MIX_2) & MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, pass_index: int) -> int:
    """A 64-bit key per (seed, pass_index): the start of one stream."""
    return mix64(mix64(seed) + (pass_index & MASK64) * GAMMA)


def uniform_coin(seed: int, pass_index: int, ids: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per id, float64, a pure function of (seed, pass_index, id).

    The coin of `id` is output number `id` of the stream keyed by (seed, pass_index), so it does not
    depend on which other ids are asked for, in what order or in which process.
    """
    z = np.asarray(ids).astype(np.uint64)  # a fresh array: the in-place steps below may scribble
    with np.errstate(over="ignore"):  # wraparound is the point of the hash
        z *= np.uint64(GAMMA)
        z += np.uint64(stream_key(seed, pass_index))
        z ^= z >> np.uint64(30)
        z *= np.uint64(MIX_1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(MIX_2)
        z ^= z >> np.uint64(31)
    # the top 53 bits fill a double's mantissa exactly: every value is k / 2**53 < 1
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# ---- the same on int64 tensors: torch has no uint64 arithmetic, and its >> is arithmetic


def signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned `value`."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


GAMMA_I64, MIX_1_I64, MIX_2_I64 = signed(GAMMA), signed(MIX_1), signed(MIX_2)


def shift_right_i64(z, bits: int):
    """Logical right shift of int64 bit patterns (an arithmetic shift with the sign copies masked off)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64_i64(z):
    """The finaliser on int64 tensors. Multiplication wraps modulo 2**64 on every torch device (two's
    complement), which is exactly the unsigned product's low 64 bits."""
    z = (z ^ shift_right_i64(z, 30)) * MIX_1_I64
    z = (z ^ shift_right_i64(z, 27)) * MIX_2_I64
    return z ^ shift_right_i64(z, 31)
