"""Is pruning lossless here, and does it beat simply training less? (docs/evaluation.md says what "lossless" means)

For each task (MAE, pixel-space DDPM) on small digit shards: Full at 3 seeds (run-to-run noise),
Random, InfoBatch and TED at the same passes and seed 0, Full at the samples forwarded of each pruned
run (fewer passes, its own cosine schedule), a long and a short schedule, and a few pruner settings.
All runs of one invocation share the machine side by side (a pool of `--workers` processes, one
torch thread each), so their wall-clocks are comparable; samples forwarded and optimizer steps do
not depend on load; the long schedule is then rerun one run at a time for wall-clock savings. It
trains through `prunepipe.pipelines.training.loop.train` and judges with the evaluators, changing neither (the
run's pruner is wrapped only to time its calls; its decisions are untouched).

    python -m prunepipe.tools.benchmarks.lossless [--task mae|ldm|both|dit] [--quick] [--out docs] [--work /tmp/bench_lossless]

Writes OUT/benchmarks/lossless_{mode}.md (the mode's tables between `bench:` markers; text outside them is
kept), its plots OUT/benchmarks/lossless_{mode}_*.png, and WORK/lossless_{mode}.json with every number
(`--from-json` re-renders the page and plots from it). docs/BENCHMARKS.md summarises the recorded suites.
The verdicts are in tools/benchmarks/lossless/verdicts.py, the plots and tables in tools/benchmarks/lossless/report.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import re
import shutil
import sys
import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import numpy as np

from prunepipe.pipelines.atomic_write import atomic_write_json
from prunepipe.pipelines.report.runs import read_metrics
from prunepipe.tools.benchmarks.lossless.plan import (
    RunSpec,
    TaskPlan,
    equal_compute_spec,
    first_specs,
    slug,
    task_plans,
)
from prunepipe.tools.benchmarks.lossless.report import (
    markdown_path,
    page,
    plot_curves,
    plot_frontier,
    render,
    write_markdown,
)
from prunepipe.tools.benchmarks.lossless.verdicts import arms, flattening, saving_targets, summarise, targets

ROOT = str(Path(__file__).resolve().parents[3])  # the repository: configs/ lives there


# ----------------------------------------------------------------------------- data
def prepare_data(work: str, plan: TaskPlan, size: int = 16) -> str:
    """The plan's shards at `size` px in WORK, written once; returns the folder holding train/ and val/.
    Digits and captioned (the digits as image-text pairs): train/index.json lists only the first shard,
    which holds exactly `train_samples` images (ids 0..N-1); captioned also writes a tiny random CLIP
    text encoder of their words in ROOT/text_encoder. Photos and redundant: `crops_per_photo` crops of
    each bundled photograph."""
    from prunepipe.pipelines.data.shards import ShardIndex
    from prunepipe.pipelines.data.splits import read_captions
    from prunepipe.tools.commands.shards import write_shards
    from prunepipe.tools.fixtures.known_groups import KNOWN, write_known_groups
    from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_text_encoder

    if plan.data not in ("digits", "captioned"):
        root = os.path.join(work, f"{plan.data}{size}_c{plan.crops_per_photo}")
        if not os.path.exists(os.path.join(root, "val", "index.json")):
            write_shards(plan.data, root, size=size, shard_size=100_000, crops_per_photo=plan.crops_per_photo)
        if plan.data == "redundant" and not os.path.exists(os.path.join(root, "train", "groups", f"{KNOWN}.npy")):
            write_known_groups(os.path.join(root, "train"))  # the dedup arms' group table (pruner.groups=known)
        return root
    captioned = plan.data == "captioned"
    train_samples = plan.train_samples
    root = os.path.join(work, f"{plan.data}{size}_n{train_samples}")
    last_written = os.path.join(root, *(("text_encoder", "config.json") if captioned else ("val", "index.json")))
    if not os.path.exists(last_written):
        write_shards("digits", root, size=size, shard_size=train_samples, captions=captioned)
        train = os.path.join(root, "train")
        # the first shard only, with the rest of what write_shards recorded (source, size, keys, ...)
        written = ShardIndex.load(train)
        first = written.expected(0)
        ShardIndex.write(train, [(written.urls[0], train_samples, first.size, first.crc32)], **written.meta)
        if captioned:
            write_tiny_text_encoder(os.path.join(root, "text_encoder"), read_captions(train))
    return root


def train_size(root: str) -> int:
    from prunepipe.pipelines.data.shards import ShardIndex

    return ShardIndex.load(os.path.join(root, "train")).num_samples


def feature_net(root: str, size: int = 16) -> str:
    """The small-domain classifier FID uses on digits (tools/commands/feature_net.py), trained once."""
    from prunepipe.tools.commands.feature_net import train_feature_net

    path = os.path.join(root, "feature_net.safetensors")
    if not os.path.exists(path):
        train_feature_net(root, path, image_size=size, channels=1, net_resolution=size)
    return path


# ----------------------------------------------------------------------------- one run (in a worker)
class TimedPruner:
    """The run's pruner, unchanged, with the seconds spent in plan/weights/update/on_step counted."""

    TIMED = ("plan", "weights", "update", "on_step")

    def __init__(self, inner):
        self._inner = inner
        self.seconds = defaultdict(float)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self.TIMED:
            return attr

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # two runs side by side on two cores, not four threads fighting
    os.environ.setdefault("TQDM_DISABLE", "1")


