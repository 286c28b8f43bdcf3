"""A run's data described once: every source's index.json read once on a rank over a whole run (the data
check, the mixture, the task, the held-out batches, the export), and the records a task is built from."""

from __future__ import annotations

import os
from collections import Counter

from test_mixture import two_sources
from test_trainer import TINY_LDM, TINY_MAE

from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.data import shards
from prunepipe.pipelines.data.description import DataDescription, SplitRecords
from prunepipe.pipelines.data.shards import ShardEntry, ShardIndex, bucket_entries
from prunepipe.pipelines.training.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def counting_reads(monkeypatch) -> Counter:
    """Every read of an index.json from now on, by its real path (shards.py opens the file in one place)."""
    reads: Counter = Counter()
    read = shards.read_index_json

    def counted(path: str) -> dict:
        reads[os.path.realpath(path)] += 1
        return read(path)

    monkeypatch.setattr(shards, "read_index_json", counted)
    return reads


def index_of(folder: str) -> str:
    return os.path.realpath(os.path.join(folder, "index.json"))


def test_a_run_reads_each_sources_index_once(digits_shards, tmp_path, monkeypatch):
    extra = [f"runs_dir={tmp_path}", "name=once", "num_passes=1", "log_every=4", *TINY_MAE]
    cfg = load_config(
        os.path.join(ROOT, "configs", "mae_tiny_full.yaml"),
        [two_sources(digits_shards), f"data.val={digits_shards}/val", *extra],
    )
    reads = counting_reads(monkeypatch)
    train(cfg)
    assert os.path.isdir(os.path.join(cfg.run_dir, "export")), "the run went to its end"
    # data.val's folder is a train source as well, and still read once
    assert reads == {index_of(f"{digits_shards}/train"): 1, index_of(f"{digits_shards}/val"): 1}, reads


def test_a_diffusion_run_on_latents_reads_its_index_once_and_builds_its_task_from_the_records(
    digits_shards, tmp_path, monkeypatch
):
    latents = tmp_path / "latents"
    latents.mkdir()
    written = ShardIndex.load(f"{digits_shards}/train")
    # the digits' images (1 x 16 x 16 after decode) stand in for latents of 4 px images under a factor-4 VAE
    ShardIndex.write(
        str(latents),
        [ShardEntry(url, int(count)) for url, count in zip(written.urls, written.counts)],
        **written.meta,
        latent_shape=[1, 16, 16],
        resolution=64,
        vae="a-vae-named-only",
        scaling_factor=0.5,
    )
    cfg = load_config(
        os.path.join(ROOT, "configs", "ldm_tiny_full.yaml"),
        [
            f"data.train={latents}",
            "data.val=",
            "data.channels=1",
            "ldm.space=latents",
            f"runs_dir={tmp_path}",
            "name=latents",
            "max_steps=2",
            *TINY_LDM,
        ],
    )
    records = DataDescription.load(cfg.data).records
    assert records.latent_shape == (1, 16, 16) and records.resolution == 64
    assert records.vae is not None and (records.vae.name, records.vae.scaling_factor) == ("a-vae-named-only", 0.5)
    assert records.text_features is None and records.buckets == []
    reads = counting_reads(monkeypatch)
    train(cfg)
    assert reads == {index_of(str(latents)): 1}


def test_a_bucketed_index_reads_back_the_table_its_writer_wrote(tmp_path):
    table = bucket_entries([(64, 128), (96, 64)], channels=4, factor=8)
    assert table == [
        {"name": "64x128", "image": [64, 128], "shape": [4, 8, 16]},
        {"name": "96x64", "image": [96, 64], "shape": [4, 12, 8]},
    ]
    ShardIndex.write(str(tmp_path), [ShardEntry("a.tar", 2, bucket=1), ShardEntry("b.tar", 3, bucket=0)], buckets=table)
    index = ShardIndex.load(str(tmp_path))
    assert SplitRecords.of(index).buckets == table and index.bucket_shapes == [(4, 8, 16), (4, 12, 8)]
    assert index.buckets.tolist() == [1, 0]
