"""pipelines/atomic_write.py: a file is replaced whole or not at all (the old content stays when the
write fails anywhere), no temporary is left behind, two writers never share a temporary, and no
module of the project renames files by hand beside it."""

from __future__ import annotations

import ast
import errno
import json
import os
import subprocess
import sys

import pytest

from prunepipe.pipelines.atomic_write import (
    atomic_open,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    move_into_place,
    sync_directory,
)
from prunepipe.pipelines.evaluation.records import write_record
from prunepipe.pipelines.writer_names import host_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pipelines", "pruning", "tools", "launch")


def test_each_writer_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = str(tmp_path / "f")
    atomic_write_bytes(path, b"\x00bytes")
    assert open(path, "rb").read() == b"\x00bytes"
    atomic_write_text(path, "text\n")
    assert open(path).read() == "text\n"
    atomic_write_json(path, {"b": 1, "a": [2]}, indent=1, sort_keys=True)
    assert open(path).read() == json.dumps({"b": 1, "a": [2]}, indent=1, sort_keys=True)
    with atomic_open(path, "w") as f:
        f.write("opened")
    assert open(path).read() == "opened"
    assert os.listdir(tmp_path) == ["f"]


def test_an_error_inside_the_block_leaves_the_old_content_and_no_temporary(tmp_path):
    path = str(tmp_path / "f.json")
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError, match="mid-way"):
        with atomic_open(path, "w") as f:
            f.write("half of the new")
            f.flush()
            assert len(os.listdir(tmp_path)) == 2  # the temporary, beside the target
            raise RuntimeError("mid-way")
    assert open(path).read() == "old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_a_new_file_that_fails_is_never_created(tmp_path):
    with pytest.raises(TypeError):
        atomic_write_json(str(tmp_path / "new.json"), {"not json": object()})
    assert os.listdir(tmp_path) == []


def test_a_failed_rename_leaves_the_old_content_and_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / "f")
    atomic_write_text(path, "old")

    def no_room(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_room)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(path, "new")
    with pytest.raises(OSError, match="No space"):
        write_record(str(tmp_path), {"optimizer_steps": 3, "metrics": {}})
    monkeypatch.undo()
    assert open(path).read() == "old"
    assert sorted(os.listdir(tmp_path)) == ["eval", "f"]
    assert os.listdir(tmp_path / "eval") == []


def test_a_failed_sync_leaves_the_old_content_and_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / "f")
    atomic_write_text(path, "old")

    def broken_disk(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_disk)
    with pytest.raises(OSError, match="Input/output"):
        atomic_write_bytes(path, b"new")
    monkeypatch.undo()
    assert open(path).read() == "old"
    assert os.listdir(tmp_path) == ["f"]


def test_a_folder_the_file_system_cannot_sync_is_no_error(tmp_path, monkeypatch):
    def refused(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", refused)
    sync_directory(str(tmp_path))  # the rename stands; only a real I/O error is raised


def test_a_named_file_written_over_time_is_moved_into_place(tmp_path):
    partial, path = str(tmp_path / "t.tar.x.partial"), str(tmp_path / "t.tar")
    with open(partial, "wb") as f:
        f.write(b"shard")
    move_into_place(partial, path)
    assert os.listdir(tmp_path) == ["t.tar"] and open(path, "rb").read() == b"shard"


def test_only_a_whole_new_file_is_written():
    with pytest.raises(ValueError, match="mode"):
        with atomic_open("x", "a"):
            pass


SEEN_TEMPORARY = """
import os, sys
from prunepipe.pipelines.atomic_write import atomic_open
path = sys.argv[1]
with atomic_open(path, "w") as f:
    print(sorted(set(os.listdir(os.path.dirname(path))) - {os.path.basename(path)})[0])
    f.write(str(os.getpid()))
"""


def test_two_processes_writing_one_file_use_temporaries_of_their_own(tmp_path):
    path = str(tmp_path / "index.json")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    names = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", SEEN_TEMPORARY, path], capture_output=True, text=True, env=env, check=True
        )
        names.append(done.stdout.strip())
    assert names[0] != names[1]
    for name in names:  # INDEX.HOST.PID-TOKEN.tmp: another host, process or call never takes it
        assert name.startswith(f"index.json.{host_id()}.") and name.endswith(".tmp")
    assert names[0].split(".")[-2].split("-")[0] != names[1].split(".")[-2].split("-")[0]  # the PIDs
    assert os.listdir(tmp_path) == ["index.json"]


# The renames that are not a file written whole: each (module, function) with its reason.
RENAMES_ALLOWED = {
    ("pipelines/atomic_write.py", "move_into_place"): "the one rename of a file written whole",
    (
        "pipelines/checkpoint/store.py",
        "_seal",
    ): "a whole checkpoint folder, every rank's files in it, renamed into place",
    ("pipelines/checkpoint/store.py", "abandon_newer"): "newer checkpoint folders moved aside on a rollback",
}


def renames_in(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of every os.replace / os.rename / shutil.move / X.rename(...) (a
    pathlib rename) in a module's source, and of every import of those names from os or shutil."""
    tree = ast.parse(source)
    found = []

    def visit(node, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.ImportFrom) and child.module in ("os", "shutil"):
                if {a.name for a in child.names} & {"replace", "rename", "renames", "move"}:
                    found.append((function, child.lineno))
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                owner = child.func.value.id if isinstance(child.func.value, ast.Name) else ""
                attr = child.func.attr
                if (owner == "os" and attr in ("replace", "rename", "renames")) or (
                    owner == "shutil" and attr == "move"
                ):
                    found.append((function, child.lineno))
                elif attr == "rename":  # pathlib's
                    found.append((function, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_renames_are_found_wherever_they_are_written():
    source = """
import os, shutil
from os import replace
def f(tmp, path):
    os.replace(tmp, path)
    def inner():
        shutil.move(tmp, path)
    Path(tmp).rename(path)
    return "a.tmp".replace(".tmp", "")
os.rename("a", "b")
"""
    assert renames_in(source) == [("<module>", 3), ("f", 5), ("inner", 7), ("f", 8), ("<module>", 10)]


def test_no_module_renames_files_by_hand_beside_atomic_write():
    found = []
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")
                    source = open(os.path.join(ROOT, path)).read()
                    found += [(path, function, line) for function, line in renames_in(source)]
    unlisted = [
        f"{path}:{line} ({function})" for path, function, line in found if (path, function) not in RENAMES_ALLOWED
    ]
    assert not unlisted, (
        "write a file whole with prunepipe.pipelines.atomic_write (atomic_open, atomic_write_*, move_into_place), "
        "or list a rename that is not a file write in RENAMES_ALLOWED with its reason:\n" + "\n".join(unlisted)
    )
    assert {(path, function) for path, function, _ in found} == set(RENAMES_ALLOWED)  # no stale entry
