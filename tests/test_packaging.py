"""The package as others meet it: static analysers resolve `prunepipe.*` in the editable install (they run
no import hook: src/ is on sys.path by a plain .pth line), a bare folder name imports nothing outside the
repository, and a wheel holds every module and config and runs the demo from a venv that cannot see the
checkout (pyproject.toml, docs/design.md "Layout")."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest
from eval_runs import TINY_MAE
from test_layout import PACKAGES, ROOT, project_modules

PROBE = textwrap.dedent("""
    from prunepipe.pipelines.config import load_config
    from prunepipe.pruning import build_pruner

    reveal_type(load_config)
    reveal_type(build_pruner)
""")


# Every task provides the Task protocol, and the builder, the loop and the evaluator hold a task as a Task;
# a class with a model alone is refused as one (the one error expected)
TASK_PROBE = textwrap.dedent("""
    from prunepipe.pipelines.evaluation.runner import Evaluator
    from prunepipe.pipelines.tasks.build import build_task
    from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask
    from prunepipe.pipelines.tasks.mae import MAETask
    from prunepipe.pipelines.tasks.protocol import Task
    from prunepipe.pipelines.training.loop import Trainer

    def tasks(mae: MAETask, ldm: DiffusionTask) -> list[Task]:
        return [mae, ldm]

    def held(trainer: Trainer) -> None:
        reveal_type(trainer.task)

    reveal_type(build_task)
    reveal_type(Evaluator.evaluate)

    class NoLoss:
        model = None

    broken: Task = NoLoss()
""")
SKIP_THIRD_PARTY = "[mypy]\nfollow_imports = skip\n[mypy-prunepipe.*]\nfollow_imports = silent\n"


def run_mypy(folder, *options: str, probe_text: str = PROBE, targets=None) -> subprocess.CompletedProcess:
    """mypy, as the dev environment runs it, on PROBE (or `targets`) from a folder outside the repository."""
    probe = folder / "probe.py"
    probe.write_text(probe_text)
    command = [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", str(folder / "cache"), *options]
    targets = [str(probe)] if targets is None else targets
    return subprocess.run([*command, *targets], cwd=folder, capture_output=True, text=True, timeout=600)


def assert_mypy_resolved(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout + done.stderr  # no import-not-found, no import-untyped
    assert "-> prunepipe.pipelines.config.RunConfig" in done.stdout, done.stdout  # read the source, not Any
    assert "-> prunepipe.pruning.base.Pruner" in done.stdout, done.stdout


def test_mypy_finds_the_namespace_of_the_editable_install(tmp_path):
    # The project followed silently, third-party packages skipped: 2 s of CPU, where following torch's
    # sources too takes a minute (the slow test below runs exactly that)
    (tmp_path / "mypy.ini").write_text(SKIP_THIRD_PARTY)
    assert_mypy_resolved(run_mypy(tmp_path, "--config-file", str(tmp_path / "mypy.ini")))


def test_mypy_checks_the_task_protocol_on_every_task_the_builder_the_loop_and_the_evaluator(tmp_path):
    (tmp_path / "mypy.ini").write_text(SKIP_THIRD_PARTY)
    config = ["--config-file", str(tmp_path / "mypy.ini")]
    builder = run_mypy(tmp_path, *config, targets=["-m", "prunepipe.pipelines.tasks.build"])
    assert builder.returncode == 0, builder.stdout + builder.stderr  # each builder returns a Task
    done = run_mypy(tmp_path, *config, probe_text=TASK_PROBE)
    task = "prunepipe.pipelines.tasks.protocol.Task"
    assert f'Revealed type is "{task}"' in done.stdout, done.stdout  # the loop's
    assert f"-> {task}" in done.stdout, done.stdout  # the builder's
    assert f"task: {task}, model" in done.stdout, done.stdout  # the evaluator's
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and 'type "NoLoss", variable has type "Task"' in errors[0], done.stdout


@pytest.mark.slow
def test_mypy_follow_imports_silent_finds_the_namespace(tmp_path):
    assert_mypy_resolved(run_mypy(tmp_path, "--follow-imports=silent"))


def test_the_namespace_imports_from_the_repository_and_a_bare_folder_name_from_nowhere(tmp_path):
    script = "import os, prunepipe.launch.configs as c; print(os.path.realpath(c.__file__), c.CONFIGS)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    root = os.path.realpath(ROOT)
    assert done.stdout.split() == [os.path.join(root, "launch", "configs.py"), os.path.join(root, "configs")], (
        done.stderr
    )
    for bare in PACKAGES:
        done = subprocess.run([sys.executable, "-c", f"import {bare}"], cwd=tmp_path, env=env, capture_output=True)
        assert done.returncode != 0, f"`import {bare}` works outside the repository"


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """The wheel, built from a copy of the sources, installed into a fresh venv whose only other path is the
    dev environment's site-packages as a plain directory: its .pth files (the editable install's src/) are
    not read there, so `prunepipe` can come from the wheel alone. Nothing is downloaded."""
    pytest.importorskip("setuptools", minversion="77")  # pyproject's build backend, used without isolation
    top = tmp_path_factory.mktemp("wheel")
    source = top / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "src", "configs", *PACKAGES):
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    done = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(top), str(source)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = glob.glob(str(top / "prunepipe-*.whl"))
    venv = top / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(purelib, "dev_dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run(
        [*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return wheel, venv, purelib


def in_venv(venv, *command: str, cwd) -> str:
    """A command of the wheel's venv, run outside the repository, with nothing of it on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, cwd=cwd, env={**env, "PATH": f"{venv}/bin:{env['PATH']}"}, capture_output=True)
    output = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0, f"{' '.join(command)}:\n{output[-4000:]}"
    return done.stdout.decode()


