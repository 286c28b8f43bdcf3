"""What `prunepipe shards write --captions` writes: the bundled digits and photo crops as img2dataset writes web
image-text pairs (KEY.jpg, KEY.txt the caption, KEY.json its metadata), captioned from what is known
of each image: the digit's name, or the photograph, the crop's place in it and how close it is.
Nothing is downloaded; the captions are plain and few, so a tiny word-level tokenizer covers them
(tools/fixtures/tiny_text_encoder.py).
"""

from __future__ import annotations

import io
import json
from typing import Iterator

import numpy as np
from PIL import Image

from prunepipe.tools.commands.sources import box_crop, bundled_photos, digits, photo_crop_boxes, split_by_permutation

CAPTIONED_SOURCES = ("digits", "photos")
# width:height of `--aspects` photo crops: square, landscape 2:1 and 4:3, portrait 1:2, as web images come
CROP_ASPECTS = ((1, 1), (2, 1), (1, 2), (4, 3))
CAPTIONED_KEYS = ["jpg", "json", "txt"]
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ROWS, COLUMNS = ("top", "middle", "bottom"), ("left", "centre", "right")


def digit_caption(label: int) -> str:
    return f"a handwritten digit {DIGIT_NAMES[label]}"


def crop_caption(photo_name: str, photo_size: tuple[int, int], box: tuple[int, int, int, int]) -> str:
    """'a close-up of the astronaut photograph, top left': the photograph, how much of it the crop holds
    (a quarter of the shorter side or less: close-up), and in which third of each axis its centre lies."""
    width, height = photo_size
    left, top, right, bottom = box
    row = ROWS[min(int(3 * (top + bottom) / 2 / height), 2)]
    column = COLUMNS[min(int(3 * (left + right) / 2 / width), 2)]
    where = "centre" if (row, column) == ("middle", "centre") else f"{row} {column}"
    zoom = "close-up" if right - left <= min(width, height) / 4 else "wide crop"
    return f"a {zoom} of the {photo_name.replace('_', ' ')} photograph, {where}"


def aspect_crops(size: int, crops_per_photo: int, seed: int = 0) -> Iterator[tuple[str, Image.Image, str, dict]]:
    """(key, image, caption, metadata) of crops of the bundled photographs in the aspect ratios of
    CROP_ASPECTS, in turn, each resized to a shorter side of `size` and kept at its own aspect: data
    for aspect-ratio buckets (`latents encode --buckets`) that ships with the installed packages."""
    rng = np.random.default_rng(seed)
    for label, name, photo in bundled_photos():
        width, height = photo.size
        for i in range(crops_per_photo):
            across, down = CROP_ASPECTS[i % len(CROP_ASPECTS)]
            unit = int(
                rng.integers(
                    max(1, min(width // across, height // down) // 3), min(width // across, height // down) + 1
                )
            )
            box_w, box_h = unit * across, unit * down
            left, top = int(rng.integers(0, width - box_w + 1)), int(rng.integers(0, height - box_h + 1))
            box = (left, top, left + box_w, top + box_h)
            scale = size / min(box_w, box_h)
            image = photo.crop(box).resize((round(box_w * scale), round(box_h * scale)), Image.BICUBIC)
            meta = {"class": label, "photograph": name, "crop": list(box)}
            yield f"photo_{name}_{i:04d}", image, crop_caption(name, photo.size, box), meta


def captioned_items(
    source: str, size: int, *, seed: int = 0, crops_per_photo: int = 250, aspects: bool = False
) -> Iterator[tuple[str, Image.Image, str, dict]]:
    """(key, image, caption, metadata) of a bundled source, in its order; with `aspects`, the photo
    crops at their own aspect ratios (`aspect_crops`)."""
    if aspects:
        if source != "photos":
            raise ValueError(f"--aspects writes the photo crops at their own aspect ratios; got --source {source}")
        yield from aspect_crops(size, crops_per_photo, seed)
        return
    if source == "digits":
        for key, image, label in digits(size):
            yield key, image, digit_caption(label), {"class": label}
        return
    if source != "photos":
        raise ValueError(f"--captions writes {', '.join(CAPTIONED_SOURCES)}; got --source {source}")
    for key, photo, label, box in photo_crop_boxes(size, crops_per_photo, seed):
        name = key.rsplit("_", 1)[0].removeprefix("photo_")
        image = box_crop(photo, box, size)
        yield key, image, crop_caption(name, photo.size, box), {"class": label, "photograph": name, "crop": list(box)}


def jpeg_bytes(image: Image.Image, quality: int = 95) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def img2dataset_sample(key: str, image: Image.Image, caption: str, meta: dict) -> dict:
    """One sample as img2dataset writes it: the image as jpg, the caption as txt, and a json with
    the caption, the key and the size beside what the source knows."""
    record = {"key": key, "caption": caption, "status": "success", "width": image.width, "height": image.height, **meta}
    return {"__key__": key, "jpg": jpeg_bytes(image), "txt": caption, "json": json.dumps(record)}


def captioned_splits(
    source: str,
    size: int,
    *,
    val_fraction: float = 0.1,
    seed: int = 0,
    crops_per_photo: int = 250,
    aspects: bool = False,
) -> dict[str, list[tuple[str, Image.Image, str, dict]]]:
    """train and val items of `source`, split by the permutation `prunepipe shards write` draws without
    captions, so that the same images are held out."""
    items = captioned_items(source, size, seed=seed, crops_per_photo=crops_per_photo, aspects=aspects)
    return split_by_permutation(list(items), val_fraction, seed)
