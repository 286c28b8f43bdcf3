"""Files written whole or not at all: a reader, a resumed run or a crash finds the old content or the
new, never half of one. The one way the project writes such a file (records, metrics, manifests,
index.json, side tables, caches, reports): into a temporary beside the target named for its writer
(host, PID, a random token: pipelines/writer_names.py, so two ranks or two requeued jobs on a shared
file system never write one temporary), flushed and synced to disk, renamed onto the target, and the
folder synced so that the rename itself survives a crash. A failed write removes its temporary and
leaves the target as it was.

Writers that fill a named file over a long time (a tar shard, a memory-mapped table) name it
themselves and hand it to `move_into_place` when it is complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from typing import IO, Any, Iterator

from prunepipe.pipelines.writer_names import temporary_name

# a folder that cannot be synced (some file systems refuse, Windows cannot open one): the rename stands
_UNSYNCABLE = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR, errno.EACCES}


def sync_directory(path: str) -> None:
    """Sync the folder `path` to disk, so that a rename or a new name in it survives a crash; a
    no-op where the platform or the file system cannot sync a folder."""
    if os.name == "nt":
        return
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError as e:
        if e.errno in _UNSYNCABLE:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _UNSYNCABLE:
            raise
    finally:
        os.close(fd)


def sync_file(path: str) -> None:
    """Sync the file `path` (its content) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_into_place(temporary: str, path: str, *, synced: bool = False) -> None:
    """Rename the complete file `temporary` onto `path` (the same folder): its content synced first
    (`synced`: the writer did), the folder synced after."""
    if not synced:
        sync_file(temporary)
    os.replace(temporary, path)
    sync_directory(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb", *, suffix: str = ".tmp", **open_kwargs) -> Iterator[IO[Any]]:
    """A file open for writing (`mode` "w" or "wb") whose content replaces `path` when the block ends
    without an error; on an error the temporary is removed and `path` is left as it was. `suffix`
    ends the temporary's name (PATH.HOST.PID-TOKEN.SUFFIX), for sweepers of leftovers by suffix."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open({path!r}, {mode!r}): a whole new file is written: mode 'w' or 'wb'")
    temporary = temporary_name(path, suffix)
    try:
        with open(temporary, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        move_into_place(temporary, path, synced=True)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    """`data` at `path`, whole or not at all."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str, text: str, encoding: str | None = None) -> None:
    """`text` at `path`, whole or not at all."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)


def atomic_write_json(path: str, obj: Any, **dump_kwargs) -> None:
    """`obj` as JSON at `path` (`dump_kwargs` go to json.dump: indent, sort_keys, default), whole or
    not at all. An object JSON cannot encode fails before `path` is touched."""
    with atomic_open(path, "w") as f:
        json.dump(obj, f, **dump_kwargs)