def test_the_wheel_holds_every_module_and_config_and_imports_alone(wheel_venv, tmp_path):
    wheel, venv, purelib = wheel_venv
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {f"prunepipe/{path}" for path in project_modules().values()}
    shipped = glob.glob(os.path.join(ROOT, "configs", "*.yaml")) + glob.glob(os.path.join(ROOT, "configs", "*.txt"))
    configs = {f"prunepipe/configs/{os.path.basename(p)}" for p in shipped}
    marks = {f"prunepipe/{p}/py.typed" for p in PACKAGES} | {"prunepipe/launch/slurm.sbatch"}
    assert not (modules | configs | marks) - names, sorted((modules | configs | marks) - names)
    assert not [n for n in names if not n.startswith(("prunepipe/", "prunepipe-"))], "top-level names besides prunepipe"

    # prunepipe and its configs come from the venv; no path of the repository is on sys.path
    script = "import json, sys, prunepipe.launch.cli as c; print(json.dumps([c.__file__, sys.path]))"
    cli, path = json.loads(in_venv(venv, "python", "-c", script, cwd=tmp_path))
    installed = os.path.join(purelib, "prunepipe")
    assert cli == os.path.join(installed, "launch", "cli", "__init__.py")
    root, dependencies = os.path.realpath(ROOT), os.path.realpath(sysconfig.get_paths()["purelib"])
    seen = [os.path.realpath(p or tmp_path) for p in path]
    assert not [p for p in seen if p.startswith(root + os.sep) and p != dependencies], path  # .venv may be in ROOT
    assert in_venv(venv, "prunepipe", "configs", cwd=tmp_path).strip() == os.path.join(installed, "configs")


