"""docs/gpu.md from what tools/gpu_check.sh measured: the throughput rows, the kill-and-resume
verdict, the gradient all-reduce counts under accumulation and the CUDA-only tests' summary line. Usage:
python -m prunepipe.tools.benchmarks.gpu_report --throughput T.json --resume R.json [--allreduce A.json --allreduce-two A2.json
  --allreduce-two-log A2.log] --tests LINE --command CMD --out FILE"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch


def render_allreduce(one: dict | None, two: dict | None, two_log: str) -> list[str]:
    """The all-reduce counts of tools/benchmarks/allreduce_count.py: one process, then two sharing the device."""
    lines = [
        "## Gradient all-reduces under accumulation",
        "",
        "DDP around the tiny MAE, micro-batches driven by the loop's GradientAccumulation, every bucket "
        "all-reduce counted by a comm hook (tools/benchmarks/allreduce_count.py). Expected: none inside a group, "
        "each of DDP's buckets once at the micro-batch that ends it (DDP rebuilds its buckets after the "
        "first synchronised backward, so the first step may reduce fewer).",
        "",
    ]
    for label, verdict in (("one process", one), ("two processes on one device", two)):
        if verdict is None:
            lines.append(f"- {label}: no verdict" + (f" ({two_log})" if label.startswith("two") and two_log else ""))
            continue
        lines.append(
            f"- {label}: {verdict['backend']}, world size {verdict['world_size']}, grad_accum "
            f"{verdict['grad_accum']}, {verdict['micro_batches']} micro-batches, {verdict['optimizer_steps']} "
            f"optimizer steps: all-reduces per micro-batch {verdict['all_reduces_per_micro_batch']}, DDP's "
            f"buckets {verdict['ddp_buckets_per_micro_batch']}: "
            + (
                "**one bucket set per optimizer step**."
                if verdict["one_bucket_set_per_step"]
                else "**not one bucket set per optimizer step**."
            )
        )
    return lines + [""]


def last_error(log: str) -> str:
    """The last line of a log that names an error (why two processes could not share the device)."""
    if not os.path.exists(log):
        return ""
    with open(log, errors="replace") as f:
        errors = [line.strip() for line in f if "Error" in line or "error" in line]
    return errors[-1][:300] if errors else ""


def render(
    throughput: list[dict], resume: dict | None, tests: str, command: str, seconds: float, allreduce: list[str] = ()
) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    lines = [
        "# On a GPU",
        "",
        f"Measured by `{command}` on {device}, torch {torch.__version__}, in {seconds:.0f} s.",
        "",
        "## Throughput: the project loop against a bare loop",
        "",
        "Same model, batch, optimizer, EMA and precision; the bare loop holds the decoded images in memory "
        "and draws from torch's global RNG (tools/benchmarks/throughput.py). Time ratio = project ms/step / bare ms/step.",
        "",
        "| task | batch | timed steps | project samples/s | bare samples/s | project ms/step | bare ms/step | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in throughput:
        lines.append(
            f"| {r['task']} | {r['batch_size']} | {r['steps']} | {r['project_samples_per_s']} | "
            f"{r['bare_samples_per_s']} | {r['project_ms_per_step']} | {r['bare_ms_per_step']} | "
            f"{r['ratio_project_over_bare_time']}x |"
        )
    lines += ["", "## Kill-and-resume exactness", ""]
    if resume is None:
        lines.append("No verdict: the check did not finish (see resume.log beside the script's other output).")
    else:
        lines.append(
            f"`{resume['config']}` with {' '.join(resume['overrides'])} on {resume['device']}: {resume['steps']} "
            f"steps, SIGKILLed after the checkpoint at step {resume['killed_at_step']} "
            f"({'killed mid-run' if resume['killed_mid_run'] else 'the run ended before the kill'}), resumed: "
            + (
                f"final weights, EMA ({resume.get('ema_tensors', '?')} tensors) and pruner state **bitwise equal**."
                if resume["bitwise_equal"]
                else f"**differs** in {', '.join(resume['differences'])}."
            )
        )
    lines += ["", *allreduce, "## CUDA-only tests", "", f"`pytest -m 'not slow' -k cuda`: {tests}", ""]
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
    parser.add_argument("--allreduce", help="tools/benchmarks/allreduce_count.py's JSON, one process")
    parser.add_argument("--allreduce-two", help="the same, two processes sharing the device")
    parser.add_argument("--allreduce-two-log", default="", help="their output, for the error when they failed")
    parser.add_argument("--tests", required=True, help="the tests' summary line")
    parser.add_argument("--command", required=True)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    throughput, resume = read_json(args.throughput, []), read_json(args.resume, None)
    allreduce = []
    if args.allreduce:
        allreduce = render_allreduce(
            read_json(args.allreduce, None),
            read_json(args.allreduce_two, None) if args.allreduce_two else None,
            last_error(args.allreduce_two_log),
        )
    with open(args.out, "w") as f:
        f.write(render(throughput, resume, args.tests, args.command, args.seconds, allreduce))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
