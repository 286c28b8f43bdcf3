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
- the frontier is what Full can reach at or below each compute: the running best of the fitted
  curve along compute. Where training longer makes Full worse (redundant data, a clean held-out
  set), Full trained less is the better buy, and a pruned run must beat the best Full at or below
  its compute; averaging the worsening curve flat would let a run look better than every Full. The
  running best is of the fitted shape, not of single runs, so it is not the luckiest run's;
- the iso-quality compute is where the seed's curve reaches the run's quality, linear between
  lengths; beyond the ends it is a bound, never extrapolated: a run better than every Full saves
  *at least* what the longest Full gives, a run no better than the cheapest *at most* what it gives;
- saving = 1 - compute(run) / iso-quality compute. A run on the frontier saves 0.

Across seeds: the mean and a 95% t interval over the seeds whose saving is measured (a bound is
reported as a bound, never averaged into an interval: bounds piled at one end make it narrow and
wrong), a percentile bootstrap beside it (no normality assumed, but it covers less than its level
at few seeds: tools/benchmarks/interval_coverage.py measures both), and the seeds a paired t test would
need to detect an effect of the measured size.
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
    monotone: bool  # False: Full got worse with compute somewhere; the best Full at or below each compute was read
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
    # the envelope is non-increasing: the first reach is the answer. A fitted curve leaves rounding of 1e-16
    # where a run equals a Full point; that is a reach, not a saving of 1e-16 interpolated past it
    slack = 1e-12 * max(1.0, abs(float(target)))
    reached = np.nonzero(signed <= target + slack)[0]
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


def quality_at(points: list[tuple[float, float]], compute: float, lower_is_better: bool) -> float | None:
    """Full at equal compute: the quality this seed's Full frontier `points` (compute, quality) reaches
    at `compute`, the best Full at or below it (the envelope iso_quality inverts), linear between its
    points, so that a run better than this value is a run with a positive saving at equal quality.
    Beyond the ends the nearest end's value, never a slope extended: above the longest Full that is
    the best Full at or below the compute; below the cheapest it is Full of a little more compute (an
    equal-compute run rounded to whole passes), a reference harder to beat. None with fewer than two
    lengths: one point is no frontier."""
    xs, ys, _ = envelope(points, lower_is_better)
    if len(xs) < 2:
        return None
    return float(np.interp(compute, xs, ys))


def equal_compute_references(
    frontiers: dict[int, list[tuple[float, float]]], runs: dict[int, float], lower_is_better: bool
) -> dict[int, float]:
    """Per seed of `runs` (seed -> compute): its Full at that compute, read off its curve of the
    shape-plus-level model (quality_at). Seeds without a Full run, or whose curve has one length, are
    left out."""
    if not frontiers:
        return {}
    model = fit_frontier(frontiers, lower_is_better)
    found = {}
    for seed, compute in sorted(runs.items()):
        if seed in frontiers:
            value = quality_at(model.curve(seed), compute, lower_is_better)
            if value is not None:
                found[seed] = value
    return found


