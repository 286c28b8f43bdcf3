"""The README as a specification. Every command block that runs on the bundled data runs, in order and as
written, in an empty folder beside the shipped configs (slow: minutes); a block that does not (your own
data under /data, a cluster's launchers, the Makefile's targets) says why in the comment above it. Fast:
every command of every block parses as its program would parse it, each `train` config loads with its
overrides, and each file and module it names exists."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from prunepipe.launch.cli import build_parser
from prunepipe.pipelines.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
NOT_RUN = re.compile(r"<!-- not run by tests/test_readme\.py: (.+?) -->\s*$")
# what makes a block one that cannot run on the bundled data: a block marked so names one of these
ELSEWHERE = ("/data/", "/path/to/", "torchrun ", "sbatch ", "make ")


@dataclass
class Block:
    line: int  # where its ``` starts in README.md (1-based)
    commands: list  # argv lists, comments and line continuations gone
    not_run: str  # why the block does not run on the bundled data; "" when it does


def readme_blocks() -> list[Block]:
    """The README's ```bash blocks in order."""
    with open(README) as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        end = lines.index("```", i + 1)
        marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
        text = "\n".join(lines[i + 1 : end]).replace("\\\n", " ")
        commands = [argv for argv in (shlex.split(line, comments=True) for line in text.splitlines()) if argv]
        blocks.append(Block(i + 1, commands, marker.group(1) if marker else ""))
        i = end + 1
    return blocks


def prunepipe_argv(argv: list[str]) -> list[str] | None:
    """The arguments `prunepipe` gets from a command line (directly or under torchrun), None for another program."""
    if argv[0] == "prunepipe":
        return argv[1:]
    if argv[0] == "torchrun" and "prunepipe.launch.cli" in argv:
        return argv[argv.index("prunepipe.launch.cli") + 1 :]
    return None


def test_every_block_runs_or_says_why_not():
    blocks = readme_blocks()
    assert len(blocks) >= 8 and sum(not b.not_run for b in blocks) >= 6
    for block in blocks:
        text = " ".join(" ".join(argv) + " " for argv in block.commands)
        elsewhere = [marker for marker in ELSEWHERE if marker in text]
        if block.not_run:
            assert elsewhere, (
                f"README.md line {block.line}: marked not run ({block.not_run}), yet it names nothing else"
            )
        else:
            assert not elsewhere, f"README.md line {block.line} names {elsewhere}: mark it not run, saying why"


def test_every_readme_command_parses_and_its_configs_load():
    for block in readme_blocks():
        for argv in block.commands:
            where = f"README.md line {block.line}: {shlex.join(argv)}"
            args = prunepipe_argv(argv)
            if args is not None:
                try:
                    parsed, extra = build_parser(args).parse_known_args(args)
                except SystemExit:
                    pytest.fail(f"{where}: does not parse")
                assert not extra or all("=" in e and not e.startswith("-") for e in extra), where
                if parsed.command == "train":
                    load_config(os.path.join(ROOT, parsed.config), [*parsed.overrides, *extra])
            elif argv[0] == "python":
                assert argv[1] == "-m" and importlib.util.find_spec(argv[2]) is not None, where
            elif argv[0] == "sbatch":
                script = next(a for a in argv[1:] if a.endswith(".sbatch"))
                assert os.path.isfile(os.path.join(ROOT, script)), where
                config = argv[argv.index(script) + 1]
                load_config(os.path.join(ROOT, config), argv[argv.index(config) + 1 :])
            elif argv[0] == "make":
                with open(os.path.join(ROOT, "Makefile")) as f:
                    assert re.search(rf"^{argv[1]}:", f.read(), flags=re.M), where
            else:
                pytest.fail(f"{where}: a program this test does not know")


def as_run(argv: list[str]) -> list[str]:
    """The command line run: `prunepipe` and `python` as this interpreter runs them."""
    if argv[0] == "prunepipe":
        return [sys.executable, "-m", "prunepipe.launch.cli", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    raise AssertionError(f"{shlex.join(argv)}: not a command this test runs")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_blocks_on_bundled_data_run_in_order_as_written(tmp_path):
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")  # the README's paths are the repository's
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    took = []
    for block in readme_blocks():
        for argv in [] if block.not_run else block.commands:
            start = time.perf_counter()
            done = subprocess.run(as_run(argv), cwd=tmp_path, env=env, capture_output=True, text=True)
            took.append((time.perf_counter() - start, shlex.join(argv)))
            output = (done.stdout + done.stderr)[-3000:]
            assert done.returncode == 0, f"README.md line {block.line}: {shlex.join(argv)} failed:\n{output}"
    print("\n".join(f"{seconds:7.1f} s  {command}" for seconds, command in took))
