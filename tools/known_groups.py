"""The exact near-duplicate groups of the bundled `redundant` shards (tools/sources.py), known from
their keys: a copy is named after its original, `ORIGINAL_dupNNNNN` (`_heldoutdupNNNNN` in val_mix; an exact,
re-encoded or cropped copy `_dupexactNNNNN`, `_dupjpegNNNNN`, `_dupcropNNNNN`: tools/sources.py:copy_key).
Written as the group table the dedup pruner reads (pipelines/data/group_table.py), so that the pruner
can be measured and tested before groups found from embeddings exist. For the small bundled shards:
it holds every key of the split in memory.

    python -m tools.known_groups DATA/train     # writes DATA/train/groups/known.npy and .json
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from pipelines.data.group_table import GROUPS_FOLDER, open_group_table, write_group_table
from pipelines.data.side_tables import make_header
from pipelines.data.shards import ShardIndex, read_shard
from tools.sources import COPY_KEY

KNOWN = "known"  # the table's name: pruner.groups=known


def original_key(key: str) -> str:
    """The key of the sample `key` is a copy of (itself when it is no copy)."""
    copy = COPY_KEY.match(key)
    return copy.group("original") if copy else key


def split_keys(split: str) -> list[str]:
    """Every sample's key in id order (index order, then position in the shard)."""
    return [sample["__key__"] for url in ShardIndex.load(split).urls for _, sample in read_shard(url)]


def known_groups(split: str) -> np.ndarray:
    """int32 per sample id: its group, the smallest id among the samples with its original (the
    original and its copies); a sample without copies is its own group."""
    first_of: dict[str, int] = {}
    roots = [original_key(key) for key in split_keys(split)]
    for sample_id, root in enumerate(roots):
        first_of.setdefault(root, sample_id)
    return np.array([first_of[root] for root in roots], dtype=np.int32)


def write_known_groups(split: str, name: str = KNOWN) -> str:
    """The known groups of `split` as `split/groups/NAME.npy` with its header; returns the .npy path."""
    groups = known_groups(split)
    sizes = np.bincount(groups, minlength=len(groups))
    header = make_header(split, "groups", groups.shape,
                         made_by="tools.known_groups: the keys of the redundant source's copies name their original",
                         groups=int(np.count_nonzero(sizes)), groups_with_copies=int(np.count_nonzero(sizes > 1)),
                         grouped_samples=int(sizes[sizes > 1].sum()), largest_group=int(sizes.max()))
    return write_group_table(os.path.join(split, GROUPS_FOLDER, f"{name}.npy"), groups, header)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("split", help="a split folder of redundant shards (with index.json)")
    parser.add_argument("--name", default=KNOWN)
    args = parser.parse_args(argv)
    path = write_known_groups(args.split, args.name)
    header = open_group_table(path, shards_dir=args.split).header
    print(f"{path}: {header['grouped_samples']} of {header['shape'][0]} samples in {header['groups_with_copies']} "
          f"groups of 2 or more (largest {header['largest_group']})")


if __name__ == "__main__":
    main()
