"""Compute saved at equal quality: where a seed's Full frontier (Full trained for several schedule
lengths, each with its own schedule) reaches a pruned run's quality, and the seeds' savings summed
up with intervals. Pure numbers in, numbers and verdict words out; it reads and trains nothing.

Per seed (docs/evaluation.md, "Compute saved at equal quality"):
- the frontier is that seed's Full runs as (compute, quality) points; where training longer got
  worse somewhere (a non-monotone frontier), each point takes the best quality of any Full at or
  below its compute, so the saving is against the best Full a user could have stopped at;
- the iso-quality compute is where that envelope reaches the run's quality, linear between points
  (monotone, because the envelope is); beyond the frontier's ends it is a bound, never extrapolated:
  a run better than every Full saves *at least* what the longest Full gives, a run no better than
  the cheapest Full saves *at most* what the cheapest gives;
- saving = 1 - compute(run) / iso-quality compute. A run on the frontier saves 0.

Across seeds: the mean and a 95% t interval (the headline; the t interval holds its level for
normal savings at any number of seeds), a percentile bootstrap beside it (no normality assumed,
but it covers less than its level at few seeds: tools/bench/interval_coverage.py measures both),
and the seeds a paired t test would need to detect an effect of the measured size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

EXACT, AT_LEAST, AT_MOST = "interpolated", "at least", "at most"
LEVEL = 0.95
POWER = 0.8
MAX_SEEDS = 10_000  # seeds_needed answers None beyond this: no practical number of seeds shows it


@dataclass
class IsoQuality:
    """One seed's answer: the compute at which its Full frontier reaches the run's quality."""

    compute: float  # the run's compute (any unit; the frontier's)
    iso_compute: float  # where the frontier reaches the run's quality (the bound when `kind` is not EXACT)
    saving: float  # 1 - compute / iso_compute
    kind: str  # EXACT, AT_LEAST (better than every Full) or AT_MOST (no better than the cheapest Full)
    monotone: bool  # False: the frontier got worse somewhere, the envelope of the best Full was used
    points: int  # frontier points

    def as_dict(self) -> dict:
        return asdict(self)


def envelope(points: list[tuple[float, float]], lower_is_better: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """(computes ascending, best quality of any point at or below each, whether the points were
    already monotone). Several points at one compute (e.g. two runs of the same passes) count as
    their best."""
    if not points:
        raise ValueError("a frontier needs at least one Full run")
    xs = np.asarray([p[0] for p in points], dtype=float)
    ys = np.asarray([p[1] for p in points], dtype=float)
    if not (np.all(np.isfinite(xs)) and np.all(np.isfinite(ys))):
        raise ValueError(f"a frontier point is not finite: {points}")
    order = np.lexsort((ys if lower_is_better else -ys, xs))
    xs, ys = xs[order], ys[order]
    keep = np.r_[True, xs[1:] != xs[:-1]]  # the best at each compute (sorted first by quality)
    xs, ys = xs[keep], ys[keep]
    signed = ys if lower_is_better else -ys  # lower = better from here on
    best = np.minimum.accumulate(signed)
    monotone = bool(np.all(best == signed))
    return xs, (best if lower_is_better else -best), monotone


def iso_quality(points: list[tuple[float, float]], compute: float, value: float, lower_is_better: bool) -> IsoQuality:
    """Where this seed's Full frontier `points` (compute, quality) reaches `value`, and the saving of
    a run of `compute` that reached it."""
    xs, ys, monotone = envelope(points, lower_is_better)
    signed, target = (ys, value) if lower_is_better else (-ys, -value)
    reached = np.nonzero(signed <= target)[0]  # the envelope is non-increasing: the first reach is the answer
    if len(reached) == 0:  # better than every Full: it would take more than the longest one
        iso, kind = xs[-1], AT_LEAST
    elif reached[0] == 0:  # no better than the cheapest Full: somewhere at or below its compute
        iso, kind = xs[0], AT_MOST
    else:
        i = reached[0]
        # signed[i-1] > target >= signed[i]: linear between the two envelope points
        iso = xs[i - 1] + (signed[i - 1] - target) / (signed[i - 1] - signed[i]) * (xs[i] - xs[i - 1])
        kind = EXACT
    return IsoQuality(float(compute), float(iso), float(1.0 - compute / iso), kind, monotone, len(xs))


def t_interval(values: list[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(mean, low, high): the t interval of the mean over seeds; nan bounds with fewer than 2."""
    from scipy import stats

    array = np.asarray(values, dtype=float)
    mean = float(array.mean()) if len(array) else float("nan")
    if len(array) < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + level / 2, len(array) - 1) * array.std(ddof=1) / math.sqrt(len(array)))
    return mean, mean - half, mean + half


