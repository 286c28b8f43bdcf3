"""The sources `prunepipe shards write --source NAME` writes from, by name: adding a source is one entry
of SHARD_SOURCES. The command line reads the names and help lines from here before any source runs, so
this module imports nothing heavy and names each source's function as "module:function" (imported when
that source is written).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

if TYPE_CHECKING:
    from PIL.Image import Image

    Item = tuple[str, Image, int]  # (key, image, class): a sample before it is encoded; class -1 when unknown
    ItemsFunction = Callable[["SourceOptions"], Iterable[Item]]
    WriteFunction = Callable[[str, "SourceOptions"], dict[str, str]]


@dataclass(frozen=True)
class SourceOptions:
    """What `shards write`'s flags give a source: tools/commands/shards.py:write_shards' arguments, whose
    defaults they are."""

    size: int
    shard_size: int
    val_fraction: float
    seed: int
    folder: str | None
    crops_per_photo: int
    redundant_fraction: float
    redundant_originals: int
    redundant_copies: str
    redundant_kinds: Mapping[str, float] | None
    workers: int | None
    chunk: int
    square: bool


@dataclass(frozen=True)
class ShardSource:
    """One source: its line of --help, and either `items`, its samples (split into train and val by the
    seeded permutation and written as PNG), or `write`, a writer of its own splits (OUT/SPLIT/, returning
    each split's index.json). Either is a function or its "module:function" name."""

    help: str
    items: str | ItemsFunction | None = None
    write: str | WriteFunction | None = None

    def __post_init__(self):
        if (self.items is None) == (self.write is None):
            raise ValueError(
                f"a shard source has items or write, one of them; got items={self.items!r}, write={self.write!r}"
            )


SHARD_SOURCES: dict[str, ShardSource] = {
    "digits": ShardSource(
        "scikit-learn's 1,797 handwritten 8x8 digit scans, upscaled to --resolution; class = the digit",
        items="prunepipe.tools.commands.sources:digit_items",
    ),
    "photos": ShardSource(
        "square crops of the photographs bundled with scikit-image and scikit-learn (--crops-per-photo each); "
        "class = the photograph",
        items="prunepipe.tools.commands.sources:photo_items",
    ),
    "redundant": ShardSource(
        "photo crops of which a fraction are copies (near, exact, re-encoded, cropped; evenly or heavy-tailed "
        "over the originals), with a clean val and an in-distribution val_mix",
        write="prunepipe.tools.commands.shards:write_redundant",
    ),
    "folder": ShardSource(
        "the images under --folder; class = the first-level subfolder",
        write="prunepipe.tools.commands.shards:write_folder_source",
    ),
}


def shard_source(name: str) -> ShardSource:
    """The registered source `name`; the error names the accepted ones."""
    if name not in SHARD_SOURCES:
        raise ValueError(f"unknown shard source {name!r}; accepted: {', '.join(SHARD_SOURCES)}")
    return SHARD_SOURCES[name]


def resolve(function):
    """A function given as itself or as its "module:function" name."""
    if not isinstance(function, str):
        return function
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(module), name)
