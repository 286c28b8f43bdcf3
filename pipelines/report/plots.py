"""PNG plots of a comparison (matplotlib, Agg): held-out quality against samples forwarded and
against wall-clock, kept fraction per pass, and the pruners' score histograms at a few checkpoints.
Drawing only: it reads run summaries and checkpoint pruner states, and judges nothing.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from prunepipe.pipelines.evaluation.records import PRIMARY_METRICS  # noqa: E402
from prunepipe.pipelines.report.runs import RunSummary  # noqa: E402

MAX_HISTOGRAMS = 3  # checkpoints per run in the score histogram
BOUND_MARKS = {"at least": ">=", "at most": "<="}


def _style(run: RunSummary, is_baseline: bool) -> dict:
    return {
        "linestyle": "--" if is_baseline else "-",
        "marker": "o",
        "markersize": 3,
        "label": f"{run.name} ({run.pruner})",
    }


def _held_out_metrics(runs: list[RunSummary]) -> list[str]:
    found = {k for r in runs for rec in r.trajectory for k in (rec.get("held_out") or {})}
    return [m for m in PRIMARY_METRICS if m in found]


def plot_quality(baselines: list[RunSummary], pruned: list[RunSummary], x: str, path: str) -> str | None:
    """One panel per held-out metric: its value at each pass end against `x` (samples_forwarded or
    wall_seconds), plus evaluation records (eval/*.json, `kind: eval`) as larger markers."""
    runs = [(r, True) for r in baselines] + [(r, False) for r in pruned]
    metrics = _held_out_metrics([r for r, _ in runs])
    eval_metrics = [
        m
        for m in PRIMARY_METRICS
        if m not in metrics and any(m in e.get("metrics", {}) for r, _ in runs for e in r.evals)
    ]
    panels = metrics + eval_metrics
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], panels):
        for run, is_baseline in runs:
            points = [
                (rec[x], rec["held_out"][metric])
                for rec in run.trajectory
                if metric in (rec.get("held_out") or {}) and x in rec
            ]
            line = None
            if points:
                (line,) = ax.plot(*zip(*points), **_style(run, is_baseline))
            evals = [(e[x], e["metrics"][metric]) for e in run.evals if metric in e.get("metrics", {}) and x in e]
            if evals:
                ax.plot(
                    *zip(*evals),
                    linestyle="none",
                    marker="*",
                    markersize=10,
                    color=line.get_color() if line else None,
                    label=None if line else _style(run, is_baseline)["label"],
                )
        source = "held-out, pass ends" if metric in metrics else "evaluations"
        ax.set(
            xlabel="samples forwarded" if x == "samples_forwarded" else "training wall-clock (s)",
            ylabel=metric,
            title=f"{metric} ({source}; {'higher' if PRIMARY_METRICS[metric] else 'lower'} is better)",
        )
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_kept_fraction(runs: list[RunSummary], path: str) -> str | None:
    if not any(r.trajectory for r in runs):
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for run in runs:
        passes_done = [rec["pass_index"] + 1 for rec in run.trajectory]
        ax.plot(
            passes_done,
            [rec["kept_fraction"] for rec in run.trajectory],
            marker="o",
            markersize=4,
            label=f"{run.name} ({run.pruner})",
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="pass", ylabel="kept fraction", ylim=(0, 1.05), title="samples kept per pass")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def checkpoint_scores(run_path: str) -> list[dict]:
    """[{"pass_index", "optimizer_steps", "scores", "threshold"}] from the pruner state of each complete
    checkpoint (scores of samples the pruner has measured: InfoBatch's `seen`, TED's `visits` > 0)."""
    from prunepipe.pipelines.checkpoint.manifest import verify
    from prunepipe.pipelines.checkpoint.parts import is_part_file
    from prunepipe.pipelines.checkpoint.store import complete_checkpoints, load_checkpoint_states

    found = []
    for folder in complete_checkpoints(run_path):
        # only the parts' files (the pruner's, the position's) are read, so only they are checked
        if verify(folder, only=is_part_file).problem is not None:
            continue  # damaged: `prunepipe checkpoints verify` says how
        states = load_checkpoint_states(folder, read_model=False)
        pruner, position = states["pruner"], states["position"] or {}
        if pruner is None or "score" not in pruner["tables"]:
            continue
        scores = pruner["tables"]["score"].double().numpy()
        tables = pruner["tables"]
        measured = (
            tables["seen"].numpy().astype(bool)
            if "seen" in tables
            else tables["visits"].numpy() > 0
            if "visits" in tables
            else np.isfinite(scores)
        )
        scalars = pruner.get("scalars") or {}
        threshold = scalars.get("threshold", scalars.get("score_threshold"))
        pass_index, steps = position.get("pass_index", 0), position.get("optimizer_steps", 0)
        # mid-pass, `pass_index` is the pass in progress (0-based); between passes, the number completed
        label = (
            f"step {steps}, in pass {pass_index + 1}"
            if position.get("batch_in_pass", 0)
            else f"step {steps}, after pass {pass_index}"
        )
        found.append(
            {
                "label": label,
                "pass_index": pass_index,
                "optimizer_steps": steps,
                "scores": scores[measured & np.isfinite(scores)],
                "threshold": None if threshold is None else float(threshold),
            }
        )
    return found


def plot_score_histograms(runs: list[RunSummary], path: str) -> str | None:
    """Per pruned run, the score distribution at up to MAX_HISTOGRAMS checkpoints (first, middle, last)."""
    per_run = [(run, checkpoint_scores(run.path)) for run in runs]
    per_run = [(run, states) for run, states in per_run if states]
    if not per_run:
        return None
    fig, axes = plt.subplots(
        len(per_run), MAX_HISTOGRAMS, figsize=(4 * MAX_HISTOGRAMS, 3 * len(per_run)), squeeze=False
    )
    for row, (run, states) in zip(axes, per_run):
        picks = sorted({0, len(states) // 2, len(states) - 1})
        for ax, k in zip(row, picks):
            state = states[k]
            ax.hist(state["scores"], bins=40, color="tab:blue", alpha=0.8)
            if state["threshold"] is not None:
                ax.axvline(state["threshold"], color="tab:red", linestyle="--", label="threshold")
                ax.legend(fontsize=8)
            ax.set(title=f"{run.name}: {state['label']}", xlabel="score", ylabel="samples")
        for ax in row[len(picks) :]:
            ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_equal_quality(found: dict, path: str) -> str | None:
    """One panel per metric: each seed's Full runs (final quality against samples forwarded) with the
    curve read off for it, and each pruned run in its seed's colour; the title holds each setting's
    saving."""
    from prunepipe.pipelines.report.frontier import interval_text

    metrics = [m for m in PRIMARY_METRICS if any(m in answers for answers in found["runs"].values())]
    if not metrics:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.5), squeeze=False)
    seeds = sorted({a["seed"] for answers in found["runs"].values() for a in answers.values()})
    colour = {seed: f"C{i % 10}" for i, seed in enumerate(seeds)}
    for ax, metric in zip(axes[0], metrics):
        drawn = set()
        for name, answers in found["runs"].items():
            answer = answers.get(metric)
            if answer is None:
                continue
            seed = answer["seed"]
            if seed not in drawn:
                drawn.add(seed)
                ax.plot(
                    [p["samples_forwarded"] for p in answer["frontier"]],
                    [p["value"] for p in answer["frontier"]],
                    color=colour[seed],
                    marker="o",
                    ms=4,
                    ls="none",
                    label=f"Full runs, seed {seed}",
                )
                ax.plot(
                    [p["samples_forwarded"] for p in answer["curve"]],
                    [p["value"] for p in answer["curve"]],
                    color=colour[seed],
                    lw=1.2,
                    label="its curve (shape + level)",
                )
            ax.plot(
                [answer["compute"]],
                [answer["value"]],
                color=colour[seed],
                marker="s",
                ms=8,
                mfc="none",
                ls="none",
                label=f"{name} (saves {BOUND_MARKS.get(answer['kind'], '')}{100 * answer['saving']:.0f}%)",
            )
        summaries = [
            f"{s['setting']}: {interval_text(s['metrics'][metric])}"
            for s in found["settings"]
            if metric in s["metrics"]
        ]
        ax.set_title(f"{metric}: saved at equal quality\n" + "; ".join(summaries), fontsize=9)
        ax.set_xlabel("samples forwarded")
        ax.set_ylabel(f"{metric} ({'higher' if PRIMARY_METRICS[metric] else 'lower'} is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(
    baselines: list[RunSummary], pruned: list[RunSummary], out: str, found: dict | None = None
) -> list[str]:
    """All plots that have data; returns the paths written."""
    written = [
        plot_equal_quality(found, os.path.join(out, "quality_vs_compute_frontier.png")) if found else None,
        plot_quality(baselines, pruned, "samples_forwarded", os.path.join(out, "quality_vs_samples.png")),
        plot_quality(baselines, pruned, "wall_seconds", os.path.join(out, "quality_vs_time.png")),
        plot_kept_fraction(baselines + pruned, os.path.join(out, "kept_fraction.png")),
        plot_score_histograms(pruned, os.path.join(out, "score_histograms.png")),
    ]
    return [p for p in written if p is not None]
