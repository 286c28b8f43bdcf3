"""The lossless benchmark's verdicts, read by `prunepipe compare`'s functions: the benchmark's runs become
compare's records (tools/benchmarks/lossless/records.py) and each verdict is compare's (equal passes,
equal compute off each seed's fitted Full frontier, compute saved at equal quality), with the
benchmark's bookkeeping around them: run-to-run noise from the Full seeds, distances in seed standard
deviations, whether Full had converged, and the targets met or missed. Pure functions of the runs'
recorded numbers (tools/benchmarks/lossless/run.py runs them)."""

from __future__ import annotations

import math

import numpy as np

from prunepipe.pipelines.evaluation.records import lower_is_better
from prunepipe.pipelines.report.compare import equal_compute, equal_passes, judge, judge_equal_compute
from prunepipe.pipelines.report.equal_quality import equal_quality, full_points
from prunepipe.pipelines.report.frontier import (
    AT_LEAST,
    AT_MOST,
    equal_compute_references,
    interval_text,
    paired_difference,
)
from prunepipe.pipelines.report.lossless import LOSSLESS_K, in_noise_units
from prunepipe.tools.benchmarks.lossless.plan import TaskPlan
from prunepipe.tools.benchmarks.lossless.records import PRUNED_ROLES, full_summaries, run_name, summary

TARGET_SAVING = {
    "infobatch": 0.25,
    "ted": 0.30,
}  # the targets: converged regime, lossless (pipelines/report/lossless.py)
TARGET_ISO_SAVING = 0.25  # the pays suite: compute saved at equal quality, with the 95% CI above 0
BEATS = "beats equal compute"  # compare's word for a run better than Full at its compute by > K seed std


def seed_stats(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation) of the Full seeds."""
    array = np.asarray(values, dtype=float)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else float("nan")


def delta_in_std(value: float, reference: float, std: float, lower: bool) -> float:
    """How much worse than `reference` `value` is, in seed standard deviations (negative = better)."""
    if value is None or reference is None:
        return float("nan")
    return in_noise_units(value - reference if lower else reference - value, std)


def schedule_groups(results: list[dict], plans: list[TaskPlan]):
    """(plan, schedule, its runs, its Full seed runs, its metric names main first) of every schedule
    that has Full runs."""
    for plan in plans:
        for schedule in ("long", "short"):
            group = [r for r in results if r["task"] == plan.task and r["schedule"] == schedule]
            fulls = [r for r in group if r["role"] == "full"]
            if fulls:
                metrics = sorted({m for r in group for m in r["metrics"]}, key=lambda m: (m != plan.main, m))
                yield plan, schedule, group, fulls, metrics


def summarise(results: list[dict], plans: list[TaskPlan]) -> list[dict]:
    """One row per run, per task and schedule, with cost, quality, deltas in seed std and verdicts: a
    pruned run's are compare's, at equal passes against the Full seeds and at equal compute against
    its seed's fitted Full frontier (every Full run of the schedule, any length)."""
    rows = []
    for plan, schedule, group, fulls, metric_names in schedule_groups(results, plans):
        stats = {
            m: seed_stats([r["metrics"][m] for r in fulls if r["metrics"].get(m) is not None]) for m in metric_names
        }
        wall_full = float(np.mean([r["wall_seconds"] for r in fulls]))
        sf_full = float(np.mean([r["samples_forwarded"] for r in fulls]))
        baselines = [summary(r) for r in fulls]
        frontier = full_summaries(group)
        mean, std = stats[plan.main]
        lower = lower_is_better(plan.main)
        for r in group:
            skipped = 1.0 - r["samples_forwarded"] / sf_full
            saving = 1.0 - r["wall_seconds"] / wall_full
            row = {
                "task": plan.task,
                "schedule": schedule,
                "passes": r["passes"],
                "label": r["label"],
                "role": r["role"],
                "seed": r["seed"],
                "key": r["key"],
                "samples_forwarded": r["samples_forwarded"],
                "compute": r["samples_forwarded"] / sf_full,
                "optimizer_steps": r["optimizer_steps"],
                "wall_seconds": r["wall_seconds"],
                "saving": saving,
                "skipped": skipped,
                "realised": saving / skipped if skipped > 0.02 else float("nan"),
                "metrics": r["metrics"],
                "main": plan.main,
                "deltas": {
                    m: delta_in_std(r["metrics"].get(m), stats[m][0], stats[m][1], lower_is_better(m))
                    for m in metric_names
                },
                "full_mean": mean,
                "full_std": std,
                "pruner_overhead": sum(r["pruner_seconds"].values()) / max(r["wall_seconds"], 1e-9),
                "step_ms": 1000 * r["wall_seconds"] / max(r["optimizer_steps"], 1),
            }
            if r["role"] in PRUNED_ROLES:
                run = summary(r)
                passes = equal_passes(baselines, run, {}, LOSSLESS_K)["metrics"].get(plan.main)
                compute = equal_compute(baselines, run, frontier, {}, LOSSLESS_K)["metrics"].get(plan.main)
                row["lossless"] = passes["verdict"] == "lossless" if passes else None
                reference = compute["reference"] if compute else None
                row["equal_compute_value"], row["equal_compute_how"] = reference, "frontier"
                row["equal_compute_delta"] = delta_in_std(r["metrics"][plan.main], reference, std, lower)
                row["equal_compute_verdict"] = compute["verdict"] if compute else "not measured"
                row["beats_equal_compute"] = compute["verdict"] == BEATS if compute else None
            rows.append(row)
    return rows


