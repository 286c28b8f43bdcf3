"""The `prunepipe` command line: one subcommand per job, each a thin call into the library."""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_DATA = "data/digits"


def _shards_write(args) -> None:
    from tools.shards import write_shards

    paths = write_shards(
        args.source,
        args.out,
        size=args.size,
        shard_size=args.shard_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        folder=args.folder,
        crops_per_photo=args.crops_per_photo,
    )
    for split, path in paths.items():
        print(f"{split}: {path}")


def _shards_index(args) -> None:
    from tools.shards import index_shards

    print(index_shards(args.shards, args.out))


def _shards_inspect(args) -> None:
    from tools.shards import inspect_shards

    print(json.dumps(inspect_shards(args.location, args.grid), indent=1))


def _demo(args) -> None:
    from tools.shards import inspect_shards, write_shards

    if not os.path.exists(os.path.join(args.data, "train", "index.json")):
        write_shards("digits", args.data, size=32, shard_size=300)
    grid = os.path.join(args.data, "train_grid.png")
    print(json.dumps(inspect_shards(os.path.join(args.data, "train"), grid), indent=1))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prunepipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    shards = sub.add_parser("shards", help="write, index and inspect WebDataset shards")
    shards_sub = shards.add_subparsers(dest="shards_command", required=True)
    write = shards_sub.add_parser("write", help="write train/val shards from bundled data or a folder")
    write.add_argument("--source", choices=("digits", "photos", "folder"), default="digits")
    write.add_argument("--out", required=True, help="output folder (gets train/ and val/)")
    write.add_argument("--folder", help="image folder, for --source folder")
    write.add_argument("--size", type=int, default=32, help="image side in pixels")
    write.add_argument("--shard-size", type=int, default=500, help="samples per shard")
    write.add_argument("--val-fraction", type=float, default=0.1)
    write.add_argument("--crops-per-photo", type=int, default=250, help="for --source photos")
    write.add_argument("--seed", type=int, default=0)
    write.set_defaults(func=_shards_write)
    index = shards_sub.add_parser("index", help="write index.json for shards written elsewhere")
    index.add_argument("shards", nargs="+", help="folders, globs, brace patterns or urls of .tar shards")
    index.add_argument("--out", required=True, help="folder for index.json")
    index.set_defaults(func=_shards_index)
    inspect = shards_sub.add_parser("inspect", help="counts, fields, labels and a PNG grid")
    inspect.add_argument("location", help="folder with index.json")
    inspect.add_argument("--grid", help="write a PNG grid of the first images here")
    inspect.set_defaults(func=_shards_inspect)

    demo = sub.add_parser("demo", help="the main job on the bundled digits, on CPU")
    demo.add_argument("--data", default=DEFAULT_DATA)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"prunepipe: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
