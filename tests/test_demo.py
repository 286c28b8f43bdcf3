"""`prunepipe demo` (what `make demo` runs) end to end, shortened to two seeds: it writes the digits
shards once, trains a pruned MAE, its full baseline, a full run of equal compute and one of half the
passes at each seed, evaluates them, and ends with the compare report, both verdicts and the compute saved at equal
quality with its interval; in a log file it writes no progress-bar frames."""

from __future__ import annotations

import glob
import json
import os

import yaml
from eval_runs import TINY_MAE

from prunepipe.launch.cli import main as cli_main


def test_demo_compares_a_pruned_run_with_full_runs_and_ends_with_both_verdicts(tmp_path, capsys):
    data, runs = tmp_path / "digits", tmp_path / "runs"
    # 4 passes: InfoBatch prunes in passes 2-3 (pass 1 has no scores yet, delta 0.875 keeps pass 4 full)
    args = ["demo", "--data", str(data), "--passes", "4", "--seeds", "2", f"runs_dir={runs}", *TINY_MAE]
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "writing scikit-learn's digits as shards" in out
    assert os.path.isfile(data / "train" / "index.json") and os.path.isfile(data / "val" / "index.json")
    names = [
        "demo_mae_infobatch",
        "demo_mae_infobatch_s1",
        "demo_mae_full_s0",
        "demo_mae_full_s1",
        "demo_mae_full_short",
        "demo_mae_full_short_s1",
        "demo_mae_full_half",
        "demo_mae_full_half_s1",
    ]
    for name in names:
        [record] = [json.load(open(p)) for p in glob.glob(str(runs / name / "eval" / "*_raw.json"))]
        assert set(record["metrics"]) == {"masked_mse", "psnr", "ssim", "probe_accuracy"}
        assert record["details"]["probe_train_samples"] == 100  # the tiny configs' 10 labels per class
    assert os.path.isfile(runs / "demo_mae_infobatch" / "export" / "encoder.safetensors")

    report = json.load(open(runs / "demo_mae_infobatch" / "report" / "report.json"))
    assert [b["name"] for b in report["baseline"]] == names[2:4]
    # Full at equal compute: each pruned run's own seed's fitted frontier (its baseline, equal-compute
    # and half-length runs) read at its samples forwarded
    short = report["equal_compute"]["demo_mae_infobatch"]
    assert short["reference"].startswith("Full of seed 0 at ") and "demo_mae_full_short" in short["reference"]
    assert "_s1" not in short["reference"]
    paired = report["equal_compute"]["demo_mae_infobatch_s1"]["reference"]
    assert paired.startswith("Full of seed 1 at ") and "demo_mae_full_short_s1" in paired
    records = [json.loads(line) for line in open(runs / "demo_mae_full_short" / "metrics.jsonl")]
    assert (
        max(r["pass_index"] for r in records if r["kind"] == "pass") + 1 < 4
    )  # fewer passes: the pruned run's compute
    assert "## Quality at equal passes" in out and "## Quality at equal compute" in out
    # each seed's baseline, equal-compute and half-length runs are its frontier: a saving per seed
    [setting] = report["equal_quality"]["settings"]
    saving = setting["metrics"]["masked_mse"]
    assert setting["setting"] == "demo_mae_infobatch" and saving["seeds"] == [0, 1]
    for seed, answer in zip((0, 1), saving["per_seed"]):  # distinct schedule lengths (a short run may be half)
        suffix = "_s1" if seed else ""
        lengths = {
            yaml.safe_load(open(runs / name / "config.yaml"))["num_passes"]
            for name in (f"demo_mae_full_s{seed}", f"demo_mae_full_short{suffix}", f"demo_mae_full_half{suffix}")
        }
        assert answer["points"] == len(lengths) >= 2
    assert saving["n"] == 2
    assert "## Compute saved at equal quality" in out
    verdicts = out.strip().splitlines()[-1]
    passes = [report["equal_passes"][n]["verdict"] for n in names[:2]]
    assert verdicts.startswith("Verdicts for demo_mae_infobatch (InfoBatch, 2 seeds): at equal passes ")
    assert f"; at equal quality (masked_mse) {saving['verdict']}." in verdicts
    assert passes[0] in verdicts and short["verdict"] in verdicts
    assert "\r" not in out + captured.err  # a log file gets lines, not redrawn progress bars

    # A second demo reuses the shards (one seed, two passes: only the data step matters here)
    assert cli_main([*args[:3], "--passes", "2", "--seeds", "1", "--name", "again", *args[7:]]) == 0
    assert "writing scikit-learn's digits" not in capsys.readouterr().out