def execute(
    spec: RunSpec, plan: TaskPlan, data_root: str, runs_dir: str, fid_weights: str, evaluate_runs: bool = True
) -> dict:
    """Train one run, then evaluate its final raw weights; returns everything the report needs.
    Without `evaluate_runs` there is no held-out evaluation at all (the timing phase)."""
    import contextlib
    import io
    from unittest import mock

    import prunepipe.pipelines.training.loop as loop
    from prunepipe.pipelines.config import load_config

    val = f"{data_root}/val" if evaluate_runs else ""  # data.val= : no held-out set
    overrides = [
        f"runs_dir={runs_dir}",
        f"name={spec.key}",
        f"seed={spec.seed}",
        f"num_passes={spec.passes}",
        f"data.train={data_root}/train",
        f"data.val={val}",
        *(o.format(data=data_root) for o in plan.overrides),
    ]  # "{data}": the bench's data folder
    pruner = dict(spec.pruner)
    # e.g. timestep-normalised scores, or another train split ("{data}" is the bench's data folder)
    overrides += [
        f"{k}={v.format(data=data_root) if isinstance(v, str) else v}" for k, v in pruner.pop("run", {}).items()
    ]
    overrides += [f"pruner.{k}={v}" for k, v in pruner.items()]
    cfg = load_config(os.path.join(ROOT, plan.config), overrides)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    timed: list[TimedPruner] = []

    def build_timed(*args, **kwargs):
        timed.append(TimedPruner(loop_build(*args, **kwargs)))
        return timed[-1]

    loop_build = loop.build_pruner
    start, cpu_start = time.perf_counter(), time.process_time()
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with mock.patch.object(loop, "build_pruner", build_timed), quiet[0], quiet[1]:
        loop.train(cfg)
    process_seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    passes = [r for r in read_metrics(os.path.join(cfg.run_dir, "metrics.jsonl")) if r.get("kind") == "pass"]
    last = passes[-1]
    result = dataclasses.asdict(spec)
    result.update(
        samples_forwarded=last["samples_forwarded"],
        optimizer_steps=last["optimizer_steps"],
        wall_seconds=last["wall_seconds"],
        process_seconds=process_seconds,
        cpu_seconds=cpu_seconds,
        mean_kept_fraction=float(np.mean([r["kept_fraction"] for r in passes])),
        pruner_seconds=dict(timed[0].seconds) if timed else {},
        curve=[
            {
                "pass": r["pass_index"] + 1,
                "samples_forwarded": r["samples_forwarded"],
                "wall_seconds": r["wall_seconds"],
                "held_out": r.get("held_out", {}).get(plan.main),
            }
            for r in passes
        ],
        metrics={plan.main: last.get("held_out", {}).get(plan.main)},
        metrics_source="trainer held-out (run seed)",
    )
    if not evaluate_runs:
        return result
    metrics, replication = evaluate(cfg, plan, fid_weights, train=f"{data_root}/train")
    result["metrics"].update(metrics)
    if replication is not None:
        result["replication"] = replication
    for split in plan.extra_splits:  # e.g. val_mix: the train mix's held-out data beside the clean val
        extra, _ = evaluate(cfg, plan, fid_weights, val=f"{data_root}/{split}", fid=False)
        result["metrics"].update({f"{name.removeprefix('eval_')}@{split}": value for name, value in extra.items()})
    if result["metrics"].get("eval_" + plan.main) is not None:
        result["metrics"][plan.main] = result["metrics"].pop("eval_" + plan.main)
        result["metrics_source"] = "evaluators, raw final weights, eval seed 0, all val"
    return result


