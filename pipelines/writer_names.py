"""Names that belong to one writer of a shared folder (NFS, Lustre): its host, its PID and a random
token, for the temporary files moved into place, the partial outputs and the locks of a job. The PID
alone is not enough: containers on different hosts (or on one host, sharing its name) run in PID
namespaces of their own and reuse each other's PIDs, and two threads of one process share one.

Nothing here writes or removes a file; pipelines/ and tools/ both name their temporaries with it.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import socket

# the tail a writer adds to a name: PID-TOKEN after the host id (PATH.HOST.PID-TOKEN.SUFFIX)
WRITER_TAIL = re.compile(r"(?P<pid>\d+)-(?P<token>[0-9a-f]{8})")
PROCESS_TOKEN = secrets.token_hex(4)  # one per process (a forked child differs by its PID)


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This host as a writer's name carries it: the host name, then `~` and the inode of the PID
    namespace where /proc shows it. Two containers that share a host name (`--network host`) but not
    their PIDs are two hosts to a liveness check; a host name never holds a `~`."""
    host = socket.gethostname()
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # pid:[4026531836]
    except OSError:
        return host
    inode = namespace.partition("[")[2].rstrip("]")
    return f"{host}~{inode}" if inode.isdigit() else host


def writer_tag(token: str | None = None) -> str:
    """HOST.PID-TOKEN: this process on this host, with `token` (a fresh random one by default)."""
    return f"{host_id()}.{os.getpid()}-{token or secrets.token_hex(4)}"


def temporary_name(path: str, suffix: str = ".tmp") -> str:
    """PATH.HOST.PID-TOKEN.SUFFIX, a fresh token each call: a name no other writer (another host,
    another container, another thread of this process, this thread earlier) ever uses."""
    return f"{path}.{writer_tag()}{suffix}"


def written_here(name: str, suffix: str) -> tuple[bool, int] | None:
    """For a name `temporary_name` (or `writer_tag`) made: (written on this host, the writer's PID);
    None for a name of another form."""
    if not name.endswith(suffix):
        return None
    written_as, _, tail = name[: len(name) - len(suffix)].rpartition(".")
    match = WRITER_TAIL.fullmatch(tail)
    if match is None:
        return None
    return written_as.endswith(f".{host_id()}"), int(match["pid"])
