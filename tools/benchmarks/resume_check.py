"""Kill-and-resume exactness on whatever device this machine trains on: a run trained straight
through against the same run SIGKILLed right after a checkpoint and resumed; the final weights, EMA
weights and pruner state must be equal bit for bit. Usage:
python -m prunepipe.tools.benchmarks.resume_check CONFIG --out DIR [key=value ...] (exit 1 when they differ)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch

from prunepipe.pipelines.checkpoint.store import latest_checkpoint, load_checkpoint_states
from prunepipe.pipelines.report.runs import read_metrics

COMPARED = ("model", "ema", "pruner")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def launch(config: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "prunepipe.launch.cli", "train", config, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished(process: subprocess.Popen, what: str) -> None:
    out = process.communicate(timeout=600)[0]
    if process.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {process.returncode}):\n{out[-3000:]}")


def differences(a, b, path: str = "") -> list[str]:
    """Where two saved states differ (dicts of tensors, arrays and plain values)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys differ"]
        return [d for key in a for d in differences(a[key], b[key], f"{path}.{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # the EMA's shadow_params
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [path]
    if hasattr(a, "shape"):  # numpy
        return [] if (a.shape == b.shape and (a == b).all()) else [path]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a} != {b}"]


def final_state(run_dir: str) -> dict:
    """The last checkpoint's model, EMA (shadow weights and step count) and pruner (tables read from their files)."""
    states = load_checkpoint_states(latest_checkpoint(run_dir))
    return {part: states[part] for part in COMPARED}


def check(config: str, out: str, overrides: list[str]) -> dict:
    common = [f"runs_dir={out}", *overrides]
    finished(launch(config, [*common, "name=straight"]), "the straight run")
    steps = read_metrics(os.path.join(out, "straight", "metrics.jsonl"))[-1]["optimizer_steps"]
    half = max(1, steps // 2)
    killed_args = [*common, "name=killed", f"checkpoint.every_steps={half}"]
    killed = launch(config, killed_args)
    target = os.path.join(out, "killed", "checkpoints", f"step_{half:06d}")
    deadline = time.time() + 600
    while not os.path.exists(target) and killed.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    was_killed = killed.returncode == -signal.SIGKILL
    finished(launch(config, [*killed_args, "checkpoint.resume=latest"]), "the resumed run")
    straight, resumed = final_state(os.path.join(out, "straight")), final_state(os.path.join(out, "killed"))
    differ = [d for part in COMPARED for d in differences(straight[part], resumed[part], part)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "config": os.path.relpath(config, ROOT),
        "overrides": overrides,
        "device": device,
        "steps": steps,
        "killed_at_step": half,
        "killed_mid_run": was_killed,
        "compared": list(COMPARED),
        "ema_tensors": len(straight["ema"]["shadow_params"]),
        "bitwise_equal": not differ,
        "differences": differ[:20],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML run config")
    parser.add_argument("--out", required=True, help="folder for the two runs")
    parser.add_argument("--json", help="write the verdict here")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")


def run_from_args(args) -> int:
    verdict = check(os.path.abspath(args.config), args.out, args.overrides)
    print(json.dumps(verdict, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(verdict, f, indent=1)
    return 0 if verdict["bitwise_equal"] and verdict["killed_mid_run"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    if any("=" not in e for e in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = [*args.overrides, *extra]  # key=value after the options are overrides too
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
