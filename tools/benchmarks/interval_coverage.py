"""Benchmark: do the saving intervals of `pipelines/report/frontier.py` hold their level? Simulated
experiments with a known answer, each as the lossless benchmark runs them: per seed a Full frontier
(Full at 50..100% compute, quality falling linearly with compute, a seed effect shared by every run
of that seed, and evaluation noise per run) and a pruned run at 70% compute whose true quality is
Full's at `--true-compute`. The estimand is the mean per-seed saving (the frontier is fitted over
an experiment's seeds, so it is taken over 4,000 simulated experiments of the same size); the
printout is how often the t and the bootstrap intervals cover it.

    python -m prunepipe.tools.benchmarks.interval_coverage [--experiments 2000] [--seeds 3 5 10]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from prunepipe.pipelines.report.frontier import bootstrap_interval, saving_summary, savings_over_seeds

FRONTIER = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # Full's compute, a fraction of the full schedule
ARM_COMPUTE = 0.7


def simulated_runs(
    rng: np.random.Generator,
    seeds: int,
    true_compute: float,
    seed_std: float = 0.5,
    eval_std: float = 0.02,
    arm_std: float = 0.02,
    slope: float = 1.0,
) -> tuple[dict, dict]:
    """(frontiers, runs) of one simulated experiment (quality: lower is better)."""
    frontiers, runs = {}, {}
    for seed in range(seeds):
        offset = rng.normal(0.0, seed_std)  # the seed's initialisation and draws, shared by all its runs
        frontiers[seed] = [(c, offset - slope * c + rng.normal(0.0, eval_std)) for c in FRONTIER]
        runs[seed] = (ARM_COMPUTE, offset - slope * true_compute + rng.normal(0.0, arm_std))
    return frontiers, runs


def simulated_savings(rng: np.random.Generator, seeds: int, true_compute: float) -> list[float]:
    return [a.saving for a in savings_over_seeds(*simulated_runs(rng, seeds, true_compute), True).values()]


def coverage(
    seeds: int, experiments: int, true_compute: float = 0.85, rng_seed: int = 0, bootstrap: bool = True
) -> dict:
    """How often each interval covers the mean per-seed saving, over `experiments` experiments."""
    rng = np.random.default_rng(rng_seed)
    truth_rng = np.random.default_rng(rng_seed + 1)  # the estimand: the mean saving of experiments of this size
    truth = float(np.mean([np.mean(simulated_savings(truth_rng, seeds, true_compute)) for _ in range(4_000)]))
    hits_t = hits_boot = 0
    for _ in range(experiments):
        frontiers, runs = simulated_runs(rng, seeds, true_compute)
        summary = saving_summary(frontiers, runs, lower_is_better=True)  # what the reports print
        hits_t += summary["low"] <= truth <= summary["high"]
        values = [s["saving"] for s in summary["per_seed"]]
        if bootstrap:
            low, high = bootstrap_interval(values, resamples=2000, seed=int(rng.integers(1 << 31)))
            hits_boot += low <= truth <= high
    return {
        "seeds": seeds,
        "experiments": experiments,
        "truth": truth,
        "noise_free": 1.0 - ARM_COMPUTE / true_compute,
        "t": hits_t / experiments,
        "bootstrap": hits_boot / experiments if bootstrap else float("nan"),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experiments", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[3, 5, 10])
    parser.add_argument("--true-compute", type=float, default=0.85)


def run_from_args(args) -> int:
    print(f"{'seeds':>5} {'true saving':>11} {'jackknife t 95% covers':>22} {'bootstrap 95% covers':>20}")
    for seeds in args.seeds:
        found = coverage(seeds, args.experiments, args.true_compute)
        print(f"{seeds:>5} {found['truth']:>11.2%} {found['t']:>22.1%} {found['bootstrap']:>20.1%}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prunepipe.tools.benchmarks.interval_coverage", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
