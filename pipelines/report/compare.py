"""`prunepipe compare`: was a pruned run lossless? Reads run folders (config.yaml, metrics.jsonl,
eval/*.json), judges each quality metric against the baseline within a printed tolerance, at equal
passes and at equal compute (docs/design.md, "What lossless means"), tabulates the cost and writes
report.md, report.json and the PNG plots. It never evaluates a model (run `prunepipe eval` first), and
never judges a number measured one way against one measured another: eval records are compared with
eval records, a training log's held-out values with values read from training logs, and the report
says per run and per section which it read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from prunepipe.pipelines.atomic_write import atomic_write_json, atomic_write_text
from prunepipe.pipelines.evaluation.records import PRIMARY_METRICS, lower_is_better
from prunepipe.pipelines.report.equal_quality import equal_quality, full_points
from prunepipe.pipelines.report.frontier import equal_compute_references
from prunepipe.pipelines.report.lossless import LOSSLESS_K, beats, is_lossless
from prunepipe.pipelines.report.runs import (
    EVALUATED,
    LOGGED,
    RunSummary,
    held_out_metrics,
    load_run,
    trajectory_value,
)

# Tolerances when the baseline is a single run (no measured seed noise): (value, relative?).
DEFAULT_TOLERANCES = {
    "fid": (0.05, True),
    "masked_mse": (0.02, True),
    "denoise_mse": (0.02, True),
    "psnr": (0.1, False),
    "ssim": (0.005, False),
    "probe_accuracy": (0.01, False),
    "clip_score": (0.01, True),
}
DEFAULT_K = LOSSLESS_K  # tolerance = k x the baseline seeds' standard deviation when there are >= 2 of them


# ----------------------------------------------------------------------------- verdicts
@dataclass
class Tolerance:
    value: float
    relative: bool
    source: str

    def absolute(self, reference: float) -> float:
        return self.value * abs(reference) if self.relative else self.value

    def describe(self, reference: float) -> str:
        if self.relative:
            return f"{self.value:.1%} rel = {self.absolute(reference):.4g} ({self.source})"
        return f"{self.value:.4g} ({self.source})"


def parse_tolerances(items: list[str]) -> dict[str, Tolerance]:
    """`metric=0.5` (absolute) or `metric=3%` (relative to the baseline), as given on the command line."""
    parsed = {}
    for item in items:
        name, _, text = item.partition("=")
        if name not in PRIMARY_METRICS or not text:
            raise ValueError(
                f"--tolerance {item!r}: expected METRIC=VALUE or METRIC=VALUE%, METRIC one of "
                f"{', '.join(PRIMARY_METRICS)}"
            )
        relative = text.endswith("%")
        try:
            value = float(text.rstrip("%")) / (100 if relative else 1)
        except ValueError:
            raise ValueError(f"--tolerance {item!r}: {text!r} is not a number") from None
        parsed[name] = Tolerance(value, relative, "given")
    return parsed


def tolerance_for(
    metric: str, baseline_values: list[float], k: float = DEFAULT_K, given: dict[str, Tolerance] | None = None
) -> Tolerance:
    """A given tolerance wins; else k x the sample std (ddof 1) of >= 2 baseline seeds; else the default."""
    if given and metric in given:
        return given[metric]
    if len(baseline_values) >= 2:
        return Tolerance(
            k * float(np.std(baseline_values, ddof=1)), False, f"{k:g} x seed std, n={len(baseline_values)}"
        )
    value, relative = DEFAULT_TOLERANCES.get(metric, (0.02, True))
    return Tolerance(value, relative, "default, single baseline run")


def judge(metric: str, reference: float, value: float, tolerance: float) -> tuple[float, str]:
    """(delta = value - reference, verdict): "lossless" unless worse by more than the tolerance
    (better is always fine)."""
    delta = value - reference
    worse_by = delta if lower_is_better(metric) else -delta
    return delta, ("lossless" if is_lossless(worse_by, tolerance, k=1.0) else "not lossless")


def judge_equal_compute(metric: str, reference: float, value: float, tolerance: float) -> tuple[float, str]:
    """Against a full run of the same compute: did the pruner's selection beat training less?"""
    delta = value - reference
    better_by = -delta if lower_is_better(metric) else delta
    if beats(better_by, tolerance, k=1.0):
        return delta, "beats equal compute"
    return delta, ("ties equal compute" if better_by >= -tolerance else "worse than equal compute")


