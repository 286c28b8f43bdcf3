"""Benchmark: the shard tools at scale. Generates an image folder of class subfolders (crops of the
photographs bundled with scikit-image and scikit-learn, with jitter), writes it with `prunepipe
shards write --source folder` (wall time, peak memory of the process tree), then indexes the written
shards with this tree's `shards index`, with and without `--no-checksums` (each shard's CRC-32 for
its index entry, or its size alone), and another tree's (today's code: a checkout of main), run
alternately, warm and with the shards evicted from the page cache, as written (shards write leaves
img2dataset's stats files beside its tars) and without the stats files (every shard's headers read);
prints the times and the ratios: what the checksums cost, and old / new.

    python -m prunepipe.tools.benchmarks.shard_tools --folder /tmp/bench_folder --images 100000 --old-tree /tmp/old_main

Nothing is written inside the repository; the folder is reused when it already holds the images.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from PIL import Image, ImageEnhance

from prunepipe.tools.commands.sources import photo_files

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


# ---------------------------------------------------------------------------- the image folder
def make_folder(root: str, images: int, classes: int, side: int, seed: int = 0) -> int:
    """`images` JPEGs of `side` px in `classes` subfolders: class c is a region of one bundled photo,
    each image a random crop of it with brightness and colour jitter. Returns how many it wrote."""
    photos = []
    for path in photo_files():
        with Image.open(path) as img:
            photos.append(img.convert("RGB"))
    rng = np.random.default_rng(seed)
    written = 0
    for c in range(classes):
        photo = photos[c % len(photos)]
        w, h = photo.size
        region = min(max(side * 2, min(w, h) // 3), min(w, h))  # at 256 px: the whole photo's short side
        left, top = int(rng.integers(0, w - region + 1)), int(rng.integers(0, h - region + 1))
        folder = os.path.join(root, f"class_{c:03d}")
        os.makedirs(folder, exist_ok=True)
        for i in range(images // classes + (c < images % classes)):
            crop_side = int(rng.integers(side, region + 1))
            x, y = (
                left + int(rng.integers(0, region - crop_side + 1)),
                top + int(rng.integers(0, region - crop_side + 1)),
            )
            image = photo.crop((x, y, x + crop_side, y + crop_side)).resize((side, side), Image.BILINEAR)
            image = ImageEnhance.Brightness(image).enhance(float(rng.uniform(0.8, 1.2)))
            image = ImageEnhance.Color(image).enhance(float(rng.uniform(0.8, 1.2)))
            image.save(os.path.join(folder, f"{c:03d}_{i:06d}.jpg"), quality=90)
            written += 1
    return written


def count_images(root: str) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


# ---------------------------------------------------------------------------- measuring a command
def tree_memory(pid: int) -> tuple[int, int]:
    """(proportional set size summed over a process and its descendants: pages shared between them,
    such as a forked worker's copy of its parent's, counted once; the largest single RSS), in bytes."""
    pss = largest = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/smaps_rollup") as f:
                fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.endswith("kB\n")}
            pss, largest = pss + fields["Pss"], max(largest, fields["Rss"])
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    pending += [int(child) for child in f.read().split()]
        except (OSError, KeyError):
            continue  # gone meanwhile
    return pss, largest


def run_measured(command: list[str], tree: str) -> tuple[float, int, int]:
    """(wall seconds, peak summed PSS, peak single-process RSS; polled every 50 ms) of a command run
    with `tree` first on the import path."""
    env = {**os.environ, "PYTHONPATH": tree, "TQDM_DISABLE": "1"}
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    peak_pss = peak_rss = 0
    while process.poll() is None:
        pss, rss = tree_memory(process.pid)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(0.05)
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} (PYTHONPATH={tree}) failed with exit code {process.returncode}")
    return time.perf_counter() - start, peak_pss, peak_rss


IMPORTS_ONLY = "import prunepipe.tools.commands.shards, time; time.sleep(1)"
NO_CHECKSUMS = "new --no-checksums"  # this tree's index, each shard's size recorded and no CRC-32


# ---------------------------------------------------------------------------- indexing, old and new
INDEX_TIMER = """
import sys, time
from prunepipe.tools.commands.shards import index_shards
options = {"workers": int(sys.argv[3])} if len(sys.argv) > 3 and sys.argv[3] != "-" else {}  # the old: none
if len(sys.argv) > 4:
    options["checksums"] = False
start = time.perf_counter()
index_shards([sys.argv[1]], sys.argv[2], **options)
seconds = time.perf_counter() - start
try:  # bytes this process and its reaped workers had fetched from storage (page-cache misses)
    with open("/proc/self/io") as f:
        fetched = int(next(line for line in f if line.startswith("read_bytes:")).split()[1])