@dataclass
class FrontierModel:
    """Full's quality as shape(length) + level(seed): `computes` ascending, the fitted `shape` there,
    `levels` per seed, and whether the shape never gets worse with compute (`monotone`)."""

    computes: np.ndarray
    shape: np.ndarray
    levels: dict[int, float]
    monotone: bool
    own: dict[int, list[tuple[float, float]]]  # seeds left with their own points (no length shared)
    lower_is_better: bool = True
    rise: dict | None = None  # paired_difference of each seed's longest Full against its Full at best_compute

    def curve(self, seed: int) -> list[tuple[float, float]]:
        """The seed's frontier as (compute, quality) points."""
        if seed in self.own:
            return self.own[seed]
        return [(float(x), float(y + self.levels[seed])) for x, y in zip(self.computes, self.shape)]

    @property
    def best_compute(self) -> float:
        """The compute at which the fitted shape is best (the cheapest of equals)."""
        signed = self.shape if self.lower_is_better else -self.shape
        return float(self.computes[int(np.argmin(signed))])

    def where_best(self, unit: float = 1.0) -> dict:
        """summarise_savings' `best_full` (the compute, over `unit`, at which the fitted Full is best,
        when training longer hurts) and `best_is_cheapest` (that compute is the cheapest measured)."""
        if not self.hurts:
            return {"best_full": None, "best_is_cheapest": False}
        return {"best_full": self.best_compute / unit, "best_is_cheapest": self.best_compute == float(self.computes[0])}

    @property
    def hurts(self) -> bool:
        """Whether training longer hurts over the measured range: the fitted Full is best short of the
        longest compute. A dip between two lengths that the longest Full recovers from is not that, nor
        a tie with the longest (a count-valued metric such as probe accuracy ties often, and the fit
        leaves rounding of 1e-16 between equal lengths). The seeds must show it: their paired differences
        (longest Full minus Full at best_compute, same seed) have a t interval on the worse side of 0, so a
        worse longest Full within seed noise is read as the usual frontier, never as a finding."""
        signed = self.shape if self.lower_is_better else -self.shape
        worse = bool(signed[-1] > signed.min() + 1e-12 * max(1.0, float(np.abs(signed).max())))
        return worse and self.rise is not None and self.rise["reading"] == "worse"


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
    design[-1, len(computes) :] = 1.0  # levels sum to 0: the shape is the seeds' average
    solution = np.linalg.lstsq(design, np.append(values, 0.0), rcond=None)[0]
    shape, levels = solution[: len(computes)], solution[len(computes) :]
    signed = shape if lower_is_better else -shape  # lower = better from here on
    tolerance = 1e-12 * max(1.0, float(np.abs(signed).max()))
    monotone = bool(np.all(np.diff(signed) <= tolerance))
    best, longest = computes[int(np.argmin(signed))], computes[-1]
    at = {seed: y for seed, x, y in rows if x == longest}
    rise = (
        paired_difference(at, {seed: y for seed, x, y in rows if x == best}, lower_is_better)
        if best != longest
        else None
    )
    return FrontierModel(
        computes, shape, {s: float(u) for s, u in zip(seeds, levels)}, monotone, own, lower_is_better, rise
    )


def savings_over_seeds(
    frontiers: dict[int, list[tuple[float, float]]], runs: dict[int, tuple[float, float]], lower_is_better: bool
) -> dict[int, IsoQuality]:
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