def evaluate(
    cfg, plan: TaskPlan, fid_weights: str, val: str = "", fid: bool = True, train: str = ""
) -> tuple[dict, dict | None]:
    """PSNR, linear probe (MAE) and FID (diffusion) of the final raw weights, through the evaluators
    of pipelines/evaluate*.py; and with `plan.replication_samples` (and `fid`), how many samples copy a
    `train` image (else None): a rate, not a quality the frontier reads."""
    import contextlib
    import io

    from prunepipe.pipelines.evaluation.config import EvalConfig, FIDConfig, ProbeConfig, ReplicationConfig
    from prunepipe.pipelines.trained import evaluate_checkpoint

    # Raw weights: the EMA (decay 0.999) of runs this short lags far behind and would judge the EMA's
    # warmup, not the pruner. Probe: 10 labelled images per class, because on digits random encoder
    # features are already ~90% linearly separable with all labels (pipelines/evaluation/config.py).
    fid_config = FIDConfig(
        enabled=fid and plan.fid_samples > 0,
        num_samples=max(plan.fid_samples, 2),
        sampler_steps=plan.fid_steps,
        feature="classifier",
        weights=fid_weights,
        reference="train",
        reference_samples=0,
    )
    # every arm's samples searched among the whole train split (the oracle trains on a part of it)
    replication = ReplicationConfig(
        enabled=fid and plan.replication_samples > 0,
        num_samples=max(plan.replication_samples, 1),
        max_train=0,
        held_out_samples=0,
        train=train,
        picture_pairs=0,
    )
    eval_cfg = EvalConfig(
        weights="raw",
        seed=0,
        val=val,
        val_samples=0,
        fid=fid_config,
        replication=replication,
        probe=ProbeConfig(enabled=plan.task == "mae", pool="avg", per_class=10),
    )
    with contextlib.redirect_stderr(io.StringIO()):  # progress bars
        record = evaluate_checkpoint(cfg.run_dir, "latest", eval_cfg, device="cpu", write=not val)
    details = record["details"]
    copies = (
        {k: v for k, v in details.items() if k.startswith("replication_") and isinstance(v, (int, float))}
        if replication.enabled
        else None
    )
    keep = {"psnr": "psnr", "probe_accuracy": "probe_accuracy", "fid": "fid", plan.main: "eval_" + plan.main}
    metrics = {name: float(details[key]) for key, name in keep.items() if isinstance(details.get(key), (int, float))}
    return metrics, copies


# ----------------------------------------------------------------------------- scheduling
def recorded_runs(paths: list[str]) -> dict[str, dict]:
    """The runs of recorded reports by key (one result per key: an equal-compute alias is the run it
    names), each marked with the report it came from."""
    runs: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            for result in json.load(f)["results"]:
                runs.setdefault(result["key"], {**result, "reused_from": os.path.basename(path)})
    return runs


def same_run(spec: RunSpec, recorded: dict | None) -> bool:
    """Does a recorded result train exactly what `spec` asks (task, schedule, seed, passes, pruner)?"""
    return recorded is not None and all(
        recorded.get(name) == getattr(spec, name) for name in ("task", "schedule", "seed", "passes", "pruner")
    )