except (OSError, StopIteration):
    fetched = -1
print(seconds, fetched)
"""


def index_seconds(
    tree: str, shards: str, out: str, workers: int | None = None, checksums: bool = True
) -> tuple[float, int]:
    """(seconds one `index_shards` call takes in a fresh process of `tree`, imports not counted; bytes
    it read from storage, -1 where /proc/self/io is missing). `checksums` False is `--no-checksums`."""
    env = {**os.environ, "PYTHONPATH": tree, "TQDM_DISABLE": "1"}
    extra = ([] if workers is None else [str(workers)]) if checksums else [str(workers or "-"), "no-checksums"]
    done = subprocess.run(
        [sys.executable, "-c", INDEX_TIMER, shards, out, *extra],
        env=env,
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
    )
    seconds, fetched = done.stdout.strip().splitlines()[-1].split()
    return float(seconds), int(fetched)


def evict(paths: list[str]) -> None:
    """Drop `paths` from the page cache, theirs only (posix_fadvise DONTNEED, after a sync so that
    none is dirty): other work on the machine keeps its cache."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def large_member_shards(root: str, samples: int, member_bytes: int, shard_size: int = 500) -> tuple[str, str]:
    """Shards whose images are ImageNet-sized (`member_bytes` of incompressible bytes, as a JPEG is),
    written with webdataset's TarWriter, in `root`/plain and again (hard links) in `root`/stats with
    an img2dataset stats file beside each. Returns the two folders."""
    import json

    import webdataset as wds

    plain, stats = os.path.join(root, "plain"), os.path.join(root, "stats")
    os.makedirs(plain, exist_ok=True)
    os.makedirs(stats, exist_ok=True)
    rng = np.random.default_rng(0)
    for shard, start in enumerate(range(0, samples, shard_size)):
        name = f"{shard:05d}"
        path = os.path.join(plain, name + ".tar")
        count = min(shard_size, samples - start)
        if not os.path.exists(path):
            with wds.TarWriter(path) as sink:
                for i in range(start, start + count):
                    sink.write({"__key__": f"{i:09d}", "jpg": rng.bytes(member_bytes), "txt": f"caption {i}"})
        if not os.path.exists(os.path.join(stats, name + ".tar")):
            os.link(path, os.path.join(stats, name + ".tar"))
        with open(os.path.join(stats, name + "_stats.json"), "w") as f:
            json.dump(
                {
                    "count": count,
                    "successes": count,
                    "failed_to_download": 0,
                    "failed_to_resize": 0,
                    "duration": 0.0,
                    "status_dict": {"success": count},
                },
                f,
            )
    return plain, stats


def tars_only(shards: str) -> str:
    """`shards`' tars alone, hard-linked into `shards`_tars: indexed there, every shard's headers are
    read, as for shards another writer made without stats files."""
    folder = shards.rstrip("/") + "_tars"
    os.makedirs(folder, exist_ok=True)
    urls = glob.glob(os.path.join(shards, "*.tar"))
    for gone in set(os.listdir(folder)) - {os.path.basename(url) for url in urls}:
        os.remove(os.path.join(folder, gone))
    for url in urls:
        link = os.path.join(folder, os.path.basename(url))
        if os.path.exists(link) and not os.path.samefile(link, url):
            os.remove(link)  # a tar written again since
        if not os.path.exists(link):
            os.link(url, link)
    return folder


def compare_index(
    label: str, shards: str, sides: list[tuple[str, str]], repeats: int, workers: int | None = None
) -> None:
    """Time `index_shards` on `shards` for each (name, tree), alternated, warm and cold, this tree's
    with `workers` (default: its own) and, as the side NO_CHECKSUMS, `--no-checksums`; print medians,
    what the checksums cost (new / NO_CHECKSUMS) and, with an "old" side, old / new."""
    urls = sorted(glob.glob(os.path.join(shards, "*.tar")))
    print(f"{label}: {len(urls)} shards, {sum(os.path.getsize(u) for u in urls) / 2**20:.0f} MiB in {shards}")
    index_out = shards.rstrip("/") + "_index"
    for cache in ("warm", "cold"):
        times: dict[str, list[float]] = {name: [] for name, _ in sides}
        fetched: dict[str, list[int]] = {name: [] for name, _ in sides}
        if cache == "warm":
            for url in urls:  # every page in the cache (the header walk alone would leave the data out)
                with open(url, "rb") as f:
                    while f.read(1 << 24):
                        pass
        for _ in range(repeats):
            for name, tree in sides:  # alternated, so that changing load falls on both
                if cache == "cold":
                    evict(urls + glob.glob(os.path.join(shards, "*_stats.json")))  # what index reads
                seconds, read_bytes = index_seconds(
                    tree, shards, index_out, workers if tree == HERE else None, checksums=name != NO_CHECKSUMS
                )
                times[name].append(seconds)
                fetched[name].append(read_bytes)
        line = ", ".join(
            f"{name} median {statistics.median(t):.3f} s ({' '.join(f'{x:.3f}' for x in t)}), "
            f"read from storage {statistics.median(fetched[name]) / 2**20:.0f} MiB"
            for name, t in times.items()
        )
        ratio = (
            f"; with / without checksums = {statistics.median(times['new']) / statistics.median(times[NO_CHECKSUMS]):.2f}x"
            if NO_CHECKSUMS in times
            else ""
        )
        ratio += (
            f"; old / new = {statistics.median(times['old']) / statistics.median(times['new']):.1f}x"
            if "old" in times
            else ""
        )
        print(f"  shards index, {cache} cache: {line}{ratio}")


