"""The one resize of an image to a square side: the shard writers (tools/) and the decoder use it,
so an image written at a resolution and one resized while decoding get the same pixels.

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
