"""The pruner's tables in a checkpoint: files of their own written from the tables' memory, read back
into the tables with no second copy."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from prunepipe.pipelines.checkpoint.pruner_state import TABLES, CheckpointedPruner, read_npy_into
from prunepipe.pruning import build_pruner

N = 4_000_000  # 20 MB of InfoBatch tables


def scored_infobatch(num_samples: int = N):
    pruner = build_pruner("infobatch", num_samples, 8, seed=2)
    ids = np.arange(num_samples)
    pruner.update(ids, np.random.default_rng(0).exponential(1.0, num_samples).astype(np.float32))
    pruner.plan(1)
    return pruner


def test_tables_round_trip_through_their_files_without_a_second_copy(tmp_path):
    original = scored_infobatch()
    saver = CheckpointedPruner(original)
    state = saver.state_dict()
    assert state["tables"] == {"score": f"{TABLES}/score.npy", "seen": f"{TABLES}/seen.npy"}
    saver.write_files(str(tmp_path))
    np.testing.assert_array_equal(np.load(tmp_path / TABLES / "score.npy"), original.tables()["score"])
    restored = build_pruner("infobatch", N, 8, seed=2)
    loader = CheckpointedPruner(restored)
    loader.load_state_dict(state)
    tracemalloc.start()
    loader.read_files(str(tmp_path))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < N // 4, f"loading allocated {peak} bytes for {5 * N} bytes of tables"
    ids = np.arange(N)
    np.testing.assert_array_equal(restored.weights(ids), original.weights(ids))
    np.testing.assert_array_equal(restored.tables()["score"], original.tables()["score"])
    assert restored.stats() == original.stats()


def test_a_table_file_of_another_size_is_named(tmp_path):
    CheckpointedPruner(scored_infobatch(5000)).write_files(str(tmp_path))
    expected = r"seen\.npy: pruner table is uint8\[5000\], this pruner expects uint8\[6000\]"
    with pytest.raises(ValueError, match=expected):
        read_npy_into(os.path.join(tmp_path, TABLES, "seen.npy"), np.zeros(6000, np.uint8))
