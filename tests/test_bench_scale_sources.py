"""`prunepipe bench scale --sources K`: the mixture's pass boundary it measures is the one training
computes (ShardStream.layout), and its kept counts per source are those of the draw and the plan."""

from __future__ import annotations

import numpy as np
import torch

from prunepipe.pipelines.data.mixture import Mixture, permuted
from prunepipe.pipelines.data.stream import ShardStream
from prunepipe.pruning import build_pruner
from prunepipe.pruning.pass_plan import PassPlan
from prunepipe.tools.benchmarks import scale


def planned(samples: int) -> PassPlan:
    pruner = build_pruner("infobatch", samples, 100, seed=0)
    scale.score_everything(pruner, 1)
    pruner.plan(5)
    return PassPlan.from_pruner(pruner)


def test_mixture_boundary_is_the_streams_and_counts_each_source(tmp_path):
    samples, world, workers = 30_000, 4, 2
    plan = planned(samples)
    mixture = Mixture.load(scale.write_sources(samples, 3, 1_000, str(tmp_path)))
    done = scale.mixture_boundary(mixture, plan, seed=0, pass_index=5, world=world, workers=workers, batch_size=64)
    draw, layout = done["draw"], done["layout"]
    assert draw.drawn.tolist() == [25_000, 3_000, 2_000]  # 2.5x, 0.3x and the rest (0.2x) of 10,000 each
    assert draw.full == (2, 0, 0) and draw.partial == (5_000, 3_000, 2_000)
    # kept per source, counted sample by sample: the whole walks' kept, then the partial walk's
    expected = []
    for k in range(3):
        lo, hi = int(mixture.offsets[k]), int(mixture.offsets[k + 1])
        kept = plan.kept_between(lo, hi)
        taken = permuted(np.arange(hi - lo), hi - lo, 0, 5, k) < draw.partial[k]
        expected.append(draw.full[k] * int(kept.sum()) + int((kept & taken).sum()))
    assert done["kept_per_source"].tolist() == expected
    assert layout.kept == sum(expected)
    stream = ShardStream(mixture.index, batch_size=64, world_size=world, mixture=mixture)
    trained = stream.layout(5, plan, workers)
    assert trained.kept == layout.kept and trained.kept_per_source.tolist() == expected
    assert np.array_equal(trained.batches, layout.batches) and np.array_equal(trained.shard_order, layout.shard_order)
    # one folder of the same samples: the pass a single folder always had
    single = Mixture.load(scale.write_sources(samples, 1, 1_000, str(tmp_path)))
    alone = scale.mixture_boundary(single, plan, seed=0, pass_index=5, world=world, workers=workers, batch_size=64)
    assert alone["draw"].whole and alone["layout"].kept == plan.count_kept()


def test_sources_rows_and_ratio(tmp_path):
    threads = torch.get_num_threads()
    try:
        rows = [scale.measure_sources("random", 20_000, k, 1, 2, 2, 1_000, str(tmp_path)) for k in (1, 3)]
    finally:
        torch.set_num_threads(threads)
    assert [r["drawn"] for r in rows] == [20_000, 20_000]  # a weighted pass of the sources' total
    assert rows[0]["partial_units"] == 0 and rows[1]["partial_units"] == 3 * 7  # 7 shards a source, all partial
    assert sum(rows[1]["kept_per_source"]) == rows[1]["kept"]
    ratio = scale.compare_sources(*rows)
    assert ratio["sources"] == 3 and "peak_rss_B_ratio" in ratio  # in pytest's process the peak says little
    table = scale.format_sources_table([*rows, ratio])
    assert "ratio 3/1" in table and len(table.splitlines()) == 5
