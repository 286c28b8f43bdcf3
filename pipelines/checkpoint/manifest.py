"""A checkpoint's manifest: every file's size and CRC-32, written last, so a checkpoint is intact only
if its manifest verifies. Catches what the atomic rename cannot: a file truncated, deleted or changed
after the checkpoint was complete (a node failure on a shared file system, a bad disk, a partial copy).
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from typing import Callable

from prunepipe.pipelines.atomic_write import atomic_write_json

MANIFEST = "manifest.json"
# 1: accelerate's save_state (model.safetensors, optimizer.bin), written by rank 0; 2: the model, optimizer and
# EMA weights through torch.distributed.checkpoint, written by every rank (sharded.py). Both verify; only 2 resumes.
FORMAT = 2
FORMATS = (1, 2)
_CHUNK = 1 << 22


def file_crc32(path: str, sync: bool = False) -> int:
    """CRC-32 of a file, read in chunks (zlib's C loop: GB/s); `sync` also flushes it to disk."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
        if sync:
            os.fsync(f.fileno())
    return crc


def file_entry(path: str) -> dict:
    """A file's manifest entry (size and CRC-32), the file synced to disk on the way."""
    return {"bytes": os.path.getsize(path), "crc32": f"{file_crc32(path, sync=True):08x}"}


def write_manifest(folder: str, step: int, known: dict[str, dict] | None = None) -> str:
    """Sync every file of `folder` to disk, then write (and sync) its manifest, last. `known`: entries
    other ranks made of the files they wrote (relative name -> file_entry), taken as they are, so that
    no rank reads back the whole checkpoint alone."""
    files, known = {}, known or {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative == MANIFEST or relative.startswith(MANIFEST + "."):  # it, or its temporary
                continue
            files[relative] = known[relative] if relative in known else file_entry(path)
    body = {"format": FORMAT, "step": step, "files": files}
    path = os.path.join(folder, MANIFEST)
    atomic_write_json(path, {**body, "self_crc32": _self_crc(body)}, indent=1, sort_keys=True)
    return path


@dataclass(frozen=True)
class Verdict:
    """What `verify` found: intact, or damaged (with the first problem)."""

    folder: str
    problem: str | None = None  # None: intact

    @property
    def intact(self) -> bool:
        return self.problem is None

    def describe(self) -> str:
        name = os.path.basename(self.folder.rstrip("/"))
        return f"{name}: {self.problem or 'ok'}"


def verify(folder: str, only: Callable[[str], bool] | None = None) -> Verdict:
    """Check every file the manifest lists (or those `only` selects): present, of its size, of its
    CRC-32 (sizes first: cheap). `only` lets a reader of a few small files skip reading the rest."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        return Verdict(folder, "is not a folder")
    if not os.path.exists(path):
        return Verdict(folder, f"{MANIFEST} is missing")
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("lists no files")
        if manifest.get("format") not in FORMATS:
            raise ValueError(f"format {manifest.get('format')!r}, this version reads {' and '.join(map(str, FORMATS))}")
        body = {key: manifest[key] for key in ("format", "step", "files")}
        if manifest.get("self_crc32") != _self_crc(body):
            raise ValueError("its own CRC-32 does not match its content")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Verdict(folder, f"{MANIFEST} is unreadable ({type(e).__name__}: {e})")
    if only is not None:
        files = {name: entry for name, entry in files.items() if only(name)}
    for name, entry in sorted(files.items()):
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            return Verdict(folder, f"{name} is missing (the manifest lists it)")
        size = os.path.getsize(file)
        if size != entry["bytes"]:
            return Verdict(folder, f"{name} is {size} bytes, manifest says {entry['bytes']}")
    for name, entry in sorted(files.items()):
        crc = f"{file_crc32(os.path.join(folder, name)):08x}"
        if crc != entry["crc32"]:
            return Verdict(folder, f"{name} has CRC-32 {crc}, manifest says {entry['crc32']} (its bytes changed)")
    return Verdict(folder)


def manifest_format(folder: str) -> int | None:
    """The format its manifest records (FORMATS), None without a readable manifest."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            return int(json.load(f)["format"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _self_crc(body: dict) -> str:
    """CRC-32 of the manifest's canonical content, so that a changed byte in the manifest shows too."""
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"
