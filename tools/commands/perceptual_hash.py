"""The perceptual hash (pHash) as a model-free embedding for near-exact copies: a copy moved by a pixel
or two, rescaled, re-encoded or a little brighter keeps the signs of its lowest spatial frequencies.

The definition is imagehash's `phash` (grey 32x32 image, 2-D DCT-II, the top-left 8x8 coefficients,
each bit = coefficient above their median), written here with scipy's DCT over a whole batch: the
imagehash package would add a dependency (and PyWavelets) for these lines and hash one PIL image at
a time. The 64 bits are stored as a row of +-1/8: L2-normalised, so the inner product that
`prunepipe shards dedup` thresholds is 1 - 2 * hamming / 64 (hamming <= 8: a threshold of 0.74, halfway
to 9; `threshold_for_hamming`).

`phash:12` keeps the 12x12 lowest frequencies of the same 32x32 image (144 bits): on the bundled
redundant set it separates copies from other crops better than the standard 8x8 (docs/dedup.md).
"""

from __future__ import annotations

import numpy as np
from scipy.fft import dct

SIDE = 32  # the grey image the DCT sees (imagehash's phash: hash_size 8 x highfreq_factor 4)
BITS_SIDE = 8  # the 8x8 lowest frequencies: 64 bits
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R 601-2, PIL's convert("L")


def phash_bits(pixels: np.ndarray, bits_side: int = BITS_SIDE) -> np.ndarray:
    """bool [B, bits_side^2]: the pHash of uint8 images [B, C, SIDE, SIDE] (C = 1 or 3)."""
    if pixels.ndim != 4 or pixels.shape[2:] != (SIDE, SIDE):
        raise ValueError(f"phash expects images [B, C, {SIDE}, {SIDE}], got {list(pixels.shape)}")
    grey = pixels.astype(np.float32)
    grey = grey[:, 0] if grey.shape[1] == 1 else np.einsum("bchw,c->bhw", grey[:, :3], LUMA)
    frequencies = dct(dct(grey, axis=1), axis=2)[:, :bits_side, :bits_side].reshape(len(grey), -1)
    return frequencies > np.median(frequencies, axis=1, keepdims=True)


def bits_to_rows(bits: np.ndarray) -> np.ndarray:
    """float32 [B, bits] rows of +-1/sqrt(bits) (unit length): inner product = 1 - 2 * hamming / bits."""
    return np.where(bits, 1.0, -1.0).astype(np.float32) / np.sqrt(bits.shape[1], dtype=np.float32)


def threshold_for_hamming(hamming: int, bits: int = BITS_SIDE * BITS_SIDE) -> float:
    """The inner-product threshold that keeps hash rows within Hamming distance `hamming`: halfway to the
    next distance, so that float16 rounding (1/12 is not exact) cannot move a pair across it."""
    return 1.0 - (2 * hamming + 1) / bits


class PerceptualHash:
    """pHash behind the feature-model interface of tools/commands/feature_models.py; `bits_side` 8 is imagehash's."""

    image_size = SIDE
    channels = 3

    def __init__(self, bits_side: int = BITS_SIDE):
        if not 2 <= bits_side <= SIDE:
            raise ValueError(f"phash:{bits_side}: the side of the frequency block must be in 2..{SIDE}")
        self.bits_side = bits_side
        self.dim = bits_side * bits_side
        self.spec = "phash" if bits_side == BITS_SIDE else f"phash:{bits_side}"

    def __call__(self, pixels) -> np.ndarray:
        """uint8 [B, C, SIDE, SIDE] (tensor or array) -> float32 [B, dim] rows of +-1/sqrt(dim)."""
        array = pixels.numpy() if hasattr(pixels, "numpy") else np.asarray(pixels)
        return bits_to_rows(phash_bits(array, self.bits_side))

    def describe(self) -> dict:
        side = self.bits_side
        return {
            "model": self.spec,
            "weights": None,
            "weights_sha256": None,
            "dim": self.dim,
            "image_size": SIDE,
            "channels": self.channels,
            "preprocessing": f"decoded with the shorter side to {SIDE} px (bicubic), centre square, grey "
            f"(ITU-R 601-2 luma); 2-D DCT-II; bit = one of the {side}x{side} lowest frequencies "
            f"above their median (imagehash's phash at 8x8); row = bits as +-1/{side}",
            "features": f"{self.dim}-bit perceptual hash: inner product = 1 - 2 * hamming / {self.dim}",
        }
