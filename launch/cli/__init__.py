"""The `prunepipe` command line: one subcommand per job, each a thin call into the library.

Each command group's module owns its flags and its calls; this one builds the parser from them and runs the
command named. Building the parser imports argparse and the groups' modules only: torch and the rest load
when a command needs them, so `--help` and a mistyped config answer at once."""

from __future__ import annotations

import argparse
import sys

from prunepipe.launch.cli import (
    bench,
    checkpoints,
    compare,
    evaluate,
    export,
    fixtures,
    latents,
    shards,
    train,
)
from prunepipe.launch.cli.options import Parser

# the command groups in --help's order (shards.py adds embeddings.py's commands to its group)
GROUPS = (shards, latents, fixtures, train, evaluate, checkpoints, export, compare, bench)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line; `argv` lets a benchmark's own options be imported only when it is named."""
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(prog="prunepipe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_commands(sub, argv)
    return parser


# errors a user can act on, printed as one line; a class not yet imported cannot have been raised, so
# these are looked up after the fact instead of importing their modules (and torch) before every command
ACTIONABLE = (
    ("prunepipe.pipelines.checkpoint.store", "CheckpointError"),
    ("prunepipe.pipelines.data.shards", "BadInputError"),
)


def actionable(error: BaseException) -> bool:
    """Whether `error` is one the user can act on: ValueError (a config's ConfigError too), a missing file,
    bad input or a bad checkpoint."""
    kinds = [ValueError, FileNotFoundError]
    kinds += [getattr(sys.modules[module], name) for module, name in ACTIONABLE if module in sys.modules]
    return isinstance(error, tuple(kinds))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`eval RUN --weights raw probe.pool=avg`) are overrides too
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        code = args.func(args)
    except Exception as e:
        if not actionable(e):
            raise
        print(f"prunepipe: error: {e}", file=sys.stderr)
        return 2
    return code or 0