def pooled_std(a: list[float], b: list[float]) -> float:
    """sqrt of the mean of the two sample variances: the noise of a difference of two seed means."""
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    return math.sqrt((np.var(a, ddof=1) + np.var(b, ddof=1)) / 2)


def arms(results: list[dict], plans: list[TaskPlan]) -> list[dict]:
    """Per task, schedule and pruner setting run at several seeds, for each metric:
    - the compute saved at equal quality: compare's reading (pipelines/report/equal_quality.py), per
      seed where that seed's fitted Full frontier (Full at every schedule length run: the full
      schedule, the frontier, the equal-compute runs) reaches the setting's quality, with the mean's
      interval over seeds;
    - Full at equal compute: the same frontier read at each seed's compute, paired (same seed) and
      as a seed mean;
    - the seed means against Full at equal passes and at equal compute in pooled std (positive =
      worse), judged by compare's rule: lossless = within LOSSLESS_K pooled stds of Full at equal
      passes, pays = better than Full at equal compute by more than it."""
    rows = []
    seeded = [p for p in plans if len(p.pruned_seeds) > 1]
    for plan, schedule, group, fulls, metrics in schedule_groups(results, seeded):
        full_compute = float(np.mean([r["samples_forwarded"] for r in fulls]))
        frontier = full_summaries(group)
        pruned = [summary(r) for r in group if r["role"] in PRUNED_ROLES]
        read = equal_quality(frontier, pruned, unit=full_compute, metrics=metrics)
        settings = {tuple(s["runs"]): s for s in read["settings"]}
        for label in dict.fromkeys(r["label"] for r in group if r["role"] in PRUNED_ROLES):
            mine = [r for r in group if r["label"] == label and r["role"] in PRUNED_ROLES]
            equal = [r for r in group if r["role"] == "equal_compute" and r["compute_of"] == label]
            setting = settings.get(tuple(run_name(r) for r in mine), {"metrics": {}})
            row = {
                "task": plan.task,
                "data": plan.data,
                "schedule": schedule,
                "label": label,
                "pruner": mine[0]["pruner"].get("name", "?"),
                "seeds": sorted(r["seed"] for r in mine),
                # a fixed subset every pass (a static deduplication): a data set, not a per-pass selection
                "static": bool(mine[0]["pruner"].get("static", False)),
                "samples_forwarded": float(np.mean([r["samples_forwarded"] for r in mine])),
                "compute": float(np.mean([r["samples_forwarded"] for r in mine])) / full_compute,
                "equal_compute_passes": sorted({r["passes"] for r in equal}),
                "main": plan.main,
                "metrics": {},
            }
            for metric in metrics:
                cell = arm_cell(mine, fulls, frontier, metric)
                if cell is None:
                    continue
                cell["frontier_points"] = {
                    str(seed): len(points) for seed, points in sorted(full_points(frontier, metric).items())
                }
                cell["saving"] = setting["metrics"].get(metric)
                row["metrics"][metric] = cell
            rows.append(row)
    return rows


