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

from pipelines.data.resize import resize_center_crop
from pipelines.data.shards import BadInputError
from pruning.base import uniform_coin

try:  # deprecated since torchvision 0.29 (for TorchCodec, which needs FFmpeg); PIL decodes all where it is gone
    from torchvision.io import ImageReadMode, decode_image
except ImportError:  # pragma: no cover - a torchvision without them
    decode_image = None

IMAGE_FIELDS = ("png", "jpg", "jpeg", "webp", "ppm", "bmp", "tif", "tiff")
FAST_FIELDS = ("png", "jpg", "jpeg", "webp")  # torchvision decodes these; PIL the rest, and 1-channel
LATENT_FIELDS = ("latent.npy", "npy")
LABEL_FIELDS = ("cls", "label", "class")
NO_LABEL = -1


@dataclass
class SampleDecoder:
    """Decode an image (or a precomputed latent) and its optional class label.

    Per sample, `decode` gives the pixels as uint8 [C, H, W] (a latent as float32); per batch,
    `finish` brings the stacked pixels to float [-1, 1] and applies the flips: a handful of tensor
    ops per batch instead of per sample. `__call__` does both for one sample.
    """

    resolution: int = 32
    channels: int = 3
    hflip: bool = False
    seed: int = 0
    num_classes: int = 0  # > 0: a label must be below it (a bad one is named here, not met on the device)

    def __call__(self, sample: dict, sample_id: int, epoch: int) -> tuple[torch.Tensor, int]:
        pixels, label = self.decode(sample, sample_id)
        return self.finish(pixels[None], np.array([sample_id]), epoch)[0], label

    def decode(self, sample: dict, sample_id: int) -> tuple[torch.Tensor, int]:
        """(uint8 [C, H, W] pixels, or a float32 latent; the label) of one sample."""
        latent_field = next((f for f in LATENT_FIELDS if f in sample), None)
        if latent_field is not None:
            tensor = self._latent(sample, latent_field)
        else:
            field = next((f for f in IMAGE_FIELDS if f in sample), None)
            if field is None:
                present = ", ".join(sorted(k for k in sample if not k.startswith("__"))) or "none"
                raise BadInputError(
                    f"{_where(sample)}: no image field (expected one of {', '.join(IMAGE_FIELDS + LATENT_FIELDS)}; "
                    f"has: {present})"
                )
            tensor = self._image(sample, field)
        return tensor, self._label(sample)

    def finish(self, stacked: torch.Tensor, ids: np.ndarray, epoch: int) -> torch.Tensor:
        """A batch of `decode` outputs, stacked, as the model reads it: pixels in [-1, 1], each
        sample flipped where its (seed, epoch, id) coin says."""
        batch = stacked.float().div_(127.5).sub_(1.0) if stacked.dtype == torch.uint8 else stacked
        if self.hflip:
            flip = torch.from_numpy(uniform_coin(self.seed, epoch, np.asarray(ids)) < 0.5)
            if bool(flip.any()):
                batch[flip] = batch[flip].flip(-1)
        return batch

    def _image(self, sample: dict, field: str) -> torch.Tensor:
        data = sample[field]
        pixels = _fast_rgb(data) if self.channels == 3 and field in FAST_FIELDS else None
        if pixels is not None and tuple(pixels.shape[1:]) == (self.resolution, self.resolution):
            return pixels
        try:
            if pixels is not None:  # decoded, but at another size: PIL resizes the same pixels
                img = Image.fromarray(pixels.permute(1, 2, 0).numpy())
            else:
                with Image.open(io.BytesIO(data)) as opened:
                    img = opened.convert("RGB" if self.channels == 3 else "L")
            array = np.asarray(resize_center_crop(img, self.resolution), dtype=np.uint8)
        except Exception as e:  # noqa: BLE001 - PIL raises many types for bad bytes
            raise BadInputError(f"{_where(sample)}: cannot decode field {field!r} as an image: {e}") from e
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()

    @staticmethod
    def _latent(sample: dict, field: str) -> torch.Tensor:
        try:
            array = np.load(io.BytesIO(sample[field]), allow_pickle=False)
        except Exception as e:  # noqa: BLE001
            raise BadInputError(f"{_where(sample)}: cannot decode field {field!r} as a .npy array: {e}") from e
        return torch.from_numpy(np.asarray(array, dtype=np.float32))

    def _label(self, sample: dict) -> int:
        field = next((f for f in LABEL_FIELDS if f in sample), None)
        if field is None:
            return NO_LABEL
        try:
            label = int(sample[field].decode().strip())
        except (ValueError, UnicodeDecodeError) as e:
            raise BadInputError(f"{_where(sample)}: field {field!r} is not an integer class label") from e
        if self.num_classes and not -1 <= label < self.num_classes:
            raise BadInputError(f"{_where(sample)}: label {label} is out of range for {self.num_classes} classes "
                                f"(ldm.num_classes; -1 = no label)")
        return label


def _where(sample: dict) -> str:
    """The sample as an error names it (built only for an error: decoding runs once per sample)."""
    return f"shard {sample.get('__url__')} key {sample.get('__key__')!r}"


def _fast_rgb(data: bytes) -> torch.Tensor | None:
    """uint8 [3, H, W] from torchvision's libpng/libjpeg-turbo/libwebp decoders (about half of PIL's
    time on small images; the same pixels as PIL's convert("RGB"), tests/test_decode.py), or None
    where they do not apply (16-bit PNG) or fail, so that PIL decides and names the problem."""
    if decode_image is None:
        return None
    try:
        pixels = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError:
        return None
    return pixels if pixels.dtype == torch.uint8 and pixels.shape[0] == 3 else None

