"""Real images that ship inside installed packages, and image folders, as (key, image, label).

Nothing here downloads: scikit-learn's digits and sample photos and scikit-image's bundled
photographs are files inside those packages.
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np
from PIL import Image

from pipelines.data.decode import resize_center_crop

SOURCES = ("digits", "photos", "folder")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".ppm", ".tif", ".tiff")

# scikit-image's bundled photographs (in the wheel, not fetched) and scikit-learn's two samples.
SKIMAGE_PHOTOS = (
    "astronaut.png", "brick.png", "camera.png", "chelsea.png", "coffee.png", "grass.png",
    "gravel.png", "hubble_deep_field.jpg", "ihc.png", "moon.png", "motorcycle_left.png",
    "retina.jpg", "rocket.jpg",
)
SKLEARN_PHOTOS = ("china.jpg", "flower.jpg")


def digits(size: int = 32) -> Iterator[tuple[str, Image.Image, int]]:
    """scikit-learn's 1,797 real 8x8 handwritten-digit scans, upscaled to `size` RGB, with class."""
    from sklearn.datasets import load_digits

    data = load_digits()
    for i, (pixels, label) in enumerate(zip(data.images, data.target)):
        gray = Image.fromarray(np.round(pixels * (255.0 / 16.0)).astype(np.uint8), mode="L")
        yield f"digits_{i:05d}", gray.resize((size, size), Image.BILINEAR).convert("RGB"), int(label)


def photo_files() -> list[str]:
    import skimage.data
    import sklearn.datasets

    sk_dir = os.path.join(os.path.dirname(sklearn.datasets.__file__), "images")
    files = [os.path.join(skimage.data.data_dir, n) for n in SKIMAGE_PHOTOS]
    files += [os.path.join(sk_dir, n) for n in SKLEARN_PHOTOS]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"bundled photographs missing from the installed packages: {missing}")
    return files


def photo_crops(size: int = 32, crops_per_photo: int = 250, seed: int = 0) -> Iterator[tuple[str, Image.Image, int]]:
    """Deterministic square crops of the bundled photographs, resized to `size`; class = photo."""
    rng = np.random.default_rng(seed)
    for label, path in enumerate(photo_files()):
        with Image.open(path) as img:
            photo = img.convert("RGB")
        w, h = photo.size
        name = os.path.splitext(os.path.basename(path))[0]
        for i in range(crops_per_photo):
            side = int(rng.integers(min(size, min(w, h)), max(size, min(w, h) // 2) + 1))
            left, top = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
            crop = photo.crop((left, top, left + side, top + side)).resize((size, size), Image.BICUBIC)
            yield f"photo_{name}_{i:04d}", crop, label


def image_folder(root: str, size: int | None = None) -> Iterator[tuple[str, Image.Image, int]]:
    """Images under `root` in sorted order; class = index of the first-level subfolder (or -1)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"image folder {root} does not exist")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.lower().endswith(IMAGE_SUFFIXES)]
    if not paths:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {root}")
    for i, path in enumerate(paths):
        rel = os.path.relpath(path, root)
        top = rel.split(os.sep)[0]
        label = classes.index(top) if top in classes else -1
        try:
            with Image.open(path) as img:
                image = img.convert("RGB")
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{path}: not a readable image: {e}") from e
        if size is not None:
            image = resize_center_crop(image, size)
        yield f"img_{i:07d}", image, label


def load_source(name: str, *, size: int, folder: str | None = None, seed: int = 0, crops_per_photo: int = 250):
    if name == "digits":
        return digits(size)
    if name == "photos":
        return photo_crops(size, crops_per_photo=crops_per_photo, seed=seed)
    if name == "folder":
        if not folder:
            raise ValueError("source 'folder' needs --folder PATH")
        return image_folder(folder, size)
    raise ValueError(f"unknown source {name!r}; accepted: {', '.join(SOURCES)}")