def arm_cell(mine: list[dict], fulls: list[dict], frontier: list, metric: str) -> dict | None:
    """One setting's seeds on one metric against Full at equal passes (the Full seeds) and at equal
    compute (each seed's fitted frontier at that seed's compute): seed means, pooled-std deltas and
    compare's verdicts on them, and the paired differences. None with fewer than 2 seeds measured."""
    lower = lower_is_better(metric)
    value = {r["seed"]: r["metrics"][metric] for r in mine if r["metrics"].get(metric) is not None}
    if len(value) < 2:
        return None
    compute = {r["seed"]: float(r["samples_forwarded"]) for r in mine if r["seed"] in value}
    at_passes = {r["seed"]: r["metrics"][metric] for r in fulls if r["metrics"].get(metric) is not None}
    at_compute = equal_compute_references(full_points(frontier, metric), compute, lower)
    values, full, same = list(value.values()), list(at_passes.values()), list(at_compute.values())
    cell = {
        "mean": float(np.mean(values)),
        "std": float(np.std(values, ddof=1)),
        "n": len(values),
        "full_mean": float(np.mean(full)) if full else float("nan"),
        "equal_compute_mean": float(np.mean(same)) if same else float("nan"),
    }
    noise_passes, noise_compute = pooled_std(values, full), pooled_std(values, same)
    cell["delta_passes"] = delta_in_std(cell["mean"], cell["full_mean"], noise_passes, lower)
    cell["delta_compute"] = delta_in_std(cell["mean"], cell["equal_compute_mean"], noise_compute, lower)
    cell["lossless"] = (
        judge(metric, cell["full_mean"], cell["mean"], LOSSLESS_K * noise_passes)[1] == "lossless"
        if math.isfinite(cell["delta_passes"])
        else None
    )
    cell["pays"] = (
        judge_equal_compute(metric, cell["equal_compute_mean"], cell["mean"], LOSSLESS_K * noise_compute)[1] == BEATS
        if math.isfinite(cell["delta_compute"])
        else None
    )
    cell["paired_passes"] = paired_difference(value, at_passes, lower)
    cell["paired_compute"] = paired_difference(value, at_compute, lower)
    cell["paired_compute_how"] = ["frontier"] if at_compute else []
    return cell


