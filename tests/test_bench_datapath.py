"""`prunepipe bench datapath` runs its five pipelines side by side on the same JPEG shards and counts
the same images in each; its cores for a rate follow from the project's rate. No timing is asserted."""

from __future__ import annotations

import argparse

from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.tools.benchmarks import datapath


def test_every_pipeline_reads_every_image_of_the_bundled_jpegs(tmp_path, capsys):
    index = ShardIndex.load(datapath.write_bundled_jpegs(str(tmp_path / "jpegs"), count=24, shard_size=10))
    assert index.num_samples == 24 and len(index.urls) == 3 and index.meta["keys"] == ["cls", "jpg"]
    for name, pipeline in datapath.PIPELINES.items():
        assert pipeline(index, 8) == 24, name  # three whole batches: the stream drops no tail
    parser = argparse.ArgumentParser()
    datapath.add_arguments(parser)
    args = parser.parse_args(["--data", str(tmp_path / "jpegs"), "--repeats", "1", "--batch", "8", "--target", "1000"])
    assert datapath.run_from_args(args) == 0
    said = capsys.readouterr().out
    assert all(f"| {name} |" in said for name in datapath.PIPELINES)
    assert "| 1000 img/s |" in said


def test_cores_for_a_rate_count_the_training_process():
    assert datapath.cores_for(2500, 861) == 4
    assert datapath.cores_for(800, 800) == 2
