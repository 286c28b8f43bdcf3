"""One verdict: over every recorded suite of `prunepipe bench lossless` (docs/benchmarks/*.json), the
benchmark's verdicts and `prunepipe compare`'s on the same runs agree. The compare side reads run
folders written here from the recorded runs (config.yaml, a metrics.jsonl pass record), as it reads
any run; the benchmark side reads the recorded JSON through its own adapter. Equal passes, equal
compute and the compute saved at equal quality are checked run by run and setting by setting, and
the recorded pages must hold what the code reads from their runs today."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import yaml

from prunepipe.pipelines.evaluation.records import PRIMARY_METRICS
from prunepipe.pipelines.report.compare import compare_runs
from prunepipe.tools.benchmarks.lossless.plan import TaskPlan
from prunepipe.tools.benchmarks.lossless.verdicts import arms, schedule_groups, summarise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITES = sorted(glob.glob(os.path.join(ROOT, "docs", "benchmarks", "lossless_*.json")))
FULL = ("full", "frontier", "equal_compute")
PRUNED = ("pruned", "ablation")


def _load(path: str) -> tuple[dict, list[TaskPlan]]:
    with open(path) as f:
        saved = json.load(f)
    return saved, [TaskPlan(**p) for p in saved["plans"]]


def _folder(root: str, name: str, result: dict) -> str:
    """A run folder as training leaves it, as far as `compare` reads one: the config (its setting is
    the arm's label) and the last pass's record with the recorded final quality as held-out."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    config = {
        "name": name,
        "task": result["task"],
        "seed": result["seed"],
        "num_passes": result["passes"],
        "pruner": {"name": result["pruner"].get("name", "?")},
        "arm": result["label"] if result["role"] in PRUNED else "full",
    }
    with open(os.path.join(path, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    record = {
        "kind": "pass",
        "pass_index": result["passes"] - 1,
        "samples_forwarded": result["samples_forwarded"],
        "optimizer_steps": result["optimizer_steps"],
        "wall_seconds": result["wall_seconds"],
        "held_out": {m: v for m, v in result["metrics"].items() if m in PRIMARY_METRICS and v is not None},
    }
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps(record) + "\n")
    return path


def test_every_recorded_suite_is_here():
    names = {os.path.basename(p) for p in SUITES}
    assert len(names) >= 12 and "lossless_pays_redundant_s5_dedup.json" in names


@pytest.mark.parametrize("path", SUITES, ids=lambda p: os.path.basename(p)[len("lossless_") : -len(".json")])
def test_compare_and_the_benchmark_give_one_verdict(path, tmp_path):
    saved, plans = _load(path)
    rows = summarise(saved["results"], plans)
    arm_rows = arms(saved["results"], plans)
    checked = 0
    for plan, schedule, group, _, _ in schedule_groups(saved["results"], plans):
        root = tmp_path / f"{plan.task}_{schedule}"
        folders: dict[str, str] = {}  # Full runs by key: a run serving several roles is one folder
        baselines, frontier, pruned, labels = [], [], [], {}
        for r in group:
            if r["role"] in FULL:
                if r["key"] not in folders:
                    folders[r["key"]] = _folder(str(root), f"full_{r['key']}", r)
                    (baselines if r["role"] == "full" else frontier).append(folders[r["key"]])
                elif r["role"] == "full":  # first met as a frontier point: the baseline it is as well
                    baselines.append(folders[r["key"]])
            else:
                name = f"{re.sub(r'[^A-Za-z0-9]+', '_', r['label'])}_s{r['seed']}"
                pruned.append(_folder(str(root), name, r))
                labels[name] = (r["label"], r["seed"])
        frontier = [f for f in frontier if f not in baselines]
        report = compare_runs(baselines, pruned, frontier=frontier, out=str(root / "report"), plots=False)

        mine = {(r["label"], r["seed"]): r for r in rows if r["task"] == plan.task and r["schedule"] == schedule}
        for name, key in labels.items():
            row = mine[key]
            if plan.main not in PRIMARY_METRICS:
                continue
            passes = report["equal_passes"][name]["metrics"][plan.main]
            compute = report["equal_compute"][name]["metrics"].get(plan.main)
            assert (passes["verdict"] == "lossless") is row["lossless"], (name, "equal passes")
            assert (compute or {}).get("verdict", "not measured") == row["equal_compute_verdict"], (name, "compute")
            if compute:
                assert compute["reference"] == pytest.approx(row["equal_compute_value"], rel=1e-9), name
            checked += 1

        settings = {r["label"]: r for r in arm_rows if r["task"] == plan.task and r["schedule"] == schedule}
        for setting in report["equal_quality"]["settings"]:
            label = labels[setting["runs"][0]][0]
            for metric, answer in setting["metrics"].items():
                bench = (settings.get(label) or {"metrics": {}})["metrics"].get(metric)
                if bench is None:  # a setting of one seed: the benchmark reads no interval from it
                    assert len(setting["seeds"]) < 2 or len(plan.pruned_seeds) < 2, (label, metric)
                    continue
                assert answer["verdict"] == bench["saving"]["verdict"], (label, metric)
                assert answer["mean"] == pytest.approx(bench["saving"]["mean"], rel=1e-9, nan_ok=True)
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("path", SUITES, ids=lambda p: os.path.basename(p)[len("lossless_") : -len(".json")])
def test_the_recorded_pages_hold_what_the_one_reading_gives(path):
    """Each recorded suite was re-rendered with the code that reads it now (`prunepipe bench lossless
    --from-json`): its stored verdicts are the ones recomputed from its runs."""
    saved, plans = _load(path)
    rows = summarise(saved["results"], plans)
    stored = {(r["task"], r["schedule"], r["label"], r["seed"]): r for r in saved["rows"]}
    for row in rows:
        if "lossless" in row:
            old = stored[(row["task"], row["schedule"], row["label"], row["seed"])]
            assert old.get("equal_compute_verdict") == row["equal_compute_verdict"], row["label"]
            assert old["lossless"] == row["lossless"], row["label"]
    fresh = {(r["task"], r["schedule"], r["label"]): r for r in arms(saved["results"], plans)}
    for old in saved["arms"]:
        new = fresh[(old["task"], old["schedule"], old["label"])]
        for metric, cell in old["metrics"].items():
            assert cell["pays"] == new["metrics"][metric]["pays"], (old["label"], metric)
            verdict = (cell.get("saving") or {}).get("verdict")
            assert verdict == (new["metrics"][metric].get("saving") or {}).get("verdict"), (old["label"], metric)
