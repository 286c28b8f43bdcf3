"""The folder tree is the architecture (docs/design.md, "Layout"): every module imports alone, no
import circle exists between modules nor between sub-packages, each folder imports only what
docs/design.md's table "Who may import whom" allows, and no module repeats its folder's name as a prefix."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pipelines", "pruning", "tools", "launch")
NAMESPACE = "prunepipe"  # the installed name of the four folders (pyproject.toml's package-dir)
DESIGN = os.path.join(ROOT, "docs", "design.md")


def project_modules() -> dict[str, str]:
    """Dotted module name -> path relative to the repository, for every .py of the packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.relpath(os.path.join(folder, name), ROOT)
                    dotted = NAMESPACE + "." + path[:-3].replace(os.sep, ".")  # as installed: prunepipe.X
                    found[dotted.removesuffix(".__init__")] = path.replace(os.sep, "/")
    return found


def imports_of(path: str, dotted: str, modules: dict[str, str]) -> set[str]:
    """Project modules `path` imports anywhere in its body (functions included), with the packages
    whose __init__ each import runs."""
    is_package = path.endswith("__init__.py")
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = dotted.split(".") if is_package else dotted.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            named.add(source)
            named.update(f"{source}.{alias.name}" for alias in node.names)  # submodules imported by name
    targets = set()
    for name in named:
        parts = name.split(".")
        for end in range(1, len(parts) + 1):  # a.b.c runs a/__init__, a/b/__init__, a/b/c
            prefix = ".".join(parts[:end])
            if prefix in modules:
                targets.add(prefix)
    own_packages = {".".join(dotted.split(".")[:end]) for end in range(1, dotted.count(".") + 1)}
    return targets - own_packages - {dotted}  # Python runs a module's own packages before it anyway


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {dotted: imports_of(path, dotted, modules) for dotted, path in modules.items()}


