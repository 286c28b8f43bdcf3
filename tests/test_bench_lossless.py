"""The lossless benchmark harness: it runs end to end on a micro configuration and its
verdicts say what docs/design.md's "What lossless means" says, both ways. No timing thresholds."""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import pytest

from prunepipe.pipelines.report.lossless import LOSSLESS_K
from prunepipe.pruning import build_pruner
from prunepipe.tools.benchmarks.lossless.report import write_markdown
from prunepipe.tools.benchmarks.lossless.run import TaskPlan, TimedPruner, bench, equal_compute_spec
from prunepipe.tools.benchmarks.lossless.verdicts import delta_in_std, summarise


def lossless(value, full_mean, full_std, lower):
    """compare's equal-passes verdict at the benchmark's tolerance (LOSSLESS_K Full seed stds)."""
    from prunepipe.pipelines.report.compare import judge

    return judge("masked_mse" if lower else "probe_accuracy", full_mean, value, LOSSLESS_K * full_std)[1] == "lossless"


def beats_equal_compute(value, reference, full_std, lower):
    """compare's equal-compute verdict at the benchmark's tolerance."""
    from prunepipe.pipelines.report.compare import judge_equal_compute

    metric = "masked_mse" if lower else "probe_accuracy"
    return judge_equal_compute(metric, reference, value, LOSSLESS_K * full_std)[1] == "beats equal compute"


def test_verdicts_lower_is_better_both_ways():
    # Full: mean 1.00, seed std 0.10; masked MSE, lower is better; lossless within 2 std, compare's rule
    assert LOSSLESS_K == 2.0
    assert lossless(1.19, 1.00, 0.10, lower=True)
    assert lossless(0.80, 1.00, 0.10, lower=True)  # better than Full is lossless too
    assert not lossless(1.21, 1.00, 0.10, lower=True)
    assert beats_equal_compute(0.78, 1.00, 0.10, lower=True)
    assert not beats_equal_compute(0.82, 1.00, 0.10, lower=True)
    assert not beats_equal_compute(1.20, 1.00, 0.10, lower=True)


def test_verdicts_higher_is_better_both_ways():
    # probe accuracy: higher is better; Full 0.90 +- 0.01
    assert lossless(0.885, 0.90, 0.01, lower=False)
    assert not lossless(0.875, 0.90, 0.01, lower=False)
    assert beats_equal_compute(0.925, 0.90, 0.01, lower=False)
    assert not beats_equal_compute(0.915, 0.90, 0.01, lower=False)
    assert delta_in_std(0.88, 0.90, 0.01, lower=False) == pytest.approx(2.0)
    assert math.isnan(delta_in_std(0.88, 0.90, 0.0, lower=False))  # no noise measured: no verdict


def test_compare_and_the_bench_share_one_lossless_rule_and_one_direction_table():
    from prunepipe.pipelines.evaluation.records import PRIMARY_METRICS, lower_is_better
    from prunepipe.pipelines.report.compare import DEFAULT_K, judge

    assert DEFAULT_K == LOSSLESS_K
    for metric, higher in PRIMARY_METRICS.items():
        assert lower_is_better(metric) is (not higher) and lower_is_better(f"{metric}@x") is (not higher)
        worse = 1.0 + (-1 if higher else 1) * 0.19  # 1.9 std worse at std 0.1
        assert lossless(worse, 1.0, 0.1, lower_is_better(metric))
        assert judge(metric, 1.0, worse, LOSSLESS_K * 0.1)[1] == "lossless"
    with pytest.raises(ValueError, match="accepted"):
        lower_is_better("accuracy")


def _result(label, role, metric, samples, seed=0, passes=10, compute_of=""):
    key = f"full_p{passes}_s{seed}" if role != "pruned" else f"{label}_s{seed}"  # equal-compute runs: one per seed
    return {
        "task": "mae",
        "schedule": "long",
        "label": label,
        "role": role,
        "seed": seed,
        "passes": passes,
        "key": key,
        "pruner": {"name": "full" if role != "pruned" else "infobatch"},
        "compute_of": compute_of,
        "samples_forwarded": samples,
        "optimizer_steps": samples // 10,
        "wall_seconds": samples / 100,
        "metrics": {"masked_mse": metric},
        "pruner_seconds": {"update": 0.01},
        "curve": [],
    }


