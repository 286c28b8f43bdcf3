"""`prunepipe train | configs | demo`: a run from a YAML config with key=value overrides
(pipelines/training/loop.py), where the shipped configs are, and the demo's pruned and Full runs judged
(launch/demo.py)."""

from __future__ import annotations

import os


def add_commands(sub, argv: list[str]) -> None:
    train = sub.add_parser("train", help="train from a YAML config with key=value overrides")
    train.add_argument("config", help="YAML config (`prunepipe configs` prints the folder of the shipped ones)")
    train.add_argument("overrides", nargs="*", help="key=value, e.g. pruner.prune_ratio=0.3 data.batch_size=64")
    train.set_defaults(func=_train)

    configs = sub.add_parser(
        "configs", help="print the folder of the shipped YAML configs: prunepipe train $(prunepipe configs)/NAME.yaml"
    )
    configs.set_defaults(func=_configs)

    demo = sub.add_parser("demo", help="pruned vs full vs equal-compute full on the bundled digits, on CPU")
    demo.add_argument("--data", default="data/digits")
    demo.add_argument(
        "--name",
        default="demo_mae",
        help="run name prefix: NAME_infobatch[_sN], NAME_full_sN, NAME_full_short[_sN], NAME_full_half[_sN]",
    )
    demo.add_argument(
        "--passes",
        type=int,
        default=25,
        help="passes of the full schedule (0: the tiny config's 40; 12 runs of it take about 6 "
        "minutes on 2 cores, 25 passes about 3)",
    )
    demo.add_argument(
        "--seeds", type=int, default=3, help="seeds of the pruned run and its Full runs (>= 2 for an interval)"
    )
    demo.add_argument("overrides", nargs="*", help="key=value config overrides")
    demo.set_defaults(func=_demo)


def _train(args) -> None:
    from prunepipe.pipelines.config import load_config

    cfg = load_config(args.config, args.overrides)  # a mistake in it is told before torch is imported
    from prunepipe.pipelines.training.loop import train

    train(cfg)  # which checks the data the config names first, on every rank
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"run folder: {cfg.run_dir}")


def _configs(args) -> None:
    from prunepipe.launch.configs import CONFIGS

    print(CONFIGS)


def _demo(args) -> None:
    """A pruned run, its full baseline and a full run of equal compute on the digits; the verdicts."""
    from prunepipe.launch.demo import run_demo

    run_demo(args.data, args.name, passes=args.passes, overrides=args.overrides, seeds=args.seeds)