# ----------------------------------------------------------------------------- the comparison
def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def equal_passes(baselines: list[RunSummary], pruned: RunSummary, given: dict, k: float) -> dict:
    """Per metric: baseline mean, the pruned value, delta, tolerance, verdict; and the run's verdict."""
    metrics = {}
    for metric in PRIMARY_METRICS:
        values = [b.metrics[metric] for b in baselines if metric in b.metrics]
        if not values or metric not in pruned.metrics:
            continue
        reference = _mean(values)
        tolerance = tolerance_for(metric, values, k, given)
        delta, verdict = judge(metric, reference, pruned.metrics[metric], tolerance.absolute(reference))
        metrics[metric] = {
            "baseline": reference,
            "baseline_values": values,
            "value": pruned.metrics[metric],
            "delta": delta,
            "tolerance": tolerance.absolute(reference),
            "tolerance_text": tolerance.describe(reference),
            "verdict": verdict,
        }
    failed = [m for m, row in metrics.items() if row["verdict"] != "lossless"]
    verdict = "no common metric" if not metrics else ("lossless" if not failed else "not lossless")
    return {"verdict": verdict, "failed": failed, "metrics": metrics}


def frontier_references(fulls: list[RunSummary], pruned: RunSummary) -> dict[str, float]:
    """Per metric of `pruned`: Full of its seed at its samples forwarded, read off that seed's fitted
    Full frontier (`fulls`: Full runs of any schedule length), the one reading of equal compute;
    metrics whose seed has no Full run, or Full at one length only (no frontier), are left out."""
    found = {}
    for metric in PRIMARY_METRICS:
        if metric not in pruned.metrics:
            continue
        read = equal_compute_references(
            full_points(fulls, metric), {pruned.seed: float(pruned.samples_forwarded)}, lower_is_better(metric)
        )
        if pruned.seed in read:
            found[metric] = read[pruned.seed]
    return found


def equal_compute(
    baselines: list[RunSummary], pruned: RunSummary, fulls: list[RunSummary], given: dict, k: float
) -> dict:
    """The pruned run against full training of the same samples forwarded: its seed's Full frontier
    (`fulls`: the baseline, same-compute and frontier runs, fitted as pipelines/report/frontier.py
    fits them) read at that compute, so that equal compute and equal quality are one reading; where
    the seed has no frontier (Full at one length only), the baseline runs' own held-out curves read at
    that many samples."""
    references = {m: [v] for m, v in frontier_references([r for r in fulls if r.pruner == "full"], pruned).items()}
    on_frontier = bool(references)
    if on_frontier:
        runs = sorted({r.name for r in fulls if r.pruner == "full" and r.seed == pruned.seed})
        source = (
            f"Full of seed {pruned.seed} at {pruned.samples_forwarded} samples forwarded, read off its fitted "
            f"frontier ({len(runs)} Full runs of the seed: {', '.join(runs)}; one shape over the seeds plus a level "
            f"per seed, the best Full at or below that compute)"
        )
        values, value_source = pruned.metrics, f"{pruned.quality_from}, {pruned.metrics_source}"
    else:
        source = (
            f"the baseline runs' held-out curves at {pruned.samples_forwarded} samples forwarded, read from their "
            f"training logs mid-schedule (learning rate not yet decayed there, which favours the pruned run); "
            f"pass --same-compute with full runs trained for that many samples for the fair reference"
        )
        # read as the reference is: the training log's held-out records (the loop's samples and weights),
        # whatever the equal-passes section read
        value_source = f"{LOGGED}, metrics.jsonl, last pass held-out"
        values = held_out_metrics(pruned.trajectory[-1]) if pruned.trajectory else {}
        for metric in values:
            read = [trajectory_value(b, metric, pruned.samples_forwarded) for b in baselines]
            if all(v is not None for v in read):
                references[metric] = read
    metrics = {}
    for metric, reference_values in references.items():
        if metric not in values or metric not in PRIMARY_METRICS:
            continue
        reference = _mean(reference_values)
        # the seeds' spread of the very numbers compared: final evaluations, or final logged held-out
        finals = (
            [b.metrics for b in baselines]
            if on_frontier
            else [held_out_metrics(b.trajectory[-1]) for b in baselines if b.trajectory]
        )
        noise = [m[metric] for m in finals if metric in m]
        tolerance = tolerance_for(metric, noise, k, given)
        delta, verdict = judge_equal_compute(metric, reference, values[metric], tolerance.absolute(reference))
        metrics[metric] = {
            "reference": reference,
            "value": values[metric],
            "delta": delta,
            "tolerance": tolerance.absolute(reference),
            "verdict": verdict,
        }
    if not metrics:
        verdict = "not measured"
    elif all(row["verdict"] == "beats equal compute" for row in metrics.values()):
        verdict = "beats equal compute"
    else:
        verdict = "no better than training less"
    return {"verdict": verdict, "reference": source, "value_source": value_source, "metrics": metrics}


