"""docs/gpu.md from what tools/gpu_check.sh measured: the throughput rows, the kill-and-resume
verdict and the CUDA-only tests' summary line. Usage:
python -m tools.bench.gpu_report --throughput T.json --resume R.json --tests LINE --command CMD --out FILE"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch


def render(throughput: list[dict], resume: dict | None, tests: str, command: str, seconds: float) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    lines = [
        "# On a GPU", "",
        f"Measured by `{command}` on {device}, torch {torch.__version__}, in {seconds:.0f} s.", "",
        "## Throughput: the project loop against a bare loop", "",
        "Same model, batch, optimizer, EMA and precision; the bare loop holds the decoded images in memory "
        "and draws from torch's global RNG (tools/bench/throughput.py). Time ratio = project ms/step / bare ms/step.", "",
        "| task | batch | timed steps | project samples/s | bare samples/s | project ms/step | bare ms/step | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in throughput:
        lines.append(f"| {r['task']} | {r['batch_size']} | {r['steps']} | {r['project_samples_per_s']} | "
                     f"{r['bare_samples_per_s']} | {r['project_ms_per_step']} | {r['bare_ms_per_step']} | "
                     f"{r['ratio_project_over_bare_time']}x |")
    lines += ["", "## Kill-and-resume exactness", ""]
    if resume is None:
        lines.append("No verdict: the check did not finish (see resume.log beside the script's other output).")
    else:
        lines.append(
              f"`{resume['config']}` with {' '.join(resume['overrides'])} on {resume['device']}: {resume['steps']} "
              f"steps, SIGKILLed after the checkpoint at step {resume['killed_at_step']} "
              f"({'killed mid-run' if resume['killed_mid_run'] else 'the run ended before the kill'}), resumed: "
              + ("final weights and pruner state **bitwise equal**." if resume["bitwise_equal"]
                 else f"**differs** in {', '.join(resume['differences'])}."))
    lines += ["", "## CUDA-only tests", "", f"`pytest -m 'not slow' -k cuda`: {tests}", ""]
    return "\n".join(lines)


def read_json(path: str, missing):
    """The JSON in `path`, or `missing` when a step of the script did not write it."""
    if not os.path.exists(path):
        return missing
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--throughput", required=True)
    parser.add_argument("--resume", required=True)
    parser.add_argument("--tests", required=True, help="the tests' summary line")
    parser.add_argument("--command", required=True)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    throughput, resume = read_json(args.throughput, []), read_json(args.resume, None)
    with open(args.out, "w") as f:
        f.write(render(throughput, resume, args.tests, args.command, args.seconds))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
