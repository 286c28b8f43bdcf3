"""The sync helper: ids as int64 and losses as float32 gathered over ranks, a conversion without them.

The two-rank case runs a real gloo process group in two subprocesses with a hard timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from prunepipe.pruning import gather_ids_losses

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_a_process_group_it_converts_to_numpy():
    ids, losses = gather_ids_losses(torch.tensor([2**40 + 1, -1]), torch.tensor([0.5, 1.25], dtype=torch.bfloat16))
    assert ids.dtype == np.int64 and losses.dtype == np.float32
    np.testing.assert_array_equal(ids, [2**40 + 1, -1])
    np.testing.assert_array_equal(losses, [0.5, 1.25])
    ids, losses = gather_ids_losses(np.array([3, 4], np.int32), np.array([1.0, 2.0], np.float16))
    assert ids.dtype == np.int64 and losses.dtype == np.float32


RANK_PROGRAM = textwrap.dedent("""
    import datetime, json, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[3])
    from prunepipe.pruning import gather_batch, gather_ids_losses
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    # ids that a float64 (2**53 + 1) or float32 (2**33 + 1) would corrupt
    ids = torch.tensor([2**33 + 1 + rank, 2**53 + 1 + rank, -1], dtype=torch.int64)
    losses = torch.tensor([0.5 + rank, 3.0, 7.0], dtype=torch.float16, requires_grad=True)
    gathered_ids, gathered_losses = gather_ids_losses(ids, losses)
    with_ids, with_losses, strata = gather_batch(ids, losses, torch.tensor([999, rank, 7]))
    assert (with_ids == gathered_ids).all() and (with_losses == gathered_losses).all()
    print(json.dumps({"ids": [int(i) for i in gathered_ids], "ids_dtype": str(gathered_ids.dtype),
                      "losses": gathered_losses.tolist(), "losses_dtype": str(gathered_losses.dtype),
                      "strata": [int(s) for s in strata]}))
    dist.destroy_process_group()
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_gloo_ranks_gather_large_ids_exactly(tmp_path):
    program = tmp_path / "rank.py"
    program.write_text(RANK_PROGRAM)
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(program), str(rank), port, REPO],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for process in ranks:
            stdout, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, stderr[-2000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        pytest.fail("the two-rank gloo group did not finish within 120 s")
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    expected_ids = [2**33 + 1, 2**53 + 1, -1, 2**33 + 2, 2**53 + 2, -1]
    for output in outputs:  # every rank sees the same global batch, in rank order
        assert output["ids"] == expected_ids and output["ids_dtype"] == "int64"
        assert output["losses"] == [0.5, 3.0, 7.0, 1.5, 3.0, 7.0] and output["losses_dtype"] == "float32"
        assert output["strata"] == [999, 0, 7, 999, 1, 7]  # beside their ids, in the same rank order
