"""The comparison as markdown: quality at equal passes and at equal compute with tolerances and
verdicts, the cost and its saving, the notes and the plots. Formatting only; it judges nothing.
"""

from __future__ import annotations

import os

from prunepipe.pipelines.evaluation.records import PRIMARY_METRICS
from prunepipe.pipelines.report.frontier import interval_text


def _num(value) -> str:
    if value is None or value != value:
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"


def _signed(value: float) -> str:
    return "n/a" if value != value else f"{value:+.4g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def equal_quality_section(found: dict | None) -> list[str]:
    """The headline: per setting and metric, the compute saved at equal quality over its seeds."""
    if not found or not any(setting["metrics"] for setting in found["settings"]):
        return []
    lines = [
        "## Compute saved at equal quality",
        "",
        "Each pruned run against the Full curve of its own seed (baseline, same-compute and --frontier runs: "
        "Full at several schedule lengths, fitted as one shape plus a level per seed): saving = 1 - its "
        "samples forwarded / those at which that curve reaches its quality (linear between lengths; beyond "
        "their ends a bound, >= or <=, kept out of the interval). The curve is read through its running best: "
        "the best Full at or below each compute. Interval: 95% t over the measured seeds, standard error by "
        "jackknife over seeds (docs/evaluation.md).",
        "",
    ]
    hurts = {
        f"**{metric}: {s['hurts']}**; each setting is read against the best Full at or below its compute"
        for setting in found["settings"]
        for metric, s in setting["metrics"].items()
        if s.get("hurts")
    }
    lines[2:2] = [*sorted(hurts), ""] if hurts else []  # what a reader must see first
    rows = []
    marks = {"at least": ">=", "at most": "<="}
    for setting in found["settings"]:
        for metric, s in setting["metrics"].items():
            per_seed = ", ".join(
                f"s{seed}: {marks.get(a['kind'], '')}{100 * a['saving']:.1f}%"
                for seed, a in zip(s["seeds"], s["per_seed"])
            )
            rows.append(
                [setting["setting"], metric, per_seed, interval_text(s), s["verdict"], str(s["seeds_needed"] or "-")]
            )
    lines += _table(["setting", "metric", "per seed", "saving [95% CI]", "verdict", "seeds needed"], rows) + [""]
    notes = {
        f"- {setting['setting']}: {s['note']}"
        for setting in found["settings"]
        for s in setting["metrics"].values()
        if s["note"]
    }
    lines += sorted(notes) + ([""] if notes else [])
    lines += [
        "Seeds needed: for a paired t test (5%, two-sided, 80% power) to tell a saving of the measured size from 0.",
        "",
    ]
    return lines


def sources_section(found: dict | None) -> list[str]:
    """A mixture's runs side by side per source: what each forwarded and kept, and its held-out quality."""
    if not found:
        return []
    runs = list(found)
    sources = list(dict.fromkeys(name for per_run in found.values() for name in per_run))
    metrics = list(dict.fromkeys(m for per_run in found.values() for s in per_run.values() for m in s["held_out"]))
    header = ["source"] + [h for run in runs for h in (f"{run} forwarded", f"{run} kept / drawn (last pass)")]
    header += [f"{run} {metric}" for metric in metrics for run in runs]
    rows = []
    for source in sources:
        row = [source]
        for run in runs:
            cell = found[run].get(source)
            row += [_num(cell["forwarded"]), f"{cell['kept']:,} / {cell['drawn']:,}"] if cell else ["n/a"] * 2
        for metric in metrics:
            for run in runs:
                cell = found[run].get(source)
                row.append(_num(cell["held_out"].get(metric)) if cell else "n/a")
        rows.append(row)
    return ["## Per source", "", *_table(header, rows), ""]


def buckets_section(found: dict | None) -> list[str]:
    """Runs on aspect-ratio buckets side by side per bucket: what each forwarded (and its share of the
    run's), kept in the last pass, and that pass's training loss."""
    if not found:
        return []
    runs = list(found)
    buckets = list(dict.fromkeys(name for per_run in found.values() for name in per_run))
    header = ["bucket"] + [h for run in runs for h in (f"{run} forwarded (share)", f"{run} kept (last pass)")]
    header += [f"{run} train loss (last pass)" for run in runs]
    rows = []
    for bucket in buckets:
        cells = [found[run].get(bucket) for run in runs]
        row = [bucket]
        for cell in cells:
            row += [f"{_num(cell['forwarded'])} ({cell['share']:.1%})", _num(cell["kept"])] if cell else ["n/a"] * 2
        row += [_num(cell["train_loss"]) if cell else "n/a" for cell in cells]
        rows.append(row)
    return ["## Per aspect-ratio bucket", "", *_table(header, rows), ""]


