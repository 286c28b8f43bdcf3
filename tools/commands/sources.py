"""Real images that ship inside installed packages, and image folders, as (key, image, label).

Nothing here downloads: scikit-learn's digits and sample photos and scikit-image's bundled
photographs are files inside those packages.
"""

from __future__ import annotations

import io
import os
import re
from typing import Iterator, Mapping

import numpy as np
from PIL import Image, ImageEnhance

from prunepipe.pipelines.data.mixture import apportion, integer_counts  # copies per original, as shares of a pass
from prunepipe.pipelines.data.resize import resize_center_crop, resize_crop
from prunepipe.tools.commands.redundant_options import COPY_COUNTS, COPY_KINDS, DEFAULT_KINDS
from prunepipe.tools.commands.source_registry import SourceOptions

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".ppm", ".tif", ".tiff")

# scikit-image's bundled photographs (in the wheel, not fetched) and scikit-learn's two samples.
SKIMAGE_PHOTOS = (
    "astronaut.png",
    "brick.png",
    "camera.png",
    "chelsea.png",
    "coffee.png",
    "grass.png",
    "gravel.png",
    "hubble_deep_field.jpg",
    "ihc.png",
    "moon.png",
    "motorcycle_left.png",
    "retina.jpg",
    "rocket.jpg",
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


def bundled_photos() -> Iterator[tuple[int, str, Image.Image]]:
    """(class, name, RGB image) of each bundled photograph, in `photo_files` order."""
    for label, path in enumerate(photo_files()):
        with Image.open(path) as img:
            photo = img.convert("RGB")
        yield label, os.path.splitext(os.path.basename(path))[0], photo


def photo_crops(size: int = 32, crops_per_photo: int = 250, seed: int = 0) -> Iterator[tuple[str, Image.Image, int]]:
    """Deterministic square crops of the bundled photographs, resized to `size`; class = photo."""
    for key, photo, label, box in photo_crop_boxes(size, crops_per_photo, seed):
        yield key, box_crop(photo, box, size), label


def box_crop(photo: Image.Image, box: tuple[int, int, int, int], size: int) -> Image.Image:
    """The (left, top, right, bottom) `box` of `photo` resized to `size` x `size`, bicubic."""
    left, top, right, bottom = box
    return resize_crop(photo, size, (top, left, bottom - top, right - left))


def photo_crop_boxes(
    size: int = 32, crops_per_photo: int = 250, seed: int = 0
) -> Iterator[tuple[str, Image.Image, int, tuple[int, int, int, int]]]:
    """(key, whole photograph, class, crop box (left, top, right, bottom)) of `photo_crops`' crops, in
    its order: where each crop sits, for captions that say so."""
    rng = np.random.default_rng(seed)
    for label, name, photo in bundled_photos():
        w, h = photo.size
        for i in range(crops_per_photo):
            side = int(rng.integers(min(size, min(w, h)), max(size, min(w, h) // 2) + 1))
            left, top = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
            yield f"photo_{name}_{i:04d}", photo, label, (left, top, left + side, top + side)


def split_by_permutation(items: list, val_fraction: float, seed: int) -> dict[str, list]:
    """train and val of `items`, each in the items' order: a fixed permutation drawn from `seed` holds
    out round(val_fraction * N) of them, so val holds every class in proportion."""
    is_val = np.zeros(len(items), dtype=bool)
    is_val[np.random.default_rng(seed).permutation(len(items))[: int(round(val_fraction * len(items)))]] = True
    return {split: [item for item, v in zip(items, is_val) if v == (split == "val")] for split in ("train", "val")}


def recoloured(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """`image` with its brightness, contrast and colour changed by up to 10%, in that order."""
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        image = enhance(image).enhance(float(rng.uniform(0.9, 1.1)))
    return image


def near_duplicate(image: Image.Image, rng: np.random.Generator, shift: int = 2) -> Image.Image:
    """A near-duplicate, as web crawls hold them: the image moved by up to `shift` pixels (enlarged by
    2 * shift and cropped back) with its brightness, contrast and colour changed by up to 10%."""
    size = image.size[0]
    big = image.resize((size + 2 * shift, size + 2 * shift), Image.BICUBIC)
    dx, dy = (int(v) for v in rng.integers(0, 2 * shift + 1, 2))
    return recoloured(big.crop((dx, dy, dx + size, dy + size)), rng)


JPEG_QUALITIES = (50, 95)  # a re-encoding's quality, drawn uniformly: what sites re-save at, low to high
CROP_KEPT = (0.85, 0.95)  # a cropped copy keeps this share of the side, drawn uniformly


def reencoded(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """The image saved as a JPEG at a random quality in JPEG_QUALITIES and decoded back, as a copy that
    a site re-encoded: the same picture, its pixels off by the codec's rounding and 4:2:0 chroma."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=int(rng.integers(JPEG_QUALITIES[0], JPEG_QUALITIES[1] + 1)))
    with Image.open(io.BytesIO(buffer.getvalue())) as decoded:
        return decoded.convert("RGB")


def slightly_cropped(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A square crop keeping a share in CROP_KEPT of the side at a random place, enlarged back to the
    image's size and recoloured within 10%: a copy someone trimmed and re-saved."""
    size = image.size[0]
    side = int(round(size * rng.uniform(*CROP_KEPT)))
    left, top = (int(v) for v in rng.integers(0, size - side + 1, 2))
    return recoloured(image.crop((left, top, left + side, top + side)).resize((size, size), Image.BICUBIC), rng)


# The kinds of copy, each with its key's tag after `_dup` and how it is made. A near copy's tag is the
# bare `_dup`, so that the default set (all near copies) keeps the keys and images the recorded
# measurements were made on (tests/test_redundant_source.py checks its digest).
COPY_TAGS = {"exact": "exact", "jpeg": "jpeg", "near": "", "crop": "crop"}
MAKE_COPY = {
    "exact": lambda image, rng: image.copy(),
    "jpeg": reencoded,
    "near": near_duplicate,
    "crop": slightly_cropped,
}
# Heavy-tailed copy counts follow Zipf's law of rank with this exponent (docs/shard-tools.md): with 1 the
# share of copies falls as 1/rank, and the count of originals copied at least n times as 1/n.
ZIPF_EXPONENT = 1.0
# A copy's key: ORIGINAL_dupNNNNN (near), ORIGINAL_dupexactNNNNN, _dupjpeg, _dupcrop; in val_mix `_heldoutdup...`.
COPY_KEY = re.compile(r"^(?P<original>.+)_(?P<heldout>heldout)?dup(?P<tag>exact|jpeg|crop)?(?P<number>\d{5})$")
KIND_OF_TAG = {tag: kind for kind, tag in COPY_TAGS.items()}


def copy_key(original: str, kind: str, number: int, heldout: bool = False) -> str:
    """The key of copy `number` (of its split) of the sample keyed `original`, naming both and the kind."""
    return f"{original}_{'heldout' if heldout else ''}dup{COPY_TAGS[kind]}{number:05d}"


def copy_kind(key: str) -> str | None:
    """The kind of copy a key names (exact, jpeg, near, crop), or None for a sample that is no copy."""
    copy = COPY_KEY.match(key)
    return KIND_OF_TAG[copy["tag"] or ""] if copy else None


def copies_by_kind(keys) -> dict[str, int]:
    """How many of `keys` are copies of each kind (every kind named, 0 when absent)."""
    counts = dict.fromkeys(COPY_KINDS, 0)
    for key in keys:
        kind = copy_kind(key)
        if kind is not None:
            counts[kind] += 1
    return counts


def check_copy_kinds(shares: Mapping[str, float] | None) -> dict[str, float]:
    """`copy_kinds` as a share per kind (every kind named), checked: known kinds, shares >= 0, sum 1;
    None: DEFAULT_KINDS."""
    if shares is None:
        shares = DEFAULT_KINDS
    unknown = sorted(set(shares) - set(COPY_KINDS))
    if unknown:
        raise ValueError(f"redundant: copy_kinds names {unknown}; accepted kinds: {', '.join(COPY_KINDS)}")
    negative = {kind: share for kind, share in shares.items() if not share >= 0}
    if negative:
        raise ValueError(f"redundant: copy_kinds shares must be >= 0, got {negative}")
    if abs(sum(shares.values()) - 1.0) > 1e-6:
        raise ValueError(
            f"redundant: copy_kinds shares must sum to 1, got {dict(shares)} (sum {sum(shares.values()):g})"
        )
    return {kind: float(shares.get(kind, 0.0)) for kind in COPY_KINDS}


def heavy_copy_counts(total: int, originals: int) -> np.ndarray:
    """Copies per original, heavy-tailed: Zipf's law of rank floored at one copy, original k getting
    max(1, c * k^-ZIPF_EXPONENT) with c set so that the counts sum to `total` (bisection, then rounded
    to integers that keep the sum). The first originals get a large share; where c * k^-s falls below
    one, the rest get one copy each (they are copied, or they would be no originals)."""
    if total < originals:
        raise ValueError(
            f"redundant: heavy copy counts copy each of the {originals} originals "
            f"(--redundant-originals) at least once, but the fraction (--redundant-fraction) makes "
            f"only {total} duplicates; lower the originals or raise the fraction"
        )
    shape = np.arange(1, originals + 1, dtype=np.float64) ** -ZIPF_EXPONENT
    low, high = 0.0, float(total)  # c = total already gives the first original every copy
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (low, middle) if np.maximum(1.0, middle * shape).sum() > total else (middle, high)
    return integer_counts(np.maximum(1.0, low * shape), total)


def copy_origins(total: int, originals: int, copy_counts: str, popularity: np.ndarray | None = None) -> np.ndarray:
    """For each of `total` copies, the index of the original it copies. even: in turn (copy i copies
    i mod originals); heavy: `popularity` copies per original when given (the train split's counts,
    for a split drawn from the train mix), shared out in their proportion, else heavy_copy_counts."""
    if copy_counts == "even":
        return np.arange(total) % originals
    counts = heavy_copy_counts(total, originals) if popularity is None else apportion(total, popularity)
    return np.repeat(np.arange(originals), counts)


def copy_kinds_in_turn(total: int, shares: dict[str, float], rng: np.random.Generator) -> np.ndarray:
    """The kind of each of `total` copies: exactly the shares' counts (largest remainders), in a random order."""
    counts = apportion(total, np.array([shares[kind] for kind in COPY_KINDS]))
    return rng.permutation(np.repeat(np.array(COPY_KINDS), counts))


def redundant_splits(
    size: int = 32,
    *,
    fraction: float = 0.5,
    originals: int = 64,
    val_fraction: float = 0.1,
    crops_per_photo: int = 250,
    seed: int = 0,
    copy_counts: str = "even",
    copy_kinds: Mapping[str, float] | None = None,
) -> dict[str, list[tuple[str, Image.Image, int]]]:
    """Photo crops with a known redundancy, like web data: in `train`, `fraction` of the samples are
    copies of `originals` unique train crops; `val` is clean (unique held-out crops, no duplicates:
    curated data, as web pretraining is judged on); `val_mix` is held-out data drawn from the train mix
    (the clean held-out crops plus the same fraction of new copies of the train originals, by the same
    rules). `train_dedup` is train less 3 in 5 of its copies.

    `copy_counts`: "even" gives every original about the same number of copies; "heavy" gives them
    heavy-tailed counts (heavy_copy_counts), a few originals copied very often, many once.
    `copy_kinds`: the share of copies of each kind (default all "near"): "exact" (identical pixels),
    "jpeg" (re-encoded at a random quality), "near" (moved by up to 2 px and recoloured), "crop"
    (trimmed by 5-15% and recoloured). A copy's key names its original and its kind (copy_key).
    Labels are the photograph, as for `photos`. The defaults give one fixed set,
    bit for bit (its digest is pinned by a test): heavy counts draw nothing, and the kinds are drawn by a generator of their own."""
    if not 0.0 <= fraction < 1.0 or originals < 1:
        raise ValueError(f"redundant: need 0 <= fraction < 1 and originals >= 1, got {fraction}, {originals}")
    if copy_counts not in COPY_COUNTS:
        raise ValueError(f"redundant: copy_counts {copy_counts!r}; accepted: {', '.join(COPY_COUNTS)}")
    shares = check_copy_kinds(copy_kinds)
    crops = list(photo_crops(size, crops_per_photo=crops_per_photo, seed=seed))
    rng = np.random.default_rng([seed, 1])  # the split, the originals, each copy's pixels, the orders
    plan_rng = np.random.default_rng([seed, 2])  # which copy is of which kind
    order = rng.permutation(len(crops))
    held = int(round(val_fraction * len(crops)))
    val = [crops[i] for i in sorted(order[:held])]
    unique = [crops[i] for i in sorted(order[held:])]
    if originals > len(unique):
        raise ValueError(f"redundant: {originals} originals asked, but only {len(unique)} unique train crops")
    sources = [unique[i] for i in rng.choice(len(unique), originals, replace=False)]

    def copies(origins: np.ndarray, heldout: bool) -> list[tuple[str, Image.Image, int]]:
        made = []
        for number, (origin, kind) in enumerate(zip(origins, copy_kinds_in_turn(len(origins), shares, plan_rng))):
            key, image, label = sources[origin]
            made.append((copy_key(key, str(kind), number, heldout), MAKE_COPY[str(kind)](image, rng), label))
        return made

    train_origins = copy_origins(int(round(fraction / (1.0 - fraction) * len(unique))), originals, copy_counts)
    train = unique + copies(train_origins, heldout=False)
    train = [train[i] for i in rng.permutation(len(train))]  # duplicates spread over the shards
    popularity = np.bincount(train_origins, minlength=originals) if copy_counts == "heavy" else None
    mix_origins = copy_origins(int(round(fraction / (1.0 - fraction) * len(val))), originals, copy_counts, popularity)
    mix = val + copies(mix_origins, heldout=True)
    # what a deduplication that knows every copy and keeps 2 in 5 of them would leave (a benchmark's oracle)
    dedup = [item for item in train if copy_kind(item[0]) is None or int(item[0][-5:]) % 5 < 2]
    return {"train": train, "val": val, "val_mix": [mix[i] for i in rng.permutation(len(mix))], "train_dedup": dedup}


def list_image_folder(root: str) -> tuple[list[str], np.ndarray]:
    """The image files under `root` in sorted path order, and their class (int32): the index of the
    first-level subfolder, or -1 for an image at the top. Paths only: nothing is opened. Symlinked
    folders are followed (clusters link class folders in from shared storage), each real folder once,
    so a link back up the tree cannot loop."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"image folder {root} does not exist")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    class_of = {name: label for label, name in enumerate(classes)}
    paths, labels = [], []
    visited: set[tuple[int, int]] = set()  # (device, inode) of each folder walked
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        info = os.stat(dirpath)
        if (info.st_dev, info.st_ino) in visited:
            dirnames[:] = []
            continue
        visited.add((info.st_dev, info.st_ino))
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


def digit_items(options: SourceOptions) -> Iterator[tuple[str, Image.Image, int]]:
    """The digits source (source_registry.py): `digits` at the options' size."""
    return digits(options.size)


def photo_items(options: SourceOptions) -> Iterator[tuple[str, Image.Image, int]]:
    """The photos source (source_registry.py): `photo_crops` at the options' size, crops and seed."""
    return photo_crops(options.size, crops_per_photo=options.crops_per_photo, seed=options.seed)
