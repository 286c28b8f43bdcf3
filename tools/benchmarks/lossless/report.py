"""The lossless benchmark's report: curves as PNGs and the markdown tables, rendered from the
report dict that tools/benchmarks/lossless/run.py writes (and re-renders with --from-json). Each suite's
tables are a page of their own, OUT/benchmarks/lossless_{mode}.md, beside its plots and its record
(lossless_{mode}.json); docs/BENCHMARKS.md summarises them by hand and links to them."""

from __future__ import annotations

import os

import numpy as np

from prunepipe.pipelines.atomic_write import atomic_write_text
from prunepipe.pipelines.report.frontier import interval_text, percent
from prunepipe.pipelines.report.lossless import LOSSLESS_K
from prunepipe.tools.benchmarks.lossless.plan import TaskPlan
from prunepipe.tools.benchmarks.lossless.verdicts import fmt, seed_savings


def plot_curves(results: list[dict], plan: TaskPlan, out_dir: str, mode: str) -> list[str]:
    """Held-out metric per pass (left: is Full flat?) and per sample forwarded (right: pruned runs
    against Full runs with their own, shorter schedules) for the long schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"Random": "tab:green", "InfoBatch": "tab:blue", "TED": "tab:red"}
    long_runs = [r for r in results if r["task"] == plan.task and r["schedule"] == "long" and r["role"] != "ablation"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    drawn = set()
    for r in sorted(long_runs, key=lambda r: (r["role"] != "full", r["label"])):
        curve = [p for p in r["curve"] if p["held_out"] is not None]
        passes = [p["pass"] for p in curve]
        compute = [p["samples_forwarded"] / 1000 for p in curve]
        values = [p["held_out"] for p in curve]
        if r["role"] == "full":
            style = dict(color="black", lw=1.6 if r["seed"] == 0 else 1.0, alpha=1.0 if r["seed"] == 0 else 0.45)
        elif r["role"] == "equal_compute":
            if (r["key"], r["compute_of"]) in drawn or r["passes"] == plan.long:
                continue  # the same run as Full s0 or another equal-compute run: drawn once
            drawn.add((r["key"], r["compute_of"]))
            style = dict(color=colours.get(r["compute_of"], "gray"), lw=1.2, ls=":")
        else:
            style = dict(color=colours.get(r["label"], "gray"), lw=1.6)
        if r["role"] != "equal_compute":
            axes[0].plot(passes, values, label=r["label"], **style)
        axes[1].plot(compute, values, label=r["label"], **style)
        if r["role"] == "equal_compute":  # mark where it ends: the equal-compute point
            axes[1].plot(compute[-1:], values[-1:], marker="o", ms=4, color=style["color"])
    for ax, xlabel in zip(axes, ("pass", "samples forwarded (thousands)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"held-out {plan.main} (per pass, run-seed masks/noise)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    axes[0].set_title(f"{plan.task}, long schedule ({plan.long} passes): by pass")
    axes[1].set_title(f"{plan.task}: by samples forwarded\n(dotted: Full, its own shorter schedule; dot = its end)")
    tails = [
        p["held_out"]
        for r in long_runs
        for p in r["curve"][max(1, len(r["curve"]) // 10) :]
        if p["held_out"] is not None
    ]
    if tails:  # zoom on where the runs differ, not on the first passes' drop
        for ax in axes:
            ax.set_ylim(0.95 * min(tails), 1.05 * max(tails))
    fig.tight_layout()
    path = os.path.join(out_dir, f"lossless_{mode}_{plan.task}_curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def plot_frontier(results: list[dict], plan: TaskPlan, out_dir: str, mode: str, arm_rows: list[dict] = ()) -> list[str]:
    """Final quality against compute, per held-out split: Full at each schedule length (the seeds'
    mean, a band from their lowest to their highest: the line a pruner must beat to be worth more
    than training less) and every setting at its mean compute with the 95% t interval of its mean,
    labelled with its compute saved at equal quality."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from prunepipe.pipelines.evaluation.records import lower_is_better
    from prunepipe.pipelines.report.frontier import interval_text, t_interval
    from prunepipe.tools.benchmarks.lossless.records import FULL_ROLES

    metrics = [plan.main] + [f"{plan.main}@{split}" for split in plan.extra_splits]
    runs = [r for r in results if r["task"] == plan.task and r["schedule"] == "long"]
    full_compute = np.mean([r["samples_forwarded"] for r in runs if r["role"] == "full"])
    rows = {r["label"]: r for r in arm_rows if r["task"] == plan.task and r["schedule"] == "long"}
    savings = [
        (label, r["metrics"][plan.main]["saving"])
        for label, r in rows.items()
        if (r["metrics"].get(plan.main) or {}).get("saving")
    ]
    panels = len(metrics) + bool(savings)
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 5.2), squeeze=False)
    if savings:
        plot_savings(axes[0][-1], savings, plan)
    for ax, metric in zip(axes[0], metrics):
        full = {}  # passes -> {key: run}: a run that is both a frontier point and an equal-compute Full counts once
        for r in runs:
            if r["role"] in FULL_ROLES and r["metrics"].get(metric) is not None:
                full.setdefault(r["passes"], {})[r["key"]] = r
        line = sorted(
            (
                np.mean([r["samples_forwarded"] for r in g.values()]) / full_compute,
                np.mean([r["metrics"][metric] for r in g.values()]),
                min(r["metrics"][metric] for r in g.values()),
                max(r["metrics"][metric] for r in g.values()),
                len(g),
            )
            for g in full.values()
        )
        if line:
            xs, ys, lows, highs, counts = zip(*line)
            ax.plot(
                xs,
                ys,
                color="black",
                marker="o",
                ms=4,
                lw=1.5,
                label=f"Full, its own schedule (mean of {max(counts)} seeds)",
            )
            ax.fill_between(xs, lows, highs, color="black", alpha=0.12, lw=0, label="Full, lowest to highest seed")
        arms = dict.fromkeys(r["label"] for r in runs if r["role"] in ("pruned", "ablation"))
        for i, label in enumerate(arms):
            mine = [r for r in runs if r["label"] == label and r["metrics"].get(metric) is not None]
            if not mine:
                continue
            values = [r["metrics"][metric] for r in mine]
            mean, low, high = t_interval(values)
            error = [[mean - low], [high - mean]] if len(values) > 1 else None
            saving = ((rows.get(label) or {}).get("metrics", {}).get(metric) or {}).get("saving")
            text = f"{label}: saves {interval_text(saving)}" if saving else f"{label} ({len(values)} seeds)"
            ax.errorbar(
                [np.mean([r["samples_forwarded"] for r in mine]) / full_compute],
                [mean],
                yerr=error,
                color=f"C{i}",
                marker="s",
                ms=6,
                capsize=3,
                ls="none",
                label=text,
            )
        better = "below" if lower_is_better(metric) else "above"
        ax.set_title(f"{plan.task}: final {metric}\n{better} the black line = better than training less")
        ax.set_xlabel("compute (samples forwarded, fraction of Full's full schedule)")
        ax.set_ylabel(f"{metric} (bars: 95% t interval of the seed mean, unpaired)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"lossless_{mode}_{plan.task}_frontier.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def plot_savings(ax, savings: list[tuple[str, dict]], plan: TaskPlan) -> None:
    """One row per setting: each seed's compute saved at equal quality (open: a bound beyond the
    frontier's ends) and the mean with its 95% t interval; the target and 0 as lines."""
    from prunepipe.tools.benchmarks.lossless.verdicts import TARGET_ISO_SAVING

    for row, (label, saving) in enumerate(savings):
        for seed in saving["per_seed"]:
            bound = seed["kind"] != "interpolated"
            ax.plot(
                100 * seed["saving"],
                row,
                marker=">" if seed["kind"] == "at least" else "<" if bound else "o",
                ms=5,
                color="gray",
                mfc="none" if bound else "gray",
                ls="none",
            )
        if saving["n"] > 1:
            ax.errorbar(
                100 * saving["mean"],
                row + 0.25,
                xerr=[[100 * (saving["mean"] - saving["low"])], [100 * (saving["high"] - saving["mean"])]],
                color=f"C{row}",
                marker="D",
                ms=6,
                capsize=3,
            )
    ax.axvline(0, color="black", lw=1)
    ax.axvline(100 * TARGET_ISO_SAVING, color="tab:green", lw=1, ls="--", label=f"target {TARGET_ISO_SAVING:.0%}")
    ax.set_yticks(range(len(savings)), [label for label, _ in savings], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("compute saved, % (dots: seeds, open: bounds; diamond: mean of the measured seeds, 95% t CI)")
    ax.set_title(f"{plan.task}: compute saved at equal {plan.main}\neach seed against its own Full frontier")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8)


def _verdict(value) -> str:
    return "-" if value is None else ("yes" if value else "no")


def results_table(rows: list[dict], task: str, schedule: str) -> list[str]:
    rows = once_each([r for r in rows if r["task"] == task and r["schedule"] == schedule])
    if not rows:
        return []
    lengths = [r for r in rows if r["role"] == "frontier"]
    rows = [r for r in rows if r["role"] != "frontier"]
    main = rows[0]["main"]
    extra = [m for m in rows[0]["deltas"] if m != main]
    head = (
        ["run", "passes", "samples fwd", "compute", "opt steps", "wall s", "saving", main, "Δ (std)"]
        + [f"{m} (Δ std)" for m in extra]
        + ["lossless (equal passes)", "Full at equal compute", "Δ vs it (std)", "beats equal compute"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {"full": 0, "frontier": 0.5, "pruned": 1, "ablation": 2, "equal_compute": 3}
    repeated = {r["label"] for r in rows if sum(o["label"] == r["label"] for o in rows) > 1}
    for r in sorted(rows, key=lambda r: (order[r["role"]], r["label"], r.get("seed", 0))):
        name = f"{r['label']} s{r['seed']}" if r["label"] in repeated and "seed" in r else r["label"]
        cells = [
            name,
            str(r["passes"]),
            f"{r['samples_forwarded']:,}",
            f"{r['compute']:.0%}",
            str(r["optimizer_steps"]),
            f"{r['wall_seconds']:.0f}",
            f"{r['saving']:+.0%}",
            fmt(r["metrics"].get(main)),
            fmt(r["deltas"][main], 2),
        ]
        cells += [f"{fmt(r['metrics'].get(m))} ({fmt(r['deltas'][m], 2)})" for m in extra]
        if r["role"] in ("pruned", "ablation"):
            cells += [
                _verdict(r["lossless"]),
                fmt(r["equal_compute_value"]),
                fmt(r["equal_compute_delta"], 2),
                _verdict(r["beats_equal_compute"]),
            ]
        else:
            cells += ["", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    full = next(r for r in rows if r["role"] == "full")
    lines.append("")
    seeds = sum(r["role"] == "full" for r in rows)
    lines.append(
        f"Full over {seeds} seeds: {main} {fmt(full['full_mean'])} ± {fmt(full['full_std'], 2)} (sample std); "
        f"Δ = (worse - better) / that std, positive = worse than Full. Full at equal compute: the run's seed's "
        f"Full frontier (every Full run of this schedule, fitted as one shape plus a level per seed) read at the "
        f"run's samples forwarded, as `prunepipe compare` reads it."
    )
    return lines + frontier_table(lengths, main)


def frontier_table(rows: list[dict], main: str) -> list[str]:
    """Full at the other schedule lengths (each its own schedule), one line per length with every
    seed's `main`: the points of the frontier besides the seeds' Full."""
    if not rows:
        return []
    by_passes: dict[int, list[dict]] = {}
    for r in rows:
        by_passes.setdefault(r["passes"], []).append(r)
    lines = [
        "",
        f"Full at other schedule lengths (the frontier's points besides Full above), {main} per seed:",
        "",
        "| passes | compute | samples fwd | " + main + " (seed: value) |",
        "|---|---|---|---|",
    ]
    for passes, runs in sorted(by_passes.items()):
        runs = sorted(runs, key=lambda r: r["seed"])
        values = ", ".join(f"s{r['seed']} {fmt(r['metrics'].get(main))}" for r in runs)
        lines.append(
            f"| {passes} | {np.mean([r['compute'] for r in runs]):.0%} | "
            f"{int(np.mean([r['samples_forwarded'] for r in runs])):,} | {values} |"
        )
    return lines


def once_each(rows: list[dict]) -> list[dict]:
    """The rows with each Full run once: a run that is a seed's Full, a frontier point and several arms'
    equal-compute Full (one key) is one row, named by its length when it is not a seed's Full."""
    order = {"full": 0, "frontier": 1, "equal_compute": 2}
    kept, seen = [], set()
    for r in sorted(rows, key=lambda r: order.get(r["role"], -1)):
        if r["role"] in order and r.get("key") is not None:
            if r["key"] in seen:
                continue
            seen.add(r["key"])
            if r["role"] != "full":
                r = {**r, "label": f"Full {r['passes']} passes", "role": "frontier"}
        kept.append(r)
    return kept


def cost_table(rows: list[dict]) -> list[str]:
    """Per task, schedule and setting (seeds averaged; their count beside it) and Full s0: samples
    skipped, wall-clock saving and the pruner's share, side by side."""
    lines = [
        "| task | schedule | run | seeds | samples skipped | wall-clock saving | realised / skipped | step ms | "
        "pruner time / step time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["role"] in ("pruned", "ablation") or (r["role"] == "full" and r["label"] == "Full s0"):
            groups.setdefault((r["task"], r["schedule"], r["label"]), []).append(r)
    for (task, schedule, label), runs in groups.items():
        mean = {k: float(np.mean([r[k] for r in runs])) for k in ("skipped", "saving", "step_ms", "pruner_overhead")}
        realised = mean["saving"] / mean["skipped"] if mean["skipped"] > 0.02 else float("nan")
        lines.append(
            f"| {task} | {schedule} | {label} | {len(runs)} | {mean['skipped']:.1%} | {mean['saving']:.1%} | "
            f"{fmt(realised, 2)} | {mean['step_ms']:.1f} | {mean['pruner_overhead']:.3%} |"
        )
    return lines


def render(report: dict) -> str:
    rows, lines = report["rows"], []
    lines += [
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}  ",
        f"Wall time of the whole benchmark: {report['bench_seconds'] / 60:.1f} min "
        f"({report['workers']} runs side by side, 1 torch thread each); load average at start / end: "
        f"{report['load_start']} / {report['load_end']}  ",
        "",
    ]
    for plan in report["plans"]:
        task = plan["task"]
        flat = report["flattening"][task]
        data = plan.get("data", "digits")
        what = (
            f"{plan['train_samples']} training digits"
            if data == "digits"
            else f"{plan['train_samples']} training digits as captioned image-text pairs"
            if data == "captioned"
            else f"{data} shards ({plan['crops_per_photo']} crops of each bundled photograph)"
        )
        lines += [
            f"### {task}: {what} at 16 px, `{plan['config']}`",
            "",
            f"Long schedule: {plan['long']} passes; Full's mean held-out {plan['main']} changed by "
            f"{fmt(flat['change'])} ({fmt(flat['in_std'], 2)} seed std) from pass {flat['from_pass']} to "
            f"{flat['passes']}: {'flattened' if flat['flattened'] else 'NOT flattened (still improving)'}. "
            + (
                f"Full with its own {flat['shorter_passes']}-pass schedule ends {fmt(flat['shorter_gap_std'], 2)} "
                f"seed std worse than at {flat['passes']} passes: "
                + (
                    "the last passes bought nothing (converged)."
                    if flat["converged"]
                    else "the last passes still pay, so this is NOT the converged regime."
                )
                if flat["shorter_passes"]
                else ""
            ),
            "",
        ]
        for schedule in ("long", "short"):
            table = results_table(rows, task, schedule)
            if table:
                passes = plan[schedule]
                lines += [f"#### {task}, {schedule} schedule ({passes} passes)", ""] + table + [""]
        lines += arms_table(report.get("arms") or [], task)
        lines += replication_table(report["results"], task)
        # the page lies beside its plots, in OUT/benchmarks/
        lines += [f"![{task} curves]({os.path.basename(p)})" for p in report["plots"].get(task, [])] + [""]
    if report.get("timing_rows"):
        lines += [
            "### Wall-clock, one run at a time",
            "",
            "The long schedule again without held-out evaluation, one run at a time, interleaved "
            "(Full, Random, InfoBatch, TED, then again), so runs did not share the cores with each other "
            "and met the same drifts of outside load. CPU = the run process's CPU seconds (setup included).",
            "",
            "| task | run | rounds | samples skipped | opt steps | wall s (spread) | wall saving | realised / skipped "
            "| CPU s | CPU saving | CPU realised | step ms | pruner time / loop time |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in report["timing_rows"]:
            lines.append(
                f"| {t['task']} | {t['label']} | {t['rounds']} | {t['skipped']:.1%} | {t['optimizer_steps']:.0f} | "
                f"{t['wall_seconds']:.1f} ({t['wall_spread']:.1f}) | {t['saving']:.1%} | {fmt(t['realised'], 2)} | "
                f"{t['cpu_seconds']:.1f} | {t['cpu_saving']:.1%} | {fmt(t['cpu_realised'], 2)} | "
                f"{t['step_ms']:.1f} | {t['pruner_overhead']:.3%} |"
            )
        lines.append("")
    lines += ["### Cost in the side-by-side runs (two at a time; noisier)", ""] + cost_table(rows) + [""]
    lines += ["### Targets", "", "| target | status | measured |", "|---|---|---|"]
    lines += [f"| {t['target']} | {'met' if t['met'] else 'MISSED'} | {t['measured']} |" for t in report["targets"]]
    return "\n".join(lines) + "\n"


def replication_table(results: list[dict], task: str) -> list[str]:
    """Per setting: how many of its samples copy a train image (eval.replication, pixels), over seeds."""
    by_label: dict[str, list[dict]] = {}
    for r in results:
        if r["task"] == task and r.get("replication") and r["role"] in ("full", "pruned"):
            by_label.setdefault("Full" if r["role"] == "full" else r["label"], []).append(r["replication"])
    if not by_label:
        return []
    first = next(iter(by_label.values()))[0]
    lines = [
        f"Replication ({task}): {first['replication_samples']} samples of each run searched among its "
        f"{first['replication_train_samples']} train images; a copy is a sample whose nearest train image is "
        f"at most {first['replication_threshold']:g} of the mean distance to its "
        f"{first['replication_neighbours']} nearest (pixels; pipelines/evaluation/replication.py). Mean over "
        f"seeds [min, max]:",
        "",
        "| setting | seeds | copies | held-out images flagged | closer than the held-out 1% | median ratio |",
        "|---|---|---|---|---|---|",
    ]
    for label, rows in by_label.items():
        lines.append(
            f"| {label} | {len(rows)} | {_seed_spread(rows, 'replication_rate')} | "
            f"{_seed_spread(rows, 'replication_rate_held_out')} | "
            f"{_seed_spread(rows, 'replication_closer_than_held_out_p99')} | "
            f"{_seed_spread(rows, 'replication_ratio_q50', False)} |"
        )
    return lines + [""]


def _seed_spread(rows: list[dict], key: str, percent: bool = True) -> str:
    """'mean [min, max]' of `key` over the rows that hold it (a percentage, or 3 decimals); '-' if none."""
    values = [row[key] for row in rows if key in row]
    if not values:
        return "-"
    show = (lambda v: f"{v:.1%}") if percent else (lambda v: f"{v:.3f}")
    return f"{show(float(np.mean(values)))} [{show(min(values))}, {show(max(values))}]"


def _seed_savings(saving: dict) -> str:
    return seed_savings(saving, lambda value: int(round(100 * value))) + " %"


def _paired(cell: dict) -> str:
    if cell["n"] < 2:
        return "-"
    return f"{fmt(cell['mean'], 2)} [{fmt(cell['low'], 2)}, {fmt(cell['high'], 2)}] {cell['reading']}"


def arms_table(arm_rows: list[dict], task: str) -> list[str]:
    """Per setting: compute saved at equal quality (the headline), the paired differences, and the
    seed means with their pooled-std deltas."""
    mine = [r for r in arm_rows if r["task"] == task]
    if not mine:
        return []
    main = mine[0]["main"]
    hurts = sorted(
        {
            f"**{r['metrics'][main]['saving']['hurts']}**; each setting is read against the best Full at or "
            f"below its compute"
            for r in mine
            if ((r["metrics"].get(main) or {}).get("saving") or {}).get("hurts")
        }
    )
    lines = [
        f"#### {task}: compute saved at equal quality ({main}), seeds paired with their own Full",
        "",
        *([*hurts, ""] if hurts else []),
        "| setting | compute | seeds | Full points per seed | saving at equal quality [95% t CI] | bootstrap CI "
        "| per seed | verdict | seeds needed | paired Δ vs Full, equal passes [CI] | paired Δ vs Full, equal compute "
        "[CI] | pooled Δ std: passes / compute |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in mine:
        c = r["metrics"].get(main)
        if not c:
            continue
        s = c.get("saving")
        points = sorted(set((c.get("frontier_points") or {}).values()))
        lines.append(
            f"| {r['label']} | {r['compute']:.0%} | {len(r['seeds'])} | {'/'.join(map(str, points)) or '-'} | "
            + (
                f"{interval_text(s)} | [{percent(s['bootstrap_low'])}, {percent(s['bootstrap_high'])}] | {_seed_savings(s)} | "
                f"{s['verdict']} | {s['seeds_needed'] or '-'} | "
                if s
                else "- | - | - | - | - | "
            )
            + f"{_paired(c['paired_passes'])} | {_paired(c['paired_compute'])} | "
            f"{fmt(c['delta_passes'], 2)} / {fmt(c['delta_compute'], 2)} |"
        )
    notes = [
        f"- {r['label']}: {r['metrics'][main]['saving']['note']}"
        for r in mine
        if (r["metrics"].get(main) or {}).get("saving") and r["metrics"][main]["saving"]["note"]
    ]
    lines += [""] + notes + ([""] if notes else [])
    lines += [
        f"Saving = 1 − compute / the compute at which the same seed's Full frontier reaches the setting's "
        f"{main} (Full runs fitted as one shape plus a level per seed, linear between lengths; ≥ / ≤: beyond the "
        f"frontier's ends, a bound). Interval: t over "
        f"seeds (the bootstrap beside it covers less than 95% at few seeds). Seeds needed: for a paired t "
        f"test (5%, two-sided) to show this mean saving ≠ 0 with 80% power. Paired Δ: mean of per-seed "
        f"differences setting − Full of the same seed, in {main} units (Full at equal compute: the seed's "
        f"fitted frontier read at its compute, as `prunepipe compare` reads it).",
        "",
    ]
    others = [(r, m, c) for r in mine for m, c in r["metrics"].items() if m != main and c.get("saving")]
    if others:
        lines += [
            "| setting | metric | saving at equal quality [95% t CI] | per seed | paired Δ, equal passes | "
            "paired Δ, equal compute |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['label']} | {m} | {c['saving']['verdict']} | {_seed_savings(c['saving'])} | "
            f"{_paired(c['paired_passes'])} | {_paired(c['paired_compute'])} |"
            for r, m, c in others
        ]
        lines += [
            "",
            "Metrics with @val_mix are on held-out data drawn from the train mix; the others on the clean val.",
            "",
        ]
    lines += [
        f"#### {task}: settings at {len(mine[0]['seeds'])} seeds, deltas in pooled std (positive = worse)",
        "",
        "| setting | compute | metric | mean ± std | Full, equal passes | Δ | lossless | Full, equal compute "
        "(passes) | Δ | pays |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: "no", None: "n/a"}
    for r in mine:
        for metric, c in r["metrics"].items():
            lines.append(
                f"| {r['label']} | {r['compute']:.0%} | {metric} | {fmt(c['mean'])} ± {fmt(c['std'], 2)} | "
                f"{fmt(c['full_mean'])} | {fmt(c['delta_passes'], 2)} | {yes[c['lossless']]} | "
                f"{fmt(c['equal_compute_mean'])} ({', '.join(map(str, r['equal_compute_passes']))}) | "
                f"{fmt(c['delta_compute'], 2)} | {yes[c['pays']]} |"
            )
    return lines + [
        "",
        f"Lossless: within {LOSSLESS_K:g} pooled std of Full at equal passes. Pays: better than Full at the "
        f"same samples forwarded (each seed's fitted frontier read there; the passes are those of the "
        f"equal-compute runs) by more than {LOSSLESS_K:g} pooled std (unpaired seed means; "
        f"pipelines/report/compare.py's judge and judge_equal_compute).",
        "",
    ]


def markdown_path(out: str, mode: str) -> str:
    """Where a suite's generated tables go: OUT/benchmarks/lossless_{mode}.md, beside its plots."""
    return os.path.join(out, "benchmarks", f"lossless_{mode}.md")


def page(mode: str, body: str, json_path: str, out: str) -> str:
    """The generated page of one suite: its title, a line saying which command writes it, the tables."""
    return (
        f"# `prunepipe bench lossless`, {mode}: generated tables\n\n"
        f"Written by `prunepipe bench lossless`; `prunepipe bench lossless --from-json {json_path} --out {out}` "
        f"rewrites it from the recorded runs, replacing everything between the markers.\n\n{body}"
    )


def write_markdown(path: str, mode: str, body: str) -> None:
    """Replace the block between `<!-- bench:{mode}:begin -->` and `...:end -->` in `path`, keeping the rest;
    a new file is the block alone."""
    begin, end = f"<!-- bench:{mode}:begin -->", f"<!-- bench:{mode}:end -->"
    block = f"{begin}\n{body}{end}"
    text = open(path).read() if os.path.exists(path) else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    elif text:
        text = text.rstrip("\n") + f"\n\n{block}\n"
    else:
        text = block + "\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write_text(path, text)
