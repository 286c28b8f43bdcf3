"""`prunepipe demo` (what `make demo` runs): the question this project exists for, asked on the bundled
digits on CPU in a few minutes. Was the pruned run lossless, and was it better than training less?

It trains a tiny MAE with InfoBatch, its full-data baseline for the same passes at three seeds (their
spread is the tolerance), and a full run of the same compute (as many passes as the pruned run's
samples forwarded buy, with its own schedule), evaluates each on held-out data, and prints the
`prunepipe compare` report and both verdicts.
"""

from __future__ import annotations

import os

from pipelines.config import load_config
from pipelines.evaluation.runner import evaluate_checkpoint
from pipelines.report.compare import compare_runs
from pipelines.training.loop import train
from tools.shards import write_shards

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# Raw weights: after runs this short the EMA (decay 0.999) still lags far behind them.
EVAL_OVERRIDES = ["weights=raw"]


def train_and_evaluate(config: str, overrides: list[str], what: str) -> tuple[dict, str]:
    """Train `config` with `overrides`, evaluate its final raw weights; (last pass summary, run folder)."""
    cfg = load_config(os.path.join(CONFIGS, config), overrides)
    print(f"\n== {what}: configs/{config}, {cfg.passes} passes -> {cfg.run_dir}", flush=True)
    summary = train(cfg)
    record = evaluate_checkpoint(cfg.run_dir, overrides=EVAL_OVERRIDES)
    print(f"   {summary['samples_forwarded']} samples forwarded, {summary['wall_seconds']:.1f} s; held-out: "
          + ", ".join(f"{name} {value:.4g}" for name, value in record["metrics"].items()), flush=True)
    return summary, cfg.run_dir


def equal_compute_passes(pruned: dict, full_first_pass: int) -> int:
    """Passes of full data that forward about as many samples as the pruned run did."""
    return max(1, round(pruned["samples_forwarded"] / full_first_pass))


def run_demo(data: str, prefix: str = "demo_mae", passes: int = 0, overrides: list[str] = (), seeds: int = 3) -> dict:
    """Shards (written once), the runs, the comparison; returns the compare report."""
    if not os.path.exists(os.path.join(data, "train", "index.json")):
        print(f"writing scikit-learn's digits as shards in {data} ...")
        write_shards("digits", data, size=32, shard_size=300)
    common = [f"data.train={data}/train", f"data.val={data}/val", *([f"passes={passes}"] if passes else []),
              *overrides]
    steps = seeds + 2
    pruned, pruned_dir = train_and_evaluate("mae_tiny_infobatch.yaml", [*common, f"name={prefix}_infobatch"],
                                            f"1/{steps} the pruned run (InfoBatch, seed 0)")
    baseline = []  # several seeds: the verdicts' tolerances are their run-to-run spread
    for seed in range(seeds):
        full, full_dir = train_and_evaluate("mae_tiny_full.yaml", [*common, f"seed={seed}", f"name={prefix}_full_s{seed}"],
                                            f"{2 + seed}/{steps} the full-data baseline, same passes, seed {seed}")
        baseline.append(full_dir)
        if seed == 0:
            full_passes, per_pass = full["epoch"] + 1, full["samples_forwarded"] // (full["epoch"] + 1)
    short = equal_compute_passes(pruned, per_pass)
    if short == full_passes:  # pruning saved less than a pass: the seed-0 baseline is the equal-compute run
        print(f"\n== {steps}/{steps} the equal-compute run is the seed-0 baseline itself ({short} passes)")
        same_dir = baseline[0]
    else:
        _, same_dir = train_and_evaluate("mae_tiny_full.yaml", [*common, f"passes={short}", f"name={prefix}_full_short"],
                                         f"{steps}/{steps} full data for the pruned run's compute "
                                         f"({pruned['samples_forwarded']} samples, seed 0)")
    report = compare_runs(baseline, [pruned_dir], same_compute=[same_dir], weights="raw", plots=True)
    print("\n" + report["markdown"])
    name = os.path.basename(pruned_dir)
    print(f"report and plots: {report['out']}/\nthe same comparison: prunepipe compare {','.join(baseline)} "
          f"{pruned_dir} --same-compute {same_dir} --weights raw")
    print(f"\nVerdicts for {name}: at equal passes {report['equal_passes'][name]['verdict']}; "
          f"at equal compute {report['equal_compute'][name]['verdict']}.")
    return report