def load_line() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--folder", required=True, help="the image folder to generate (or reuse); outside the repo")
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--side", type=int, default=32, help="generated image side in pixels")
    parser.add_argument("--out", help="where the shards go (default: FOLDER_shards)")
    parser.add_argument("--workers", type=int, default=None, help="shards write --workers (default: its own)")
    parser.add_argument("--old-tree", help="a checkout of the code to compare `shards index` against (today's)")
    parser.add_argument("--old-write", action="store_true", help="also time --old-tree's shards write (slow)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-write", action="store_true", help="index the shards already in --out")
    parser.add_argument(
        "--large-members",
        type=int,
        default=0,
        help="also index this many samples of ImageNet-sized images (written to OUT_large)",
    )
    parser.add_argument("--member-kib", type=int, default=110, help="their image size in KiB")
    parser.add_argument(
        "--index-workers",
        type=int,
        default=None,
        help="shards index --workers (default: its own, the usable cores); more than the cores "
        "overlaps the waits for storage",
    )


def run_from_args(args) -> int:
    out = args.out or args.folder.rstrip("/") + "_shards"
    print(f"load average at start: {load_line()} on {os.cpu_count()} cores")

    if (count_images(args.folder) if os.path.isdir(args.folder) else 0) < args.images:
        start = time.perf_counter()
        made = make_folder(args.folder, args.images, args.classes, args.side)
        print(f"generated {made} images in {time.perf_counter() - start:.1f} s")
    images = count_images(args.folder)

    _, pss, rss = run_measured([sys.executable, "-c", IMPORTS_ONLY], HERE)
    print(
        f"importing the shard tools alone (torch comes with webdataset): PSS {pss / 2**20:.0f} MiB, "
        f"RSS {rss / 2**20:.0f} MiB"
    )
    trees = [("new", HERE)] + ([("old", os.path.abspath(args.old_tree))] if args.old_tree and args.old_write else [])
    for name, tree in trees if not args.skip_write else []:
        command = [
            sys.executable,
            "-m",
            "prunepipe.launch.cli",
            "shards",
            "write",
            "--source",
            "folder",
            "--folder",
            args.folder,
            "--out",
            out + ("" if name == "new" else "_old"),
            "--shard-size",
            "500",
        ]
        command += ["--resolution" if name == "new" else "--size", str(args.side)]  # the old tree: --size only
        if name == "new" and args.workers is not None:
            command += ["--workers", str(args.workers)]
        wall, pss, rss = run_measured(command, tree)
        print(
            f"shards write ({name}{', --workers ' + str(args.workers) if name == 'new' and args.workers is not None else ''}), "
            f"{images} images: {wall:.1f} s, peak memory of the process tree {pss / 2**20:.0f} MiB (PSS), "
            f"largest process {rss / 2**20:.0f} MiB (RSS)"
        )

    sides = [("new", HERE), (NO_CHECKSUMS, HERE)] + ([("old", os.path.abspath(args.old_tree))] if args.old_tree else [])
    workers = args.index_workers
    train = os.path.join(out, "train")
    if not args.skip_write or os.path.isdir(train):
        stated = len(glob.glob(os.path.join(train, "*_stats.json")))
        compare_index(
            f"the written folder's train shards, as written ({stated} img2dataset stats files beside them)",
            train,
            sides,
            args.repeats,
            workers,
        )
        compare_index(
            "the same tars without their stats files (headers read)", tars_only(train), sides, args.repeats, workers
        )
    if args.large_members:
        plain, stats = large_member_shards(out + "_large", args.large_members, args.member_kib * 1024)
        compare_index(f"{args.large_members} samples of {args.member_kib} KiB", plain, sides, args.repeats, workers)
        compare_index("the same with img2dataset stats beside each shard", stats, sides, args.repeats, workers)
    print(f"load average at end: {load_line()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
