"""The `prunepipe` command line: one subcommand per job, each a thin call into the library."""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_DATA = "data/digits"
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


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


def _train(args) -> None:
    from pipelines.config import load_config
    from pipelines.trainer import train

    cfg = load_config(args.config, args.overrides)
    train(cfg)
    print(f"run folder: {cfg.run_dir}")


def _demo(args) -> None:
    """Digits shards (written once), then a tiny MAE trained with InfoBatch on the CPU."""
    from pipelines.config import load_config
    from pipelines.trainer import train
    from tools.shards import write_shards

    if not os.path.exists(os.path.join(args.data, "train", "index.json")):
        print(f"writing scikit-learn's digits as shards in {args.data} ...")
        write_shards("digits", args.data, size=32, shard_size=300)
    config = os.path.join(CONFIGS, "mae_tiny_infobatch.yaml")
    overrides = [f"data.train={args.data}/train", f"data.val={args.data}/val", f"name={args.name}",
                 f"passes={args.passes}", *args.overrides]
    cfg = load_config(config, overrides)
    print(f"training a tiny MAE with InfoBatch for {cfg.passes} passes ({config}) ...")
    summary = train(cfg)
    print(f"\nrun folder: {cfg.run_dir}  (metrics.jsonl, checkpoints/, export/encoder.safetensors)")
    print(f"samples forwarded: {summary['samples_forwarded']}; continue a stopped run with "
          f"`prunepipe train {config} name={args.name} checkpoint.resume=latest`")


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

    train = sub.add_parser("train", help="train from a YAML config with key=value overrides")
    train.add_argument("config", help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", help="key=value, e.g. pruner.prune_ratio=0.3 data.batch_size=64")
    train.set_defaults(func=_train)

    demo = sub.add_parser("demo", help="the main job on the bundled digits, on CPU")
    demo.add_argument("--data", default=DEFAULT_DATA)
    demo.add_argument("--name", default="demo_mae_infobatch")
    demo.add_argument("--passes", type=int, default=20)
    demo.add_argument("overrides", nargs="*", help="key=value config overrides")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pipelines.shards import BadInputError

    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, BadInputError) as e:  # the user can act on these
        print(f"prunepipe: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
