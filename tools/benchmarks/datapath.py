"""MAE's data path on one core, side by side in one run: what a 224 px random resized crop (scale
0.2-1) and flip costs per image from JPEG shards, and how many cores a GPU then needs.

Run: `prunepipe bench datapath` (a bundled set: 2000 crops of about 500 x 375 of the bundled photographs,
JPEG quality 90, img2dataset's jpg + cls) or `prunepipe bench datapath --data SHARDS` (a folder with
index.json, as `prunepipe shards index` writes it). Each pipeline reads every shard once per repeat,
in this one process on one torch thread (as a loader worker runs), timed in CPU seconds of the process;
repeats are interleaved so that drift hits all alike, and the median is reported:

- project: ShardStream and SampleDecoder as training runs them (uint8 crops, flips left to the device);
- project before: the same stream with the crop resized by PIL and float batches flipped on the host
  (the path before the uint8 one);
- MAE repository: webdataset's decode("pil") and transforms.v2 RandomResizedCrop, RandomHorizontalFlip,
  ToImage, ToDtype, Normalize, stacked into batches (facebookresearch/mae's pipeline on shards);
- torchvision uint8: the same tar reader, torchvision's decode_image and transforms.v2's resized_crop
  of the uint8 tensor with the project's crop boxes and flips, stacked into uint8 batches: the floor
  for those ops;
- decode alone: the tar reader and decode_image.

The cores a GPU needs: each `--target` img/s over the project's img/s a core, plus the core the
training process keeps.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import torch

from prunepipe.pipelines.data.augment import crop_uniforms, flip_coin, random_resized_crop_box
from prunepipe.pipelines.data.decode import SampleDecoder, image_pixels
from prunepipe.pipelines.data.resize import resize_crop
from prunepipe.pipelines.data.shards import ShardIndex, read_shard
from prunepipe.pipelines.data.stream import ShardStream

SIZE = 224
SCALE = (0.2, 1.0)
SEED = 0
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as MAE normalises


# ----------------------------------------------------------------------------- the bundled set
def write_bundled_jpegs(out: str, count: int = 2000, shard_size: int = 500, seed: int = 0) -> str:
    """`count` crops of about 500 x 375 (smaller photographs: their whole width or height) of the
    bundled photographs as JPEG quality 90 with their class, img2dataset's jpg + cls; returns `out`."""
    from prunepipe.tools.commands.shards import write_samples
    from prunepipe.tools.commands.sources import bundled_photos

    photos = [(label, photo) for label, _, photo in bundled_photos()]
    rng = np.random.default_rng(seed)

    def samples():
        for i in range(count):
            label, photo = photos[i % len(photos)]
            width, height = min(500, photo.width), min(375, photo.height)
            left = int(rng.integers(0, photo.width - width + 1))
            top = int(rng.integers(0, photo.height - height + 1))
            buffer = io.BytesIO()
            photo.crop((left, top, left + width, top + height)).save(buffer, format="JPEG", quality=90)
            yield {"__key__": f"{i:08d}", "jpg": buffer.getvalue(), "cls": str(label)}

    write_samples(
        out, samples(), source="bundled-jpeg", size=0, shard_size=shard_size, keys=["cls", "jpg"], desc="jpegs"
    )
    return out


# ----------------------------------------------------------------------------- the pipelines
def project(index: ShardIndex, batch: int) -> int:
    """Images of one pass of the training stream (uint8 crops, flips for the device)."""
    decoder = SampleDecoder(SIZE, crop="random_resized", crop_scale=SCALE, hflip=True, seed=SEED, pixels_on_device=True)
    return _stream_images(ShardStream(index, batch_size=batch, decoder=decoder, seed=SEED, shuffle_buffer=batch * 4))


class _PILCropDecoder(SampleDecoder):
    """The crop as the decoder resized it before the uint8 path: a PIL image, PIL's bicubic resize."""

    def _image(self, sample, field, sample_id, pass_index):
        img = self._opened(sample, field, self._fast(sample, field))
        box = random_resized_crop_box(*img.size, self.crop_scale, crop_uniforms(self.seed, pass_index, sample_id))
        return image_pixels(resize_crop(img, self.resolution, box))


def project_before(index: ShardIndex, batch: int) -> int:
    """Images of one pass with PIL's resize and float batches flipped on the host."""
    decoder = _PILCropDecoder(SIZE, crop="random_resized", crop_scale=SCALE, hflip=True, seed=SEED)
    return _stream_images(ShardStream(index, batch_size=batch, decoder=decoder, seed=SEED, shuffle_buffer=batch * 4))


def _stream_images(stream: ShardStream) -> int:
    try:
        return sum(len(b) for b in stream.pass_loader(0, num_workers=0))
    finally:
        stream.close()