@pytest.mark.slow
def test_the_wheel_runs_the_demo_and_trains_a_shipped_config_from_any_folder(wheel_venv, tmp_path):
    # 53 s on 2 cores, 90 s when they are busy: the digits written as shards, a pruned run and its two Full
    # runs, evaluated, compared; then a shipped config trained from another folder
    _, venv, purelib = wheel_venv
    (tmp_path / "demo").mkdir()
    out = in_venv(venv, "prunepipe", "demo", "--passes", "2", "--seeds", "1", *TINY_MAE, cwd=tmp_path / "demo")
    assert "writing scikit-learn's digits as shards" in out and "Verdicts for demo_mae_infobatch" in out
    config = os.path.join(purelib, "prunepipe", "configs", "mae_tiny_full.yaml")
    data = tmp_path / "demo" / "data" / "digits"
    (tmp_path / "elsewhere").mkdir()
    overrides = [f"data.train={data}/train", f"data.val={data}/val", "num_passes=1", "name=elsewhere", *TINY_MAE]
    out = in_venv(venv, "prunepipe", "train", config, *overrides, cwd=tmp_path / "elsewhere")
    assert "run folder: runs/elsewhere" in out, out
    assert os.path.isfile(tmp_path / "elsewhere" / "runs" / "elsewhere" / "metrics.jsonl")


# pyproject.toml's floors against what the code needs: (requirement, lowest version that has it, a line of
# the code that needs it, its file, where the version comes from). NumPy 2 changed the C ABI: a compiled
# package built against NumPy 1 does not load beside NumPy 2, so with numpy>=2.0 every compiled dependency's
# floor is its first release built against NumPy 2.
FLOORS = [
    ("python", "3.11", "import tomllib", "tests/test_layout.py", "What's New in Python 3.11: tomllib"),
    ("numpy", "2.0", "np.bitwise_count(", "pruning/bitmap.py", "NumPy 2.0.0 release notes: new ufunc bitwise_count"),
    (
        "timm",
        "1.0.16",
        '"local-dir:',
        "tools/commands/feature_models.py",
        "timm PR #2476; 1.0.15's _factory.py lacks it",
    ),
    (
        "diffusers",
        "0.29",
        "FlowMatchEulerDiscreteScheduler",
        "pipelines/tasks/diffusion/task.py",
        "diffusers 0.29.0 (Stable Diffusion 3) adds the flow-matching scheduler",
    ),
    ("torch", "2.4", "import torch", "pruning/sync.py", "PyTorch 2.4.0 release notes: NumPy 2 support"),
    ("torchvision", "0.19", "from torchvision", "pipelines/data/decode.py", "the release paired with torch 2.4"),
    ("scipy", "1.13", "from scipy import stats", "pipelines/report/frontier.py", "SciPy 1.13.0: built against NumPy 2"),
    ("scikit-learn", "1.4.2", "from sklearn", "pipelines/evaluation/probe.py", "scikit-learn 1.4.2: NumPy 2 support"),
    ("scikit-image", "0.24", "import skimage", "tools/commands/sources.py", "scikit-image 0.24.0: NumPy 2 support"),
    ("matplotlib", "3.8.4", "import matplotlib", "pipelines/report/plots.py", "Matplotlib 3.8.4: NumPy 2 support"),
    ("pyarrow", "16", "import pyarrow", "tools/commands/embedding_import.py", "numpy/numpy#26191: 16.0 the first"),
    ("faiss-cpu", "1.9", "import faiss", "tools/commands/near_duplicates.py", "1.8.0.post1 requires numpy<2, 1.9.0 <3"),
]


def test_dependency_floors_are_at_least_what_the_code_uses():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    floors = {"python": project["requires-python"].removeprefix(">=")}
    for line in project["dependencies"]:
        requirement = Requirement(line)
        floors[requirement.name] = next((s.version for s in requirement.specifier if s.operator == ">="), "0")
    low = []
    for name, needed, use, path, _ in FLOORS:
        with open(os.path.join(ROOT, path)) as f:
            assert use in f.read(), f"{path} no longer has {use!r}: drop or move its row of FLOORS"
        if Version(floors[name]) < Version(needed):
            low.append(f"{name}>={floors[name]}, but {path} needs {needed} ({use})")
    assert not low, "floors below what the code uses:\n" + "\n".join(low)
