"""Shared fixtures: real WebDataset shards written by the project's own tool from bundled data."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory) -> str:
    """scikit-learn's digits as 32x32 PNG shards of 150 samples: returns the folder with train/ and val/."""
    from prunepipe.tools.commands.shards import write_shards

    out = tmp_path_factory.mktemp("digits")
    write_shards("digits", str(out), size=32, shard_size=150, val_fraction=0.1, seed=0)
    return str(out)


@pytest.fixture(scope="session")
def digits_train(digits_shards) -> str:
    return os.path.join(digits_shards, "train")
