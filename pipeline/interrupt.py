"""SIGTERM ends a command like Ctrl-C, and is not lost when a library swallows the exception.

``kill``, ``ray job stop`` and schedulers send SIGTERM. :func:`install` makes it raise ``KeyboardInterrupt`` in
the main thread, so the command's ``finally`` blocks run: an MLflow run is marked FAILED, the rows written so far
are flushed, Ray is shut down. A Python signal handler raises wherever the main thread happens to be, and some
places drop exceptions: a weakref or ``__del__`` callback run by the garbage collector (seen: SQLAlchemy's class
registry during ``import ray``) only prints "Exception ignored in" and goes on. So the handler also records the
signal, and the drivers' wait loops call :func:`check`, which raises again if a termination signal arrived: a
swallowed SIGTERM costs at most one wait, never the whole run.

``ray.init`` installs its own SIGTERM handler (``sys.exit(15)``); :func:`reinstall` puts ours back after it.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["install", "reinstall", "check", "requested", "on_terminate"]

_requested = threading.Event()
_installed = False


def on_terminate(signum, frame) -> None:
    """The SIGTERM handler: record the signal, then raise ``KeyboardInterrupt`` in the main thread."""
    _requested.set()
    raise KeyboardInterrupt(f"signal {signum}")


def install() -> bool:
    """Handle SIGTERM with :func:`on_terminate` (main thread only; elsewhere signals cannot be set). True if set."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, on_terminate)
    _installed = True
    return True


def reinstall() -> None:
    """Put :func:`on_terminate` back if :func:`install` set it and something (``ray.init``) replaced it."""
    if _installed and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is not on_terminate:
            signal.signal(signal.SIGTERM, on_terminate)


def requested() -> bool:
    """Whether a termination signal arrived in this process."""
    return _requested.is_set()


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a termination signal arrived (its first exception may have been swallowed)."""
    if _requested.is_set():
        raise KeyboardInterrupt("terminated by a signal")
