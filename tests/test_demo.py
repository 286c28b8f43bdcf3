"""`prunepipe demo` (what `make demo` runs) end to end, shortened: it writes the digits shards once,
trains a pruned MAE, its full baseline at three seeds and a full run of equal compute, evaluates them,
and ends with the compare report and both verdicts; in a log file it writes no progress-bar frames."""

from __future__ import annotations

import glob
import json
import os

from eval_runs import TINY_MAE

from launch.cli import main as cli_main


def test_demo_compares_a_pruned_run_with_full_runs_and_ends_with_both_verdicts(tmp_path, capsys):
    data, runs = tmp_path / "digits", tmp_path / "runs"
    # 4 passes: InfoBatch prunes in passes 2-3 (pass 1 has no scores yet, delta 0.875 keeps pass 4 full)
    args = ["demo", "--data", str(data), "--passes", "4", f"runs_dir={runs}", *TINY_MAE]
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "writing scikit-learn's digits as shards" in out
    assert os.path.isfile(data / "train" / "index.json") and os.path.isfile(data / "val" / "index.json")
    names = ["demo_mae_infobatch", "demo_mae_full_s0", "demo_mae_full_s1", "demo_mae_full_s2", "demo_mae_full_short"]
    for name in names:
        [record] = [json.load(open(p)) for p in glob.glob(str(runs / name / "eval" / "*_raw.json"))]
        assert set(record["metrics"]) == {"masked_mse", "psnr", "ssim", "probe_accuracy"}
        assert record["details"]["probe_train_samples"] == 100  # the tiny configs' 10 labels per class
    assert os.path.isfile(runs / "demo_mae_infobatch" / "export" / "encoder.safetensors")

    report = json.load(open(runs / "demo_mae_infobatch" / "report" / "report.json"))
    assert [b["name"] for b in report["baseline"]] == names[1:4]
    short = report["equal_compute"]["demo_mae_infobatch"]
    assert short["reference"].startswith("full run demo_mae_full_short")
    passes = [json.loads(line) for line in open(runs / "demo_mae_full_short" / "metrics.jsonl")]
    assert max(r["epoch"] for r in passes if r["kind"] == "pass") + 1 < 4  # fewer passes: the pruned run's compute
    assert "## Quality at equal passes" in out and "## Quality at equal compute" in out
    verdicts = out.strip().splitlines()[-1]
    assert verdicts == (f"Verdicts for demo_mae_infobatch: at equal passes "
                        f"{report['equal_passes']['demo_mae_infobatch']['verdict']}; at equal compute "
                        f"{short['verdict']}.")
    assert "\r" not in out + captured.err  # a log file gets lines, not redrawn progress bars

    # A second demo reuses the shards
    assert cli_main([*args[:5], "--name", "again", *args[5:]]) == 0
    assert "writing scikit-learn's digits" not in capsys.readouterr().out