def bootstrap_interval(values: list[float], level: float = LEVEL, resamples: int = 10_000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap of the mean over seeds (seeds resampled with replacement)."""
    array = np.asarray(values, dtype=float)
    if len(array) < 2:
        return float("nan"), float("nan")
    draws = np.random.default_rng(seed).integers(0, len(array), size=(resamples, len(array)))
    means = array[draws].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def seeds_needed(mean: float, std: float, power: float = POWER, level: float = LEVEL) -> int | None:
    """Seeds a two-sided one-sample (paired) t test at 1 - `level` would need to find a mean of
    `mean` with seed std `std` with probability `power`; None when no number of seeds up to
    MAX_SEEDS would (an effect of 0, or not measured)."""
    from scipy import stats

    if not (math.isfinite(mean) and math.isfinite(std)) or mean == 0:
        return None
    if std == 0:
        return 2
    effect = abs(mean) / std

    def power_at(n: int) -> float:
        critical = stats.t.ppf(0.5 + level / 2, n - 1)
        shift = effect * math.sqrt(n)
        # the far tail can come back nan from scipy where it is ~0
        return float(np.nan_to_num(stats.nct.sf(critical, n - 1, shift))
                     + np.nan_to_num(stats.nct.cdf(-critical, n - 1, shift)))

    if power_at(MAX_SEEDS) < power:
        return None
    low, high = 2, MAX_SEEDS  # power grows with n: the smallest n reaching it, by bisection
    while low < high:
        middle = (low + high) // 2
        if power_at(middle) >= power:
            high = middle
        else:
            low = middle + 1
    return low


def interval_summary(values: list[float], level: float = LEVEL) -> dict:
    """Mean, sample std, the t and the bootstrap intervals and the seeds needed, of per-seed numbers."""
    mean, low, high = t_interval(values, level)
    boot = bootstrap_interval(values, level)
    std = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
    return {"n": len(values), "mean": mean, "std": std, "low": low, "high": high,
            "bootstrap_low": boot[0], "bootstrap_high": boot[1], "seeds_needed": seeds_needed(mean, std)}


def summarise_savings(per_seed: list[IsoQuality]) -> dict:
    """The seeds' savings as one answer: interval_summary of the per-seed savings, which of them are
    bounds (`bound`: EXACT when none, else AT_LEAST / AT_MOST, or "mixed"), whether any frontier was
    non-monotone, and the verdict words."""
    values = [s.saving for s in per_seed]
    summary = interval_summary(values)
    kinds = {s.kind for s in per_seed} - {EXACT}
    summary.update(per_seed=[s.as_dict() for s in per_seed], bounded=sum(s.kind != EXACT for s in per_seed),
                   bound=EXACT if not kinds else kinds.pop() if len(kinds) == 1 else "mixed",
                   monotone=all(s.monotone for s in per_seed))
    summary["verdict"], summary["note"] = saving_verdict(summary), bound_note(summary)
    return summary


def percent(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{100 * value:.0f}%" if abs(value) >= 0.095 else f"{100 * value:.1f}%"


def interval_text(summary: dict) -> str:
    """'12% [3%, 21%]' (t interval), or '12% (1 seed)'."""
    if summary["n"] < 2:
        return f"{percent(summary['mean'])} (1 seed, no interval)"
    return f"{percent(summary['mean'])} [{percent(summary['low'])}, {percent(summary['high'])}]"


def saving_verdict(summary: dict) -> str:
    """Words that follow the numbers: what the interval says about the saving at equal quality.
    Short enough for a last line; `bound_note` says what the bounds mean."""
    text, bound = interval_text(summary), summary["bound"]
    if bound == "mixed":
        return "not resolved: some seeds beat every Full of their seed and some no Full"
    if bound == AT_MOST and not summary["high"] < 0:  # upper bounds: only "costs more" can be shown
        return f"no saving shown: at most {percent(summary['mean'])}"
    least = "at least " if bound == AT_LEAST else "at most " if bound == AT_MOST else ""
    if summary["n"] < 2:
        return f"saves {least}{text} at equal quality"
    if summary["low"] > 0:
        return f"saves {least}{text} at equal quality"
    if summary["high"] < 0:
        if bound == AT_LEAST:
            return f"not resolved: lower bounds {text}"
        return f"costs more than training less: {least}{text} at equal quality"
    return f"no saving detected (CI includes 0): {least}{text}"


def bound_note(summary: dict) -> str:
    """What the seeds beyond the frontier's ends mean for the verdict ('' when there are none)."""
    if not summary["bounded"]:
        return ""
    head = f"{summary['bounded']} of {summary['n']} seeds beyond the frontier's ends"
    if summary["bound"] == AT_LEAST:
        return (f"{head}: better than the longest Full of their seed, so their savings are lower bounds and the "
                f"interval is narrower than the truth's; Full trained longer would measure them")
    if summary["bound"] == AT_MOST:
        return (f"{head}: no better than the cheapest Full of their seed, so their savings are upper bounds; "
                f"Full trained for less compute would measure them")
    return f"{head}, on both sides: a frontier reaching lower and higher compute would place them"


def paired_difference(values: dict[int, float], references: dict[int, float], lower_is_better: bool) -> dict:
    """Per-seed differences value - reference over the seeds both hold (same seed: same init and
    draws), with the t interval of their mean; `worse` > 0 where the run is worse than its reference."""
    seeds = sorted(set(values) & set(references))
    diffs = [values[s] - references[s] for s in seeds]
    summary = interval_summary(diffs)
    sign = 1.0 if lower_is_better else -1.0
    summary.update(seeds=seeds, differences=diffs,
                   reading=("n/a" if len(diffs) < 2 else
                            "better" if sign * summary["high"] < 0 and sign * summary["low"] < 0 else
                            "worse" if sign * summary["low"] > 0 and sign * summary["high"] > 0 else
                            "no difference detected"))
    return summary
