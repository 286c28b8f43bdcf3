"""`prunepipe demo` (what `make demo` runs) end to end, shortened: it writes the digits shards once,
trains the tiny MAE with InfoBatch, evaluates the final weights and says where everything is."""

from __future__ import annotations

import glob
import json
import os

from eval_runs import TINY_MAE

from launch.cli import main as cli_main


def test_demo_writes_shards_trains_and_evaluates(tmp_path, capsys):
    data, runs = tmp_path / "digits", tmp_path / "runs"
    args = ["demo", "--data", str(data), "--passes", "2", f"runs_dir={runs}", *TINY_MAE]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "writing scikit-learn's digits as shards" in out
    assert os.path.isfile(data / "train" / "index.json") and os.path.isfile(data / "val" / "index.json")
    run_dir = runs / "demo_mae_infobatch"
    [record] = [json.load(open(path)) for path in glob.glob(str(run_dir / "eval" / "*_raw.json"))]
    assert set(record["metrics"]) == {"masked_mse", "psnr", "ssim", "probe_accuracy"}
    assert f"probe_accuracy {record['metrics']['probe_accuracy']:.4g}" in out
    assert record["details"]["probe_train_samples"] == 100  # the tiny configs' 10 labels per class
    assert os.path.isfile(run_dir / "export" / "encoder.safetensors")

    # A second demo reuses the shards
    assert cli_main([*args[:5], "name=again", *args[5:]]) == 0
    assert "writing scikit-learn's digits" not in capsys.readouterr().out
