"""One loader-worker count for the whole job: it shapes every rank's pass layout, so ranks that
computed `auto` alone (uneven nodes, per-task CPU binding) would take different steps per pass and hang."""

from __future__ import annotations

import os
import textwrap

from test_accumulation import run_two_ranks

from prunepipe.pipelines.data.workers import loader_workers, sharing_processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_auto_counts_the_processes_that_share_this_ranks_cpus():
    node = set(range(96))
    torchrun_ranks = [("n1", node)] * 8  # 8 ranks inherit one affinity: they share it
    mine = torchrun_ranks[0]
    assert sharing_processes(mine, torchrun_ranks) == 8
    assert loader_workers("auto", sharing_processes(mine, torchrun_ranks), cores=len(node)) == 11  # 12 - 1, no cap
    # srun --cpus-per-task=12, 8 tasks: each rank is bound to 12 CPUs of its own
    bound = [("n1", set(range(12 * t, 12 * t + 12))) for t in range(8)] + [("n2", set(range(12)))]
    assert sharing_processes(bound[3], bound) == 1
    assert loader_workers("auto", sharing_processes(bound[3], bound), cores=12) == 11
    # what LOCAL_WORLD_SIZE alone gave there: the bound share divided by the tasks again
    assert loader_workers("auto", 8, cores=12) == 0
    # a node of 224 cores and 8 GPUs: every core but the training process's decodes
    assert loader_workers("auto", 8, cores=224) == 27


AGREE_PROGRAM = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch.distributed as dist
    from accelerate import Accelerator
    from prunepipe.pipelines.data.workers import agree_worker_count, agreed_loader_workers, usable_cpus
    from prunepipe.pipelines.data.layout import pass_layout
    from prunepipe.pipelines.data.shards import ShardIndex

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus if rank == 0 else cpus[:1])  # uneven: rank 1 bound to one CPU
    index = ShardIndex.load(sys.argv[2])
    local = [7, 5][rank]  # what each rank's own `auto` could say on uneven nodes
    agreed = agree_worker_count(local)
    steps = {w: pass_layout(index, None, seed=0, pass_index=0, world_size=2, num_workers=w, batch_size=16).steps
             for w in (local, agreed)}
    print(json.dumps({"rank": rank, "cpus": len(usable_cpus()), "agreed": agreed,
                      "auto": agreed_loader_workers("auto", device_type="cuda"),
                      "steps_alone": steps[local], "steps_agreed": steps[agreed]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_ranks_with_different_cpus_agree_on_one_worker_count_and_one_pass_length(digits_train, tmp_path):
    program = AGREE_PROGRAM.replace("sys.argv[2]", repr(digits_train))
    results = run_two_ranks(program, tmp_path)
    assert {r["agreed"] for r in results} == {5}
    assert len({r["auto"] for r in results}) == 1, results
    assert len({r["steps_agreed"] for r in results}) == 1
    assert results[0]["steps_alone"] != results[1]["steps_alone"], "alone, the ranks would take different steps"
    assert results[0]["cpus"] >= results[1]["cpus"] == 1