def run_all(plans: list[TaskPlan], work: str, workers: int, log=None, reuse: dict | None = None) -> list[dict]:
    """Every run of every plan, `workers` at a time; an equal-compute Full starts when its pruned run
    ends. A run `reuse` holds (same key and settings) is taken from it instead of trained."""
    log = log or (lambda message: print(message, flush=True))
    reuse = reuse or {}
    runs_dir = os.path.join(work, "runs")
    jobs = []
    context = {}
    for plan in plans:
        root = prepare_data(work, plan)
        fid_weights = feature_net(root) if plan.fid_samples > 0 else ""
        context[plan.task] = (plan, root, fid_weights)
        jobs += first_specs(plan)
    cost = {
        "mae": 1.0,
        "ldm": 4.0,
        "dit": 2.0,
        "t2i": 2.5,
    }  # seconds per pass, roughly: the costliest job first keeps both workers busy
    pending = sorted(jobs, key=lambda s: -s.passes * cost[s.task])
    results = []
    pool_kwargs = dict(max_workers=workers, initializer=_init_worker, mp_context=multiprocessing.get_context("spawn"))
    done_keys: dict[str, dict] = {}
    waiting: dict[str, list[RunSpec]] = {}  # run key -> equal-compute specs that are the same run
    with ProcessPoolExecutor(**pool_kwargs) as pool:
        futures = {}
        while pending or futures:
            finished = []  # (spec, result) of runs done since the last look
            while pending and len(futures) < workers:
                spec = pending.pop(0)
                recorded = reuse.get(spec.key)
                if same_run(spec, recorded):
                    finished.append(
                        (spec, {**recorded, "label": spec.label, "role": spec.role, "compute_of": spec.compute_of})
                    )
                    continue
                futures[pool.submit(execute, spec, *context[spec.task][:2], runs_dir, context[spec.task][2])] = spec
            if not finished:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                finished = [(futures[future], future.result()) for future in done]
                for future in done:
                    futures.pop(future)
            for spec, result in finished:
                results.append(result)
                plan = context[spec.task][0]
                log(
                    f"[{time.strftime('%H:%M:%S')}] {spec.key}{' (reused)' if result.get('reused_from') else ''}: "
                    f"{result['passes']} passes, "
                    f"{result['samples_forwarded']} samples, {result['optimizer_steps']} steps, "
                    f"{result['wall_seconds']:.1f} s, {plan.main} {result['metrics'].get(plan.main)}"
                )
                done_keys[spec.key] = result
                for alias in waiting.pop(spec.key, []):
                    results.append({**result, "label": alias.label, "role": alias.role, "compute_of": alias.compute_of})
                if spec.role == "pruned":
                    batch = 32  # configs/bench_*.yaml; one rank, no worker split: a pass forwards N // B * B
                    follow = equal_compute_spec(result, (train_size(context[spec.task][1]) // batch) * batch)
                    # Full at the same passes is a run we already have (that seed), or one already asked for
                    same = (
                        f"{spec.task}_{spec.schedule}_full_s{spec.seed}" if follow.passes == spec.passes else follow.key
                    )
                    if same in done_keys:
                        results.append(
                            {
                                **done_keys[same],
                                "label": follow.label,
                                "role": follow.role,
                                "compute_of": follow.compute_of,
                            }
                        )
                    elif same in waiting or any(p.key == same for p in pending) or same in running_keys(futures):
                        waiting.setdefault(same, []).append(follow)
                    else:
                        pending.append(follow)
                        pending.sort(key=lambda s: -s.passes * cost[s.task])
    return results


def timing_runs(plans: list[TaskPlan], work: str, log=None) -> list[dict]:
    """Full, Random, InfoBatch and TED of the long schedule again, one at a time and interleaved
    (F R I T F R I T ...), without held-out evaluation: wall-clock and CPU seconds of runs that did
    not share the machine with each other, and met the same drifts of outside load."""
    log = log or (lambda message: print(message, flush=True))
    runs_dir = os.path.join(work, "timing")
    results = []
    with ProcessPoolExecutor(
        max_workers=1, initializer=_init_worker, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        for plan in plans:
            root = prepare_data(work, plan)
            for round_ in range(plan.timing_rounds):
                for label, pruner in [("Full", {"name": "full"}), *plan.pruners.items()]:
                    spec = RunSpec(
                        f"{plan.task}_timing_{slug(label)}_r{round_}",
                        plan.task,
                        "long",
                        label,
                        "full" if label == "Full" else "pruned",
                        dict(pruner),
                        0,
                        plan.long,
                    )
                    result = pool.submit(execute, spec, plan, root, runs_dir, "", False).result()
                    result["round"] = round_
                    results.append(result)
                    log(
                        f"[{time.strftime('%H:%M:%S')}] timing {spec.key}: {result['samples_forwarded']} samples, "
                        f"{result['wall_seconds']:.1f} s wall, {result['cpu_seconds']:.1f} s CPU"
                    )
    return results


def summarise_timing(timing: list[dict]) -> list[dict]:
    """Per task and pruner: skipped fraction, wall-clock and CPU saving against Full (means over rounds),
    realised = saving / skipped, and the pruner's share of the loop's wall time."""
    rows = []
    for task in sorted({r["task"] for r in timing}):
        runs = [r for r in timing if r["task"] == task]
        full = [r for r in runs if r["label"] == "Full"]
        wall_full = float(np.mean([r["wall_seconds"] for r in full]))
        cpu_full = float(np.mean([r["cpu_seconds"] for r in full]))
        sf_full = float(np.mean([r["samples_forwarded"] for r in full]))
        for label in dict.fromkeys(r["label"] for r in runs):
            mine = [r for r in runs if r["label"] == label]
            wall = float(np.mean([r["wall_seconds"] for r in mine]))
            cpu = float(np.mean([r["cpu_seconds"] for r in mine]))
            skipped = 1.0 - float(np.mean([r["samples_forwarded"] for r in mine])) / sf_full
            saving, cpu_saving = 1.0 - wall / wall_full, 1.0 - cpu / cpu_full
            pruner = float(np.mean([sum(r["pruner_seconds"].values()) for r in mine]))
            steps = float(np.mean([r["optimizer_steps"] for r in mine]))
            rows.append(
                {
                    "task": task,
                    "label": label,
                    "rounds": len(mine),
                    "passes": mine[0]["passes"],
                    "skipped": skipped,
                    "optimizer_steps": steps,
                    "wall_seconds": wall,
                    "wall_spread": float(np.ptp([r["wall_seconds"] for r in mine])),
                    "cpu_seconds": cpu,
                    "saving": saving,
                    "cpu_saving": cpu_saving,
                    "realised": saving / skipped if skipped > 0.02 else float("nan"),
                    "cpu_realised": cpu_saving / skipped if skipped > 0.02 else float("nan"),
                    "step_ms": 1000 * wall / max(steps, 1),
                    "pruner_overhead": pruner / max(wall, 1e-9),
                }
            )
    return rows


def running_keys(futures: dict) -> set[str]:
    return {spec.key for spec in futures.values()}


# ----------------------------------------------------------------------------- entry point
def bench(
    mode: str = "full",
    tasks: tuple[str, ...] = ("mae", "ldm"),
    out: str = "docs",
    work: str = "/tmp/bench_lossless",
    workers: int = 2,
    command: str = "",
    log=None,
    arms: tuple[str, ...] = (),
    frontier: tuple[float, ...] = (),
    reuse: dict | None = None,
) -> dict:
    """Run the benchmark and write OUT/benchmarks/lossless_{mode}.md and its plots; returns the report dict.
    `reuse`: recorded results by run key (`recorded_runs`), taken instead of training them again."""
    plans = task_plans(mode, list(tasks), arms, frontier)
    os.makedirs(work, exist_ok=True)
    load_start = os.getloadavg()
    start = time.perf_counter()
    results = run_all(plans, work, workers, log=log, reuse=reuse)
    timing = timing_runs(plans, work, log=log)
    meta = {
        "mode": mode,
        "command": command
        or f"prunepipe bench lossless --task {','.join(tasks)}" + (" --quick" if mode == "quick" else ""),
        "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU, "
        f"Python {platform.python_version()}, torch {__import__('torch').__version__}",
        "workers": workers,
        "bench_seconds": time.perf_counter() - start,
        "load_start": " ".join(f"{x:.1f}" for x in load_start),
        "load_end": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "timing": timing,
        "reused_runs": len({r["key"] for r in results if r.get("reused_from")}),
    }
    return write_report(results, plans, meta, out, os.path.join(work, f"lossless_{mode}.json"))


def write_report(results: list[dict], plans: list[TaskPlan], meta: dict, out: str, json_path: str) -> dict:
    """Tables, verdicts, targets, plots and OUT/benchmarks/lossless_{mode}.md from the runs' results; every
    number (and each run's per-pass curve) goes to `json_path`, from which `rerender` rewrites the report."""
    mode = meta["mode"]
    rows = summarise(results, plans)
    flat = {p.task: flattening(results, p) for p in plans}
    plot_dir = os.path.join(out, "benchmarks")
    os.makedirs(plot_dir, exist_ok=True)
    report = {
        **meta,
        "plans": [dataclasses.asdict(p) for p in plans],
        "results": results,
        "rows": rows,
        "flattening": flat,
        "arms": arms(results, plans),
    }
    report["plots"] = {
        p.task: plot_frontier(results, p, plot_dir, mode, report["arms"])
        if len(p.pruned_seeds) > 1
        else plot_curves(results, p, plot_dir, mode)
        for p in plans
    }
    report["timing_rows"] = summarise_timing(meta.get("timing") or [])
    report["targets"] = (
        saving_targets(report["arms"]) if mode.startswith("pays_") else targets(rows, flat, report["timing_rows"])
    )
    report["markdown"] = render(report)
    atomic_write_json(json_path, report, indent=1, default=float)
    write_markdown(markdown_path(out, mode), mode, page(mode, report["markdown"], json_path, out))
    return report


def merged(paths: list[str]) -> dict:
    """Recorded reports of one mode (e.g. the tasks of a suite run as separate invocations) as one."""
    saved = []
    for path in paths:
        with open(path) as f:
            saved.append(json.load(f))
    modes = {s["mode"] for s in saved}
    if len(modes) != 1:
        raise ValueError(f"--from-json: the reports are of different modes {sorted(modes)}; merge one mode at a time")
    tasks = [p["task"] for s in saved for p in s["plans"]]
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"--from-json: a task appears in more than one report ({tasks}); each must hold other tasks")
    first = saved[0]
    return {
        **first,
        "plans": [p for s in saved for p in s["plans"]],
        "results": [r for s in saved for r in s["results"]],
        "command": "; ".join(s["command"] for s in saved),
        "bench_seconds": sum(s["bench_seconds"] for s in saved),
        "load_end": saved[-1]["load_end"],
        "timing": [t for s in saved for t in (s.get("timing") or [])],
    }


def rerender(path: str | list[str], out: str, timing: bool = False, work: str = "/tmp/bench_lossless") -> dict:
    """Rewrite the report of a finished benchmark from its lossless_{mode}.json (no training), after
    running the sequential timing phase again when `timing`. Several paths: their runs as one report,
    recorded as OUT/benchmarks/lossless_{mode}.json."""
    paths = [path] if isinstance(path, str) else list(path)
    saved = merged(paths)
    if len(paths) > 1:
        path = os.path.join(out, "benchmarks", f"lossless_{saved['mode']}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
    else:
        path = paths[0]
    plans = [TaskPlan(**p) for p in saved["plans"]]
    if timing:
        plans = [
            dataclasses.replace(p, timing_rounds=task_plans(saved["mode"], [p.task])[0].timing_rounds) for p in plans
        ]
        saved["timing"] = timing_runs(plans, work)
    meta = {
        k: saved.get(k)
        for k in ("mode", "command", "machine", "workers", "bench_seconds", "load_start", "load_end", "timing")
    }
    return write_report(saved["results"], plans, meta, out, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prunepipe bench lossless", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--task",
        choices=("mae", "ldm", "both", "dit", "t2i"),
        default="both",
        help="dit: the DiT + flow latent-diffusion task (without --suite pays: InfoBatch vs Full at "
        "3 seeds, its own block); t2i: the text-conditional DiT on captioned digits, the same",
    )
    parser.add_argument("--quick", action="store_true", help="a few minutes: same runs, few passes")
    parser.add_argument("--out", default="docs", help="writes OUT/benchmarks/lossless_MODE.md and its plots")
    parser.add_argument("--work", default="/tmp/bench_lossless", help="shards and run folders")
    parser.add_argument("--workers", type=int, default=2, help="runs side by side (one torch thread each)")
    parser.add_argument(
        "--from-json",
        nargs="+",
        help="only rewrite the report from finished runs' WORK/lossless_MODE.json (several: "
        "one mode's invocations, e.g. one per task, as one report)",
    )
    parser.add_argument(
        "--suite",
        choices=("lossless", "pays"),
        default="lossless",
        help="pays: every arm at 3 seeds with its equal-compute Full at the same seeds, on --data "
        "(rescale, importance, timestep-normalised scores); pooled-std verdicts",
    )
    parser.add_argument(
        "--data",
        choices=("digits", "photos", "redundant"),
        default="digits",
        help="with --suite pays: the shards (redundant: clean val and val_mix)",
    )
    parser.add_argument(
        "--passes", type=int, default=0, help="with --suite pays: the long schedule's passes (0: the suite's own)"
    )
    parser.add_argument(
        "--seeds", type=int, default=0, help="with --suite pays: seeds of every arm and of Full (0: the suite's 3)"
    )
    parser.add_argument(
        "--arms",
        default="",
        help="with --suite pays: only these settings beside Full, comma-separated labels "
        "(e.g. 'InfoBatch,InfoBatch no rescale')",
    )
    parser.add_argument(
        "--frontier",
        default="",
        help="with --suite pays: Full also at these fractions of the passes, comma-separated "
        "(e.g. 0.5,0.6,0.7,0.8,0.9,1.2,1.5), at every seed: each seed's quality-vs-compute "
        "curve, from which the compute saved at equal quality is read (above 1: a setting "
        "better than Full gets a saving, not a bound)",
    )
    parser.add_argument(
        "--tag",
        default="",
        help="with --suite pays: a name for this invocation's report block (e.g. with --arms, "
        "so that it does not replace the whole suite's)",
    )
    parser.add_argument(
        "--reuse",
        nargs="+",
        metavar="JSON",
        help="take the runs these recorded reports (lossless_MODE.json) hold instead of training "
        "them again: a run whose key, seed, passes and pruner settings match (runs are "
        "deterministic on this code; the report lists how many were reused)",
    )
    parser.add_argument(
        "--timing-only",
        action="store_true",
        help="with --from-json: (re)run only the sequential timing runs and rewrite the report",
    )


def pays_invocation(args) -> tuple[str, str]:
    """The mode of a --suite pays invocation (it names the report block: pays_DATA[_pN][_sN][_TAG])
    and its flags as the recorded command repeats them."""
    mode, flags = f"pays_{args.data}", f" --suite pays --data {args.data}"
    for name, letter in (("passes", "p"), ("seeds", "s")):
        value = getattr(args, name)
        if value:
            mode, flags = f"{mode}_{letter}{value}", f"{flags} --{name} {value}"
    if args.arms:
        flags += f" --arms '{args.arms}'"
    if args.frontier:
        flags += f" --frontier {args.frontier}"
    if args.tag:
        mode, flags = f"{mode}_{args.tag}", f"{flags} --tag {args.tag}"
    return mode, flags


def run_from_args(args) -> int:
    if args.from_json:
        print(rerender(args.from_json, args.out, timing=args.timing_only, work=args.work)["markdown"])
        return 0
    tasks = ("mae", "ldm") if args.task == "both" else (args.task,)
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    try:
        frontier = tuple(float(f) for f in args.frontier.split(",") if f.strip())
    except ValueError:
        raise ValueError(
            f"bench lossless: --frontier {args.frontier!r}: expected fractions such as 0.5,0.7,0.9"
        ) from None
    if (args.seeds or arms or args.tag or frontier) and args.suite != "pays":
        raise ValueError("bench lossless: --seeds, --arms, --frontier and --tag belong to --suite pays")
    if args.tag and not args.tag.isidentifier():
        raise ValueError(f"bench lossless: --tag {args.tag!r} must be letters, digits and underscores")
    if args.tag and re.match(r"[ps]\d", args.tag):  # the suite's name would read it as passes or seeds
        raise ValueError(
            f"bench lossless: --tag {args.tag!r} may not start with p or s and a digit "
            f"(pays_DATA_pPASSES_sSEEDS_TAG would read it as a setting)"
        )
    mode, suite = pays_invocation(args) if args.suite == "pays" else ("quick" if args.quick else "full", "")
    command = (
        f"prunepipe bench lossless --task {args.task}{' --quick' if args.quick else ''}{suite} --out {args.out}"
        f" --workers {args.workers}"
    )
    if args.task in ("dit", "t2i") and args.suite != "pays":
        mode = f"{args.task}_quick" if args.quick else args.task
    if args.reuse:
        command += f" --reuse {' '.join(args.reuse)}"
    reuse = recorded_runs(args.reuse or [])
    report = bench(
        mode, tasks, args.out, args.work, args.workers, command=command, arms=arms, frontier=frontier, reuse=reuse
    )
    print(report["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