def test_summarise_gives_both_verdicts_from_constructed_runs():
    plan = TaskPlan("mae", "configs/bench_mae.yaml", "masked_mse", 100, 10, 0, {})
    results = [
        _result("Full s0", "full", 1.00, 1000, seed=0),
        _result("Full s1", "full", 1.10, 1000, seed=1),
        _result("Full s2", "full", 0.90, 1000, seed=2),  # mean 1.00, std 0.10
        _result("Good", "pruned", 1.05, 700),
        _result("Full @ Good", "equal_compute", 1.30, 700, passes=7, compute_of="Good"),
        _result("Bad", "pruned", 1.25, 700),
        _result("Full @ Bad", "equal_compute", 1.30, 700, passes=7, compute_of="Bad"),
        _result("Tried", "ablation", 0.92, 850),  # no run of its own: read off seed 0's fitted frontier
    ]
    rows = {r["label"]: r for r in summarise(results, [plan])}
    assert rows["Good"]["lossless"] and rows["Good"]["beats_equal_compute"]
    assert not rows["Bad"]["lossless"] and not rows["Bad"]["beats_equal_compute"]
    assert rows["Good"]["deltas"]["masked_mse"] == pytest.approx(0.5)
    assert rows["Good"]["skipped"] == pytest.approx(0.3) and rows["Good"]["saving"] == pytest.approx(0.3)
    assert rows["Good"]["realised"] == pytest.approx(1.0)
    tried = rows["Tried"]
    # every run's Full at equal compute is its seed's fitted frontier (here exact: Full at 700 of seed 0,
    # and the three seeds at 1000 with levels 0, +0.1, -0.1), 1.30 at 700 and 1.15 at 850
    assert {r["equal_compute_how"] for r in rows.values() if "lossless" in r} == {"frontier"}
    assert rows["Good"]["equal_compute_value"] == pytest.approx(1.30)
    assert tried["equal_compute_value"] == pytest.approx(np.interp(850, [700, 1000], [1.30, 1.00]))
    assert tried["lossless"] and tried["beats_equal_compute"]


def test_equal_compute_run_matches_samples_forwarded():
    spec = equal_compute_spec(
        {"task": "mae", "schedule": "long", "label": "InfoBatch", "samples_forwarded": 7040}, full_per_pass=480
    )
    assert spec.passes == 15 and spec.pruner == {"name": "full"} and spec.compute_of == "InfoBatch"
    from prunepipe.pipelines.report.frontier import quality_at

    assert quality_at([(1.0, 2.0)], 1.0, lower_is_better=True) is None  # one point is no frontier


def test_timed_pruner_changes_no_decision():
    plain, timed = (build_pruner("infobatch", 50, 4, seed=3) for _ in range(2))
    timed = TimedPruner(timed)
    losses = np.random.default_rng(0).random(50).astype(np.float32)
    for pruner in (plain, timed):
        pruner.update(np.arange(50), losses)
        pruner.plan(1)
    ids = np.arange(50)
    assert np.array_equal(plain.weights(ids), timed.weights(ids))
    assert set(timed.seconds) == {"update", "plan", "weights"}
    assert timed.state_dict()["tables"].keys() == plain.state_dict()["tables"].keys()


