"""Compute saved at equal quality: where a seed's Full frontier (Full trained for several schedule
lengths, each with its own schedule) reaches a pruned run's quality, and the seeds' savings summed
up with intervals. Pure numbers in, numbers and verdict words out; it reads and trains nothing.

The frontier (docs/evaluation.md, "Compute saved at equal quality"):
- one shape for all seeds, one level per seed: quality(length, seed) = shape(length) + level(seed),
  fitted by least squares over every Full run. A seed's initialisation and draws move all its runs
  together (the level), while a single run at one length also carries noise of its own, as large
  as a few passes of training; read one noisy point at a time, a seed's own frontier would move
  its saving by that much, so every run of every seed informs the shape and every run of a seed
  its level. A seed whose runs share no length with the others keeps its own points;
- where training longer got worse somewhere, the shape is made monotone by isotonic regression
  (least squares under "more compute is never worse"), not by the running best, which among noisy
  runs would pick the luckiest one and bias every saving down; the report says it happened;
- the iso-quality compute is where the seed's curve reaches the run's quality, linear between
  lengths; beyond the ends it is a bound, never extrapolated: a run better than every Full saves
  *at least* what the longest Full gives, a run no better than the cheapest *at most* what it gives;
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


@dataclass
class FrontierModel:
    """Full's quality as shape(length) + level(seed): `computes` ascending, `shape` there (monotone),
    `levels` per seed, and whether the fitted shape was monotone before isotonic regression."""

    computes: np.ndarray
    shape: np.ndarray
    levels: dict[int, float]
    monotone: bool
    own: dict[int, list[tuple[float, float]]]  # seeds left with their own points (no length shared)

    def curve(self, seed: int) -> list[tuple[float, float]]:
        """The seed's frontier as (compute, quality) points."""
        if seed in self.own:
            return self.own[seed]
        return [(float(x), float(y + self.levels[seed])) for x, y in zip(self.computes, self.shape)]


