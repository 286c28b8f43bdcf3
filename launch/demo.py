"""`prunepipe demo` (what `make demo` runs): the question this project exists for, asked on the bundled
digits on CPU in a few minutes. Was the pruned run lossless, was it better than training less, and
how much compute did it save at equal quality?

At each of three seeds it trains a tiny MAE with InfoBatch, its full-data baseline for the same
passes (the seeds' spread is the tolerance), a full run of the same compute (as many passes as
that seed's pruned run's samples forwarded buy, with its own schedule) and a full run of half the
passes. Each seed's three full runs are its Full frontier: the compute saved at equal quality is
read off it, paired by seed, with a 95% interval over the seeds. It evaluates every run on held-out data and prints the `prunepipe
compare` report and the three answers.
"""

from __future__ import annotations

import os

from prunepipe.launch.configs import CONFIGS
from prunepipe.pipelines.config import load_config
from prunepipe.pipelines.report.compare import compare_runs
from prunepipe.pipelines.trained import evaluate_checkpoint
from prunepipe.pipelines.training.loop import train
from prunepipe.tools.commands.shards import write_shards

# Raw weights: after runs this short the EMA (decay 0.999) still lags far behind them.
EVAL_OVERRIDES = ["weights=raw"]


def train_and_evaluate(config: str, overrides: list[str], what: str) -> tuple[dict, str]:
    """Train `config` with `overrides`, evaluate its final raw weights; (last pass summary, run folder)."""
    cfg = load_config(os.path.join(CONFIGS, config), overrides)
    print(f"\n== {what}: configs/{config}, {cfg.num_passes} passes -> {cfg.run_dir}", flush=True)
    summary = train(cfg)
    record = evaluate_checkpoint(cfg.run_dir, overrides=EVAL_OVERRIDES)
    print(
        f"   {summary['samples_forwarded']} samples forwarded, {summary['wall_seconds']:.1f} s; held-out: "
        + ", ".join(f"{name} {value:.4g}" for name, value in record["metrics"].items()),
        flush=True,
    )
    return summary, cfg.run_dir


def equal_compute_passes(pruned: dict, full_first_pass: int) -> int:
    """Passes of full data that forward about as many samples as the pruned run did."""
    return max(1, round(pruned["samples_forwarded"] / full_first_pass))


def seed_suffix(seed: int) -> str:
    return f"_s{seed}" if seed else ""


def agreed(verdicts: list[str]) -> str:
    """One verdict for several seeds: 'lossless (3 of 3 seeds)', or each verdict with its count."""
    counts = {v: verdicts.count(v) for v in dict.fromkeys(verdicts)}
    if len(verdicts) == 1:
        return verdicts[0]
    return ", ".join(f"{v} ({n} of {len(verdicts)} seeds)" for v, n in counts.items())


def run_demo(data: str, prefix: str = "demo_mae", passes: int = 0, overrides: list[str] = (), seeds: int = 3) -> dict:
    """Shards (written once), the runs, the comparison; returns the compare report."""
    if not os.path.exists(os.path.join(data, "train", "index.json")):
        print(f"writing scikit-learn's digits as shards in {data} ...")
        write_shards("digits", data, size=32, shard_size=300)
    common = [
        f"data.train={data}/train",
        f"data.val={data}/val",
        *([f"num_passes={passes}"] if passes else []),
        *overrides,
    ]
    steps, step = 4 * seeds, 0
    pruned_dirs, baseline, same_compute, frontier = [], [], [], []
    for seed in range(seeds):
        suffix = seed_suffix(seed)
        pruned, pruned_dir = train_and_evaluate(
            "mae_tiny_infobatch.yaml",
            [*common, f"seed={seed}", f"name={prefix}_infobatch{suffix}"],
            f"{step + 1}/{steps} the pruned run (InfoBatch), seed {seed}",
        )
        full, full_dir = train_and_evaluate(
            "mae_tiny_full.yaml",
            [*common, f"seed={seed}", f"name={prefix}_full_s{seed}"],
            f"{step + 2}/{steps} the full-data baseline, same passes, seed {seed}",
        )
        pruned_dirs.append(pruned_dir)
        baseline.append(full_dir)  # several seeds: the verdicts' tolerances are their run-to-run spread
        full_passes, per_pass = full["pass_index"] + 1, full["samples_forwarded"] // (full["pass_index"] + 1)
        short = equal_compute_passes(pruned, per_pass)
        if short == full_passes:  # pruning saved less than a pass: the baseline is the equal-compute run
            print(f"\n== {step + 3}/{steps} the equal-compute run of seed {seed} is its baseline ({short} passes)")
            same_compute.append(full_dir)
        else:
            _, same_dir = train_and_evaluate(
                "mae_tiny_full.yaml",
                [*common, f"seed={seed}", f"num_passes={short}", f"name={prefix}_full_short{suffix}"],
                f"{step + 3}/{steps} full data for that compute ({pruned['samples_forwarded']} samples), seed {seed}",
            )
            same_compute.append(same_dir)
        # below the pruned run's compute, so that a run worse than training less gets a measured saving
        _, half_dir = train_and_evaluate(
            "mae_tiny_full.yaml",
            [*common, f"seed={seed}", f"num_passes={max(1, full_passes // 2)}", f"name={prefix}_full_half{suffix}"],
            f"{step + 4}/{steps} full data for half the passes (the frontier's low end), seed {seed}",
        )
        frontier.append(half_dir)
        step += 4
    report = compare_runs(
        baseline, pruned_dirs, same_compute=same_compute, frontier=frontier, weights="raw", plots=True
    )
    print("\n" + report["markdown"])
    print(
        f"report and plots: {report['out']}/\nthe same comparison: prunepipe compare {','.join(baseline)} "
        f"{' '.join(pruned_dirs)} --same-compute {' '.join(same_compute)} --frontier {' '.join(frontier)} "
        f"--weights raw"
    )
    names = [os.path.basename(d) for d in pruned_dirs]
    [setting] = report["equal_quality"]["settings"]
    main = "masked_mse"
    saving = setting["metrics"][main]["verdict"] if main in setting["metrics"] else "not measured"
    print(
        f"\nVerdicts for {setting['setting']} (InfoBatch, {seeds} seed{'s' if seeds > 1 else ''}): at equal passes "
        f"{agreed([report['equal_passes'][n]['verdict'] for n in names])}; at equal compute "
        f"{agreed([report['equal_compute'][n]['verdict'] for n in names])}; at equal quality ({main}) {saving}."
    )
    return report
