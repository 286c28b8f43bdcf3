"""Gradient accumulation on real DDP replicas (2 gloo ranks): one all-reduce per optimizer step, a
short last group weighted like a full one, and replicas that stay bitwise equal when the micro-batch
that ends a step is skipped for a non-finite loss."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from prunepipe.pipelines.training.accumulation import accumulation_group

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_last_short_group_of_a_pass_is_averaged_over_its_own_size():
    # 10 micro-batches with accum 4: steps after 4, 8 and 10; the last step averages 2 micro-batches
    groups = [accumulation_group(micro, 10, 4) for micro in range(10)]
    assert [micro for micro, (is_step, _) in enumerate(groups) if is_step] == [3, 7, 9]
    assert [size for _, size in groups] == [4] * 8 + [2, 2]
    assert accumulation_group(0, 1, 4) == (True, 1)
    assert all(accumulation_group(m, 7, 1) == (True, 1) for m in range(7))


RANK_PROGRAM = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch, torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from prunepipe.pipelines.training.accumulation import GradientAccumulation
    from prunepipe.pipelines.training.parallel import ModelParallel

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)  # the same initial weights on both ranks
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(net, optimizer)
    syncs = []

    def counting_hook(state, bucket):
        syncs.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(dist.group.WORLD, counting_hook)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as in training

    def micro_batch_loss():
        x = torch.randn(8, 16, generator=data)
        return model(x).pow(2).mean()

    # buckets all-reduced by one synchronised backward
    model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
    optimizer.zero_grad(set_to_none=True)
    per_sync, syncs[:] = len(syncs), []

    accumulation = GradientAccumulation(accelerator, model, 4, ModelParallel("ddp", model, accelerator))
    total = 8
    for micro in range(total):
        is_step, size = accumulation.group(micro, total)
        with accumulation.sync_context(is_step):
            loss = micro_batch_loss()
            accumulation.backward(loss / size)
        if is_step:
            optimizer.step(); optimizer.zero_grad(set_to_none=True); accumulation.stepped()
    counted = len(syncs)

    # the micro-batch that ends a step is skipped (a non-finite loss on some rank: every rank skips it)
    accumulation = GradientAccumulation(accelerator, model, 2, ModelParallel("ddp", model, accelerator))
    syncs_at = {}
    for micro in range(4):
        syncs[:] = []
        is_step, size = accumulation.group(micro, 4)
        with accumulation.sync_context(is_step):
            loss = micro_batch_loss()
            if micro == 1:
                accumulation.skipped(is_step)
            else:
                accumulation.backward(loss / size)
        if is_step:
            optimizer.step(); optimizer.zero_grad(set_to_none=True); accumulation.stepped()
        syncs_at[micro] = len(syncs)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    print(json.dumps({"rank": rank, "per_sync": per_sync, "syncs": counted, "skip_syncs_at": syncs_at,
                      "replicas_equal": bool(torch.equal(gathered[0], gathered[1]))}), flush=True)
    dist.barrier()  # neither rank leaves while the other still talks to it
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: the reducer's Python comm hook made it abort now and then
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(program: str, tmp_path) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(program)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), REPO], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    return run_two_ranks(RANK_PROGRAM, tmp_path_factory.mktemp("accum"))


def test_accumulation_all_reduces_once_per_optimizer_step(two_rank_results):
    for result in two_rank_results:
        assert result["per_sync"] >= 1
        # 8 micro-batches with accum 4 are 2 optimizer steps: 2 synchronised backwards, not 8
        assert result["syncs"] == 2 * result["per_sync"], result


def test_replicas_stay_equal_when_the_step_ending_micro_batch_is_skipped(two_rank_results):
    assert all(result["replicas_equal"] for result in two_rank_results)
    for result in two_rank_results:
        # the skipped micro-batch 1 completes the reduction its forward announced; micro-batch 2, under
        # no_sync, then all-reduces nothing (a pending reduction would have made it all-reduce)
        per_sync, at = result["per_sync"], {int(k): v for k, v in result["skip_syncs_at"].items()}
        assert at == {0: 0, 1: per_sync, 2: 0, 3: per_sync}, result