def saving_targets(arm_rows: list[dict]) -> list[dict]:
    """The goal per task, in compute: a pruner (a setting that selects per pass, not a fixed data set
    such as the dedup oracle) saves >= 25% compute at equal quality on the main metric, with the 95%
    CI above 0. Measured: the best pruner by mean saving, and the ceiling where the suite has one."""
    targets_ = []
    for task in dict.fromkeys(r["task"] for r in arm_rows):
        judged = [
            (r, r["metrics"][r["main"]]["saving"])
            for r in arm_rows
            if r["task"] == task and r["main"] in r["metrics"] and r["metrics"][r["main"]].get("saving")
        ]
        pruners = [(r, s) for r, s in judged if r["pruner"] != "full" and not r.get("static")]
        if not pruners:
            continue
        best, saving = best_saving(pruners)
        # lower bounds at or above the target: they would reach it, but bounds are not measurements
        reached = bool(
            saving["bound"] == AT_LEAST
            and min(saving["bound_values"]) >= TARGET_ISO_SAVING
            and not (saving["n"] and saving["mean"] < TARGET_ISO_SAVING)
        )
        met = measured_target_met(saving)
        need = saving["seeds_needed"]
        measured = (
            "reached on lower bounds only, so not measured: the frontier must reach further (Full "
            "above the full schedule, --frontier ...,1.2,1.5); "
            if reached and not met
            else ""
        )
        note = f" ({saving['note']})" if saving["note"] else ""
        measured += (
            f"best: {best['label']}, {saving['verdict']}{note} ({best['main']}, {saving['seeds_total']} seeds, "
            f"t interval over the {saving['n']} measured); "
            + (
                f"seeds a paired test would need to show its saving > 0: {need}"
                if need and saving["mean"] > 0
                else "no number of seeds would show a saving > 0 (measured mean <= 0)"
            )
        )
        ceiling = [(r, s) for r, s in judged if r["pruner"] == "full" and r["label"].startswith("Dedup")]
        for r, s in ceiling:
            measured += f"; the ceiling, {r['label']}: {interval_text(s)}"
        targets_.append(
            {
                "target": f"{best['data']} set, {task}: a pruner saves >= {TARGET_ISO_SAVING:.0%} compute at "
                f"equal quality with the 95% CI above 0 ({best['main']})",
                "met": met,
                "measured": measured,
            }
        )
        targets_ += redundancy_target(task, pruners, [(r, s) for r, s in judged if r["label"] == "Dedup oracle"])
    return targets_


def measured_target_met(saving: dict) -> bool:
    """A mean saving >= TARGET_ISO_SAVING with the 95% CI above 0, every seed's saving measured: a seed
    beyond the frontier's end is a bound, and values piled at a bound make the interval too narrow."""
    return bool(saving["mean"] >= TARGET_ISO_SAVING and saving["low"] > 0 and not saving["bounded"])


SEED_MARKS = {AT_LEAST: "≥", AT_MOST: "≤"}  # a seed's saving beyond the frontier's ends: a bound


def seed_savings(saving: dict, number) -> str:
    """Each seed's saving, `number(saving)` marked ≥ / ≤ where it is a bound, comma-separated."""
    return ", ".join(f"{SEED_MARKS.get(p['kind'], '')}{number(p['saving'])}" for p in saving["per_seed"])


def best_saving(settings: list) -> tuple[dict, dict]:
    """The (arm row, saving) of the largest finite mean saving among `settings`."""
    return max(settings, key=lambda rs: rs[1]["mean"] if math.isfinite(rs[1]["mean"]) else -math.inf)


def redundancy_target(task: str, pruners: list, oracle: list) -> list[dict]:
    """The redundancy target, where the suite runs the dedup pruner: its best setting saves >= 25% compute at
    equal quality, CI above 0, and lies within the dedup oracle's interval."""
    dedup = [(r, s) for r, s in pruners if r["pruner"] == "dedup"]
    if not dedup:
        return []
    best, saving = best_saving(dedup)
    per_seed = seed_savings(saving, lambda value: f"{value:.0%}")
    measured = f"best: {best['label']}, {saving['verdict']} ({saving['seeds_total']} seeds: {per_seed})"
    within = True
    if oracle:
        ceiling = oracle[0][1]
        within = bool(math.isfinite(ceiling["low"]) and ceiling["low"] <= saving["mean"] <= ceiling["high"])
        measured += f"; the oracle: {interval_text(ceiling)}; {'within' if within else 'outside'} its interval"
    met = measured_target_met(saving) and within
    return [
        {
            "target": f"{best['data']} set, {task}: the redundancy-aware pruner saves >= {TARGET_ISO_SAVING:.0%} "
            f"compute at equal quality, 95% CI above 0, within the dedup oracle's interval ({best['main']})",
            "met": met,
            "measured": measured,
        }
    ]


