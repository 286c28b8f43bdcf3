"""One score table per node, with 2 real gloo processes on this one node: local rank 0
writes the gathered updates into tables in /dev/shm, the other rank reads the same pages, and both
plan exactly what a pruner with tables of its own plans."""

from __future__ import annotations

import glob
import json
import os
import socket

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from prunepipe.pipelines.data.layout import pass_layout
from prunepipe.pipelines.data.shards import ShardIndex
from prunepipe.pipelines.training.node_tables import SHM, NodeTables, local_rank_and_size
from prunepipe.pruning import build_pruner, gather_batch
from prunepipe.pruning.pass_plan import PassPlan

N, PASSES, BATCH = 3001, 5, 64


def one_rank(rank: int, port: int, name: str, token: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shared = build_pruner(name, N, 8, seed=1)
    alone = build_pruner(name, N, 8, seed=1)  # the per-process implementation, fed the same updates
    tables = NodeTables(shared, rank, local_rank=rank, local_size=2, token=token)
    index = ShardIndex(tuple(f"s{i}.tar" for i in range(3)), np.array([1000, 1001, 1000]))
    rng = np.random.default_rng(rank)
    report = {"writer": tables.writer, "shared": tables.shared, "same_plans": True, "steps": [], "steps_alone": []}
    for pass_index in range(PASSES):
        tables.wait_for_writer()
        for pruner, steps in ((shared, report["steps"]), (alone, report["steps_alone"])):
            pruner.plan(pass_index)
            plan = PassPlan.from_pruner(pruner)
            steps.append(
                pass_layout(
                    index,
                    plan.kept_per_shard(index.first_ids, index.counts),
                    seed=1,
                    pass_index=pass_index,
                    world_size=2,
                    num_workers=1,
                    batch_size=8,
                ).steps
            )
        report["same_plans"] &= bool(
            np.array_equal(PassPlan.from_pruner(shared).kept_mask(), PassPlan.from_pruner(alone).kept_mask())
        )
        for _ in range(N // (2 * BATCH)):
            ids, losses, _ = gather_batch(rng.integers(0, N, BATCH), rng.exponential(1.0, BATCH).astype(np.float32))
            for pruner in (shared, alone):
                pruner.update(ids, losses)
                pruner.on_step(0.01)
    tables.wait_for_writer()
    report["sees_the_update"] = all(np.array_equal(shared._tables()[k], alone._tables()[k]) for k in alone._tables())
    report["recorded_somewhere"] = bool(np.any(shared._tables()["score"]))
    report["stats_equal"] = shared.stats() == alone.stats()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", ["infobatch", "ted"])
def test_two_ranks_on_one_node_share_one_table_and_plan_as_with_their_own(name, tmp_path):
    token = f"test{os.getpid()}{name}"
    mp.start_processes(
        one_rank, args=(free_port(), name, token, str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert [r["writer"] for r in reports] == [True, False] and all(r["shared"] for r in reports)
    for report in reports:
        assert report["sees_the_update"] and report["recorded_somewhere"], "the reader sees the writer's updates"
        assert report["same_plans"] and report["stats_equal"]
        assert report["steps"] == report["steps_alone"]
    assert reports[0]["steps"] == reports[1]["steps"]
    assert len(set(reports[0]["steps"])) > 1, "pruned passes were compared"
    assert not glob.glob(os.path.join(SHM, f"prunepipe-{token}-*")), "shared files are unlinked once mapped"


def test_local_rank_comes_from_torchrun_slurm_or_a_lone_process():
    assert local_rank_and_size({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == (3, 8)
    assert local_rank_and_size({"SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4"}) == (1, 4)
    assert local_rank_and_size({"SLURM_LOCALID": "5", "SLURM_TASKS_PER_NODE": "8(x4)"}) == (5, 8)
    assert local_rank_and_size({}) == (0, 1)


def test_a_single_process_keeps_its_tables_in_process_memory():
    pruner = build_pruner("infobatch", N, 8)
    table = pruner._tables()["score"]
    tables = NodeTables(pruner, rank=0, local_rank=0, local_size=1, token="unused")
    assert not tables.shared and pruner._tables()["score"] is table
    tables.wait_for_writer()  # nothing to wait for
