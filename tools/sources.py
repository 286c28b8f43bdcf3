"""Real images that ship inside installed packages, and image folders, as (key, image, label).

Nothing here downloads: scikit-learn's digits and sample photos and scikit-image's bundled
photographs are files inside those packages.
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np
from PIL import Image, ImageEnhance

from pipelines.data.resize import resize_center_crop

SOURCES = ("digits", "photos", "redundant", "folder")
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
    for key, photo, label, box in photo_crop_boxes(size, crops_per_photo, seed):
        yield key, photo.crop(box).resize((size, size), Image.BICUBIC), label


def photo_crop_boxes(size: int = 32, crops_per_photo: int = 250, seed: int = 0
                     ) -> Iterator[tuple[str, Image.Image, int, tuple[int, int, int, int]]]:
    """(key, whole photograph, class, crop box (left, top, right, bottom)) of `photo_crops`' crops, in
    its order: where each crop sits, for captions that say so."""
    rng = np.random.default_rng(seed)
    for label, path in enumerate(photo_files()):
        with Image.open(path) as img:
            photo = img.convert("RGB")
        w, h = photo.size
        name = os.path.splitext(os.path.basename(path))[0]
        for i in range(crops_per_photo):
            side = int(rng.integers(min(size, min(w, h)), max(size, min(w, h) // 2) + 1))
            left, top = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
            yield f"photo_{name}_{i:04d}", photo, label, (left, top, left + side, top + side)


def near_duplicate(image: Image.Image, rng: np.random.Generator, shift: int = 2) -> Image.Image:
    """A near-duplicate, as web crawls hold them: the image moved by up to `shift` pixels (enlarged by
    2 * shift and cropped back) with its brightness, contrast and colour changed by up to 10%."""
    size = image.size[0]
    big = image.resize((size + 2 * shift, size + 2 * shift), Image.BICUBIC)
    dx, dy = (int(v) for v in rng.integers(0, 2 * shift + 1, 2))
    moved = big.crop((dx, dy, dx + size, dy + size))
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        moved = enhance(moved).enhance(float(rng.uniform(0.9, 1.1)))
    return moved


def redundant_splits(size: int = 32, *, fraction: float = 0.5, originals: int = 64, val_fraction: float = 0.1,
                     crops_per_photo: int = 250, seed: int = 0) -> dict[str, list[tuple[str, Image.Image, int]]]:
    """Photo crops with a known redundancy, like web data: in `train`, `fraction` of the samples are
    near-duplicates of `originals` unique train crops; `val` is clean (unique held-out crops, no
    duplicates: curated data, as web pretraining is judged on); `val_mix` is held-out data drawn from
    the train mix (the clean held-out crops plus the same fraction of new near-duplicates of the
    train originals). Labels are the photograph, as for `photos`."""
    if not 0.0 <= fraction < 1.0 or originals < 1:
        raise ValueError(f"redundant: need 0 <= fraction < 1 and originals >= 1, got {fraction}, {originals}")
    crops = list(photo_crops(size, crops_per_photo=crops_per_photo, seed=seed))
    rng = np.random.default_rng([seed, 1])
    order = rng.permutation(len(crops))
    held = int(round(val_fraction * len(crops)))
    val = [crops[i] for i in sorted(order[:held])]
    unique = [crops[i] for i in sorted(order[held:])]
    if originals > len(unique):
        raise ValueError(f"redundant: {originals} originals asked, but only {len(unique)} unique train crops")
    sources = [unique[i] for i in rng.choice(len(unique), originals, replace=False)]

    def copies(count: int, tag: str) -> list[tuple[str, Image.Image, int]]:
        made = []
        for i in range(count):
            key, image, label = sources[i % originals]
            made.append((f"{key}_{tag}{i:05d}", near_duplicate(image, rng), label))
        return made

    duplicates = int(round(fraction / (1.0 - fraction) * len(unique)))
    train = unique + copies(duplicates, "dup")
    train = [train[i] for i in rng.permutation(len(train))]  # duplicates spread over the shards
    mix = val + copies(int(round(fraction / (1.0 - fraction) * len(val))), "heldoutdup")
    # what a deduplication that knows every copy and keeps 2 in 5 of them would leave (a benchmark's oracle)
    dedup = [item for item in train if "_dup" not in item[0] or int(item[0][-5:]) % 5 < 2]
    return {"train": train, "val": val, "val_mix": [mix[i] for i in rng.permutation(len(mix))], "train_dedup": dedup}


def list_image_folder(root: str) -> tuple[list[str], np.ndarray]:
    """The image files under `root` in sorted path order, and their class (int32): the index of the
    first-level subfolder, or -1 for an image at the top. Paths only: nothing is opened."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"image folder {root} does not exist")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    class_of = {name: label for label, name in enumerate(classes)}
    paths, labels = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        found = [os.path.join(dirpath, f) for f in sorted(filenames) if f.lower().endswith(IMAGE_SUFFIXES)]
        top = os.path.relpath(dirpath, root).split(os.sep)[0]
        paths += found
        labels += [class_of.get(top, -1)] * len(found)
    if not paths:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {root}")
    return paths, np.array(labels, dtype=np.int32)


def folder_key(position: int) -> str:
    """A folder image's sample key: its position in sorted path order, so the same folder always
    gives an image the same key, whatever the seed or the split."""
    return f"img_{position:07d}"


def load_image(path: str, size: int | None = None) -> Image.Image:
    """One image file as RGB, resized and center-cropped to `size` when given; the error names the file."""
    try:
        with Image.open(path) as img:
            image = img.convert("RGB")
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: not a readable image: {e}") from e
    return resize_center_crop(image, size) if size is not None else image


def image_folder(root: str, size: int | None = None) -> Iterator[tuple[str, Image.Image, int]]:
    """Images under `root` in sorted order, decoded one at a time; class = index of the first-level
    subfolder (or -1)."""
    paths, labels = list_image_folder(root)
    for i, (path, label) in enumerate(zip(paths, labels)):
        yield folder_key(i), load_image(path, size), int(label)


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