def bootstrap_interval(
    values: list[float], level: float = LEVEL, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
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
        return float(
            np.nan_to_num(stats.nct.sf(critical, n - 1, shift)) + np.nan_to_num(stats.nct.cdf(-critical, n - 1, shift))
        )

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
    if not values:
        nan = float("nan")
        return {
            "n": 0,
            "mean": nan,
            "std": nan,
            "low": nan,
            "high": nan,
            "bootstrap_low": nan,
            "bootstrap_high": nan,
            "seeds_needed": None,
        }
    mean, low, high = t_interval(values, level)
    boot = bootstrap_interval(values, level)
    std = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
    return {
        "n": len(values),
        "mean": mean,
        "std": std,
        "low": low,
        "high": high,
        "bootstrap_low": boot[0],
        "bootstrap_high": boot[1],
        "seeds_needed": seeds_needed(mean, std),
    }


def jackknife_standard_error(
    frontiers: dict[int, list[tuple[float, float]]], runs: dict[int, tuple[float, float]], lower_is_better: bool
) -> float:
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


def saving_summary(
    frontiers: dict[int, list[tuple[float, float]]],
    runs: dict[int, tuple[float, float]],
    lower_is_better: bool,
    unit: float = 1.0,
) -> dict | None:
    """The savings of one setting's seeds (`runs`: seed -> (compute, quality)) against the Full runs
    (`frontiers`: seed -> points), summed up with a jackknife t interval over the seeds whose saving
    is measured; None without a Full run of any of its seeds. `unit` is the compute that reads as
    100% (Full's full schedule) in the words."""
    answers = savings_over_seeds(frontiers, runs, lower_is_better) if frontiers else {}
    if not answers:
        return None
    model = fit_frontier(frontiers, lower_is_better)
    measured = {seed: runs[seed] for seed, answer in answers.items() if answer.kind == EXACT}
    error = jackknife_standard_error(frontiers, measured, lower_is_better) if len(measured) > 1 else None
    summary = summarise_savings(list(answers.values()), error, **model.where_best(unit))
    summary["seeds"] = list(answers)
    return summary


def summarise_savings(
    per_seed: list[IsoQuality],
    standard_error: float | None = None,
    best_full: float | None = None,
    best_is_cheapest: bool = False,
) -> dict:
    """The seeds' savings as one answer: interval_summary of the measured (EXACT) savings only (with
    `standard_error`, the t interval is mean +- t x it: the jackknife's, when the frontier was
    fitted over the seeds); the bounds beside it (`bounded`, `bound`: EXACT when none, else AT_LEAST
    / AT_MOST, or "mixed", and their values); whether Full got worse with compute (`best_full`: the
    compute, as a fraction of Full's, at which the fitted Full is best, when that is short of the longest;
    `best_is_cheapest`: it is the cheapest measured) and the words."""
    from scipy import stats

    values = [s.saving for s in per_seed if s.kind == EXACT]
    bounds = [s for s in per_seed if s.kind != EXACT]
    summary = interval_summary(values)
    if standard_error is not None and math.isfinite(standard_error) and len(values) > 1:
        half = float(stats.t.ppf(0.5 + LEVEL / 2, len(values) - 1) * standard_error)
        effective_std = standard_error * math.sqrt(len(values))
        summary.update(
            low=summary["mean"] - half,
            high=summary["mean"] + half,
            standard_error=standard_error,
            interval="jackknife t",
            seeds_needed=seeds_needed(summary["mean"], effective_std),
        )
    else:
        summary["interval"] = "t"
    kinds = {s.kind for s in bounds}
    monotone = all(s.monotone for s in per_seed)
    summary.update(
        per_seed=[s.as_dict() for s in per_seed],
        seeds_total=len(per_seed),
        bounded=len(bounds),
        bound=EXACT if not kinds else kinds.pop() if len(kinds) == 1 else "mixed",
        bound_values=[s.saving for s in bounds],
        monotone=monotone,
        best_full=best_full,
        best_is_cheapest=bool(best_full is not None and best_is_cheapest),
    )
    summary["hurts"] = longer_hurts_text(summary)
    summary["verdict"], summary["note"] = saving_verdict(summary), bound_note(summary)
    return summary


def percent(value: float) -> str:
    return (
        "n/a" if not math.isfinite(value) else f"{100 * value:.0f}%" if abs(value) >= 0.095 else f"{100 * value:.1f}%"
    )


def longer_hurts_text(summary: dict) -> str:
    """What a reader must see first when Full got worse with compute ('' when it did not)."""
    if summary.get("best_full") is None:
        return ""
    return f"training longer hurts here: Full at {percent(summary['best_full'])} is best measured"


def interval_text(summary: dict) -> str:
    """'12% [3%, 21%]' (t interval over the measured seeds), '12% (1 measured seed, no interval)', or
    for bounds alone 'at most -54% (3 of 3 seeds are bounds, no interval)'; bounds beside measured
    seeds are added ('; 1 seed >= 40%')."""
    n, bounded = summary["n"], summary.get("bounded", 0)
    marks = {AT_LEAST: ">=", AT_MOST: "<="}
    beside = (
        "; "
        + ", ".join(
            f"{marks[s['kind']]}{percent(s['saving'])}" for s in summary.get("per_seed", []) if s["kind"] != EXACT
        )
        + " (bounds)"
        if bounded
        else ""
    )
    if n >= 2:
        return f"{percent(summary['mean'])} [{percent(summary['low'])}, {percent(summary['high'])}]" + beside
    if n == 1:
        return f"{percent(summary['mean'])} (1 measured seed, no interval)" + beside
    total = summary.get("seeds_total", bounded)
    bound, values = summary["bound"], summary.get("bound_values", [])
    if bound == AT_LEAST:
        return f"at least {percent(min(values))} ({bounded} of {total} seeds are bounds, no interval)"
    if bound == AT_MOST:
        return f"at most {percent(max(values))} ({bounded} of {total} seeds are bounds, no interval)"
    return f"bounds on both sides ({bounded} of {total} seeds), no interval"


def saving_verdict(summary: dict) -> str:
    """Words that follow the numbers: what the measured seeds' interval says about the saving at
    equal quality, or, with bounds alone, which way the frontier must be extended. Short enough
    for a last line; `bound_note` says what the bounds mean."""
    text, bound, n = interval_text(summary), summary["bound"], summary["n"]
    if n == 0:
        if bound == AT_MOST:
            most = max(summary["bound_values"])
            if most < 0:
                return (
                    f"not a saving: Full trained for less compute is as good ({text}); extend the frontier "
                    f"down to measure by how much"
                )
            return f"no saving shown: {text}; extend the frontier down (Full trained for less compute)"
        if bound == AT_LEAST:
            if summary.get("best_is_cheapest"):
                return (
                    f"not resolved: better than every Full measured, the cheapest best ({text}); extend the "
                    f"frontier down (Full trained for less compute): training less may reach it"
                )
            if summary.get("best_full") is not None:
                return f"better than every Full measured: {text}; a longer Full gets worse here, not better"
            return f"saves {text}; extend the frontier up (Full trained longer) to measure it"
        return f"not resolved: {text}; extend the frontier down and up"
    if n < 2:  # one seed: no interval, so a saving that is not positive or sits beside mixed bounds is not shown
        if summary["mean"] > 0 and bound in (EXACT, AT_LEAST):
            return f"saves {text} at equal quality"
        return f"no saving shown: {text}"
    # the interval is over the measured seeds only: bounds on its far side are seeds it leaves out, so
    # a verdict that they contradict is not resolved (the measured seeds alone would be a selection)
    against = {s["kind"] for s in summary.get("per_seed", []) if s["kind"] != EXACT}
    if summary["low"] > 0:
        if AT_MOST in against:
            return (
                f"not resolved: the measured seeds save {text}, but some seeds are no better than the cheapest "
                f"Full; extend the frontier down"
            )
        return f"saves {text} at equal quality"
    if summary["high"] < 0:
        if AT_LEAST in against:
            return (
                f"not resolved: the measured seeds cost {text}, but some seeds beat every Full; extend the frontier up"
            )
        return f"costs more than training less: {text} at equal quality"
    return f"no saving detected (CI includes 0): {text}"


def bound_note(summary: dict) -> str:
    """What the seeds beyond the frontier's ends mean for the verdict ('' when there are none)."""
    if not summary["bounded"]:
        return ""
    head = (
        f"{summary['bounded']} of {summary['seeds_total']} seeds beyond the frontier's ends, kept out of the interval"
    )
    if summary["bound"] == AT_LEAST:
        if summary.get("best_is_cheapest"):
            return (
                f"{head}: better than every Full of their seed, and the cheapest Full measured is the best, so "
                f"a shorter Full may reach them for less compute; extend the frontier down (Full trained for "
                f"less compute) to measure them"
            )
        if summary.get("best_full") is not None:
            return (
                f"{head}: better than every Full of their seed, and Full gets worse with compute here, so a "
                f"longer Full would not reach them; their savings are lower bounds over the compute measured"
            )
        return (
            f"{head}: better than the longest Full of their seed, so their savings are lower bounds; extend "
            f"the frontier up (Full trained longer) to measure them"
        )
    if summary["bound"] == AT_MOST:
        return (
            f"{head}: no better than the cheapest Full of their seed, so their savings are upper bounds; extend "
            f"the frontier down (Full trained for less compute) to measure them: training less may reach the "
            f"same quality"
        )
    return f"{head}, on both sides: a frontier reaching lower and higher compute would place them"


def paired_difference(values: dict[int, float], references: dict[int, float], lower_is_better: bool) -> dict:
    """Per-seed differences value - reference over the seeds both hold (same seed: same init and
    draws), with the t interval of their mean; `worse` > 0 where the run is worse than its reference."""
    seeds = sorted(set(values) & set(references))
    diffs = [values[s] - references[s] for s in seeds]
    summary = interval_summary(diffs)
    sign = 1.0 if lower_is_better else -1.0
    summary.update(
        seeds=seeds,
        differences=diffs,
        reading=(
            "n/a"
            if len(diffs) < 2
            else "better"
            if sign * summary["high"] < 0 and sign * summary["low"] < 0
            else "worse"
            if sign * summary["low"] > 0 and sign * summary["high"] > 0
            else "no difference detected"
        ),
    )
    return summary