def test_write_markdown_keeps_text_outside_the_generated_block(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\nhand-written notes\n")
    write_markdown(str(path), "quick", "table one\n")
    write_markdown(str(path), "quick", "table two\n")
    text = path.read_text()
    assert "hand-written notes" in text and "table two" in text and "table one" not in text


def test_bench_micro_runs_and_reports_both_verdicts(tmp_path):
    report = bench("micro", ("mae",), out=str(tmp_path / "docs"), work=str(tmp_path / "work"), workers=2)
    judged = [r for r in report["rows"] if r["role"] == "pruned"]
    assert {r["label"] for r in judged} == {"Random", "InfoBatch", "TED"}
    for row in judged:
        assert isinstance(row["lossless"], bool) and row["beats_equal_compute"] in (True, False)
        assert row["equal_compute_how"] == "frontier"
    by_label = {r["label"]: r for r in report["results"]}
    for label in ("Random", "InfoBatch", "TED"):  # the equal-compute Full forwards what the pruned run did, +- a pass
        assert abs(by_label[f"Full @ {label}"]["samples_forwarded"] - by_label[label]["samples_forwarded"]) <= 96
    fulls = [r for r in report["rows"] if r["role"] == "full"]
    assert len(fulls) == 3 and all(r["optimizer_steps"] > 0 for r in fulls)
    text = (tmp_path / "docs" / "benchmarks" / "lossless_micro.md").read_text()
    assert "lossless (equal passes)" in text and "beats equal compute" in text and "<!-- bench:micro:end -->" in text
    assert "| target | status | measured |" in text and "one run at a time" in text
    assert not (tmp_path / "docs" / "BENCHMARKS.md").exists()  # the hand-written summary is not the bench's
    timing = {r["label"]: r for r in report["timing_rows"]}
    assert set(timing) == {"Full", "Random", "InfoBatch", "TED"} and timing["Full"]["skipped"] == 0.0
    assert os.path.exists(tmp_path / "docs" / "benchmarks" / "lossless_micro_mae_curves.png")


def test_cli_has_bench_lossless():
    from prunepipe.launch.cli import build_parser

    argv = ["bench", "lossless", "--task", "mae", "--quick", "--out", "x"]
    args = build_parser(argv).parse_args(argv)
    assert (args.task, args.quick, args.out, args.workers, args.from_json) == ("mae", True, "x", 2, None)
    argv = ["bench", "lossless", "--from-json", "a.json", "b.json"]
    args = build_parser(argv).parse_args(argv)
    assert args.from_json == ["a.json", "b.json"] and args.suite == "lossless"
    from prunepipe.tools.benchmarks.lossless.run import run_from_args

    argv = ["bench", "lossless", "--suite", "pays", "--tag", "s5"]  # would have run 5 seeds
    with pytest.raises(ValueError, match="--tag 's5' may not start with p or s and a digit"):
        run_from_args(build_parser(argv).parse_args(argv))


def test_pooled_std_verdicts_of_arms_at_three_seeds():
    from prunepipe.tools.benchmarks.lossless.verdicts import arms, saving_targets

    plan = TaskPlan("mae", "configs/bench_mae.yaml", "masked_mse", 100, 10, 0, {}, pruned_seeds=(0, 1, 2))
    results = [_result(f"Full s{s}", "full", v, 1000, seed=s) for s, v in enumerate((1.00, 1.10, 0.90))]
    for seed, (mine, equal) in enumerate(((0.95, 1.40), (1.05, 1.50), (1.00, 1.45))):
        results += [
            _result("Pays", "pruned", mine, 700, seed=seed),
            _result("Full @ Pays", "equal_compute", equal, 700, seed=seed, passes=7, compute_of="Pays"),
        ]
    for seed, (mine, equal) in enumerate(((1.35, 1.40), (1.45, 1.50), (1.40, 1.45))):
        results += [
            _result("Less", "pruned", mine, 700, seed=seed),
            _result("Full @ Less", "equal_compute", equal, 700, seed=seed, passes=7, compute_of="Less"),
        ]
    rows = {r["label"]: r["metrics"]["masked_mse"] for r in arms(results, [plan])}
    # Full at equal compute is each seed's fitted frontier at 70%: the shape (1.45 at 70%) plus the
    # seed's level (-0.025, +0.075, -0.05), i.e. 1.425, 1.525, 1.40 (mean 1.45), not the raw runs
    readings = [1.425, 1.525, 1.40]
    # Pays: mean 1.00 (std 0.05) vs Full 1.00 (std 0.10) and vs equal compute 1.45
    pooled = math.sqrt((0.05**2 + np.var(readings, ddof=1)) / 2)
    assert rows["Pays"]["equal_compute_mean"] == pytest.approx(1.45)
    assert rows["Pays"]["delta_passes"] == pytest.approx(0.0, abs=1e-9) and rows["Pays"]["lossless"]
    assert rows["Pays"]["delta_compute"] == pytest.approx(-0.45 / pooled) and rows["Pays"]["pays"]
    assert not rows["Less"]["lossless"] and not rows["Less"]["pays"]  # what training less buys, no more
    # Full at 70% and at 100% of the passes, fitted as one shape (1.45, 1.00) plus a level per seed
    # (-0.025, +0.075, -0.05): Pays beats its seed's curve at 100% on seeds 0 and 1 (so it saves at
    # least 30%: a bound) and reaches 89% of the way from 70% to 100% on seed 2
    pays = rows["Pays"]["saving"]
    assert [s["kind"] for s in pays["per_seed"]] == ["at least", "at least", "interpolated"]
    assert pays["per_seed"][2]["saving"] == pytest.approx(1 - 0.7 / (0.7 + 0.3 * (1.40 - 1.00) / (1.40 - 0.95)))
    # two lower bounds and one measured saving: no interval is formed from the bounds
    assert pays["n"] == 1 and pays["bounded"] == 2 and math.isnan(pays["low"]) and math.isnan(pays["high"])
    assert pays["mean"] == pytest.approx(pays["per_seed"][2]["saving"])
    assert pays["bound"] == "at least" and "[" not in pays["verdict"] and ">=30%, >=30% (bounds)" in pays["verdict"]
    less = rows["Less"]["saving"]  # a little better than its seed's Full at 70%: a few percent
    # (seed 2 is exactly its curve at 70%, the cheapest Full: at most 0% saved)
    assert [s["kind"] for s in less["per_seed"]] == ["interpolated", "interpolated", "at most"]
    assert less["per_seed"][2]["saving"] == pytest.approx(0.0, abs=1e-12)
    assert less["per_seed"][0]["saving"] == pytest.approx(1 - 0.7 / (0.7 + 0.3 * (1.425 - 1.35) / 0.45))
    assert rows["Pays"]["paired_compute"]["differences"] == pytest.approx([-0.475, -0.475, -0.40])
    assert rows["Pays"]["paired_compute"]["reading"] == "better"
    [target] = saving_targets(arms(results, [plan]))
    assert "best: Pays" in target["measured"] and "compute at equal quality" in target["target"]
    # two seeds are lower bounds of 30% piled at the frontier's end: they would reach 25%, but unmeasured
    assert not target["met"] and target["measured"].startswith("reached on lower bounds only")


def test_bench_pays_micro_runs_every_arm_at_three_seeds_on_redundant_data(tmp_path):
    report = bench(
        "pays_micro_redundant", ("mae",), out=str(tmp_path / "docs"), work=str(tmp_path / "work"), frontier=(0.5,)
    )
    keys = {r["key"] for r in report["results"] if r["role"] == "pruned"}
    assert keys == {
        f"mae_long_{arm}{s}"
        for arm in (
            "infobatch",
            "importance",
            "dedup_oracle",
            "dedup_known",
            "dedup_known_rescaled",
            "static_dedup_known",
        )
        for s in ("", "_s1", "_s2")
    }
    oracle = next(r for r in report["results"] if r["key"] == "mae_long_dedup_oracle")
    full = next(r for r in report["results"] if r["key"] == "mae_long_full_s0")
    assert oracle["samples_forwarded"] < 0.8 * full["samples_forwarded"]  # trained on train_dedup
    for arm in report["arms"]:
        assert arm["seeds"] == [0, 1, 2] and {"masked_mse", "masked_mse@val_mix"} <= set(arm["metrics"])
    equal = [r for r in report["results"] if r["role"] == "equal_compute"]
    assert sorted((r["compute_of"], r["seed"]) for r in equal) == sorted(
        (arm, s)
        for arm in (
            "InfoBatch",
            "Importance",
            "Dedup oracle",
            "Dedup known",
            "Dedup known rescaled",
            "Static dedup known",
        )
        for s in (0, 1, 2)
    )
    # the dedup arms train on the known groups at the oracle's 70%, each rescale choice its own weights
    for label in ("Dedup known", "Dedup known rescaled"):
        arm = next(r for r in report["results"] if r["label"] == label and r["seed"] == 0)
        assert abs(arm["mean_kept_fraction"] - 0.7) < 0.1 and arm["pruner"]["groups"] == "known"
    static = next(r for r in report["results"] if r["label"] == "Static dedup known" and r["seed"] == 0)
    assert abs(static["mean_kept_fraction"] - 0.7) < 0.1  # every pass pruned: no full passes at the end
    text = (tmp_path / "docs" / "benchmarks" / "lossless_pays_micro_redundant.md").read_text()
    assert "settings at 3 seeds, deltas in pooled std" in text and "<!-- bench:pays_micro_redundant:end -->" in text
    assert "a pruner saves >= 25% compute at equal quality with the 95% CI above 0" in text
    assert "compute saved at equal quality (masked_mse), seeds paired with their own Full" in text
    # the frontier: Full at half the passes at every seed; an equal-compute run of the same length is
    # that run (trained once), and every seed of every arm has its saving against its own frontier
    frontier = [r for r in report["results"] if r["role"] == "frontier"]
    assert sorted((r["seed"], r["passes"]) for r in frontier) == [(0, 1), (1, 1), (2, 1)]
    trained = [r["key"] for r in report["results"] if r["role"] != "equal_compute"]
    assert len(trained) == len(set(trained))
    oracle_equal = [r for r in equal if r["compute_of"] == "Dedup oracle"]
    assert {r["key"] for r in oracle_equal} == {"mae_long_full_p1", "mae_long_full_p1_s1", "mae_long_full_p1_s2"}
    for arm in report["arms"]:
        saving = arm["metrics"]["masked_mse"]["saving"]
        assert saving["seeds"] == [0, 1, 2] and len(saving["per_seed"]) == 3
        assert all(s["points"] == 2 for s in saving["per_seed"])  # Full at 1 and at 2 passes

    # the tasks of a suite run as two invocations re-render as one report
    import json

    from prunepipe.tools.benchmarks.lossless.run import rerender

    recorded = tmp_path / "work" / "lossless_pays_micro_redundant.json"
    other = json.loads(recorded.read_text())
    for item in other["plans"] + other["results"]:
        item["task"] = "ldm"
    for result in other["results"]:
        result["key"] = result["key"].replace("mae_", "ldm_")
    (tmp_path / "other.json").write_text(json.dumps(other))
    both = rerender([str(recorded), str(tmp_path / "other.json")], str(tmp_path / "docs"))
    assert {a["task"] for a in both["arms"]} == {"mae", "ldm"}
    # per task: the best pruner's target and, with the dedup arms run, the redundancy-aware pruner's
    assert sorted("redundancy-aware" in t["target"] for t in both["targets"]) == [False, False, True, True]
    assert (tmp_path / "docs" / "benchmarks" / "lossless_pays_micro_redundant.json").exists()
    # the merged record re-renders its page byte for byte; the page names the command that does
    record = os.path.join(str(tmp_path / "docs"), "benchmarks", "lossless_pays_micro_redundant.json")
    page = tmp_path / "docs" / "benchmarks" / "lossless_pays_micro_redundant.md"
    first = page.read_text()
    assert first.startswith("<!-- bench:pays_micro_redundant:begin -->\n")
    assert f"`prunepipe bench lossless --from-json {record} --out {tmp_path / 'docs'}`" in first
    rerender(record, str(tmp_path / "docs"))
    assert page.read_text() == first
    with pytest.raises(ValueError, match="a task appears in more than one report"):
        rerender([str(recorded), str(recorded)], str(tmp_path / "docs"))

    # a second invocation with --reuse takes every recorded run and trains none; a changed setting is trained
    from prunepipe.tools.benchmarks.lossless.plan import first_specs, task_plans
    from prunepipe.tools.benchmarks.lossless.run import recorded_runs, same_run

    runs = recorded_runs([str(recorded)])
    again = bench(
        "pays_micro_redundant",
        ("mae",),
        out=str(tmp_path / "again"),
        work=str(tmp_path / "work2"),
        frontier=(0.5,),
        reuse=runs,
    )
    assert again["reused_runs"] == len({r["key"] for r in report["results"]})
    assert not os.path.exists(tmp_path / "work2" / "runs")
    assert sorted((r["key"], r["label"], r["metrics"]["masked_mse"]) for r in again["results"]) == sorted(
        (r["key"], r["label"], r["metrics"]["masked_mse"]) for r in report["results"]
    )
    spec = next(
        s
        for s in first_specs(task_plans("pays_micro_redundant", ["mae"], (), (0.5,))[0])
        if s.key == "mae_long_infobatch"
    )
    assert same_run(spec, runs[spec.key])
    spec.pruner["prune_ratio"] = 0.3
    assert not same_run(spec, runs[spec.key])

    # which samples the pruner skips, by kind, and how reliable its scores are over draws
    from prunepipe.tools.benchmarks.score_noise import analyse, render

    scored = analyse(str(tmp_path / "work" / "runs" / "mae_long_infobatch"), draws=4, samples=0)
    kinds = scored["kinds"]
    assert kinds["unique"]["samples"] + kinds["duplicate"]["samples"] == scored["samples"]
    assert kinds["duplicate"]["samples"] > 0 and {"raw", "normalised"} <= set(scored)
    assert all(0.0 <= row["skip_probability"] <= 1.0 for row in kinds.values())
    assert "pruner skips" in render(scored)


def test_pays_modes_name_the_data_and_optionally_the_passes():
    from prunepipe.tools.benchmarks.lossless.plan import first_specs, task_plans

    default = {p.task: p for p in task_plans("pays_redundant", ["mae", "ldm"])}
    assert default["mae"].data == "redundant" and default["mae"].extra_splits == ("val_mix",)
    assert default["mae"].pruned_seeds == (0, 1, 2) and "data.channels=3" in default["mae"].overrides
    longer = task_plans("pays_digits_p200", ["mae"])
    assert [(p.data, p.long, p.extra_splits, p.overrides) for p in longer] == [("digits", 200, (), [])]
    with pytest.raises(ValueError, match="bench data 'lsun'"):
        task_plans("pays_lsun", ["mae"])
    from prunepipe.tools.benchmarks.lossless.run import pays_invocation

    args = argparse.Namespace(
        data="redundant", passes=200, seeds=5, arms="InfoBatch no rescale", tag="lead", frontier=""
    )
    assert pays_invocation(args) == (
        "pays_redundant_p200_s5_lead",
        " --suite pays --data redundant --passes 200 --seeds 5 --arms 'InfoBatch no rescale' --tag lead",
    )
    args.frontier = "0.5,0.7"
    assert pays_invocation(args)[1].endswith("--frontier 0.5,0.7 --tag lead")
    (fronted,) = task_plans("pays_redundant_s2", ["mae"], arms=("InfoBatch",), frontier=(0.7, 0.5, 0.995, 1.5))
    assert [(s.key, s.role, s.passes) for s in first_specs(fronted) if s.seed == 1] == [
        ("mae_long_full_s1", "full", 60),
        ("mae_long_full_p30_s1", "frontier", 30),
        ("mae_long_full_p42_s1", "frontier", 42),
        ("mae_long_full_p90_s1", "frontier", 90),
        ("mae_long_infobatch_s1", "pruned", 60),
    ]  # 0.995 x 60 rounds to 60: Full itself
    with pytest.raises(ValueError, match=r"must be > 0 and not 1"):
        task_plans("pays_redundant", ["mae"], frontier=(0.5, 1.0))
    (tagged,) = task_plans("pays_redundant_masknorm", ["mae"])
    assert (tagged.data, tagged.long, tagged.pruned_seeds) == ("redundant", 60, (0, 1, 2))
    (five,) = task_plans("pays_redundant_p200_s5_lead", ["mae"], arms=("InfoBatch no rescale",))
    assert five.long == 200 and five.pruned_seeds == five.full_seeds == (0, 1, 2, 3, 4)
    assert list(five.pruners) == ["InfoBatch no rescale"]
    specs = [s.key for s in first_specs(five)]
    assert specs == [f"mae_long_full_s{i}" for i in range(5)] + ["mae_long_infobatch_no_rescale"] + [
        f"mae_long_infobatch_no_rescale_s{i}" for i in range(1, 5)
    ]
    with pytest.raises(ValueError, match="no setting 'Infobatch'; accepted: Random, InfoBatch"):
        task_plans("pays_redundant", ["mae"], arms=("Infobatch",))


@pytest.mark.slow  # ~30 s: five tiny runs in spawned workers
def test_bench_dit_micro_runs_the_dit_flow_task_infobatch_against_full(tmp_path):
    report = bench("dit_micro", ("dit",), out=str(tmp_path / "docs"), work=str(tmp_path / "work"), workers=2)
    rows = {r["label"]: r for r in report["rows"]}
    assert {"Full s0", "Full s1", "Full s2", "InfoBatch", "Full @ InfoBatch"} <= set(rows)
    assert isinstance(rows["InfoBatch"]["lossless"], bool) and rows["InfoBatch"]["beats_equal_compute"] in (True, False)
    assert all(r["task"] == "dit" and r["metrics"]["denoise_mse"] > 0 for r in report["results"])
    from prunepipe.pipelines.config import load_config

    cfg = load_config(os.path.join(str(tmp_path / "work"), "runs", "dit_long_infobatch", "config.yaml"))
    assert (cfg.ldm.backbone, cfg.ldm.objective) == ("dit", "flow")
    assert "<!-- bench:dit_micro:end -->" in (tmp_path / "docs" / "benchmarks" / "lossless_dit_micro.md").read_text()


def test_the_redundancy_target_needs_the_dedup_pruner_within_the_oracle_s_interval():
    from prunepipe.tools.benchmarks.lossless.verdicts import saving_targets

    def row(label, pruner, mean, low, high, static=False):
        saving = {
            "mean": mean,
            "low": low,
            "high": high,
            "bound": "",
            "bounded": 0,
            "n": 5,
            "seeds_total": 5,
            "bound_values": [],
            "note": "",
            "seeds_needed": 3,
            "verdict": f"saves {mean:.0%}",
            "per_seed": [{"kind": "interpolated", "saving": mean}] * 5,
        }
        return {
            "task": "mae",
            "data": "redundant",
            "label": label,
            "pruner": pruner,
            "static": static,
            "main": "masked_mse",
            "metrics": {"masked_mse": {"saving": saving}},
        }

    oracle = row("Dedup oracle", "full", 0.30, 0.20, 0.40)
    rows = [
        row("InfoBatch", "infobatch", 0.05, -0.1, 0.2),
        row("Dedup known", "dedup", 0.28, 0.12, 0.44),
        row("Static dedup known", "dedup", 0.6, 0.5, 0.7, static=True),
        oracle,
    ]
    general, redundancy = saving_targets(rows)
    assert "best: Dedup known" in general["measured"], "a static deduplication is a data set, not a pruner"
    assert redundancy["met"] and "within its interval" in redundancy["measured"]
    assert "the redundancy-aware pruner saves >= 25%" in redundancy["target"]
    oracle["metrics"]["masked_mse"]["saving"].update(low=0.35, high=0.45, mean=0.4)
    assert not saving_targets(rows)[1]["met"], "outside the oracle's interval"
    rows[1]["metrics"]["masked_mse"]["saving"].update(low=-0.02)
    oracle["metrics"]["masked_mse"]["saving"].update(low=0.2, high=0.4)
    assert not saving_targets(rows)[1]["met"], "an interval that holds 0"


def test_bench_t2i_micro_runs_the_text_task_infobatch_against_full(tmp_path):
    report = bench("t2i_micro", ("t2i",), out=str(tmp_path / "docs"), work=str(tmp_path / "work"), workers=2)
    rows = {r["label"]: r for r in report["rows"]}
    assert {"Full s0", "Full s1", "Full s2", "InfoBatch", "Full @ InfoBatch"} <= set(rows)
    assert all(r["task"] == "t2i" and r["metrics"]["denoise_mse"] > 0 for r in report["results"])
    from prunepipe.pipelines.config import load_config

    cfg = load_config(os.path.join(str(tmp_path / "work"), "runs", "t2i_long_infobatch", "config.yaml"))
    assert (cfg.ldm.conditioning, cfg.ldm.backbone, cfg.pruner["name"]) == ("text", "dit", "infobatch")
    assert cfg.ldm.text.encoder == str(tmp_path / "work" / "captioned16_n96" / "text_encoder")
    assert "<!-- bench:t2i_micro:end -->" in (tmp_path / "docs" / "benchmarks" / "lossless_t2i_micro.md").read_text()
