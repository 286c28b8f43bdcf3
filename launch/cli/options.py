"""What every command module of the `prunepipe` command line shares: the parser class, and the flags of
remote reads and of preprocessing jobs split over processes. argparse only at import: building the
command line must import nothing heavy."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: a subcommand's startup pays only for what it runs
    from prunepipe.pipelines.data.remote import ReadRetry


class DefaultsShown(argparse.HelpFormatter):
    """--help names each option's default where it has one and its help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = (
            action.default is None
            or action.default is False
            or action.default == []
            or action.default is argparse.SUPPRESS
        )
        if unset or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class Parser(argparse.ArgumentParser):
    """The parser of every (sub)command: argparse's, with the defaults shown (subparsers take their parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if kwargs.get("help") is None and kwargs.get("default") not in (None, False):
            kwargs["help"] = "(default: %(default)s)"  # argparse prints no help line for an option without help
        return super().add_argument(*args, **kwargs)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """RUN and --runs-dir: a run named by its folder, or by its name under the runs folder."""
    parser.add_argument("run", help="run folder (holding config.yaml) or run name under --runs-dir")
    parser.add_argument("--runs-dir", default="runs")


def add_read_retry_arguments(parser: argparse.ArgumentParser) -> None:
    """How a `pipe:`, http(s) or object-store shard's failed read is retried: the run config's
    `data.remote` fields (pipelines/data/remote.py:ReadRetry), with its defaults."""
    from prunepipe.pipelines.data.remote import ReadRetry

    default = ReadRetry()
    parser.add_argument(
        "--read-retries",
        type=int,
        default=default.retries,
        help="reopens of a remote shard within one stall of its read, as data.remote.retries (0: fail at once)",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=default.timeout_seconds,
        help="seconds without a byte that fail an attempt, as data.remote.timeout_seconds",
    )
    parser.add_argument(
        "--read-deadline",
        type=float,
        default=default.deadline_seconds,
        help="the most seconds one stall may block the reader, as data.remote.deadline_seconds",
    )


def read_retry(args) -> ReadRetry:
    """The ReadRetry the --read-* flags give (`add_read_retry_arguments`), checked."""
    from prunepipe.pipelines.data.remote import ReadRetry

    retry = ReadRetry(retries=args.read_retries, timeout_seconds=args.read_timeout, deadline_seconds=args.read_deadline)
    try:
        retry.check()
    except ValueError as e:
        raise ValueError(f"--read-retries/--read-timeout/--read-deadline: {e}") from None
    return retry


def add_job_arguments(parser: argparse.ArgumentParser, on_bad_sample: str, skip_means: str, bad: str) -> None:
    """The options of a preprocessing job split over processes (tools/commands/shard_jobs.py)."""
    parser.add_argument(
        "--rank",
        type=int,
        help="this process's share without torchrun, e.g. a SLURM array's "
        "$SLURM_ARRAY_TASK_ID (default: torchrun's RANK, then SLURM's)",
    )
    parser.add_argument("--world", type=int, help="the number of shares, with --rank")
    parser.add_argument(
        "--on-bad-sample",
        choices=("stop", "skip"),
        default=on_bad_sample,
        help=f"a sample that {bad}: stop naming shard and key, or skip ({skip_means}) (default: %(default)s)",
    )
    parser.add_argument(
        "--wait-hours",
        type=float,
        default=6.0,
        help="under torchrun: how long the ranks wait for the slowest one's shards before the index "
        "is written (default: %(default)s)",
    )
