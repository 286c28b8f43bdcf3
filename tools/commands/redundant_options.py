"""The options of the redundant source (tools/commands/sources.py:redundant_splits): their accepted values and
their command-line flags, shared by `prunepipe shards write` and `prunepipe bench dedup-quality`.
argparse only: building the command line must import nothing heavy.
"""

from __future__ import annotations

import argparse

COPY_COUNTS = ("even", "heavy")  # copies per original: about equal, or heavy-tailed (Zipf's law)
COPY_KINDS = ("exact", "jpeg", "near", "crop")  # how a copy is made; near takes the shares left over
DEFAULT_KINDS = {"near": 1.0}  # the shares when none are given: all near
SHARE_FLAGS = {"exact": "--redundant-exact", "jpeg": "--redundant-jpeg", "crop": "--redundant-crop"}
# write_shards' redundant options -> the flags that set them
REDUNDANT_FLAGS = {
    "redundant_fraction": "--redundant-fraction",
    "redundant_originals": "--redundant-originals",
    "redundant_copies": "--redundant-copies",
    "redundant_kinds": "/".join(SHARE_FLAGS.values()),
}


def share(text: str) -> float:
    """A share of the copies, 0 to 1 (argparse names the flag in its message)."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share of the copies from 0 to 1, got {text}")
    return value


def duplicate_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"a fraction of the train samples from 0 up to (not including) 1, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text}")
    return value


def add_redundant_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that shape the redundant set: how much is copied, from how many originals, how often
    each, and how."""
    parser.add_argument(
        REDUNDANT_FLAGS["redundant_fraction"],
        type=duplicate_fraction,
        default=0.5,
        help="for --source redundant: fraction of train that are copies",
    )
    parser.add_argument(
        REDUNDANT_FLAGS["redundant_originals"],
        type=positive_int,
        default=64,
        help="for --source redundant: how many train crops the copies copy",
    )
    parser.add_argument(
        REDUNDANT_FLAGS["redundant_copies"],
        choices=COPY_COUNTS,
        default="even",
        help="for --source redundant: copies per original, about equal (even) or heavy-tailed "
        "by Zipf's law of rank, exponent 1, at least one each (heavy: a few originals "
        "copied very often, most once when the originals are many)",
    )
    for kind, flag in SHARE_FLAGS.items():
        parser.add_argument(
            flag,
            type=share,
            default=0.0,
            help={
                "exact": "for --source redundant: share of the copies that are exact (identical pixels)",
                "jpeg": "for --source redundant: share of the copies re-encoded as JPEG at a quality of 50-95",
                "crop": "for --source redundant: share of the copies trimmed by 5-15%% of the side and recoloured",
            }[kind]
            + "; the copies no such share takes are near ones (moved by up to 2 px, recoloured)",
        )


def copy_kinds(args: argparse.Namespace) -> dict[str, float]:
    """The share of each kind of copy from the flags: near takes what the others leave."""
    shares = {kind: getattr(args, flag[2:].replace("-", "_")) for kind, flag in SHARE_FLAGS.items()}
    taken = sum(shares.values())
    if taken > 1.0 + 1e-9:
        given = ", ".join(f"{SHARE_FLAGS[kind]} {value:g}" for kind, value in shares.items() if value)
        raise ValueError(
            f"{given}: shares of the copies that sum to {taken:g}; they may sum to at most 1 "
            f"(near copies take the rest)"
        )
    return {**shares, "near": max(0.0, 1.0 - taken)}


def redundant_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of tools/commands/shards.py:write_shards that the flags set."""
    return {
        "redundant_fraction": args.redundant_fraction,
        "redundant_originals": args.redundant_originals,
        "redundant_copies": args.redundant_copies,
        "redundant_kinds": copy_kinds(args),
    }
