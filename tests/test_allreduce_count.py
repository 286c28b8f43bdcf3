"""tools/benchmarks/allreduce_count.py, the GPU script's all-reduce count, on gloo: DDP's reducer runs even
in a world of one process, so the count it reports is the loop's accumulation, not an artefact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_accumulation_all_reduces_each_bucket_once_per_optimizer_step_and_never_between(tmp_path):
    out = tmp_path / "counts.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prunepipe.tools.benchmarks.allreduce_count",
            "--grad-accum",
            "4",
            "--micro-batches",
            "10",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    counts = json.load(open(out))
    assert (counts["backend"], counts["world_size"]) == ("gloo", 1)
    assert counts["steps_at"] == [3, 7, 9], "groups of 4, then the pass's short group of 2"
    per_micro, buckets = counts["all_reduces_per_micro_batch"], counts["ddp_buckets_per_micro_batch"]
    assert [per_micro[i] for i in range(10) if i not in (3, 7, 9)] == [0] * 7
    assert [per_micro[i] for i in (3, 7, 9)] == [buckets[i] for i in (3, 7, 9)]
    assert buckets[9] > 1, "the small bucket cap spreads the model over several buckets once DDP rebuilt them"
    assert counts["one_bucket_set_per_step"] is True