def read_from(report: dict) -> str:
    """The line under a section that reads each run's final quality: eval records or training logs."""
    kinds = sorted({s["from"] for s in report.get("quality_sources", {}).values()} - {"nothing"})
    if kinds == ["eval record"]:
        return "Quality read from each run's eval record (eval/step_*.json of its last step; listed above)."
    if kinds == ["training log"]:
        return (
            "Quality read from each run's training log (metrics.jsonl, its last pass's held-out values: the loop's "
            "held-out samples and weights): no run was evaluated; `prunepipe eval RUN` measures them on the "
            "eval split."
        )
    return "Quality read from: " + (", ".join(kinds) or "nothing") + "."


def render_markdown(report: dict) -> str:
    base, pruned = report["baseline"], report["pruned"]
    names = [r["name"] for r in pruned]
    lines = [
        "# Losslessness report: pruned against full",
        "",
        f"Baseline: {', '.join(b['name'] for b in base)} (pruner {base[0]['pruner']}, {len(base)} run(s)). "
        "Pruned: " + ", ".join(f"{r['name']} ({r['pruner']})" for r in pruned) + ".",
        "Quality from: "
        + "; ".join(f"{r['name']}: {r.get('quality_from') or 'nothing'} ({r['metrics_source']})" for r in base + pruned)
        + ".",
        "",
    ]

    quality = equal_quality_section(report.get("equal_quality"))
    lines += quality + ([read_from(report), ""] if quality else [])
    lines += sources_section(report.get("sources"))
    lines += buckets_section(report.get("buckets"))
    lines += ["## Quality at equal passes", "", read_from(report), ""]
    metrics = [m for m in PRIMARY_METRICS if any(m in report["equal_passes"][n]["metrics"] for n in names)]
    header = ["metric", "better", "baseline"] + [h for n in names for h in (n, f"delta {n}", f"verdict {n}")]
    header.insert(3, "tolerance")
    rows = []
    for metric in metrics:
        first = next(
            report["equal_passes"][n]["metrics"][metric]
            for n in names
            if metric in report["equal_passes"][n]["metrics"]
        )
        row = [
            metric,
            "higher" if PRIMARY_METRICS[metric] else "lower",
            _num(first["baseline"]),
            _num(first["tolerance"]),
        ]
        for n in names:
            cell = report["equal_passes"][n]["metrics"].get(metric)
            row += [_num(cell["value"]), _signed(cell["delta"]), cell["verdict"]] if cell else ["n/a"] * 3
        rows.append(row)
    lines += _table(header, rows) + [""]
    for n in names:
        verdict = report["equal_passes"][n]
        why = (
            f" ({', '.join(verdict['failed'])} worse than the baseline by more than the tolerance)"
            if verdict["failed"]
            else ""
        )
        lines.append(f"- **{n} at equal passes: {verdict['verdict']}**{why}")
    lines.append("")

    lines += ["## Quality at equal compute (samples forwarded)", ""]
    rows = []
    for n in names:
        result = report["equal_compute"][n]
        for metric, cell in result["metrics"].items():
            rows.append(
                [
                    n,
                    metric,
                    _num(cell["value"]),
                    _num(cell["reference"]),
                    _signed(cell["delta"]),
                    _num(cell["tolerance"]),
                    cell["verdict"],
                ]
            )
    lines += _table(["run", "metric", "value", "full at equal compute", "delta", "tolerance", "verdict"], rows) + [""]
    for n in names:
        result = report["equal_compute"][n]
        lines.append(
            f"- **{n} at equal compute: {result['verdict']}**. Reference: {result['reference']}. "
            f"{n}'s values: {result.get('value_source', 'n/a')}."
        )
    lines.append("")

    lines += ["## Cost", ""]
    rows = []
    for name, c in report["cost"].items():
        saving = (
            ["-"] * 3
            if name not in names
            else [f"{c['saving_' + key]:.1%}" for key in ("samples_forwarded", "optimizer_steps", "wall_seconds")]
        )
        rows.append(
            [
                name,
                _num(c["passes"]),
                _num(c["samples_forwarded"]),
                _num(c["optimizer_steps"]),
                f"{c['wall_seconds']:.1f}",
                *saving,
            ]
        )
    lines += _table(
        [
            "run",
            "passes",
            "samples forwarded",
            "optimizer steps",
            "wall-clock s",
            "saving samples",
            "saving steps",
            "saving wall-clock",
        ],
        rows,
    ) + [""]
    lines.append("Savings are against the baseline mean; wall-clock is training time only (evaluation excluded).")
    lines.append("")

    lines += ["## Tolerances", ""]
    seen = set()
    for n in names:
        for metric, cell in report["equal_passes"][n]["metrics"].items():
            if metric not in seen:
                seen.add(metric)
                lines.append(f"- {metric}: {cell['tolerance_text']}")
    lines += [
        "",
        "A metric is lossless unless the pruned run is worse than the baseline mean by more than its "
        "tolerance; a run is lossless at equal passes when every metric is. See docs/evaluation.md.",
        "",
    ]

    if report["notes"]:
        lines += ["## Notes", "", *(f"- {note}" for note in report["notes"]), ""]
    if report.get("plots"):
        lines += ["## Plots", "", *(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in report["plots"]), ""]
    return "\n".join(lines)