def mae_repository(index: ShardIndex, batch: int) -> int:
    """Images of webdataset + PIL + transforms.v2 as MAE's main_pretrain.py transforms them."""
    import webdataset as wds
    from torchvision.transforms import v2

    transform = v2.Compose(
        [
            v2.RandomResizedCrop(SIZE, scale=SCALE, interpolation=v2.InterpolationMode.BICUBIC),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )
    dataset = wds.WebDataset(list(index.urls), shardshuffle=False).decode("pil").to_tuple("jpg", "cls")
    return _batched(((transform(img), int(label)) for img, label in dataset), batch, torch.stack)


def torchvision_uint8(index: ShardIndex, batch: int) -> int:
    """Images of the tar reader, decode_image and v2's resized_crop of the uint8 tensor, the project's boxes and flips."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import functional as F

    def crops():
        for shard, url in enumerate(index.urls):
            first = int(index.first_ids[shard])
            for position, sample in read_shard(url, lambda _: True):
                sample_id = first + position
                pixels = decode_image(torch.frombuffer(bytearray(sample["jpg"]), dtype=torch.uint8), ImageReadMode.RGB)
                height, width = pixels.shape[1:]
                box = random_resized_crop_box(width, height, SCALE, crop_uniforms(SEED, 0, sample_id))
                crop = F.resized_crop(
                    pixels, *box, [SIZE, SIZE], interpolation=F.InterpolationMode.BICUBIC, antialias=True
                )
                yield F.horizontal_flip(crop) if flip_coin(SEED, 0, [sample_id])[0] else crop

    return _batched(crops(), batch, torch.stack)


def decode_alone(index: ShardIndex, batch: int) -> int:
    """Images of the tar reader and decode_image, nothing else."""
    from torchvision.io import ImageReadMode, decode_image

    count = 0
    for url in index.urls:
        for _, sample in read_shard(url, lambda _: True):
            decode_image(torch.frombuffer(bytearray(sample["jpg"]), dtype=torch.uint8), ImageReadMode.RGB)
            count += 1
    return count


def _batched(items, batch: int, stack) -> int:
    """Count the items, stacked `batch` at a time (a short last batch too)."""
    count, pending = 0, []
    for item in items:
        pending.append(item)
        if len(pending) == batch:
            stack([p[0] if isinstance(p, tuple) else p for p in pending])
            count, pending = count + batch, []
    if pending:
        stack([p[0] if isinstance(p, tuple) else p for p in pending])
    return count + len(pending)


PIPELINES = {
    "project": project,
    "project before (PIL resize, float on the host)": project_before,
    "MAE repository (webdataset + PIL + transforms.v2)": mae_repository,
    "torchvision uint8 (same boxes and flips)": torchvision_uint8,
    "decode alone": decode_alone,
}
REFERENCE = "torchvision uint8 (same boxes and flips)"


# ----------------------------------------------------------------------------- the run
def measure(index: ShardIndex, batch: int, repeats: int) -> dict[str, float]:
    """img/s a core of each pipeline: images over CPU seconds of this process, median of `repeats`."""
    torch.set_num_threads(1)  # a loader worker's one thread
    seconds: dict[str, list[float]] = {name: [] for name in PIPELINES}
    images: dict[str, int] = {}
    for _ in range(repeats):
        for name, pipeline in PIPELINES.items():
            start = time.process_time()
            images[name] = pipeline(index, batch)
            seconds[name].append(time.process_time() - start)
    return {name: images[name] / statistics.median(seconds[name]) for name in PIPELINES}


def cores_for(target: float, per_core: float) -> int:
    """Cores a GPU training at `target` img/s needs: loader workers for the rate, and the training process's."""
    return math.ceil(target / per_core) + 1


def report(rates: dict[str, float], args, index: ShardIndex) -> str:
    reference, ours, before = (
        rates[REFERENCE],
        rates["project"],
        rates["project before (PIL resize, float on the host)"],
    )
    lines = [
        f"<!-- {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}; "
        f"{index.num_samples} images of {index.path}, batch {args.batch}, {SIZE} px, median of {args.repeats} -->",
        "",
        "| pipeline | img/s a core | / torchvision uint8 | / project before |",
        "|---|---|---|---|",
    ]
    for name, rate in rates.items():
        lines.append(f"| {name} | {rate:.0f} | {rate / reference:.2f} | {rate / before:.2f} |")
    lines += ["", "| a GPU training at | loader workers | cores |", "|---|---|---|"]
    for target in args.target:
        lines.append(f"| {target:.0f} img/s | {math.ceil(target / ours)} | {cores_for(target, ours)} |")
    lines.append(f"\n(workers at the project's {ours:.0f} img/s a core; one more core for the training process)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", help="JPEG shards (a folder with index.json); default: the bundled set")
    parser.add_argument("--images", type=int, default=2000, help="the bundled set's images (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--target",
        type=float,
        nargs="+",
        default=[1000.0, 2500.0, 7000.0],
        help="GPU training rates in img/s, for the cores each needs (default: %(default)s)",
    )


def run_from_args(args) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        location = args.data or write_bundled_jpegs(os.path.join(scratch, "jpegs"), args.images)
        index = ShardIndex.load(location)
        if index.num_samples < args.batch:  # the stream trains whole batches only
            raise ValueError(f"{index.path}: {index.num_samples} images, fewer than a batch of --batch {args.batch}")
        print(report(measure(index, args.batch, args.repeats), args, index))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    main()
