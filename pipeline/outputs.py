"""Output folders that can be written, checked before any work starts, and write failures as one line.

``foveate score --out`` and ``foveate export --out`` call :func:`writable_folder` before Ray, MLflow or a lock
file is touched, so a read-only or missing-permission target is one line naming the folder and the cause
(``pipeline.cli`` turns an ``OSError`` met later, e.g. a disk that fills up mid-run, into a line too:
:func:`describe_os_error`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["writable_folder", "describe_os_error", "WRITE_ERRNOS"]

WRITE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}
_HINTS = {
    errno.EACCES: "this user may not write there",
    errno.EPERM: "this user may not write there",
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
}


def writable_folder(folder: str | os.PathLike, option: str) -> Path:
    """``folder`` created if missing, or a ValueError naming ``option``, the folder and why it cannot be written.

    Raises:
        ValueError: ``folder`` is a file, cannot be created, or is not writable (permissions, read-only mount).
    """
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {str(path)!r} is a file; expected a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option}: cannot create the folder {str(path)!r} ({_why(exc)})") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        ro = _read_only_mount(path)
        why = "the file system is read-only" if ro else "this user may not write there"
        raise ValueError(f"{option}: cannot write in the folder {str(path)!r} ({why})")
    return path


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _why(exc: OSError) -> str:
    text = exc.strerror or str(exc)
    hint = _HINTS.get(exc.errno or 0)
    return f"{text}: {hint}" if hint and hint.lower() not in text.lower() else text


def describe_os_error(exc: OSError) -> str:
    """One line for a write that failed: the file, the cause and what it means."""
    where = exc.filename or ""
    name = f" {str(where)!r}" if where else ""
    if exc.errno in WRITE_ERRNOS and where:
        return f"cannot write{name}: {_why(exc)}"
    return f"{exc.strerror or exc}{name}" if exc.strerror else str(exc)
