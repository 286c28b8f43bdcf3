"""`prunepipe compare` as a specification: on two tiny runs it writes the markdown table, report.json
and the PNG plots (score histograms from the pruner state in checkpoints); a pruned run within the
baseline seeds' noise is lossless and a clearly worse one is not; tolerances are given > k x seed
std > per-metric default, and printed; the equal-compute verdict is always reported."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from eval_runs import one_torch_thread, session_dir, tiny_run

from prunepipe.launch.cli import main as cli_main
from prunepipe.pipelines.evaluation.config import load_eval_config
from prunepipe.pipelines.report.compare import compare_runs, parse_tolerances, tolerance_for
from prunepipe.pipelines.report.plots import checkpoint_scores
from prunepipe.pipelines.trained import evaluate_checkpoint

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def tiny_runs(digits_shards, tmp_path_factory) -> tuple[str, str]:
    """A full and an InfoBatch MAE run of 2 passes, both evaluated (reconstruction only)."""
    runs_dir = session_dir(tmp_path_factory, "eval_runs")
    full = tiny_run(digits_shards, runs_dir, "mae_tiny_full.yaml", "mae_full", ("num_passes=2",))
    pruned = tiny_run(digits_shards, runs_dir, "mae_tiny_infobatch.yaml", "mae_infobatch", ("num_passes=2",))
    quick = load_eval_config(overrides=["probe.enabled=false", "val_samples=90"])
    for run in (full, pruned):
        evaluate_checkpoint(run, eval_cfg=quick)
    return full, pruned


def test_compare_of_two_tiny_runs_writes_the_table_and_the_plots(tiny_runs, tmp_path):
    full, pruned = tiny_runs
    report = compare_runs([full], [pruned], out=str(tmp_path / "report"))
    markdown = open(tmp_path / "report" / "report.md").read()
    assert markdown == report["markdown"]
    for heading in ("## Quality at equal passes", "## Quality at equal compute", "## Cost", "## Tolerances"):
        assert heading in markdown
    assert (
        "| metric | better | baseline | tolerance | mae_infobatch | delta mae_infobatch | verdict mae_infobatch |"
        in markdown
    )
    assert "masked_mse: 2.0% rel" in markdown  # the tolerance in force is printed
    verdict = report["equal_passes"]["mae_infobatch"]["verdict"]
    assert verdict in ("lossless", "not lossless") and f"**mae_infobatch at equal passes: {verdict}**" in markdown
    assert report["equal_compute"]["mae_infobatch"]["verdict"] != "not measured"
    cost = report["cost"]["mae_infobatch"]
    assert cost["samples_forwarded"] < report["cost"]["mae_full"]["samples_forwarded"]  # InfoBatch pruned pass 2
    assert cost["saving_samples_forwarded"] > 0.05 and f"{cost['saving_samples_forwarded']:.1%}" in markdown
    names = sorted(os.path.basename(p) for p in report["plots"])
    assert names == [
        "kept_fraction.png",
        "quality_vs_compute_frontier.png",
        "quality_vs_samples.png",
        "quality_vs_time.png",
        "score_histograms.png",
    ]
    # one Full run of the pruned run's seed: the saving is a bound beside it, or read off nothing
    answer = report["equal_quality"]["runs"]["mae_infobatch"]["masked_mse"]
    assert answer["kind"] in ("at least", "at most") and answer["points"] == 1
    for path in report["plots"]:
        assert open(path, "rb").read(8) == PNG_MAGIC
    saved = json.load(open(tmp_path / "report" / "report.json"))
    assert saved["equal_passes"]["mae_infobatch"]["verdict"] == verdict


def test_score_histograms_come_from_the_pruner_tables_in_checkpoints(tiny_runs):
    _, pruned = tiny_runs
    states = checkpoint_scores(pruned)
    assert len(states) >= 3  # a checkpoint every 10 steps
    assert all(len(s["scores"]) > 0 for s in states[1:])
    assert any(s["threshold"] is not None for s in states)  # InfoBatch's mean-score threshold


def fake_run(
    root, name, pruner, seed, final, curve, samples_per_pass=1000, seconds_per_pass=10.0, kept=1.0, evaluated=True
):
    """A run folder with a config, per-pass records (held-out masked_mse `curve`) and a final eval (unless
    not `evaluated`)."""
    path = root / name
    (path / "eval").mkdir(parents=True)
    (path / "config.yaml").write_text(
        yaml.safe_dump(
            {"name": name, "task": "mae", "seed": seed, "num_passes": len(curve), "pruner": {"name": pruner}}
        )
    )
    with open(path / "metrics.jsonl", "w") as f:
        for pass_index, value in enumerate(curve):
            f.write(
                json.dumps(
                    {
                        "kind": "pass",
                        "pass_index": pass_index,
                        "optimizer_steps": 10 * (pass_index + 1),
                        "samples_forwarded": int(samples_per_pass * (pass_index + 1)),
                        "kept_fraction": kept,
                        "wall_seconds": seconds_per_pass * (pass_index + 1),
                        "held_out": {"masked_mse": value, "num_samples": 100},
                    }
                )
                + "\n"
            )
    steps = 10 * len(curve)
    if not evaluated:
        return str(path)
    (path / "eval" / f"step_{steps:06d}.json").write_text(
        json.dumps({"kind": "eval", "weights": "ema", "precision": "fp32", "optimizer_steps": steps, "metrics": final})
    )
    return str(path)


@pytest.fixture
def seeds(tmp_path):
    """Three full runs whose final masked_mse has std 0.002, so the tolerance is 2 x 0.002."""
    curve = [0.5, 0.3, 0.2, 0.15]
    return [
        fake_run(tmp_path, f"full_s{s}", "full", s, {"masked_mse": v, "probe_accuracy": a}, curve)
        for s, (v, a) in enumerate([(0.100, 0.90), (0.102, 0.91), (0.098, 0.92)])
    ]


def test_a_pruned_run_within_seed_noise_is_lossless(seeds, tmp_path):
    pruned = fake_run(
        tmp_path,
        "ib",
        "infobatch",
        0,
        {"masked_mse": 0.103, "probe_accuracy": 0.905},
        [0.5, 0.31, 0.21, 0.16],
        samples_per_pass=700,
        kept=0.7,
    )
    report = compare_runs(seeds, [pruned], out=str(tmp_path / "out"), plots=False)
    row = report["equal_passes"]["ib"]["metrics"]["masked_mse"]
    assert row["baseline"] == pytest.approx(0.100) and row["tolerance"] == pytest.approx(0.004)
    assert row["delta"] == pytest.approx(0.003) and row["verdict"] == "lossless"
    assert report["equal_passes"]["ib"]["verdict"] == "lossless"
    assert "2 x seed std, n=3" in report["markdown"]
    # 2800 samples = between the baselines' passes 2 (2000, 0.3) and 3 (3000, 0.2): 0.22; ib logged 0.16
    compute = report["equal_compute"]["ib"]["metrics"]["masked_mse"]
    assert compute["reference"] == pytest.approx(0.22) and compute["verdict"] == "beats equal compute"
    assert report["cost"]["ib"]["saving_samples_forwarded"] == pytest.approx(0.3)


def test_a_clearly_worse_pruned_run_is_not_lossless(seeds, tmp_path):
    pruned = fake_run(
        tmp_path,
        "bad",
        "random",
        0,
        {"masked_mse": 0.130, "probe_accuracy": 0.80},
        [0.5, 0.4, 0.35, 0.3],
        samples_per_pass=700,
        kept=0.7,
    )
    report = compare_runs(seeds, [pruned], out=str(tmp_path / "out"), plots=False)
    verdict = report["equal_passes"]["bad"]
    assert verdict["verdict"] == "not lossless" and sorted(verdict["failed"]) == ["masked_mse", "probe_accuracy"]
    assert "**bad at equal passes: not lossless** (masked_mse, probe_accuracy worse" in report["markdown"]
    assert report["equal_compute"]["bad"]["verdict"] == "no better than training less"
    # a tolerance given on the command line wins over the seeds' noise
    lenient = compare_runs(
        seeds, [pruned], tolerances=["masked_mse=50%", "probe_accuracy=0.2"], out=str(tmp_path / "out2"), plots=False
    )
    assert lenient["equal_passes"]["bad"]["verdict"] == "lossless"


def test_tolerance_sources_and_errors():
    assert tolerance_for("fid", [10.0]).describe(10.0) == "5.0% rel = 0.5 (default, single baseline run)"
    assert tolerance_for("fid", [10.0, 12.0], k=1.0).absolute(11.0) == pytest.approx(2**0.5)
    assert parse_tolerances(["fid=1.5"])["fid"].absolute(30.0) == 1.5
    with pytest.raises(ValueError, match="--tolerance 'loss=1'"):
        parse_tolerances(["loss=1"])


def test_compare_cli_takes_several_baseline_seeds_as_a_glob(seeds, tmp_path):
    pruned = fake_run(tmp_path, "ib", "infobatch", 0, {"masked_mse": 0.101}, [0.5, 0.31, 0.21, 0.16])
    out = tmp_path / "cli"
    assert cli_main(["compare", str(tmp_path / "full_s*"), pruned, "--out", str(out), "--k", "3"]) == 0
    report = json.load(open(out / "report.json"))
    assert [b["name"] for b in report["baseline"]] == ["full_s0", "full_s1", "full_s2"] and report["k"] == 3.0
    assert cli_main(["compare", str(tmp_path / "full_s0"), str(tmp_path / "missing")]) == 2


def test_compare_of_weights_that_were_not_evaluated_names_what_to_run(tiny_runs, tmp_path, capsys):
    # tiny_runs were evaluated with their EMA weights only: comparing raw weights must not quietly
    # fall back to the training log's held-out numbers.
    full, pruned = tiny_runs
    with pytest.raises(ValueError, match=r"evaluated with the ema weights only.*prunepipe eval .* --weights raw"):
        compare_runs([full], [pruned], out=str(tmp_path / "raw"), weights="raw", plots=False)
    assert cli_main(["compare", full, pruned, "--weights", "raw", "--out", str(tmp_path / "raw"), "--no-plots"]) == 2
    error = capsys.readouterr().err
    assert f"`prunepipe eval {pruned} --weights raw`" in error and "(--weights ema)" in error
    assert not os.path.exists(tmp_path / "raw" / "report.md")
    assert compare_runs([full], [pruned], out=str(tmp_path / "ema"), plots=False)["pruned"][0][
        "metrics_source"
    ].startswith("eval/")


def test_an_evaluated_run_is_never_judged_against_an_unevaluated_ones_training_log(seeds, tmp_path, capsys):
    # Full never evaluated (its log's last held-out), the pruned run evaluated; the log
    # reads other samples with other weights, so the gap between the two is no verdict
    full = fake_run(tmp_path, "full_logged", "full", 0, {}, [0.5, 0.3, 0.2, 0.15], evaluated=False)
    pruned = fake_run(tmp_path, "ib", "infobatch", 0, {"masked_mse": 0.13}, [0.5, 0.31, 0.21, 0.16], kept=0.7)
    for baseline, judged in (([full], [pruned]), ([seeds[0]], [full])):
        with pytest.raises(ValueError, match=r"1 run\(s\) have eval records and 1 only their training log"):
            compare_runs(baseline, judged, out=str(tmp_path / "mixed"), plots=False)
    assert cli_main(["compare", full, pruned, "--out", str(tmp_path / "mixed"), "--no-plots"]) == 2
    assert f"`prunepipe eval {full}`, then compare again" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"`prunepipe eval .*full_logged`"):  # a same-compute reference too
        compare_runs([seeds[0]], [pruned], same_compute=[full], out=str(tmp_path / "mixed"), plots=False)
    assert not os.path.exists(tmp_path / "mixed" / "report.md")


def test_runs_read_from_their_training_logs_alone_are_compared_and_labelled_so(tmp_path):
    full = fake_run(tmp_path, "full", "full", 0, {}, [0.5, 0.3, 0.2, 0.15], evaluated=False)
    pruned = fake_run(
        tmp_path, "ib", "infobatch", 0, {}, [0.5, 0.31, 0.21, 0.16], samples_per_pass=700, kept=0.7, evaluated=False
    )
    report = compare_runs([full], [pruned], out=str(tmp_path / "logs"), plots=False)
    assert report["quality_sources"]["ib"]["from"] == report["quality_sources"]["full"]["from"] == "training log"
    assert report["equal_passes"]["ib"]["metrics"]["masked_mse"]["value"] == pytest.approx(0.16)
    markdown = report["markdown"]
    assert "ib: training log (metrics.jsonl, last pass held-out (not evaluated))" in markdown
    passes = markdown.split("## Quality at equal passes")[1].split("##")[0]
    assert "Quality read from each run's training log" in passes and "no run was evaluated" in passes
    assert "ib's values: training log, metrics.jsonl, last pass held-out" in markdown


def test_equal_compute_from_the_baselines_curves_reads_the_pruned_run_the_same_way_and_says_so(seeds, tmp_path):
    pruned = fake_run(tmp_path, "ib", "infobatch", 0, {"masked_mse": 0.1}, [0.5, 0.31, 0.21, 0.16], 700, kept=0.7)
    report = compare_runs(seeds, [pruned], out=str(tmp_path / "out"), plots=False)
    assert report["quality_sources"]["ib"]["from"] == "eval record"
    compute = report["equal_compute"]["ib"]
    assert compute["metrics"]["masked_mse"]["value"] == pytest.approx(0.16), "the log's value, not the eval's 0.1"
    assert compute["value_source"].startswith("training log") and "training logs" in compute["reference"]
    assert "Quality read from each run's eval record" in report["markdown"].split("## Quality at equal passes")[1]


def test_compare_reads_the_compute_saved_at_equal_quality_off_each_seeds_full_frontier(tmp_path):
    """Full at 2, 3 and 4 passes per seed (1000 samples a pass; seed s shifts every Full run of it by
    its offset, as an initialisation does); three pruned seeds at 2800 samples whose quality Full of
    the same seed reaches at 4000, 3500 and 3800 samples: they save 30%, 20% and 26.3%."""
    offsets = {0: 0.0, 1: 0.02, 2: -0.02}
    full = {
        s: [
            fake_run(tmp_path, f"full_p{p}_s{s}", "full", s, {"masked_mse": v + off}, [0.5] * p)
            for p, v in ((2, 0.20), (3, 0.15), (4, 0.10))
        ]
        for s, off in offsets.items()
    }
    pruned = [
        fake_run(
            tmp_path,
            f"ib_s{s}",
            "infobatch",
            s,
            {"masked_mse": v + offsets[s]},
            [0.5] * 4,
            samples_per_pass=700,
            kept=0.7,
        )
        for s, v in ((0, 0.10), (1, 0.125), (2, 0.11))
    ]
    baselines = [runs[-1] for runs in full.values()]
    same = [runs[1] for runs in full.values()]  # Full at 3 passes of every seed
    frontier = [runs[0] for runs in full.values()]
    report = compare_runs(
        baselines, pruned, same_compute=same, frontier=frontier, out=str(tmp_path / "out"), weights="ema"
    )
    answers = report["equal_quality"]["runs"]
    savings = [answers[f"ib_s{s}"]["masked_mse"]["saving"] for s in range(3)]
    assert savings == pytest.approx([0.30, 0.20, 1 - 2800 / 3800])
    assert all(answers[f"ib_s{s}"]["masked_mse"]["points"] == 3 for s in range(3))
    [setting] = report["equal_quality"]["settings"]
    summary = setting["metrics"]["masked_mse"]
    assert setting["setting"] == "ib" and setting["seeds"] == [0, 1, 2]
    assert summary["mean"] == pytest.approx(sum(savings) / 3) and summary["low"] > 0
    assert summary["verdict"].startswith("saves 25% [")
    # the equal-compute reference is the pruned run's own seed's fitted frontier read at its compute:
    # 2800 samples lie 80% of the way from Full at 2 passes (0.20) to 3 (0.15), plus the seed's level
    compute = report["equal_compute"]["ib_s1"]
    assert compute["reference"].startswith("Full of seed 1 at 2800 samples forwarded, read off its fitted frontier")
    assert compute["metrics"]["masked_mse"]["reference"] == pytest.approx(0.16 + 0.02)
    assert "## Compute saved at equal quality" in report["markdown"]
    assert report["markdown"].index("Compute saved at equal quality") < report["markdown"].index("equal passes")
    assert os.path.isfile(tmp_path / "out" / "quality_vs_compute_frontier.png")

    # without the frontier the seeds still have two Full points each (baseline, same compute)
    two = compare_runs(baselines, pruned, same_compute=same, out=str(tmp_path / "two"), plots=False)
    assert two["equal_quality"]["runs"]["ib_s0"]["masked_mse"]["points"] == 2
    assert any("fewer than 3 Full runs" in note for note in two["notes"])
    # a seed without any Full run is named, not guessed
    lone = fake_run(tmp_path, "ib_s7", "infobatch", 7, {"masked_mse": 0.1}, [0.5] * 4, samples_per_pass=700)
    alone = compare_runs(baselines, [lone], out=str(tmp_path / "lone"), plots=False)
    assert alone["equal_quality"]["missing"] == [7] and any("seed(s) 7" in n for n in alone["notes"])
    with pytest.raises(ValueError, match="pruned data"):
        compare_runs(baselines, pruned, frontier=[pruned[0]], out=str(tmp_path / "bad"), plots=False)

    out = tmp_path / "cli"
    assert (
        cli_main(
            [
                "compare",
                ",".join(baselines),
                *pruned,
                "--frontier",
                str(tmp_path / "full_p[23]_s*"),
                "--out",
                str(out),
                "--no-plots",
            ]
        )
        == 0
    )
    recorded = json.load(open(out / "report.json"))
    assert recorded["equal_quality"]["settings"][0]["metrics"]["masked_mse"]["mean"] == pytest.approx(summary["mean"])


def test_compare_says_first_when_training_longer_hurts_and_claims_no_saving_that_training_less_beats(tmp_path):
    """Full at 2, 3, 4 and 5 passes (50% to 125% of the 4-pass baseline) gets worse on every seed, as on
    redundant data judged on a clean held-out set; the pruned runs at 77% of the baseline's compute are
    a touch worse than Full at 2 passes: training less reaches their quality for less compute."""
    offsets = {0: -0.002, 1: 0.0, 2: 0.002}
    full = {
        s: [
            fake_run(tmp_path, f"full_p{p}_s{s}", "full", s, {"masked_mse": v + off}, [0.5] * p)
            for p, v in ((2, 0.206), (3, 0.213), (4, 0.223), (5, 0.230))
        ]
        for s, off in offsets.items()
    }
    pruned = [
        fake_run(
            tmp_path,
            f"ib_s{s}",
            "infobatch",
            s,
            {"masked_mse": 0.207 + offsets[s]},
            [0.5] * 4,
            samples_per_pass=770,
            kept=0.77,
        )
        for s in offsets
    ]
    baselines = [runs[2] for runs in full.values()]
    frontier = [run for runs in full.values() for i, run in enumerate(runs) if i != 2]
    report = compare_runs(baselines, pruned, frontier=frontier, out=str(tmp_path / "out"), plots=False)
    [setting] = report["equal_quality"]["settings"]
    summary = setting["metrics"]["masked_mse"]
    assert summary["hurts"] == "training longer hurts here: Full at 50% is best measured"
    assert summary["verdict"].startswith("not a saving") and "[" not in summary["verdict"]
    section = report["markdown"][report["markdown"].index("## Compute saved at equal quality") :]
    assert section.splitlines()[2].startswith(
        "**masked_mse: training longer hurts here: Full at 50% is best measured**"
    )
    assert "saves at least" not in report["markdown"]


def test_runs_that_share_a_seed_are_still_told_first_when_training_longer_hurts(tmp_path):
    """Two runs of one setting at seed 0 (not independent seeds: the plain t interval, noted) against
    Full at 2 to 5 passes getting worse on every seed: the headline and the verdict are those of
    independent seeds, not a saving that training less beats."""
    offsets = {0: -0.002, 1: 0.0, 2: 0.002}
    full = {
        s: [
            fake_run(tmp_path, f"full_p{p}_s{s}", "full", s, {"masked_mse": v + off}, [0.5] * p)
            for p, v in ((2, 0.206), (3, 0.213), (4, 0.223), (5, 0.230))
        ]
        for s, off in offsets.items()
    }
    pruned = [
        fake_run(
            tmp_path,
            f"ib_{tag}",
            "infobatch",
            0,
            {"masked_mse": 0.207 + offsets[0] + extra},
            [0.5] * 4,
            samples_per_pass=770,
            kept=0.77,
        )
        for tag, extra in (("a", 0.0), ("b", 0.0005))
    ]
    baselines = [runs[2] for runs in full.values()]
    frontier = [run for runs in full.values() for i, run in enumerate(runs) if i != 2]
    report = compare_runs(baselines, pruned, frontier=frontier, out=str(tmp_path / "out"), plots=False)
    [setting] = report["equal_quality"]["settings"]
    assert setting["repeated_seeds"]
    summary = setting["metrics"]["masked_mse"]
    assert summary["hurts"] == "training longer hurts here: Full at 50% is best measured"
    assert summary["verdict"].startswith("not a saving") and "[" not in summary["verdict"]
    assert "**masked_mse: training longer hurts here: Full at 50% is best measured**" in report["markdown"]