def cost(baselines: list[RunSummary], run: RunSummary) -> dict:
    row = {
        "passes": run.passes_done,
        "samples_forwarded": run.samples_forwarded,
        "optimizer_steps": run.optimizer_steps,
        "wall_seconds": run.wall_seconds,
    }
    for key in ("samples_forwarded", "optimizer_steps", "wall_seconds"):
        reference = _mean([getattr(b, key) for b in baselines])
        row[f"saving_{key}"] = 1.0 - getattr(run, key) / reference if reference else float("nan")
    return row


def notes_on(baselines: list[RunSummary], pruned: list[RunSummary], given: dict, k: float) -> list[str]:
    """What a reader must know before trusting the verdicts."""
    notes = []
    if len(baselines) < 2:
        notes.append(
            "The baseline is one run: the tolerances are defaults, not measured run-to-run noise. Train the "
            "full config with 2+ seeds and pass them as BASELINE (comma-separated) for k x seed-std tolerances."
        )
    for run in pruned:
        if baselines and run.passes_done != baselines[0].passes_done:
            notes.append(
                f"{run.name} trained {run.passes_done} passes, the baseline {baselines[0].passes_done}: "
                f"the equal-passes table does not compare equal passes."
            )
    for b in baselines:
        for metric in held_out_metrics(b.trajectory[-1]) if len(b.trajectory) >= 2 else {}:
            before, after = b.trajectory[-2]["held_out"][metric], b.trajectory[-1]["held_out"][metric]
            tolerance = tolerance_for(metric, [], k, given).absolute(after)
            if (after - before) * (1 if PRIMARY_METRICS[metric] else -1) > tolerance:
                notes.append(
                    f"Baseline {b.name} still improved {metric} by {abs(after - before):.4g} in its last pass: "
                    f"the schedule is short and unconverged, so the equal-passes verdict is sensitive to it "
                    f"(such schedules usually fail it)."
                )
    return notes


def equal_quality_notes(found: dict, pruned: list[RunSummary]) -> list[str]:
    """What limits the compute-at-equal-quality answer."""
    notes = []
    if found["missing"]:
        notes.append(
            f"No Full run of seed(s) {', '.join(map(str, found['missing']))}: their pruned runs have no "
            f"frontier to be read against (train Full at that seed, or pass it as baseline or --frontier)."
        )
    few = sorted(
        {r.name for r in pruned if 0 < max((len(a["frontier"]) for a in found["runs"][r.name].values()), default=0) < 3}
    )
    if few:
        notes.append(
            f"{', '.join(few)}: fewer than 3 Full runs of their seed, so the frontier between them is a "
            f"straight line; pass Full runs of more schedule lengths with --frontier (e.g. 50% to 90% of the "
            f"passes) for a curve."
        )
    for setting in found["settings"]:
        if setting["repeated_seeds"]:
            notes.append(
                f"{setting['setting']}: several runs share a seed ({setting['seeds']}), so they are not "
                f"independent seeds; the interval over them is too narrow."
            )
    return notes


