"""`prunepipe shards write | index | verify | inspect`: WebDataset shards from bundled data or a folder,
the index of shards written elsewhere, their bytes against it, and what a folder holds
(tools/commands/shards.py). The embedding and near-duplicate commands of the group: embeddings.py."""

from __future__ import annotations

import json

from prunepipe.launch.cli import embeddings
from prunepipe.launch.cli.options import add_read_retry_arguments, read_retry
from prunepipe.tools.commands.redundant_options import add_redundant_arguments, redundant_options
from prunepipe.tools.commands.source_registry import SHARD_SOURCES


def add_commands(sub, argv: list[str]) -> None:
    shards = sub.add_parser(
        "shards", help="write, index and inspect WebDataset shards; embed them and find near-duplicates"
    )
    shards_sub = shards.add_subparsers(dest="shards_command", required=True)
    add_write(shards_sub)
    add_index(shards_sub)
    check = shards_sub.add_parser(
        "verify",
        help="read every shard and check its size and CRC-32 against index.json (exit 1 when any is bad)",
    )
    check.add_argument("location", help="folder with index.json (or the index file)")
    check.add_argument(
        "--workers",
        type=int,
        default=None,
        help="shards read at a time, in threads (default: the usable cores; more for remote storage)",
    )
    add_read_retry_arguments(check)
    check.set_defaults(func=_verify)
    inspect = shards_sub.add_parser("inspect", help="counts, fields, labels and a PNG grid")
    inspect.add_argument("location", help="folder with index.json")
    inspect.add_argument("--grid", help="write a PNG grid of the first images here")
    inspect.set_defaults(func=_inspect)
    embeddings.add_commands(shards_sub)


def add_write(shards_sub) -> None:
    write = shards_sub.add_parser("write", help="write train/val shards from bundled data or a folder")
    write.add_argument(
        "--source",
        choices=tuple(SHARD_SOURCES),
        default="digits",
        help="; ".join(f"{name}: {source.help}" for name, source in SHARD_SOURCES.items()).replace("%", "%%"),
    )
    write.add_argument("--out", required=True, help="output folder (gets train/ and val/)")
    write.add_argument("--folder", help="image folder, for --source folder")
    write.add_argument(
        "--resolution",
        type=int,
        default=32,
        help="image side in pixels, as in `latents encode --resolution` and data.resolution",
    )
    write.add_argument("--shard-size", type=int, default=500, help="samples per shard")
    write.add_argument("--val-fraction", type=float, default=0.1)
    write.add_argument("--crops-per-photo", type=int, default=250, help="for --source photos and redundant")
    add_redundant_arguments(write)
    write.add_argument(
        "--seed", type=int, default=0, help="the val split, the photo crops, and the sample order of --source folder"
    )
    write.add_argument(
        "--workers",
        type=int,
        default=None,
        help="for --source folder --square: processes decoding and resizing images (default: the usable "
        "cores; 0 or 1: this process)",
    )
    write.add_argument(
        "--square",
        action="store_true",
        help="for --source folder: decode each image and write its centre square at --resolution as PNG; "
        "without it each file's bytes are written as they are (a JPEG stays a JPEG, uncropped, as "
        "img2dataset writes them) and training crops the whole image",
    )
    write.add_argument(
        "--captions",
        action="store_true",
        help="for --source digits and photos: img2dataset-style image-text pairs (jpg, txt, json), "
        "captioned from the digit or the photograph and the crop's place",
    )
    write.add_argument(
        "--aspects",
        action="store_true",
        help="with --source photos --captions: crops at 1:1, 2:1, 1:2 and 4:3 (width:height), shorter side "
        "--resolution, each kept at its own aspect ratio (data for `latents encode --buckets`)",
    )
    write.set_defaults(func=_write)


def _write(args) -> None:
    from prunepipe.tools.commands.shards import write_shards

    paths = write_shards(
        args.source,
        args.out,
        size=args.resolution,
        shard_size=args.shard_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        folder=args.folder,
        crops_per_photo=args.crops_per_photo,
        workers=args.workers,
        **(redundant_options(args) if args.source == "redundant" else {}),
        captions=args.captions,
        aspects=args.aspects,
        square=args.square,
    )
    for split, path in paths.items():
        print(f"{split}: {path}")


