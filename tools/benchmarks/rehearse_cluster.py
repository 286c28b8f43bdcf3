"""A cluster rehearsal on one machine: two emulated nodes of two ranks each (two torchrun
launches sharing one c10d rendezvous on localhost, gloo), a node that dies (its agent, ranks and
loader workers SIGKILLed at once) and a SLURM requeue (`checkpoint.resume=latest`), checked against
a run never interrupted: the final weights, EMA and pruner state bit for bit, and every pass summary.

It emulates processes, rendezvous, collectives, files and signals; not NCCL, a network or GPUs.
The run is the tiny MAE with InfoBatch; `--mixture` trains it on two sources, `--buckets` rehearses the
tiny text-to-image PixArt on aspect-ratio buckets instead (latents of four shapes, batches of one bucket).
Usage: python -m prunepipe.tools.benchmarks.rehearse_cluster [--work DIR]   (exit 1 on FAIL; docs/multinode.md)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from prunepipe.pipelines.checkpoint.sharded import OPTIMIZER, read_whole
from prunepipe.pipelines.checkpoint.store import latest_checkpoint, load_checkpoint_states
from prunepipe.pipelines.report.runs import read_metrics
from prunepipe.tools.benchmarks.resume_check import differences

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "mae_tiny_infobatch.yaml")
BUCKETS_CONFIG = os.path.join(ROOT, "configs", "ldm_t2i_tiny_buckets.yaml")
NODES, RANKS_PER_NODE = 2, 2
TINY_MAE = (
    "mae.embed_dim=32",
    "mae.depth=1",
    "mae.num_heads=2",
    "mae.decoder_embed_dim=32",
    "mae.decoder_depth=1",
    "mae.decoder_num_heads=2",
    "data.val_batches=1",
)
# What a pass summary must repeat after a requeue (wall_seconds and train_loss cannot: see `compare_passes`)
PASS_FIELDS = (
    "optimizer_steps",
    "steps_in_pass",
    "kept_samples",
    "kept_fraction",
    "tail",
    "samples_forwarded",
    "held_out",
    "sources",  # a mixture's per-source accounting (--mixture)
    "buckets",  # each aspect-ratio bucket's kept and forwarded (--buckets), without its train_loss
)


def run_overrides(
    data: str, runs_dir: str, name: str, passes: int, every_steps: int, dist_timeout: int, buckets: bool = False
) -> list[str]:
    """The rehearsed run: tiny MAE (or with `buckets` the tiny bucketed PixArt, batches of 4), InfoBatch
    pruning from the second pass, two micro-batches per optimizer step, loader workers chosen per rank,
    in-loop evaluation every pass (small; none for the PixArt, whose VAE is random), a metric line every
    step (so the rehearsal sees how far the run got) and a short collective timeout."""
    common = [
        f"data.train={data}/train",
        f"data.val={data}/val",
        f"runs_dir={runs_dir}",
        f"name={name}",
        f"num_passes={passes}",
        "optim.grad_accum=2",
        "data.num_workers=auto",
        f"checkpoint.every_steps={every_steps}",
        "checkpoint.keep=100",
        "log_every=1",
        f"dist_timeout_seconds={dist_timeout}",
    ]
    if buckets:
        return [
            *common,
            "data.batch_size=4",
            "data.val_batches=1",
            "pruner={name: infobatch, prune_ratio: 0.5, delta: 0.75}",
        ]
    return [
        *common,
        "data.batch_size=32",
        "eval.every_passes=1",
        "eval.val_samples=64",
        "eval.probe.train_samples=300",
        *TINY_MAE,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- emulated nodes
def proc_tree(root: int) -> dict[int, dict[bytes, bytes]]:
    """`root` and every process below it, each with its environment (read from /proc)."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: the parent
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    found = {}
    for pid in tree:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                found[pid] = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
    return found


def kill_node(process: subprocess.Popen) -> None:
    """SIGKILL a torchrun agent and everything below it at once, and reap the agent. torchrun starts each
    rank in a session of its own (start_new_session in torch's SubprocessHandler), so killing the agent's
    process group alone would leave the ranks training on; every process group of its tree is killed."""
    groups = set()
    for pid in proc_tree(process.pid):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


