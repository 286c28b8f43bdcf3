"""Decoding one undecoded webdataset sample into (image tensor [C, H, W] in [-1, 1], label), and its
text when the task reads one: the caption, or its precomputed text-encoder features.

This is the expensive step that pruned samples never reach. Augmentation randomness is a
pure function of (seed, pass_index, id) with a stream per purpose (pipelines/data/augment.py), so resumed
runs and any worker layout see the same crops and flips.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from prunepipe.pipelines.data.augment import CROPS, crop_uniforms, flip_coin, random_resized_crop_box
from prunepipe.pipelines.data.resize import resize_center_crop
from prunepipe.pipelines.data.shards import BadInputError

try:  # deprecated since torchvision 0.29 (for TorchCodec, which needs FFmpeg); PIL decodes all where it is gone
    from torchvision.io import ImageReadMode, decode_image
except ImportError:  # pragma: no cover - a torchvision without them
    decode_image = None

IMAGE_FIELDS = ("png", "jpg", "jpeg", "webp", "ppm", "bmp", "tif", "tiff")
FAST_FIELDS = ("png", "jpg", "jpeg", "webp")  # torchvision decodes these; PIL the rest, and 1-channel
LATENT_FIELDS = ("latent.npy", "npy")
FLIPPED_LATENT_FIELD = "latent_flip.npy"  # the latent of the mirrored image (`prunepipe latents encode --flip`)
LABEL_FIELDS = ("cls", "label", "class")
CAPTION_FIELD = "txt"  # img2dataset's caption (LAION, DataComp, CC12M, COYO shards alike)
METADATA_FIELD = "json"  # img2dataset's metadata, which holds the caption too
TEXT_FEATURES_FIELD = "text.npy"  # the caption's real tokens' features [n, D] (`latents encode --text-encoder`)
NO_LABEL = -1


@dataclass
class SampleDecoder:
    """Decode an image (or a precomputed latent) and its optional class label.

    Per sample, `decode` gives the pixels as uint8 [C, H, W] (a latent as float32), cropped; per
    batch, `finish` brings the stacked pixels to float [-1, 1] and applies the flips: a handful of
    tensor ops per batch instead of per sample. `__call__` does both for one sample.

    A latent cannot be cropped, nor mirrored exactly (the encoder's convolutions are not mirror-
    symmetric): with `hflip`, `decode` picks the stored latent of the mirrored image where the flip
    coin says (docs/diffusion.md, "Latents and flips").
    """

    resolution: int = 32
    channels: int = 3
    hflip: bool = False
    seed: int = 0
    num_classes: int = 0  # > 0: a label must be below it (a bad one is named here, not met on the device)
    crop: str = "center"  # center: shorter side to `resolution`, centre square; random_resized: MAE's
    crop_scale: tuple[float, float] = (0.2, 1.0)  # random_resized: the crop's share of the image area
    captions: bool = False  # the task reads captions: a sample without one is bad input (data.on_bad_sample)
    # > 0: the task reads precomputed text features of this width, at most text_max_length tokens
    text_width: int = 0
    text_max_length: int = 0
    # True: a batch keeps its uint8 pixels and carries its flip coins, and `Batch.to` brings them to float
    # and flips them on the device it moves to (a quarter of the bytes to copy, no float work in the
    # loader workers); False: `finish` does that on the host. Either gives the same floats.
    pixels_on_device: bool = False

    def __post_init__(self):
        if self.crop not in CROPS:
            raise ValueError(f"data.crop: got {self.crop!r}, accepted: {', '.join(CROPS)}")

    def __call__(self, sample: dict, sample_id: int, pass_index: int) -> tuple[torch.Tensor, int]:
        pixels, label = self.decode(sample, sample_id, pass_index)
        return self.finish(pixels[None], np.array([sample_id]), pass_index)[0], label

    def decode(self, sample: dict, sample_id: int, pass_index: int = 0) -> tuple[torch.Tensor, int]:
        """(uint8 [C, H, W] pixels, or a float32 latent; the label) of one sample in pass `pass_index`."""
        latent_field = next((f for f in LATENT_FIELDS if f in sample), None)
        if latent_field is not None:
            if self.crop != "center":
                raise ValueError(
                    f"{_where(sample)}: data.crop={self.crop} crops images, and this shard holds "
                    f"latents; use data.crop=center (crop before encoding instead)"
                )
            if self.hflip:
                latent_field = self._latent_flip_choice(sample, latent_field, sample_id, pass_index)
            tensor = self._latent(sample, latent_field)
        else:
            field = next((f for f in IMAGE_FIELDS if f in sample), None)
            if field is None:
                raise BadInputError(
                    f"{_where(sample)}: no image field (expected one of {', '.join(IMAGE_FIELDS + LATENT_FIELDS)}; "
                    f"has: {_fields(sample)})"
                )
            tensor = self._image(sample, field, sample_id, pass_index)
        return tensor, self._label(sample)

    def decode_original(self, sample: dict) -> tuple[Image.Image, int]:
        """(the sample's image as decoded, before any resize or crop, RGB or L as `channels` says; its
        label): what `latents encode --buckets` cuts to the image's aspect-ratio bucket. The same pixels
        `decode` starts from (torchvision's decoders where they apply, else PIL)."""
        field = next((f for f in IMAGE_FIELDS if f in sample), None)
        if field is None:
            raise BadInputError(
                f"{_where(sample)}: no image field (expected one of {', '.join(IMAGE_FIELDS)}; has: {_fields(sample)})"
            )
        try:
            img = self._opened(sample, field, self._fast(sample, field))
        except Exception as e:  # noqa: BLE001 - PIL raises many types for bad bytes
            raise BadInputError(f"{_where(sample)}: cannot decode field {field!r} as an image: {e}") from e
        return img, self._label(sample)

    def text(self, sample: dict) -> str | np.ndarray | None:
        """What the task reads of the sample's text: its caption, its features [n, D], or None."""
        if self.text_width:
            return text_features(sample, self.text_width, self.text_max_length)
        return caption(sample) if self.captions else None

    def finish(self, stacked: torch.Tensor, ids: np.ndarray, pass_index: int) -> torch.Tensor:
        """A batch of `decode` outputs, stacked, as the model reads it: pixels in [-1, 1], each
        image flipped where its flip coin of (seed, pass_index, id) says (latents were chosen in `decode`)."""
        if stacked.dtype != torch.uint8:
            return stacked
        batch = stacked.float().div_(127.5).sub_(1.0).contiguous()
        if self.hflip:
            flip = torch.from_numpy(flip_coin(self.seed, pass_index, ids))
            if bool(flip.any()):
                batch[flip] = batch[flip].flip(-1)
        return batch

    def batch_images(
        self, stacked: torch.Tensor, ids: np.ndarray, pass_index: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(a batch's images, its flip coins or None) as the stream hands them on: with `pixels_on_device`
        uint8 pixels and a bool [B] of the images `finish` would mirror; else `finish`'s floats and None."""
        if not (self.pixels_on_device and stacked.dtype == torch.uint8):
            return self.finish(stacked, ids, pass_index), None
        return stacked, torch.from_numpy(flip_coin(self.seed, pass_index, ids)) if self.hflip else None

    def _latent_flip_choice(self, sample: dict, plain_field: str, sample_id: int, pass_index: int) -> str:
        """The field of the plain latent or, where the flip coin says, of the mirrored image's."""
        if FLIPPED_LATENT_FIELD not in sample:
            raise ValueError(
                f"{_where(sample)}: data.hflip=true on latent shards needs the latent of the mirrored "
                f"image ({FLIPPED_LATENT_FIELD}): encode with `prunepipe latents encode --flip`, "
                f"or set data.hflip=false"
            )
        return FLIPPED_LATENT_FIELD if flip_coin(self.seed, pass_index, [sample_id])[0] else plain_field

    def _fast(self, sample: dict, field: str) -> torch.Tensor | None:
        """uint8 [3, H, W] from torchvision's decoders where they apply (RGB, their formats), else None."""
        return _fast_rgb(sample[field]) if self.channels == 3 and field in FAST_FIELDS else None

    def _opened(self, sample: dict, field: str, pixels: torch.Tensor | None) -> Image.Image:
        """The image as decoded, uncropped: the fast decoders' `pixels` where there are some (PIL resizes
        the same pixels), else PIL's decoding, in RGB or L as `channels` says."""
        if pixels is not None:
            return Image.fromarray(pixels.permute(1, 2, 0).numpy())
        with Image.open(io.BytesIO(sample[field])) as opened:
            return opened.convert("RGB" if self.channels == 3 else "L")

    def _image(self, sample: dict, field: str, sample_id: int, pass_index: int) -> torch.Tensor:
        pixels = self._fast(sample, field)
        random_crop = self.crop == "random_resized"
        if pixels is not None and not random_crop and tuple(pixels.shape[1:]) == (self.resolution, self.resolution):
            return pixels
        try:
            if random_crop:  # on the original image, before any resize (MAE's RandomResizedCrop)
                if pixels is None:
                    pixels = image_pixels(self._opened(sample, field, None))
                height, width = pixels.shape[1:]
                box = random_resized_crop_box(
                    width, height, self.crop_scale, crop_uniforms(self.seed, pass_index, sample_id)
                )
                return tensor_resized_crop(pixels, self.resolution, box)
            return image_pixels(resize_center_crop(self._opened(sample, field, pixels), self.resolution))
        except Exception as e:  # noqa: BLE001 - PIL raises many types for bad bytes
            raise BadInputError(f"{_where(sample)}: cannot decode field {field!r} as an image: {e}") from e

    @staticmethod
    def _latent(sample: dict, field: str) -> torch.Tensor:
        return torch.from_numpy(np.asarray(_npy(sample, field), dtype=np.float32))

    def _label(self, sample: dict) -> int:
        field = next((f for f in LABEL_FIELDS if f in sample), None)
        if field is None:
            return NO_LABEL
        try:
            label = int(sample[field].decode().strip())
        except (ValueError, UnicodeDecodeError) as e:
            raise BadInputError(f"{_where(sample)}: field {field!r} is not an integer class label") from e
        if self.num_classes and not -1 <= label < self.num_classes:
            raise BadInputError(
                f"{_where(sample)}: label {label} is out of range for {self.num_classes} classes "
                f"(ldm.num_classes; -1 = no label)"
            )
        return label


def tensor_resized_crop(pixels: torch.Tensor, size: int, box: tuple[int, int, int, int]) -> torch.Tensor:
    """The (top, left, height, width) box of uint8 `pixels` [C, H, W] resized to size x size, bicubic and
    antialiased on the uint8 tensor: torchvision's `resized_crop` of a tensor, without a PIL image. PIL's
    bicubic filter (the same a = -0.5 kernel, antialiased alike) gives pixels within about 0.05 levels on
    average (docs/data.md, "Pixels of the random resized crop") at about twice the speed; channels-last
    is the layout torch's uint8 kernel reads fastest (docs/throughput.md)."""
    top, left, height, width = box
    crop = pixels[None, :, top : top + height, left : left + width].contiguous(memory_format=torch.channels_last)
    if (height, width) == (size, size):
        return crop[0]
    return torch.nn.functional.interpolate(crop, size=(size, size), mode="bicubic", antialias=True)[0]


def stack_pixels(pixels: list[torch.Tensor]) -> torch.Tensor:
    """The samples' `decode` outputs as one batch [B, ...]. Channels-last pixels (the crop's resize
    leaves them so) are stacked as such, a copy of whole rows, and the batch is channels-last too:
    stacking them into the default layout transposes every image on the host, about a tenth of the
    crop's time; the device makes the floats contiguous (`Batch.to`)."""
    if all(p.dtype == torch.uint8 and p.dim() == 3 and p.stride(0) == 1 for p in pixels):
        return torch.stack([p.permute(1, 2, 0) for p in pixels]).permute(0, 3, 1, 2)
    return torch.stack(pixels)


def image_pixels(img: Image.Image) -> torch.Tensor:
    """uint8 [C, H, W] of a PIL image (C = 1 for L)."""
    array = np.asarray(img, dtype=np.uint8)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def caption(sample: dict) -> str:
    """The sample's caption: the `txt` field (UTF-8, stripped), else (no `txt`, or an empty one) the
    `caption` of its `json` metadata, where img2dataset writes it too. Missing everywhere, empty
    everywhere or undecodable is bad input, never a silently unconditional sample."""
    raw = sample.get(CAPTION_FIELD)
    if raw is None:
        return _json_caption(sample)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise BadInputError(f"{_where(sample)}: field {CAPTION_FIELD!r} is not UTF-8 text: {e}") from e
    return text or _json_caption(sample, txt="empty")


def _json_caption(sample: dict, txt: str = "missing") -> str:
    """img2dataset's `json` metadata's `caption`, for a sample whose `txt` field is `txt` (missing or empty)."""
    missing = (
        f"{_where(sample)}: no caption (field {CAPTION_FIELD!r} {txt}, and no 'caption' in field "
        f"{METADATA_FIELD!r}; has: {_fields(sample)})"
    )
    raw = sample.get(METADATA_FIELD)
    if raw is None:
        raise BadInputError(missing)
    try:
        text = json.loads(raw).get("caption")
    except (ValueError, AttributeError) as e:
        raise BadInputError(f"{_where(sample)}: field {METADATA_FIELD!r} is not a JSON object: {e}") from e
    if not isinstance(text, str) or not text.strip():
        raise BadInputError(missing)
    return text.strip()


def text_features(sample: dict, width: int, max_length: int) -> np.ndarray:
    """The features of the sample's caption's real tokens, [n, width] (1 <= n <= max_length), as stored
    (float16 or float32). Missing or malformed is bad input, never a silently unconditional sample."""
    if TEXT_FEATURES_FIELD not in sample:
        raise BadInputError(
            f"{_where(sample)}: no text features (field {TEXT_FEATURES_FIELD!r}, written by "
            f"`prunepipe latents encode --text-encoder`; has: {_fields(sample)})"
        )
    array = _npy(sample, TEXT_FEATURES_FIELD)
    if (
        array.ndim != 2
        or array.shape[1] != width
        or not 1 <= array.shape[0] <= max_length
        or array.dtype not in (np.float16, np.float32)
    ):
        raise BadInputError(
            f"{_where(sample)}: field {TEXT_FEATURES_FIELD!r} holds {array.dtype} {list(array.shape)}; "
            f"expected float16 or float32 [tokens, {width}] with 1 to {max_length} tokens, as the "
            f"shards' index.json records"
        )
    return array


def _npy(sample: dict, field: str) -> np.ndarray:
    """A field's .npy bytes as an array; bytes that are not one are bad input, naming the field."""
    try:
        return np.load(io.BytesIO(sample[field]), allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - numpy raises many types for bad bytes
        raise BadInputError(f"{_where(sample)}: cannot decode field {field!r} as a .npy array: {e}") from e


def _fields(sample: dict) -> str:
    """The sample's fields, for a message about one it lacks."""
    return ", ".join(sorted(k for k in sample if not k.startswith("__"))) or "none"


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
