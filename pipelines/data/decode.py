"""Decoding one undecoded webdataset sample into (image tensor [C, H, W] in [-1, 1], label).

This is the expensive step that pruned samples never reach. Augmentation randomness is a
pure function of (seed, epoch, id), so resumed runs and any worker layout see the same flips.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from pipelines.data.shards import BadInputError
from pruning.base import uniform_coin

IMAGE_FIELDS = ("png", "jpg", "jpeg", "webp", "ppm", "bmp", "tif", "tiff")
LATENT_FIELDS = ("latent.npy", "npy")
LABEL_FIELDS = ("cls", "label", "class")
NO_LABEL = -1


@dataclass
class SampleDecoder:
    """Decode an image (or a precomputed latent) and its optional class label."""

    resolution: int = 32
    channels: int = 3
    hflip: bool = False
    seed: int = 0

    def __call__(self, sample: dict, sample_id: int, epoch: int) -> tuple[torch.Tensor, int]:
        where = f"shard {sample.get('__url__')} key {sample.get('__key__')!r}"
        latent_field = next((f for f in LATENT_FIELDS if f in sample), None)
        if latent_field is not None:
            tensor = self._latent(sample[latent_field], where, latent_field)
        else:
            field = next((f for f in IMAGE_FIELDS if f in sample), None)
            if field is None:
                present = ", ".join(sorted(k for k in sample if not k.startswith("__"))) or "none"
                raise BadInputError(
                    f"{where}: no image field (expected one of {', '.join(IMAGE_FIELDS + LATENT_FIELDS)}; "
                    f"has: {present})"
                )
            tensor = self._image(sample[field], where, field)
        if self.hflip and uniform_coin(self.seed, epoch, np.array([sample_id]))[0] < 0.5:
            tensor = tensor.flip(-1)
        return tensor, self._label(sample, where)

    def _image(self, data: bytes, where: str, field: str) -> torch.Tensor:
        try:
            with Image.open(io.BytesIO(data)) as img:
                img = img.convert("RGB" if self.channels == 3 else "L")
                img = resize_center_crop(img, self.resolution)
                array = np.asarray(img, dtype=np.uint8)
        except Exception as e:  # noqa: BLE001 - PIL raises many types for bad bytes
            raise BadInputError(f"{where}: cannot decode field {field!r} as an image: {e}") from e
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)

    @staticmethod
    def _latent(data: bytes, where: str, field: str) -> torch.Tensor:
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except Exception as e:  # noqa: BLE001
            raise BadInputError(f"{where}: cannot decode field {field!r} as a .npy array: {e}") from e
        return torch.from_numpy(np.asarray(array, dtype=np.float32))

    @staticmethod
    def _label(sample: dict, where: str) -> int:
        field = next((f for f in LABEL_FIELDS if f in sample), None)
        if field is None:
            return NO_LABEL
        try:
            return int(sample[field].decode().strip())
        except (ValueError, UnicodeDecodeError) as e:
            raise BadInputError(f"{where}: field {field!r} is not an integer class label") from e


def resize_center_crop(img: Image.Image, size: int) -> Image.Image:
    """Shorter side to `size` (bicubic, antialiased), then a centred square crop."""
    w, h = img.size
    if (w, h) == (size, size):
        return img
    scale = size / min(w, h)
    img = img.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BICUBIC)
    w, h = img.size
    left, top = (w - size) // 2, (h - size) // 2
    return img.crop((left, top, left + size, top + size))