def _isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Non-increasing least-squares fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([float(value), float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:  # a rise: pool the two blocks
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([np.full(n, m) for m, _, n in blocks])


def _linked(frontiers: dict[int, list[tuple[float, float]]]) -> set[int]:
    """The largest set of seeds joined through lengths they share (their levels are comparable)."""
    seeds = sorted(frontiers)
    parent = {s: s for s in seeds}

    def root(s):
        while parent[s] != s:
            s = parent[s]
        return s

    by_length: dict[float, list[int]] = {}
    for seed, points in frontiers.items():
        for x, _ in points:
            by_length.setdefault(x, []).append(seed)
    for members in by_length.values():
        for other in members[1:]:
            parent[root(other)] = root(members[0])
    groups: dict[int, set[int]] = {}
    for s in seeds:
        groups.setdefault(root(s), set()).add(s)
    return max(groups.values(), key=len) if groups else set()


def fit_frontier(frontiers: dict[int, list[tuple[float, float]]], lower_is_better: bool) -> FrontierModel:
    """The shape-plus-level model of several seeds' Full runs (`frontiers`: seed -> (compute, quality)).
    Runs of one length share its compute exactly (same data and batch size), which is how lengths
    are matched across seeds."""
    linked = _linked(frontiers) if len(frontiers) > 1 else set(frontiers)
    own = {seed: sorted(points) for seed, points in frontiers.items() if seed not in linked}
    rows = [(seed, x, y) for seed in sorted(linked) for x, y in frontiers[seed]]
    if not rows:
        raise ValueError("a frontier needs at least one Full run")
    values = np.array([y for _, _, y in rows], dtype=float)
    if not np.all(np.isfinite(values)) or not all(math.isfinite(x) for _, x, _ in rows):
        raise ValueError(f"a frontier point is not finite: {frontiers}")
    computes = np.array(sorted({x for _, x, _ in rows}), dtype=float)
    seeds = sorted(linked)
    column = {x: i for i, x in enumerate(computes)}
    design = np.zeros((len(rows) + 1, len(computes) + len(seeds)))
    for r, (seed, x, _) in enumerate(rows):
        design[r, column[x]] = 1.0
        design[r, len(computes) + seeds.index(seed)] = 1.0
    design[-1, len(computes):] = 1.0  # levels sum to 0: the shape is the seeds' average
    solution = np.linalg.lstsq(design, np.append(values, 0.0), rcond=None)[0]
    shape, levels = solution[:len(computes)], solution[len(computes):]
    counts = np.bincount([column[x] for _, x, _ in rows], minlength=len(computes)).astype(float)
    signed = shape if lower_is_better else -shape  # lower = better from here on
    fitted = _isotonic(signed, counts)
    monotone = bool(np.allclose(fitted, signed, rtol=0, atol=1e-12 * max(1.0, float(np.abs(signed).max()))))
    shape = fitted if lower_is_better else -fitted
    return FrontierModel(computes, shape, {s: float(u) for s, u in zip(seeds, levels)}, monotone, own)


def savings_over_seeds(frontiers: dict[int, list[tuple[float, float]]], runs: dict[int, tuple[float, float]],
                       lower_is_better: bool) -> dict[int, IsoQuality]:
    """Per seed of `runs` (seed -> (compute, quality)) that has Full runs: its IsoQuality against its
    curve of the shape-plus-level model. `points` counts the seed's own Full runs."""
    model = fit_frontier(frontiers, lower_is_better)
    found = {}
    for seed, (compute, value) in sorted(runs.items()):
        if seed not in frontiers:
            continue
        answer = iso_quality(model.curve(seed), compute, value, lower_is_better)
        answer.points = len(frontiers[seed])
        if seed not in model.own:  # the model's shape, not the seed's own points, decided monotony
            answer.monotone = model.monotone
        found[seed] = answer
    return found


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


def jackknife_standard_error(frontiers: dict[int, list[tuple[float, float]]], runs: dict[int, tuple[float, float]],
                             lower_is_better: bool) -> float:
    """Standard error of the mean saving with every seed left out in turn, the frontier refitted
    without it: the shape is fitted over all seeds, so their savings share its error, which the
    spread of the savings alone does not show (the plain t interval then covers too rarely)."""
    seeds = [seed for seed in runs if seed in frontiers]
    if len(seeds) < 2:
        return float("nan")
    means = []
    for left_out in seeds:
        rest = {seed: points for seed, points in frontiers.items() if seed != left_out}
        answers = savings_over_seeds(rest, {seed: runs[seed] for seed in seeds if seed != left_out}, lower_is_better)
        means.append(np.mean([a.saving for a in answers.values()]))
    means = np.asarray(means)
    return float(math.sqrt((len(means) - 1) / len(means) * np.sum((means - means.mean()) ** 2)))


def saving_summary(frontiers: dict[int, list[tuple[float, float]]], runs: dict[int, tuple[float, float]],
                   lower_is_better: bool) -> dict | None:
    """The savings of one setting's seeds (`runs`: seed -> (compute, quality)) against the Full runs
    (`frontiers`: seed -> points), summed up with a jackknife t interval; None without a Full run of
    any of its seeds."""
    answers = savings_over_seeds(frontiers, runs, lower_is_better) if frontiers else {}
    if not answers:
        return None
    summary = summarise_savings(list(answers.values()), jackknife_standard_error(frontiers, runs, lower_is_better))
    summary["seeds"] = list(answers)
    return summary


def summarise_savings(per_seed: list[IsoQuality], standard_error: float | None = None) -> dict:
    """The seeds' savings as one answer: interval_summary of the per-seed savings (with
    `standard_error`, the t interval is mean +- t x it: the jackknife's, when the frontier was
    fitted over the seeds), which of them are bounds (`bound`: EXACT when none, else AT_LEAST /
    AT_MOST, or "mixed"), whether any frontier was non-monotone, and the verdict words."""
    from scipy import stats

    values = [s.saving for s in per_seed]
    summary = interval_summary(values)
    if standard_error is not None and math.isfinite(standard_error) and len(values) > 1:
        half = float(stats.t.ppf(0.5 + LEVEL / 2, len(values) - 1) * standard_error)
        effective_std = standard_error * math.sqrt(len(values))
        summary.update(low=summary["mean"] - half, high=summary["mean"] + half, standard_error=standard_error,
                       interval="jackknife t", seeds_needed=seeds_needed(summary["mean"], effective_std))
    else:
        summary["interval"] = "t"
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