def by_source(runs: list[RunSummary]) -> dict:
    """Per run of a mixture, per source: samples drawn and kept in the last pass, forwarded in the run,
    and the held-out metrics of the source's own held-out split (the last pass's). {} without mixtures."""
    found = {}
    for run in runs:
        last = run.trajectory[-1] if run.trajectory else {}
        if not last.get("sources"):
            continue
        held = last.get("held_out_by_source") or {}
        found[run.name] = {
            name: {**counts, "held_out": held_out_metrics({"held_out": held.get(name, {})})}
            for name, counts in last["sources"].items()
        }
    return found


def by_bucket(runs: list[RunSummary]) -> dict:
    """Per run on aspect-ratio buckets, per bucket: samples forwarded in the run and their share of the
    run's, kept and the mean training loss in the last pass: whether pruning trains one aspect ratio
    less than the full run does. {} without buckets."""
    found = {}
    for run in runs:
        last = run.trajectory[-1] if run.trajectory else {}
        if not last.get("buckets"):
            continue
        total = sum(b["forwarded"] for b in last["buckets"].values())
        found[run.name] = {
            name: {**counts, "share": counts["forwarded"] / total if total else 0.0}
            for name, counts in last["buckets"].items()
        }
    return found


def check_one_precision(runs: list[RunSummary], weights: str = "ema") -> None:
    """Refuse to judge eval records of different `eval.precision` against each other: a precision
    shifts every number it measures the same way, a bias that the tolerances (seed noise) do not
    allow for."""
    evaluated = [r for r in runs if r.precision is not None]
    if len({r.precision for r in evaluated}) <= 1:
        return
    listing = "; ".join(f"{r.path} ({r.metrics_source}): {r.precision}" for r in evaluated)
    target = "fp32"  # an evaluation's default
    redo = [r for r in evaluated if r.precision != target]
    raise ValueError(
        f"compare: the runs' eval records were measured at different precisions, which cannot be "
        f"judged against each other: {listing}. Re-evaluate "
        + ", ".join(
            f"`prunepipe eval {r.path} precision={target}{' --weights raw' if weights == 'raw' else ''}`" for r in redo
        )
        + " so that every record states one precision"
    )


def check_one_source(runs: list[RunSummary], weights: str = "ema") -> None:
    """Refuse to judge eval records against a training log's held-out values: the loop measures other
    samples (eval.val_samples of the held-out split, mid-schedule for a curve) with the weights it trains,
    the evaluators theirs, so a gap between the two says nothing about pruning. Names the `prunepipe eval`
    command of every run that has only its training log."""
    logged = [r for r in runs if r.quality_from == LOGGED]
    evaluated = [r for r in runs if r.quality_from == EVALUATED]
    if not (logged and evaluated):
        return
    flag = " --weights raw" if weights == "raw" else ""
    listing = "; ".join(f"{r.path}: {r.metrics_source}" for r in logged)
    raise ValueError(
        f"compare: {len(evaluated)} run(s) have eval records and {len(logged)} only their training log's held-out "
        f"values ({listing}); the two are measured on other samples with other weights, so they are not judged "
        f"against each other. Evaluate "
        + ", ".join(f"`prunepipe eval {r.path}{flag}`" for r in logged)
        + ", then compare again"
    )


def quality_sources(runs: list[RunSummary]) -> dict:
    """Per run: what its quality was read from (an eval record or its training log) and which file."""
    return {r.name: {"from": r.quality_from or "nothing", "source": r.metrics_source} for r in runs}


