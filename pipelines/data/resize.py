"""Resizing an image to a square side or to a height x width bucket, by a centre crop, or to a square
by a given box (the random resized crop): the shard writers (tools/) and the decoder use the same
code, so an image written at a resolution and one resized while decoding get the same pixels.

PIL only: the shard writer imports this, and must not pull in torchvision (about 200 MB RSS).
"""

from __future__ import annotations

from PIL import Image


def resize_center_crop(img: Image.Image, size: int) -> Image.Image:
    """Shorter side to `size` (bicubic, antialiased), then a centred square crop."""
    return resize_cover_crop(img, size, size)[0]


def resize_cover_crop(img: Image.Image, height: int, width: int) -> tuple[Image.Image, tuple[int, int]]:
    """`img` resized to cover height x width (scale = max(height / H, width / W), bicubic, antialiased),
    then its centred height x width crop; with the crop's (top, left) in the resized image (SDXL's
    crop_coords_top_left). The square crop is the case height == width, pixel for pixel."""
    w, h = img.size
    if (w, h) == (width, height):
        return img, (0, 0)
    scale = max(height / h, width / w)
    img = img.resize((max(width, round(w * scale)), max(height, round(h * scale))), Image.BICUBIC)
    w, h = img.size
    left, top = (w - width) // 2, (h - height) // 2
    return img.crop((left, top, left + width, top + height)), (top, left)


def resize_crop(img: Image.Image, size: int, box: tuple[int, int, int, int]) -> Image.Image:
    """The (top, left, height, width) box of `img` resized to size x size, bicubic: what torchvision's
    `resized_crop` does to a PIL image (crop, then PIL's antialiased resize)."""
    top, left, height, width = box
    return img.crop((left, top, left + width, top + height)).resize((size, size), Image.BICUBIC)