@dataclass
class Node:
    """One emulated node: a torchrun agent in a process session of its own, and its ranks."""

    name: str
    process: subprocess.Popen
    log: str

    def exit_code(self) -> int | None:
        return self.process.poll()

    def ranks(self) -> list[int]:
        """The global ranks this node runs (RANK in the environment of the agent's workers)."""
        return sorted(int(env[b"RANK"]) for env in proc_tree(self.process.pid).values() if b"RANK" in env)

    def kill(self) -> None:
        """As a node dies: the agent, every rank and their loader workers at once, no clean-up."""
        kill_node(self.process)


def start_nodes(work: str, label: str, rdzv_id: str, overrides: list[str], config: str = CONFIG) -> list[Node]:
    """Two `torchrun --nnodes=2 --nproc-per-node=2` launches sharing one c10d rendezvous on a fresh
    localhost port, as launch/slurm.sbatch starts one per node; each in a session of its own."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    nodes = []
    for n in range(NODES):
        log = os.path.join(work, f"{label}_node{n}.log")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={NODES}",
            f"--nproc-per-node={RANKS_PER_NODE}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
            "-m",
            "prunepipe.launch.cli",
            "train",
            config,
            *overrides,
        ]
        with open(log, "w") as out:
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        nodes.append(Node(f"node{n}", process, log))
    return nodes


def wait_nodes(nodes: list[Node], limit: float) -> tuple[list[int | None], float]:
    """Wait up to `limit` seconds for every node to exit; returns their exit codes (None: still running
    at the limit, then killed) and the seconds waited."""
    start = time.time()
    while time.time() - start < limit and any(n.exit_code() is None for n in nodes):
        time.sleep(0.2)
    codes = [n.exit_code() for n in nodes]
    for n, code in zip(nodes, codes):
        if code is None:
            n.kill()
    return codes, time.time() - start


def tail(node: Node, lines: int = 25) -> str:
    with open(node.log) as f:
        return "".join(f.readlines()[-lines:])


# ----------------------------------------------------------------------------- what the runs wrote
def metric_records(run_dir: str, kind: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [record for record in read_metrics(path) if record.get("kind") == kind]  # each step once


def last_logged_step(run_dir: str) -> int:
    return max((r["optimizer_steps"] for r in metric_records(run_dir, "train")), default=0)


def checkpoint_step(folder: str) -> int:
    return int(os.path.basename(folder).split("_")[1])


def kill_step(reference: list[dict], every_steps: int) -> int:
    """The first checkpoint of the reference run that falls inside a pass that prunes: the rehearsal
    kills the run after it, so the requeue resumes mid-pass with a pruned plan."""
    total = reference[-1]["optimizer_steps"]
    ends = [r["optimizer_steps"] for r in reference]
    pruned = {r["pass_index"] for r in reference if r["kept_fraction"] < 1.0}
    for step in range(every_steps, total, every_steps):
        pass_index = next(e for e, end in enumerate(ends) if step <= end)
        if step not in ends and pass_index in pruned:
            return step
    raise ValueError(
        f"no checkpoint.every_steps={every_steps} checkpoint falls inside a pruned pass "
        f"(pass ends at steps {ends}); choose another --every-steps"
    )


def compare_passes(reference: list[dict], requeued: list[dict]) -> list[str]:
    """Every pass of the reference has a summary in the requeued run (the killed attempt's and the
    requeue's, last one per pass counting) that agrees on PASS_FIELDS."""
    theirs = {r["pass_index"]: r for r in requeued}
    problems = []
    for mine in reference:
        other = theirs.get(mine["pass_index"])
        if other is None:
            problems.append(f"pass {mine['pass_index'] + 1}: no summary after the requeue")
            continue
        for field in PASS_FIELDS:
            if _repeatable(mine.get(field)) != _repeatable(other.get(field)):
                problems.append(f"pass {mine['pass_index'] + 1} {field}: {mine.get(field)} != {other.get(field)}")
    return problems


def _repeatable(value):
    """A summary field without the training losses in it: like train_loss, a bucket's covers the part
    of a resumed pass trained after the resume (the losses before it are not checkpointed)."""
    if isinstance(value, dict):
        return {k: _repeatable(v) for k, v in value.items() if k != "train_loss"}
    return value


def compare_evals(reference: list[dict], requeued: list[dict]) -> list[str]:
    """The in-loop evaluations (EMA weights at each pass end) of both runs, metric by metric."""
    theirs = {r["pass_index"]: r["metrics"] for r in requeued}
    return [
        f"eval after pass {r['pass_index'] + 1}: {r['metrics']} != {theirs.get(r['pass_index'])}"
        for r in reference
        if r["metrics"] != theirs.get(r["pass_index"])
    ]


def tensor_mismatch(what: str, a: list, b: list) -> list[str]:
    """One line for a list of tensors that should be equal bit for bit: how many differ and by how much."""
    if len(a) != len(b):
        return [f"{what}: {len(a)} tensors != {len(b)}"]
    differ = [(x - y).abs().max().item() for x, y in zip(a, b) if not torch.equal(x, y)]
    if not differ:
        return []
    return [f"{what}: {len(differ)} of {len(a)} tensors differ, largest |difference| {max(differ):.3g}"]


def compare_final_states(reference_dir: str, requeued_dir: str) -> tuple[list[str], dict]:
    """Model and EMA weights, pruner state and position (less its wall clock) of both runs' last
    checkpoints, bit for bit."""
    a_dir, b_dir = latest_checkpoint(reference_dir), latest_checkpoint(requeued_dir)
    if a_dir is None or b_dir is None or os.path.basename(a_dir) != os.path.basename(b_dir):
        return [f"last checkpoints differ: {a_dir} and {b_dir}"], {}
    a, b = load_checkpoint_states(a_dir), load_checkpoint_states(b_dir)
    for state in (a, b):
        state["position"] = {k: v for k, v in state["position"].items() if k != "wall_seconds"}
    names = sorted(a["model"])
    if names != sorted(b["model"]):
        return [f"model: the checkpoints hold other tensors ({sorted(set(names) ^ set(b['model']))})"], {}
    problems = tensor_mismatch("model", [a["model"][k] for k in names], [b["model"][k] for k in names])
    problems += tensor_mismatch("EMA", a["ema"]["shadow_params"], b["ema"]["shadow_params"])
    ema_counters = [{k: v for k, v in state["ema"].items() if k != "shadow_params"} for state in (a, b)]
    problems += differences(*ema_counters, "ema")  # its step count and decay
    problems += differences(a["pruner"], b["pruner"], "pruner") + differences(a["position"], b["position"], "position")
    moments = [read_whole(folder, OPTIMIZER) or {} for folder in (a_dir, b_dir)]
    keys = sorted(moments[0])
    problems += tensor_mismatch(
        "AdamW", [moments[0][k] for k in keys], [moments[1].get(k, torch.empty(0)) for k in keys]
    )
    compared = {
        "checkpoint": os.path.basename(a_dir),
        "model_tensors": len(names),
        "ema_tensors": len(a["ema"]["shadow_params"]),
        "optimizer_tensors": len(keys),
        "pruner": sorted(a["pruner"]),
        "position": sorted(a["position"]),
    }
    return problems, compared


# ----------------------------------------------------------------------------- the rehearsal
def rehearse(
    work: str,
    *,
    passes: int = 3,
    every_steps: int = 4,
    dist_timeout: int = 60,
    kill: str = "rank0",
    hang_limit: float = 180.0,
    run_limit: float = 600.0,
    mixture: bool = False,
    buckets: bool = False,
    strategy: str = "ddp",
    say=print,
) -> dict:
    """Reference run, killed run, requeue; returns the verdict (verdict["pass"] is the PASS/FAIL).
    Whatever happens, no process it started outlives it."""
    started: list[Node] = []
    try:
        return _rehearse(
            work,
            started,
            passes=passes,
            every_steps=every_steps,
            dist_timeout=dist_timeout,
            kill=kill,
            hang_limit=hang_limit,
            run_limit=run_limit,
            mixture=mixture,
            buckets=buckets,
            strategy=strategy,
            say=say,
        )
    finally:
        for node in started:
            if node.exit_code() is None:
                node.kill()


def _rehearse(
    work: str,
    started: list,
    *,
    passes: int,
    every_steps: int,
    dist_timeout: int,
    kill: str,
    hang_limit: float,
    run_limit: float,
    mixture: bool,
    buckets: bool,
    strategy: str,
    say,
) -> dict:
    start = time.time()

    def progress(message: str) -> None:
        say(f"[rehearsal {time.time() - start:5.0f}s] {message}")

    os.makedirs(work, exist_ok=True)
    data, runs = os.path.join(work, "digits"), os.path.join(work, "runs")
    if buckets:  # photo crops at four aspect ratios, encoded to latents of four shapes
        data = os.path.join(work, "aspects", "latents")
        if not os.path.exists(os.path.join(data, "val", "index.json")):
            from prunepipe.tools.fixtures.bucketed_photos import write_bucketed_photos

            write_bucketed_photos(os.path.join(work, "aspects"), crops_per_photo=16)
    elif not os.path.exists(os.path.join(data, "train", "index.json")):
        from prunepipe.tools.commands.shards import write_shards

        write_shards("digits", data, size=32, shard_size=200, val_fraction=0.1)
    mixed: list[str] = []
    if mixture:  # digits and photo crops 3:1, each source's scores normalised within it
        photos = os.path.join(work, "photos")
        if not os.path.exists(os.path.join(photos, "train", "index.json")):
            from prunepipe.tools.commands.shards import write_shards

            write_shards("photos", photos, size=32, shard_size=100, val_fraction=0.1, crops_per_photo=150)
        mixed = [
            f"data.train=[{{name: digits, path: {data}/train, weight: 3}}, {{name: photos, path: {photos}/train, weight: 1}}]",
            f"data.val=[{{name: digits, path: {data}/val}}, {{name: photos, path: {photos}/val}}]",
            "score.normalise=stratum_mean",
            "score.per_source=true",
        ]
    if strategy != "ddp":  # the model sharded over all 4 ranks, or per node and replicated across the two
        mixed.append(f"parallel.strategy={strategy}")
    shutil.rmtree(runs, ignore_errors=True)  # runs of an earlier rehearsal would be resumed and appended to
    verdict: dict = {
        "work": work,
        "nodes": NODES,
        "ranks_per_node": RANKS_PER_NODE,
        "passes": passes,
        "every_steps": every_steps,
        "dist_timeout_seconds": dist_timeout,
        "killed_node": kill,
        "mixture": mixture,
        "buckets": buckets,
        "strategy": strategy,
        "problems": [],
    }
    problems = verdict["problems"]

    def finish() -> dict:
        verdict["seconds"] = round(time.time() - start, 1)
        verdict["pass"] = not problems
        return verdict

    def job(label: str, rdzv_id: str, name: str, extra: list[str] = ()) -> list[Node]:
        overrides = [*run_overrides(data, runs, name, passes, every_steps, dist_timeout, buckets), *mixed, *extra]
        nodes = start_nodes(work, label, rdzv_id, overrides, BUCKETS_CONFIG if buckets else CONFIG)
        started.extend(nodes)
        return nodes

    def run_to_end(label: str, rdzv_id: str, name: str, extra: list[str] = ()) -> bool:
        began = time.time()
        nodes = job(label, rdzv_id, name, extra)
        codes, _ = wait_nodes(nodes, run_limit)
        verdict[f"{label}_seconds"] = round(time.time() - began, 1)
        if codes != [0] * NODES:
            problems.append(f"{label}: exit codes {codes} (None: still running after {run_limit:.0f} s)")
            for n in nodes:
                say(f"--- {n.log}\n{tail(n)}")
            return False
        return True

    # (a) the reference: both nodes to the end
    progress(f"(a) reference run: {NODES} nodes x {RANKS_PER_NODE} ranks, {passes} passes")
    if not run_to_end("reference", "rehearsal-reference", "reference"):
        return finish()
    reference = metric_records(os.path.join(runs, "reference"), "pass")
    at = kill_step(reference, every_steps)
    verdict["kill_after_checkpoint"] = at
    progress(
        f"reference done in {verdict['reference_seconds']} s: "
        + ", ".join(
            f"pass {r['pass_index'] + 1} {r['steps_in_pass']} micro-batches kept {r['kept_samples']}" for r in reference
        )
    )

    # (b) the same run afresh; a node dies after the mid-pass checkpoint at step `at`
    progress(f"(b) the same run afresh; {kill} node SIGKILLed once it is past the checkpoint at step {at}")
    requeued_dir = os.path.join(runs, "requeued")
    nodes = job("killed", "rehearsal-job", "requeued")
    while last_logged_step(requeued_dir) <= at and all(n.exit_code() is None for n in nodes):
        time.sleep(0.02)
    if any(n.exit_code() is not None for n in nodes):
        problems.append(f"killed run: a node exited before the kill (exit codes {[n.exit_code() for n in nodes]})")
        wait_nodes(nodes, 0)
        return finish()
    holds_rank0 = [0 in n.ranks() for n in nodes]
    victim = nodes[holds_rank0.index(True) if kill == "rank0" else holds_rank0.index(False)]
    survivor = next(n for n in nodes if n is not victim)
    survivor_processes, victim_ranks = proc_tree(survivor.process.pid), victim.ranks()
    victim.kill()
    killed_at = time.time()
    verdict["killed_after_step"] = last_logged_step(requeued_dir)
    progress(
        f"{victim.name} killed (ranks {victim_ranks}, their agent and loader workers) after step "
        f"{verdict['killed_after_step']}; waiting up to {hang_limit:.0f} s for {survivor.name} to exit"
    )
    (code,), _ = wait_nodes([survivor], hang_limit)
    verdict["survivor_exit_code"] = code
    verdict["survivor_exit_seconds"] = round(time.time() - killed_at, 1)
    if code is None:
        problems.append(
            f"the surviving node hung: still running {hang_limit:.0f} s after its peer died "
            f"(dist_timeout_seconds={dist_timeout}); killed"
        )
        say(f"--- {survivor.log}\n{tail(survivor)}")
        return finish()
    left = [pid for pid in survivor_processes if os.path.exists(f"/proc/{pid}")]
    if left:
        problems.append(f"{survivor.name}'s agent exited but processes {left} of its tree still run")
    progress(f"{survivor.name} exited by itself with code {code}, {verdict['survivor_exit_seconds']} s after the kill")
    newest = latest_checkpoint(requeued_dir)
    position = load_checkpoint_states(newest, read_model=False)["position"] if newest else None
    if not position or position["batch_in_pass"] == 0 or checkpoint_step(newest) >= verdict["killed_after_step"]:
        problems.append(
            f"the kill did not fall after a mid-pass checkpoint (newest: {newest}, "
            f"position {position and {k: position[k] for k in ('pass_index', 'batch_in_pass')}})"
        )
        return finish()
    verdict["resume_checkpoint"] = {
        "step": checkpoint_step(newest),
        "pass_index": position["pass_index"],
        "batch_in_pass": position["batch_in_pass"],
    }

    # (c) the requeue: both nodes again, from the newest intact checkpoint
    progress(
        f"(c) requeue with checkpoint.resume=latest (newest: step {checkpoint_step(newest)}, "
        f"pass {position['pass_index'] + 1}, micro-batch {position['batch_in_pass']})"
    )
    if not run_to_end("requeue", "rehearsal-job", "requeued", ["checkpoint.resume=latest"]):
        return finish()
    logs = "".join(open(os.path.join(work, f"requeue_node{n}.log")).read() for n in range(NODES))
    if f"resumed from {newest}" not in logs:
        problems.append(f"the requeue did not say 'resumed from {newest}'")

    # the verdict
    state_problems, compared = compare_final_states(os.path.join(runs, "reference"), requeued_dir)
    requeued = metric_records(requeued_dir, "pass")
    evals = compare_evals(metric_records(os.path.join(runs, "reference"), "eval"), metric_records(requeued_dir, "eval"))
    problems += state_problems + compare_passes(reference, requeued) + evals
    verdict["compared"] = {
        **compared,
        "pass_fields": list(PASS_FIELDS),
        "passes": len(reference),
        "evals": len(metric_records(os.path.join(runs, "reference"), "eval")),
    }
    verdict["pass_summaries"] = [
        {k: r[k] for k in ("pass_index", "optimizer_steps", "steps_in_pass", "kept_samples", "samples_forwarded")}
        for r in reference
    ]
    return finish()


def describe(verdict: dict) -> str:
    """The verdict as a user reads it: PASS or FAIL, what was compared and the numbers."""
    lines = [
        f"{'PASS' if verdict['pass'] else 'FAIL'}: cluster rehearsal in {verdict['seconds']} s "
        f"({verdict['nodes']} nodes x {verdict['ranks_per_node']} ranks, gloo, c10d rendezvous on localhost)"
    ]
    if "survivor_exit_seconds" in verdict:
        lines.append(
            f"  {verdict['killed_node']} node killed after step {verdict['killed_after_step']}; the other "
            f"exited by itself (code {verdict['survivor_exit_code']}) {verdict['survivor_exit_seconds']} s "
            f"later (dist_timeout_seconds={verdict['dist_timeout_seconds']})"
        )
    if "resume_checkpoint" in verdict:
        r = verdict["resume_checkpoint"]
        lines.append(
            f"  requeue resumed from step {r['step']} (pass {r['pass_index'] + 1}, micro-batch {r['batch_in_pass']})"
        )
    if "compared" in verdict:
        c = verdict["compared"]
        lines.append(
            f"  compared at {c.get('checkpoint')}: {c.get('model_tensors')} model tensors, "
            f"{c.get('ema_tensors')} EMA tensors, {c.get('optimizer_tensors')} AdamW tensors, the pruner's state "
            f"and the position, bit for bit; "
            f"{c['passes']} pass summaries ({', '.join(c['pass_fields'])}); {c['evals']} in-loop evaluations"
        )
        for r in verdict["pass_summaries"]:
            lines.append(
                f"    pass {r['pass_index'] + 1}: {r['steps_in_pass']} micro-batches, kept {r['kept_samples']}, "
                f"forwarded {r['samples_forwarded']}, optimizer step {r['optimizer_steps']}"
            )
    lines += [f"  problem: {p}" for p in verdict["problems"]]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--work", default="rehearsal", help="folder for the shards, runs and node logs")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--every-steps", type=int, default=4, help="checkpoint.every_steps (optimizer steps)")
    parser.add_argument("--dist-timeout", type=int, default=60, help="dist_timeout_seconds of the runs")
    parser.add_argument(
        "--kill",
        choices=("rank0", "other"),
        default="rank0",
        help="the node that dies: the one holding rank 0 (whose process hosts the ranks' TCP store), or the other",
    )
    parser.add_argument(
        "--hang-limit",
        type=float,
        default=180.0,
        help="seconds the surviving node may take to exit before it counts as hung",
    )
    parser.add_argument(
        "--mixture",
        action="store_true",
        help="train on two sources (digits and photo crops, weights 3:1), scores per source",
    )
    parser.add_argument(
        "--buckets",
        action="store_true",
        help="rehearse the tiny text-to-image PixArt on aspect-ratio buckets (photo crops at 1:1, 2:1, 1:2, 4:3)",
    )
    parser.add_argument(
        "--strategy",
        choices=("ddp", "fsdp", "hsdp"),
        default="ddp",
        help="parallel.strategy of the runs (hsdp: each node's ranks shard, the nodes replicate)",
    )
    parser.add_argument("--json", help="write the verdict here too")


def run_from_args(args) -> int:
    if args.mixture and args.buckets:
        raise ValueError("--mixture and --buckets rehearse different runs: give one")
    verdict = rehearse(
        os.path.abspath(args.work),
        passes=args.passes,
        every_steps=args.every_steps,
        dist_timeout=args.dist_timeout,
        kill=args.kill,
        hang_limit=args.hang_limit,
        mixture=args.mixture,
        buckets=args.buckets,
        strategy=args.strategy,
    )
    print(describe(verdict))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(verdict, f, indent=1)
    return 0 if verdict["pass"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        return run_from_args(parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
