"""Resizing an image to a square side, by a centre crop or a given box (the random resized crop):
the shard writers (tools/) and the decoder use the same code, so an image written at a resolution
and one resized while decoding get the same pixels.

PIL only: the shard writer imports this, and must not pull in torchvision (about 200 MB RSS).
"""

from __future__ import annotations

from PIL import Image


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


def resize_crop(img: Image.Image, size: int, box: tuple[int, int, int, int]) -> Image.Image:
    """The (top, left, height, width) box of `img` resized to size x size, bicubic: what torchvision's
    `resized_crop` does to a PIL image (crop, then PIL's antialiased resize)."""
    top, left, height, width = box
    return img.crop((left, top, left + width, top + height)).resize((size, size), Image.BICUBIC)
