"""A damaged shard keeps what is intact: an img2dataset shard cut in half since it was indexed trains
the samples before the cut, and the samples after it are counted, named and shown in the pass's
record and line; a pass's kept share is of the pass's length (a source taken twice is twice as long).
"""

from __future__ import annotations

import json
import os

import numpy as np
from test_shards import read_all, write_img2dataset_shard

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.training.loop import train
from prunepipe.pipelines.training.metrics import format_pass
from prunepipe.tools.commands.shards import index_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MAE = [
    "mae.embed_dim=32",
    "mae.depth=1",
    "mae.num_heads=2",
    "mae.decoder_embed_dim=32",
    "mae.decoder_depth=1",
    "mae.decoder_num_heads=2",
    "data.val=''",
    "data.num_workers=0",
    "checkpoint.every_steps=1000",
]


def cut_in_half(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_a_shard_cut_in_half_delivers_its_samples_before_the_cut_and_names_the_lost(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_img2dataset_shard(folder, 0, 100)
    index = ShardIndex.load(index_shards([str(folder)], str(folder), workers=1))
    assert index.expected(0).size is not None, "the index records the shard's size"
    cut_in_half(index.urls[0])

    batches = read_all(index, "skip")
    delivered = sorted(int(i) for b in batches for i in b.ids if int(i) >= 0)
    events = [e for b in batches for e in b.bad]
    lost = sum(e.samples_lost for e in events)
    assert 40 <= len(delivered) <= 50, "the samples wholly before the cut train"
    assert delivered == list(range(len(delivered))), "in index order, the first ones"
    assert len(delivered) + lost == 100
    (event,) = events
    assert index.urls[0] in event.message and "cut short at" in event.message
    assert f"ids {len(delivered)} to 99" in event.message


def test_a_pass_over_a_cut_shard_records_the_loss_and_its_line_shows_what_trained(digits_shards, tmp_path):
    from eval_runs import digit_shards

    shards = tmp_path / "shards"
    digit_shards(digits_shards, shards, shards=2, per_shard=64)
    cut_in_half(str(shards / "1.tar"))  # indexed whole, with its size: cut since
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [
            f"data.train={shards}",
            f"runs_dir={tmp_path}",
            "name=cut",
            "num_passes=1",
            "data.batch_size=16",
            "data.on_bad_sample=skip",
            *TINY_MAE,
        ],
    )
    summary = train(cfg)
    (record,) = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl")) if '"pass"' in line]
    assert record["kept_fraction"] == 1.0 and record["kept_samples"] == 128
    assert 25 <= record["lost_samples"] <= 40, "the cut shard's samples after the cut, not all 64"
    assert record["bad_samples"] == record["lost_samples"]
    assert summary["lost_samples"] == record["lost_samples"]
    trained = (128 - record["lost_samples"]) / 128
    line = format_pass(record, 1)
    assert f"kept {trained:.1%} (100.0% planned, {record['lost_samples']} lost to bad input)" in line


def test_kept_fraction_of_a_source_repeated_twice_is_at_most_one(digits_shards, tmp_path):
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [
            f"data.train=[{{name: digits, path: {digits_shards}/train, repeat: 2}}]",
            f"runs_dir={tmp_path}",
            "name=twice",
            "num_passes=1",
            "data.batch_size=64",
            *TINY_MAE,
        ],
    )
    summary = train(cfg)
    samples = ShardIndex.load(f"{digits_shards}/train").num_samples
    assert summary["pass_length"] == 2 * samples
    assert summary["kept_fraction"] == summary["kept_samples"] / (2 * samples) == 1.0
    assert np.isclose(summary["kept_fraction"], 1.0) and summary["lost_samples"] == 0