def flattening(results: list[dict], plan: TaskPlan) -> dict:
    """Is Full converged on the long schedule? Two checks, both in seed std of the final metric:
    - in its curve: the mean held-out metric moved < 1 std over the last quarter of the passes (a
      cosine schedule flattens at its end whatever the model, so this alone is weak);
    - across schedules: Full trained for fewer passes (the equal-compute runs, own schedules) ends
      < 1 std worse than Full at all passes, i.e. the last passes bought nothing.
    """
    fulls = [r for r in results if r["task"] == plan.task and r["schedule"] == "long" and r["role"] == "full"]
    curves = np.array([[p["held_out"] for p in r["curve"]] for r in fulls], dtype=float)
    mean_curve = curves.mean(axis=0)
    n = len(mean_curve)
    at = max(0, int(round(0.75 * n)) - 1)
    _, curve_std = seed_stats(list(curves[:, -1]))
    change = mean_curve[at] - mean_curve[-1]
    mean, std = seed_stats([r["metrics"][plan.main] for r in fulls])
    shorter = [
        r
        for r in results
        if r["task"] == plan.task and r["schedule"] == "long" and r["role"] == "equal_compute" and r["passes"] < n
    ]
    found = {
        "passes": n,
        "from_pass": at + 1,
        "change": float(change),
        "in_std": float(change / curve_std),
        "flattened": bool(abs(change / curve_std) < 1.0),
        "shorter_passes": None,
        "shorter_gap_std": None,
    }
    if shorter:
        fewest = min(shorter, key=lambda r: r["passes"])
        gap = delta_in_std(fewest["metrics"][plan.main], mean, std, lower_is_better(plan.main))
        found.update(shorter_passes=fewest["passes"], shorter_gap_std=float(gap))
    found["converged"] = bool(
        found["flattened"] and (found["shorter_gap_std"] is None or found["shorter_gap_std"] < 1.0)
    )
    return found


def fmt(value, digits=4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def targets(rows: list[dict], flat: dict, timing_rows: list[dict] = ()) -> list[dict]:
    """The benchmark's targets, each met or MISSED, from the long schedule ("converged" only if it flattened);
    realised saving and overhead from the sequential timing runs when there are any."""
    found = []
    timed = {(r["task"], r["label"]): r for r in timing_rows}
    for task in sorted({r["task"] for r in rows}):
        long_rows = {r["label"]: r for r in rows if r["task"] == task and r["schedule"] == "long"}
        for label, key in (("InfoBatch", "infobatch"), ("TED", "ted")):
            r = long_rows.get(label)
            if r is None:
                continue
            need = TARGET_SAVING[key]
            t = timed.get((task, label), r)
            where = " (sequential timing runs)" if (task, label) in timed else " (side-by-side runs)"
            ok = bool(r["lossless"] and t["saving"] >= need and flat[task]["converged"])
            found.append(
                {
                    "target": f"{task}: {label} saves >= {need:.0%} wall-clock, within {LOSSLESS_K:g} seed std, converged",
                    "met": ok,
                    "measured": f"saving {t['saving']:.1%}{where}, Δ {fmt(r['deltas'][r['main']], 2)} std, "
                    f"Full converged: {flat[task]['converged']}",
                }
            )
            found.append(
                {
                    "target": f"{task}: {label} beats Full at equal compute by > {LOSSLESS_K:g} seed std",
                    "met": bool(r["beats_equal_compute"]),
                    "measured": f"Δ vs equal-compute Full {fmt(r['equal_compute_delta'], 2)} std",
                }
            )
            if t["skipped"] > 0.02:
                found.append(
                    {
                        "target": f"{task}: {label} realised wall-clock saving >= 90% of samples skipped",
                        "met": bool(t["realised"] >= 0.9),
                        "measured": f"{t['saving']:.1%} of {t['skipped']:.1%} = {fmt(t['realised'], 2)}" + where,
                    }
                )
            found.append(
                {
                    "target": f"{task}: {label} pruner overhead < 1% of step time",
                    "met": bool(t["pruner_overhead"] < 0.01),
                    "measured": f"{t['pruner_overhead']:.3%}" + where,
                }
            )
    return found
