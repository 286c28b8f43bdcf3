"""The command line as a package of command groups (launch/cli/): a shard source is one registry entry
(tools/commands/source_registry.py) that `shards write` offers and writes; `--help` and a mistyped config
answer without torch; eval's flags are shorthands of eval keys, checked as the keys are; every benchmark
program under tools/benchmarks/ is a `prunepipe bench NAME`."""

from __future__ import annotations

import ast
import glob
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from prunepipe.launch.cli import build_parser, main
from prunepipe.launch.cli.bench import BENCHES
from prunepipe.pipelines.config import load_config, to_yaml
from prunepipe.pipelines.data.shards import ShardIndex, read_shard
from prunepipe.tools.commands.source_registry import SHARD_SOURCES, ShardSource, SourceOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "mae_tiny_infobatch.yaml")


def stripes(options: SourceOptions):
    """Ten images of vertical stripes, i + 1 pixels apart; class = i % 2."""
    for i in range(10):
        pixels = np.zeros((options.size, options.size, 3), dtype=np.uint8)
        pixels[:, :: i + 1] = 255
        yield f"stripes_{i:02d}", Image.fromarray(pixels), i % 2


def test_a_shard_source_is_one_registry_entry_that_shards_write_offers_and_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(SHARD_SOURCES, "stripes", ShardSource("ten striped images", items=stripes))
    with pytest.raises(SystemExit):
        main(["shards", "write", "--help"])
    assert "stripes: ten striped images" in " ".join(capsys.readouterr().out.split())

    argv = ["shards", "write", "--source", "stripes", "--out", str(tmp_path), "--resolution", "8"]
    assert main([*argv, "--val-fraction", "0.2", "--shard-size", "3"]) == 0
    assert f"train: {tmp_path / 'train' / 'index.json'}" in capsys.readouterr().out
    train, val = ShardIndex.load(str(tmp_path / "train")), ShardIndex.load(str(tmp_path / "val"))
    assert (train.num_samples, val.num_samples, len(train)) == (8, 2, 3)  # 8 samples in shards of 3
    assert train.meta["source"] == "stripes" and train.meta["size"] == 8
    samples = [sample for url in train.urls + val.urls for _, sample in read_shard(url)]
    assert sorted(s["__key__"] for s in samples) == [f"stripes_{i:02d}" for i in range(10)]
    for sample in samples:
        i = int(sample["__key__"][-2:])
        with Image.open(io.BytesIO(sample["png"])) as image:
            assert image.size == (8, 8) and np.asarray(image)[0, :: i + 1].min() == 255
        assert sample["cls"] == str(i % 2).encode()

    with pytest.raises(SystemExit):  # a name the registry does not hold is refused by the parser
        build_parser().parse_args(["shards", "write", "--source", "nowhere", "--out", str(tmp_path)])


def test_a_registered_source_names_its_items_or_its_writer_not_both():
    with pytest.raises(ValueError, match="items or write, one of them"):
        ShardSource("both", items=stripes, write="prunepipe.tools.commands.shards:write_redundant")
    with pytest.raises(ValueError, match="items or write, one of them"):
        ShardSource("neither")


def test_help_and_a_mistyped_config_answer_without_torch():
    # a fresh interpreter: what building the parser and failing on the config imports, nothing of it loaded before
    commands = [
        ["--help"],
        *[[group, "--help"] for group in ("shards", "latents", "eval", "export", "sample", "compare", "bench")],
        ["shards", "write", "--help"],
        ["bench", "lossless", "--help"],
        ["train", TINY, "data.train=/nowhere", "data.batchsize=3"],
    ]
    script = (
        "import contextlib, io, json, sys\n"
        "from prunepipe.launch.cli import main\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except SystemExit as e:\n"
        "            code = e.code\n"
        "    print(json.dumps([argv[0], code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'diffusers'})]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(commands)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert [code for _, code, _ in answers] == [0] * (len(commands) - 1) + [2]  # the typo: exit 2
    assert [heavy for _, _, heavy in answers] == [[]] * len(commands)


def test_eval_flags_set_eval_keys_and_are_checked_as_the_keys_are(tmp_path, capsys):
    args = build_parser().parse_args(["eval", "RUN", "probe.pool=avg", "--weights", "raw", "--fid-samples", "7"])
    assert (args.overrides, args.key_flags) == (["probe.pool=avg"], ["weights=raw", "fid.num_samples=7"])
    cfg = load_config(TINY, ["data.train=/nowhere/train", "data.val=", f"runs_dir={tmp_path}", "name=run"])
    os.makedirs(cfg.run_dir)
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    capsys.readouterr()
    assert main(["eval", cfg.run_dir, "--weights", "best"]) == 2
    assert "weights='best' is not accepted; accepted: ema, raw" in capsys.readouterr().err
    assert main(["eval", cfg.run_dir, "--fid-samples", "many"]) == 2
    assert "fid.num_samples" in capsys.readouterr().err


def benchmark_programs() -> set[str]:
    """The modules under tools/benchmarks/ that run as programs (a `main` or a `run_from_args`), dotted."""
    found = set()
    for path in glob.glob(os.path.join(ROOT, "tools", "benchmarks", "**", "*.py"), recursive=True):
        with open(path) as f:
            defined = {node.name for node in ast.parse(f.read()).body if isinstance(node, ast.FunctionDef)}
        if defined & {"main", "run_from_args"}:
            found.add("prunepipe." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, "."))
    return found


# programs under tools/benchmarks/ that measure nothing themselves
NOT_BENCHMARKS = {"prunepipe.tools.benchmarks.gpu_report": "renders docs/gpu.md from what tools/gpu_check.sh measured"}


def test_every_benchmark_is_a_bench_command_with_its_own_flags():
    benches = {module for module, _ in BENCHES.values()}
    assert benchmark_programs() - set(NOT_BENCHMARKS) == benches
    for module in benches:
        with open(os.path.join(ROOT, *module.split(".")[1:]) + ".py") as f:
            defined = {node.name for node in ast.parse(f.read()).body if isinstance(node, ast.FunctionDef)}
        assert {"add_arguments", "run_from_args"} <= defined, module


def test_the_command_line_is_in_pieces():
    folder = os.path.join(ROOT, "launch", "cli")
    lines = {
        name: sum(1 for _ in open(os.path.join(folder, name))) for name in os.listdir(folder) if name.endswith(".py")
    }
    assert lines.pop("__init__.py") < 100
    assert max(lines.values()) <= 300, lines