def add_index(shards_sub) -> None:
    index = shards_sub.add_parser("index", help="write index.json for shards written elsewhere")
    index.add_argument("shards", nargs="+", help="folders, globs, brace patterns or urls of .tar shards")
    index.add_argument("--out", required=True, help="folder for index.json")
    index.add_argument(
        "--workers",
        type=int,
        default=None,
        help="shards read at a time, in threads (default: the usable cores; more for remote "
        "storage, where waiting dominates)",
    )
    index.add_argument(
        "--verify",
        action="store_true",
        help="count the tar headers of shards that have img2dataset's *_stats.json too; they must agree",
    )
    index.add_argument(
        "--no-checksums",
        action="store_true",
        help="record each shard's size (a stat) but not its CRC-32, which reads every byte of a shard "
        "whose count did not (large local members, img2dataset's stats files): for huge local folders",
    )
    index.add_argument(
        "--aspect",
        action="store_true",
        help="also print the samples' aspect-ratio histogram (count, share) from each sample's img2dataset json "
        "width/height (else original_width/original_height), no image decoded; without them: unknown",
    )
    index.add_argument(
        "--buckets",
        default="",
        metavar="NAME|FILE",
        help="count the histogram per bucket of this table (implies --aspect; as `latents encode --buckets`), "
        "not per common ratio",
    )
    index.set_defaults(func=_index)


def _index(args) -> None:
    from prunepipe.pipelines.data.shards import ShardIndex
    from prunepipe.tools.commands.shards import index_shards

    path = index_shards(
        args.shards, args.out, workers=args.workers, verify=args.verify, checksums=not args.no_checksums
    )
    index = ShardIndex.load(path)
    counted = index.meta["counted"]
    print(
        f"{path}: {len(index)} shards, {index.num_samples} samples; "
        f"{counted['img2dataset_stats']} shard(s) counted from img2dataset's *_stats.json"
        + (" (--verify to count their tar headers too)" if counted["img2dataset_stats"] and not args.verify else "")
        + f", {counted['tar_headers_read']} from their tar headers"
        + ("; sizes recorded, no CRC-32 (--no-checksums)" if args.no_checksums else "; sizes and CRC-32s recorded")
    )
    if args.aspect or args.buckets:
        from prunepipe.tools.commands.aspect_buckets import histogram_lines, load_buckets
        from prunepipe.tools.commands.shards import aspect_counts

        table = load_buckets(args.buckets) if args.buckets else None
        histogram = aspect_counts(args.shards, table, workers=args.workers)
        print(f"aspect ratios of {histogram.total} samples, from their json's width and height:")
        print("\n".join(histogram_lines(histogram, table)))


def _verify(args) -> int:
    """Each shard's bytes against index.json: a line per bad shard, a summary, exit 1 when any is bad."""
    from prunepipe.tools.commands.shards import verify_shards

    checked, bad, read = {"size and crc32": 0, "size": 0, "nothing": 0}, 0, 0
    for check in verify_shards(args.location, workers=args.workers, retry=read_retry(args)):
        checked[check.checked] += 1
        read += check.bytes_read
        if check.problem is not None:
            bad += 1
            print(f"shard {check.url}: {check.problem}", flush=True)
    shards = sum(checked.values())
    hint = " (index.json records neither size nor CRC-32: index them again with `prunepipe shards index`)"
    print(
        f"{args.location}: {shards} shard(s), {bad} bad; {checked['size and crc32']} checked by size and CRC-32, "
        f"{checked['size']} by size alone, {checked['nothing']} not checked"
        + (hint if checked["nothing"] else "")
        + f"; {read / 2**20:.1f} MiB read"
    )
    return 1 if bad else 0


def _inspect(args) -> None:
    from prunepipe.tools.commands.shards import inspect_shards

    print(json.dumps(inspect_shards(args.location, args.grid), indent=1))
