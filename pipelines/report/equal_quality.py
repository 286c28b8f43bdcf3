"""Compute saved at equal quality for run folders (`prunepipe compare --frontier`): each pruned run
against the Full curve of its own seed (the baseline, the same-compute runs and the frontier runs:
Full at several schedule lengths, fitted as one shape plus a level per seed), and the runs of one
setting (configs equal but for the seed and the name) summed up over their seeds. The arithmetic
is pipelines/report/frontier.py's."""

from __future__ import annotations

import re

from prunepipe.pipelines.evaluation.records import PRIMARY_METRICS, lower_is_better
from prunepipe.pipelines.report.frontier import (
    IsoQuality,
    fit_frontier,
    saving_summary,
    savings_over_seeds,
    summarise_savings,
)
from prunepipe.pipelines.report.runs import RunSummary


def full_points(fulls: list[RunSummary], metric: str) -> dict[int, list[tuple[float, float]]]:
    """Per seed, (samples forwarded, final `metric`) of its Full runs; a folder given twice counts once."""
    points: dict[int, dict[str, tuple[float, float]]] = {}
    for run in fulls:
        if metric in run.metrics and run.samples_forwarded > 0:
            points.setdefault(run.seed, {})[run.path] = (float(run.samples_forwarded), float(run.metrics[metric]))
    return {seed: sorted(found.values()) for seed, found in points.items()}


def setting_name(runs: list[RunSummary]) -> str:
    """The runs' common name without a seed suffix (`ib_s1`, `ib_s2` -> `ib`), else their names."""
    stems = {re.sub(r"_s\d+$", "", r.name) for r in runs}
    return stems.pop() if len(stems) == 1 else " + ".join(r.name for r in runs)


def equal_quality(
    fulls: list[RunSummary], pruned: list[RunSummary], unit: float = 1.0, metrics: list[str] | None = None
) -> dict:
    """{"runs": {name: {metric: per-seed answer}}, "settings": [one per setting with its seeds' summary
    per metric], "missing": seeds of pruned runs without any Full run}. `unit`: the samples forwarded
    that read as 100% (the baseline's); `metrics`: those judged (default: every primary metric; a
    `metric@split` reads as its metric)."""
    metrics = list(PRIMARY_METRICS) if metrics is None else metrics
    full_runs = [r for r in fulls if r.pruner == "full"]
    per_run: dict[str, dict] = {r.name: {} for r in pruned}
    missing = sorted({r.seed for r in pruned} - {r.seed for r in full_runs})
    for metric in metrics:
        frontiers = full_points(full_runs, metric)
        measured = [r for r in pruned if metric in r.metrics and r.seed in frontiers]
        if not measured:
            continue
        lower = lower_is_better(metric)
        model = fit_frontier(frontiers, lower)
        for run in measured:  # runs of several settings may share a seed: each is read on its own
            found = savings_over_seeds(frontiers, {run.seed: (run.samples_forwarded, run.metrics[metric])}, lower)[
                run.seed
            ]
            per_run[run.name][metric] = {
                **found.as_dict(),
                "seed": run.seed,
                "value": run.metrics[metric],
                "frontier": [{"samples_forwarded": x, "value": y} for x, y in frontiers[run.seed]],
                "curve": [{"samples_forwarded": x, "value": y} for x, y in model.curve(run.seed)],
            }
    settings = []
    groups: dict[str, list[RunSummary]] = {}
    for run in pruned:
        groups.setdefault(run.setting, []).append(run)
    for runs in groups.values():
        seeds = [r.seed for r in runs]
        entry = {
            "setting": setting_name(runs),
            "runs": [r.name for r in runs],
            "seeds": seeds,
            "repeated_seeds": len(set(seeds)) < len(seeds),
            "metrics": {},
        }
        for metric in metrics:
            measured = {
                r.seed: (float(r.samples_forwarded), float(r.metrics[metric]))
                for r in runs
                if metric in per_run[r.name]
            }
            if measured and not entry["repeated_seeds"]:
                entry["metrics"][metric] = saving_summary(
                    full_points(full_runs, metric), measured, lower_is_better(metric), unit=unit
                )
            elif measured:  # seeds repeated: no jackknife over seeds, the plain t interval (noted)
                fields = IsoQuality.__dataclass_fields__
                answers = [per_run[r.name][metric] for r in runs if metric in per_run[r.name]]
                where = fit_frontier(full_points(full_runs, metric), lower_is_better(metric)).where_best(unit)
                entry["metrics"][metric] = {
                    **summarise_savings([IsoQuality(**{k: a[k] for k in fields}) for a in answers], **where),
                    "seeds": [a["seed"] for a in answers],
                }
        settings.append(entry)
    return {"runs": per_run, "settings": settings, "missing": missing}
