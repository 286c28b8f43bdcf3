"""Per-sample flags packed eight to a byte, in `np.packbits` order (bit 7 of byte 0 is id 0): a frozen
plan's candidates, the samples a pass has consumed. One bit per sample where a numpy bool costs eight
(2e9 samples are 250 MB of bits, 2 GB of bools). Pure numpy; opens nothing.
"""

from __future__ import annotations

import numpy as np

_CHUNK = 1 << 22  # ids per step of the chunked whole-table operations: bounded temporaries


class Bitmap:
    """`length` flags in `packed` (uint8 [ceil(length / 8)]); the bits past `length` are always 0."""

    __slots__ = ("packed", "length")

    def __init__(self, packed: np.ndarray, length: int):
        packed = np.asanyarray(packed)  # keeps a shared-memory view (pruning/pass_plan.py) as it is
        if packed.dtype != np.uint8 or packed.shape != ((int(length) + 7) // 8,):
            raise ValueError(
                f"a bitmap of {length} flags is uint8[{(int(length) + 7) // 8}], got {packed.dtype}{list(packed.shape)}"
            )
        self.packed, self.length = packed, int(length)

    @classmethod
    def zeros(cls, length: int) -> "Bitmap":
        return cls(np.zeros((int(length) + 7) // 8, dtype=np.uint8), length)

    @classmethod
    def from_bools(cls, flags: np.ndarray) -> "Bitmap":
        flags = np.asarray(flags, dtype=bool).reshape(-1)
        return cls(np.packbits(flags), len(flags))

    def __len__(self) -> int:
        return self.length

    def test(self, ids: np.ndarray) -> np.ndarray:
        """bool per id (ids in range: the caller checks)."""
        ids = np.asarray(ids, dtype=np.int64)
        return ((self.packed[ids >> 3] >> (7 - (ids & 7)).astype(np.uint8)) & 1).astype(bool)

    def set(self, ids: np.ndarray) -> None:
        """Set the flags of `ids` (repeats allowed: `bitwise_or.at` accumulates, plain indexing would not)."""
        ids = np.asarray(ids, dtype=np.int64)
        np.bitwise_or.at(self.packed, ids >> 3, (np.uint8(128) >> (ids & 7).astype(np.uint8)))

    def between(self, start: int, stop: int) -> np.ndarray:
        """The flags of ids [start, stop) as bools: a shard's worth, unpacked on demand."""
        first, last = start >> 3, (stop + 7) >> 3
        bits = np.unpackbits(self.packed[first:last])
        offset = start - 8 * first
        return bits[offset : offset + stop - start].astype(bool)

    def count(self) -> int:
        return int(np.bitwise_count(self.packed).sum(dtype=np.int64))

    def copy(self) -> "Bitmap":
        return Bitmap(self.packed.copy(), self.length)

    def __eq__(self, other) -> bool:
        return isinstance(other, Bitmap) and self.length == other.length and np.array_equal(self.packed, other.packed)

    __hash__ = None

    @classmethod
    def from_chunks(cls, length: int, flags_between) -> "Bitmap":
        """A bitmap whose flags [start, stop) are `flags_between(start, stop)` (bools), built a chunk
        at a time so that no bool array of `length` ever exists."""
        bitmap = cls.zeros(length)
        for start in range(0, int(length), _CHUNK):  # _CHUNK is a multiple of 8: chunks start on a byte
            stop = min(start + _CHUNK, int(length))
            bitmap.packed[start >> 3 : (stop + 7) >> 3] = np.packbits(np.asarray(flags_between(start, stop), bool))
        return bitmap