def test_every_module_imports_alone_in_a_fresh_interpreter():
    # One interpreter loads the third-party libraries once; each project module is then imported in
    # a forked child that has imported no project module yet: a circle or a missing import fails there.
    # The lazily loaded parts of diffusers and transformers are loaded up front too (each child paid
    # them again: 27 s of 34), and two children run at a time on the two cores.
    modules = sorted(m for m in project_modules() if not m.endswith("__main__"))
    script = textwrap.dedent("""
        import importlib, os, sys, traceback
        for heavy in ("torch", "diffusers", "timm", "accelerate", "webdataset", "torchmetrics", "sklearn",
                      "skimage", "matplotlib", "omegaconf", "safetensors", "scipy", "PIL", "torchvision",
                      "transformers", "diffusers.training_utils", "diffusers.models", "diffusers.schedulers",
                      "diffusers.pipelines.ddpm"):
            importlib.import_module(heavy)
        assert not [m for m in sys.modules if m.split(".")[0] == "prunepipe"]
        failed, running = [], {}

        def reap():
            pid, status = os.wait()
            name, read = running.pop(pid)
            message = b""
            while chunk := os.read(read, 65536):
                message += chunk
            os.close(read)
            if status != 0:
                failed.append(name + ": " + message.decode())

        for name in sys.argv[1:]:
            if len(running) == 2:
                reap()
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                try:
                    importlib.import_module(name)
                    code = 0
                except BaseException:
                    os.write(write, traceback.format_exc(limit=3).encode())  # short: fits the pipe's buffer
                    code = 1
                os._exit(code)
            os.close(write)
            running[pid] = (name, read)
        while running:
            reap()
        print("\\n".join(sorted(failed)))
        sys.exit(1 if failed else 0)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},  # this tree's modules, whatever is installed
    )
    assert done.returncode == 0, f"modules that do not import alone:\n{done.stdout}{done.stderr[-3000:]}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_import_circle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_find_cycle_sees_a_circle_through_function_level_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def sub_package(path: str) -> str:
    """The unit of docs/design.md's "no circle between sub-packages": a folder of pipelines/ or tools/,
    a module directly in pipelines/, pruning/, launch/ (a path or a folder `x/` of the repository)."""
    parts = path.rstrip("/").removesuffix(".py").split("/")
    if parts[0] in ("pipelines", "tools") and len(parts) > 1 and parts[1] != "__init__":
        return f"{parts[0]}/{parts[1]}"
    return parts[0]


def sub_package_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {unit it imports: ["module imports module", ...]}, from every import statement of
    every module (inside functions too); a unit's imports of itself left out."""
    modules, graph = project_modules(), import_graph()
    units: dict[str, dict[str, list[str]]] = {}
    for dotted, targets in graph.items():
        unit = sub_package(modules[dotted])
        edges = units.setdefault(unit, {})
        for target in sorted(targets):
            if sub_package(modules[target]) != unit:
                edges.setdefault(sub_package(modules[target]), []).append(
                    f"{modules[dotted]} imports {modules[target]}"
                )
    return units


def test_no_import_circle_between_sub_packages():
    units = sub_package_graph()
    cycle = find_cycle({unit: set(edges) for unit, edges in units.items()})
    if cycle is not None:
        why = [f"  {a} -> {b}: {'; '.join(units[a][b][:3])}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("sub-packages in an import circle: " + " -> ".join(cycle) + "\n" + "\n".join(why))


def test_sub_packages_are_folders_and_the_modules_of_pipelines():
    assert sub_package("pipelines/evaluation/runner.py") == "pipelines/evaluation"
    assert sub_package("pipelines/tasks/diffusion/dit.py") == "pipelines/tasks"
    assert sub_package("pipelines/trained.py") == "pipelines/trained"
    assert sub_package("pipelines/__init__.py") == sub_package("pipelines/") == "pipelines"
    assert sub_package("tools/benchmarks/lossless/run.py") == sub_package("tools/benchmarks/") == "tools/benchmarks"
    assert sub_package("launch/cli/bench.py") == "launch"
    assert sub_package("pruning/bitmap.py") == "pruning"


def test_the_rules_of_docs_design_allow_no_circle_between_sub_packages():
    units = {sub_package(path) for path in project_modules().values()}
    allowed: dict[str, set[str]] = {}
    for unit, targets in import_rules().items():
        for target in targets:  # a folder allows every unit in it (`pipelines/`: all of pipelines)
            reached = (
                {u for u in units if (u + "/").startswith(target)} if target.endswith("/") else {sub_package(target)}
            )
            allowed.setdefault(sub_package(unit), set()).update(reached - {sub_package(unit)})
    cycle = find_cycle(allowed)
    assert cycle is None, "docs/design.md's table allows an import circle: " + " -> ".join(cycle)


def import_rules() -> dict[str, list[str]]:
    """docs/design.md's table "Who may import whom": unit (a folder `x/` or a module `x/y.py`) ->
    the project folders and modules it may import besides its own folder."""
    text = open(DESIGN).read()
    section = text.split("### Who may import whom", 1)[1].split("\n#", 1)[0]
    rules = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        allowed = re.findall(r"`([^`]+)`", cells[1])
        for unit in re.findall(r"`([^`]+)`", cells[0]):
            rules[unit] = allowed
    return rules


def rule_of(path: str, rules: dict[str, list[str]]) -> str | None:
    """The most specific rule for `path`: the module itself, else its nearest folder."""
    if path in rules:
        return path
    folder = path.rsplit("/", 1)[0]
    while folder:
        if folder + "/" in rules:
            return folder + "/"
        folder = folder.rsplit("/", 1)[0] if "/" in folder else ""
    return None


def test_imports_follow_the_rules_of_docs_design():
    rules = import_rules()
    assert {
        "pruning/",
        "pipelines/data/",
        "pipelines/tasks/",
        "pipelines/training/",
        "pipelines/evaluation/",
        "pipelines/report/",
        "tools/commands/",
        "tools/fixtures/",
        "tools/benchmarks/",
        "launch/",
    } <= set(rules)
    modules, graph = project_modules(), import_graph()
    broken, unruled = [], []
    for dotted, targets in graph.items():
        path = modules[dotted]
        if path.endswith("__init__.py") and not targets:
            continue  # a docstring-only package init (the test below says which inits may import)
        unit = rule_of(path, rules)
        if unit is None:
            unruled.append(path)
            continue
        allowed = list(rules[unit]) + ([unit] if unit.endswith("/") else [])
        for target in targets:
            target_path = modules[target]
            if target_path.endswith("__init__.py") and not graph[target]:
                continue  # a docstring-only package init that Python runs on the way: no dependency
            if not any(target_path == a or (a.endswith("/") and target_path.startswith(a)) for a in allowed):
                broken.append(f"{path} imports {target_path} (rule {unit}: {', '.join(rules[unit]) or 'nothing'})")
    assert not unruled, f"modules no rule of docs/design.md covers: {unruled}"
    assert not broken, "imports docs/design.md does not allow:\n" + "\n".join(sorted(broken))


# the package inits that hold code: pruning's contract, re-exported; the command line's entry point
INITS_WITH_CODE = ("pruning/__init__.py", "launch/cli/__init__.py")


def test_package_inits_import_nothing_of_the_project_but_pruning_s_contract_and_the_command_line():
    graph, modules = import_graph(), project_modules()
    for dotted, path in modules.items():
        if path.endswith("__init__.py") and path not in INITS_WITH_CODE:
            assert not graph[dotted], f"{path} imports {sorted(graph[dotted])}: keep package inits docstring-only"


def named_with_its_folder_prefix(path: str) -> bool:
    """`report/report_plots.py`, `evaluation/evaluate_fid.py`: the folder's name said twice."""
    folder, stem = path.split("/")[-2], os.path.basename(path)[:-3]
    word = stem.split("_")[0]
    return stem == folder or ("_" in stem and word[:5] == folder[:5])


def test_no_module_is_named_with_its_folder_prefix():
    assert named_with_its_folder_prefix("pipelines/report/report_plots.py")
    assert named_with_its_folder_prefix("pipelines/evaluation/evaluate_fid.py")
    assert not named_with_its_folder_prefix("pipelines/report/plots.py")
    offenders = [
        p
        for p in project_modules().values()
        if "/" in p and not p.endswith("__init__.py") and named_with_its_folder_prefix(p)
    ]
    assert not offenders, offenders


def test_the_loop_asks_of_a_task_only_what_the_task_protocol_declares_and_both_tasks_provide_it():
    """pipelines/tasks/protocol.py is the whole interface: every `task.NAME` in pipelines/training/ is one of
    its members, and MAETask and DiffusionTask have them all."""
    import typing

    from prunepipe.pipelines.tasks.protocol import Task

    declared = set(typing.get_type_hints(Task)) | {n for n in vars(Task) if not n.startswith("_")}
    used = {}
    training = os.path.join(ROOT, "pipelines", "training")
    for path in sorted(os.path.join(training, name) for name in os.listdir(training) if name.endswith(".py")):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "task":
                used.setdefault(node.attr, os.path.basename(path))
    undeclared = {name: where for name, where in used.items() if name not in declared}
    assert used and not undeclared, f"the loop uses task members the Task protocol does not declare: {undeclared}"

    from prunepipe.pipelines.tasks.diffusion.config import DiffusionConfig
    from prunepipe.pipelines.tasks.diffusion.task import DiffusionTask
    from prunepipe.pipelines.tasks.mae import MAEConfig, MAETask

    tasks = [
        MAETask(
            MAEConfig(
                embed_dim=16,
                depth=1,
                num_heads=2,
                decoder_embed_dim=16,
                decoder_depth=1,
                decoder_num_heads=2,
                patch_size=4,
            ),
            image_size=8,
            channels=1,
        ),
        DiffusionTask(DiffusionConfig(), image_size=8, channels=1),
    ]
    for task in tasks:
        assert isinstance(task, Task), type(task).__name__


def test_the_loop_reads_in_one_sitting():
    # the loop is the file everyone reads first: what it sets up and accounts lives in the modules that own it
    with open(os.path.join(ROOT, "pipelines", "training", "loop.py")) as f:
        lines = f.read().count("\n")
    assert lines < 320, f"pipelines/training/loop.py has {lines} lines; move setup or accounting to its owner"


def test_the_layout_map_of_docs_design_names_every_module_and_only_modules_that_exist():
    """The map in docs/design.md ("## Layout") is the reader's way in: every module of the four folders
    is named in it (its file name under its folder's line), and every file it names exists there."""
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        text = f.read()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    named = set(re.findall(r"[\w/]*?([a-z_0-9]+\.(?:py|sh))\b", block))
    files = {}
    for top in ("pipelines", "pruning", "launch", "tools"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if name.endswith((".py", ".sh")) and name != "__init__.py" and "__pycache__" not in folder:
                    files.setdefault(name, []).append(os.path.relpath(os.path.join(folder, name), ROOT))
    unnamed = sorted(
        path for name, paths in files.items() for path in paths if name not in named and name != "__main__.py"
    )
    missing = sorted(name for name in named if name not in files)
    assert not unnamed, f"modules the map of docs/design.md does not name: {unnamed}"
    assert not missing, f"files the map of docs/design.md names that do not exist: {missing}"


def test_the_four_folders_install_as_the_prunepipe_namespace_and_are_imported_only_by_it():
    """src/prunepipe/ is the namespace: a relative link to each of the four folders and to configs/, nothing
    else, and pyproject.toml finds the packages there (no generic top-level names in a user's environment,
    and src/ is what an editable install puts on sys.path); no module or test imports a folder by its bare
    name (which would load a second copy of it from the working directory)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert setuptools["packages"] == {"find": {"where": ["src"]}}
    assert "package-dir" not in setuptools
    namespace = os.path.join(ROOT, "src", NAMESPACE)
    links = {name: os.readlink(os.path.join(namespace, name)) for name in os.listdir(namespace)}
    assert links == {name: f"../../{name}" for name in (*PACKAGES, "configs")}
    bare = []
    sources = list(project_modules().values()) + [
        os.path.join("tests", n) for n in os.listdir(os.path.join(ROOT, "tests")) if n.endswith(".py")
    ]
    for path in sources:
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and not node.level
                else []
            )
            bare += [f"{path}: {name}" for name in names if name.split(".")[0] in PACKAGES]
    assert not bare, f"imports of a folder by its bare name, not {NAMESPACE}.: {bare}"


def test_the_code_is_as_the_formatter_writes_it():
    """One layout for every file: `make format` (ruff: its format and its import order, pyproject.toml)."""
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    for command in ([ruff, "format", "--check", "--quiet", "."], [ruff, "check", "--quiet", "."]):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(command[1:])}: run `make format`\n{done.stdout}{done.stderr}"


def test_design_pruner_contract_names_the_base_class_methods():
    """docs/design.md's "Pruners" block lists the contract: every public method of `Pruner` that the loop
    and the stream call is named there, and every name there exists on `Pruner`."""
    import re as _re

    from prunepipe.pruning.base import Pruner

    with open(DESIGN) as f:
        text = f.read()
    block = text[text.index("class Pruner:") :]
    block = block[: block.index("```")]
    named = set(_re.findall(r"def (\w+)\(", block)) | set(_re.findall(r"^\s+(\w+): ", block, flags=_re.M))
    called = {"plan", "weights", "update", "on_step", "stats", "state_dict", "load_state_dict", "frozen_plan"}
    assert called <= named, f"docs/design.md's pruner contract leaves out {sorted(called - named)}"
    assert all(hasattr(Pruner, name) for name in named), [n for n in named if not hasattr(Pruner, n)]