def compare_runs(
    baselines: list[str],
    pruned: list[str],
    *,
    same_compute: list[str] = (),
    frontier: list[str] = (),
    tolerances: list[str] = (),
    k: float = DEFAULT_K,
    out: str | None = None,
    weights: str = "ema",
    plots: bool = True,
) -> dict:
    """Compare run folders and write report.md, report.json and the PNGs to `out` (default: the first
    pruned run's report/ folder); returns the report as a dict (its "markdown" key holds the table).
    `frontier`: Full runs of other schedule lengths; with the baseline and the same-compute runs they
    are each seed's Full frontier, from which the compute saved at equal quality is read."""
    from prunepipe.pipelines.report.markdown import render_markdown
    from prunepipe.pipelines.report.plots import write_plots

    if not baselines or not pruned:
        raise ValueError("compare needs at least one baseline run and one pruned run")
    given = parse_tolerances(list(tolerances))
    base = [load_run(p, weights) for p in baselines]
    runs = [load_run(p, weights) for p in pruned]
    same = [load_run(p, weights) for p in same_compute]
    curve = [load_run(p, weights) for p in frontier]
    not_full = [r.path for r in curve if r.pruner != "full"]
    if not_full:
        raise ValueError(
            f"compare --frontier: {', '.join(not_full)} pruned data (a frontier is Full trained for "
            f"several schedule lengths, each its own schedule)"
        )
    other_weights = [r for r in base + runs + same + curve if not r.evals and r.evaluated_weights]
    if other_weights:  # falling back to the training log would compare other numbers than asked for
        raise ValueError(
            f"compare --weights {weights}: "
            + "; ".join(
                f"run {r.path} was evaluated with the {'/'.join(r.evaluated_weights)} weights only"
                for r in other_weights
            )
            + ". Evaluate them with "
            + ", ".join(f"`prunepipe eval {r.path} --weights {weights}`" for r in other_weights)
            + f", or compare the weights they were evaluated with (--weights {other_weights[0].evaluated_weights[0]})"
        )
    check_one_source(base + runs + same + curve, weights)
    check_one_precision(base + runs + same + curve, weights)
    tasks = {r.task for r in base + runs + same + curve}
    if len(tasks) > 1:
        raise ValueError(f"compare: runs of different tasks {sorted(tasks)} cannot be compared")
    out = out or os.path.join(runs[0].path, "report")
    os.makedirs(out, exist_ok=True)
    report = {
        "baseline": [
            {
                "name": b.name,
                "path": b.path,
                "pruner": b.pruner,
                "seed": b.seed,
                "metrics": b.metrics,
                "metrics_source": b.metrics_source,
                "quality_from": b.quality_from,
            }
            for b in base
        ],
        "pruned": [
            {
                "name": r.name,
                "path": r.path,
                "pruner": r.pruner,
                "seed": r.seed,
                "metrics": r.metrics,
                "metrics_source": r.metrics_source,
                "quality_from": r.quality_from,
            }
            for r in runs
        ],
        "k": k,
        # the final quality the equal-passes and equal-quality sections read, per run (one kind: check_one_source)
        "quality_sources": quality_sources(base + runs + same + curve),
        "equal_passes": {r.name: equal_passes(base, r, given, k) for r in runs},
        "equal_compute": {r.name: equal_compute(base, r, base + same + curve, given, k) for r in runs},
        "cost": {r.name: cost(base, r) for r in base + runs},
        "equal_quality": equal_quality(
            base + same + curve, runs, unit=float(np.mean([b.samples_forwarded for b in base])) or 1.0
        ),
        "notes": notes_on(base, runs, given, k),
        "sources": by_source(base + runs),
        "buckets": by_bucket(base + runs),
    }
    report["notes"] += equal_quality_notes(report["equal_quality"], runs)
    report["plots"] = write_plots(base, runs, out, report["equal_quality"]) if plots else []
    report["markdown"] = render_markdown(report)
    atomic_write_text(os.path.join(out, "report.md"), report["markdown"])
    atomic_write_json(
        os.path.join(out, "report.json"), {k_: v for k_, v in report.items() if k_ != "markdown"}, indent=1
    )
    report["out"] = out
    return report
