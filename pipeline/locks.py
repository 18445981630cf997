"""One writer per output: an exclusive lock for a store folder or a predictions file.

``with output_lock(path, "foveate ingest"):`` takes an advisory ``flock`` on ``<folder>/.foveate.lock`` (for a
folder) or ``.<name>.lock`` beside a file, and records who holds it (command, pid, host, start time) in that
file. A second writer fails at once with :class:`OutputLocked` naming the holder. The kernel drops the lock
when its process ends, however it ends (``kill -9`` included), so a crashed run never leaves a stale lock:
the next run simply takes it. Locks are per machine and need a local filesystem with ``flock`` (not every
network filesystem has one).

For an object-storage target (``s3://...``) the lock file is a local one named after the URL
(``$TMPDIR/foveate-locks/<sha256 of the URL>.lock``): two writers of one URL on the same machine exclude each
other, writers on different machines do not (object storage has no lock that a killed process releases by
itself; keep one ingest per ``--out`` URL, e.g. one RayJob).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["OutputLocked", "output_lock", "lock_path"]


class OutputLocked(RuntimeError):
    """Another process is writing the same output."""


def lock_path(target: str | Path) -> Path:
    """The lock file of ``target``: ``<target>/.foveate.lock`` for a folder, ``.<name>.lock`` beside a file, a
    per-machine file named after the URL for an object-storage URL."""
    from workers import storage

    if storage.is_url(target):
        import hashlib
        import tempfile

        digest = hashlib.sha256(storage.normalize(target).encode()).hexdigest()[:32]
        return Path(tempfile.gettempdir()) / "foveate-locks" / f"{digest}.lock"
    target = Path(target)
    return target / ".foveate.lock" if target.is_dir() else target.with_name(f".{target.name}.lock")


@contextlib.contextmanager
def output_lock(target: str | Path, command: str) -> Iterator[Path]:
    """Hold the exclusive lock of ``target`` (a folder that exists, or a file path) while the block runs.

    Raises:
        OutputLocked: another process holds it (the message names its command, pid, host and start time).
    """
    path = lock_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                holder = {}
            raise OutputLocked(
                f"another {holder.get('command', 'foveate process')} (pid {holder.get('pid', '?')}, host "
                f"{holder.get('host', '?')}, since {holder.get('started', '?')}) is writing {target}; wait for it "
                f"to finish or stop it (a process that died releases the lock by itself)"
            ) from None
        info = {
            "command": command,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv[:8],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        try:
            yield path
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
