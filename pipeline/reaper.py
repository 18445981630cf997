"""Stop an in-process Ray's processes when the command that started it dies without shutting it down.

``ray.init()`` in a foveate command starts Ray's daemons (GCS, raylet, dashboard and runtime-env agents, workers)
as descendants of the command. When the command is killed with ``kill -9`` (or by the OOM killer), the GCS and
raylet exit within seconds, but Ray 2.60's dashboard and runtime-env agents, re-parented and renamed
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``: their command line no longer names the session), keep
running and listening — measured here: still alive 25 s after the kill, and in other runs for many minutes.
:func:`start_reaper` starts this module as a small watcher process in its own session: while the command runs
it records the command's Ray descendants (pid and start time, so a reused pid is never touched); once the
command is gone it sends SIGTERM, then SIGKILL after a grace period, to those still alive. When the command
ends normally it has already shut Ray down, and the watcher finds nothing left to stop.

Run as ``python -m pipeline.reaper PID START_TICKS`` (``START_TICKS``: field 22 of ``/proc/PID/stat``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["start_reaper", "ray_descendants", "alive"]

POLL_SECONDS = 0.5
GRACE_SECONDS = 3.0


def _stat(pid: int) -> tuple[str, int, str] | None:
    """``(state, ppid, start_ticks)`` of a process, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), fields[19]  # fields 3, 4 and 22 of the full line


def alive(pid: int, ticks: str) -> bool:
    """The process ``pid`` started at ``ticks`` still runs (not a zombie, pid not reused)."""
    st = _stat(pid)
    return st is not None and st[0] != "Z" and st[2] == ticks


def ray_descendants(pid: int) -> dict[int, str]:
    """``{pid: start_ticks}`` of the living descendants of ``pid`` whose command line mentions Ray (its daemons,
    agents and ``ray::`` workers), this process excluded."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        st = _stat(int(proc.name))
        if st is None or st[0] == "Z":
            continue
        children.setdefault(st[1], []).append(int(proc.name))
        ticks[int(proc.name)] = st[2]
    out: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        if p == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ray" in cmd:
            out[p] = ticks[p]
    return out


def start_reaper() -> subprocess.Popen | None:
    """Watch this process; stop its Ray descendants once it is gone. None where ``/proc`` is absent."""
    st = _stat(os.getpid())
    if st is None:
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.reaper", str(os.getpid()), st[2]],
        cwd=str(Path(__file__).resolve().parents[1]),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a signal to the command's process group does not reach the watcher
    )


def _reap(pid: int, ticks: str) -> None:
    seen: dict[int, str] = {}
    while alive(pid, ticks):
        seen = {p: t for p, t in seen.items() if alive(p, t)}
        seen.update(ray_descendants(pid))
        time.sleep(POLL_SECONDS)
    for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, 0.0)):
        seen = {p: t for p, t in seen.items() if alive(p, t)}
        if not seen:
            return
        for p in seen:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(alive(p, t) for p, t in seen.items()):
            time.sleep(0.2)


if __name__ == "__main__":  # pragma: no cover - exercised through a subprocess in tests/test_faults.py
    _reap(int(sys.argv[1]), sys.argv[2])
