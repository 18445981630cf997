"""The ``foveate`` command line (also ``python -m pipeline``).

Each sub-command lives in its own stage module ``pipeline.<name>``, which defines
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status), and may define ``log_file(args)`` (where
that command's log file goes). Modules are imported only when their command runs, so ``foveate --help`` stays
fast. Logging handlers are configured here and nowhere else.

The commands that run Ray or MLflow (:data:`INTERNALS_COMMANDS`) keep the terminal for foveate's own messages,
progress bars, errors and summaries; Ray's and MLflow's internal messages go to a log file named once at the
start ("Ray/MLflow internals: PATH"), see :func:`internals_to_file`. ``-v`` restores the raw stream.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline import __version__, interrupt

__all__ = ["main", "build_parser", "COMMANDS", "INTERNALS_COMMANDS", "configure_logging", "internals_to_file"]

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "synth": ("pipeline.synth", "write synthetic slides (SVS / tiled TIFF) with labels.csv"),
    "ingest": ("pipeline.ingest", "tile slide archives into OME-Zarr stores on Ray"),
    "train": ("pipeline.train", "train scorer + selection + features end to end on Ray Train"),
    "tune": ("pipeline.tune", "hyperparameter search on Ray Tune: every trial in MLflow, the best registered"),
    "pretrain": ("pipeline.pretrain", "pretrain the patch encoder self-supervised (SimCLR / BYOL) on Ray Train"),
    "score": ("pipeline.score", "batch-score an archive of stores with a trained model"),
    "compare": ("pipeline.compare", "compare the runs of an MLflow experiment"),
    "verify": ("pipeline.verify", "check slide stores against their completion markers (chunk inventory)"),
    "export": ("pipeline.export", "write the chosen patches of a predictions file as GeoJSON (QuPath)"),
    "view": ("pipeline.view", "a local web viewer of slide stores, their tiles and predictions (127.0.0.1)"),
    "demo": ("pipeline.demo", "synth -> ingest -> train -> score -> compare on embedded defaults"),
    "config": ("pipeline.config_show", "show the effective training config and where each value came from"),
}


# commands that start Ray or MLflow: their internal messages go to a log file unless -v (compare: MLflow only)
INTERNALS_COMMANDS = ("ingest", "train", "tune", "pretrain", "score", "compare", "demo")
RAY_COMMANDS = ("ingest", "train", "tune", "pretrain", "score", "demo")
# top-level packages whose log records are foveate's own (shown on the terminal at the chosen level)
OWN_LOGGERS = ("foveate", "pipeline", "workers", "operators", "benchmarks", "__main__")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_NOISY = ("urllib3", "matplotlib", "PIL", "numcodecs", "alembic", "filelock", "fsspec")

_running = False  # a command is running in this process (the demo's stages run inside it and reuse its logging)


def _setup_environment() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _Console(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record is emitted (a test's capture, the terminal kept by
    :func:`internals_to_file`); on a terminal through ``tqdm.write``, so a line never cuts a progress bar."""

    def __init__(self, level: int = logging.NOTSET):
        logging.Handler.__init__(self, level)

    @property
    def stream(self):  # StreamHandler's attribute, resolved at emit time
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.setStream; the stream is always sys.stderr
        pass

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = self.stream
            if stream is not None and stream.isatty():
                from tqdm import tqdm

                tqdm.write(self.format(record), file=stream)
                return
        except Exception:
            pass
        super().emit(record)


class _OwnOrError(logging.Filter):
    """Lets through foveate's own records, and any library's (Ray, MLflow, ...) at ERROR and above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.split(".", 1)[0] in OWN_LOGGERS


@contextlib.contextmanager
def _native_stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at ``path`` while keeping Python's ``sys.stderr`` on the terminal.

    Ray's C++ core worker inside this process writes its errors straight to descriptor 2, glog style
    (``[2026-01-01 12:00:00,000 E 123 456] core_worker.cc:2465: ...``); Ray has no setting that sends them
    elsewhere short of ``RAY_BACKEND_LOG_LEVEL``, which would also silence Ray's own log files. Python output
    (log lines, progress bars, tracebacks) keeps going to the terminal through a copy of the original descriptor.
    """
    stream = sys.stderr
    try:
        stream.flush()
        python_on_fd2 = stream.fileno() == 2
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        python_on_fd2 = False  # e.g. pytest's capsys: Python output never reaches descriptor 2 anyway
    saved = os.dup(2)
    console = None
    if python_on_fd2:
        console = open(  # closed below
            os.dup(saved),
            "w",
            encoding=getattr(stream, "encoding", None) or "utf-8",
            errors="backslashreplace",
            buffering=1,
        )
        sys.stderr = console
    target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(target, 2)
    os.close(target)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if console is not None:
            sys.stderr = stream
            console.close()


@contextlib.contextmanager
def internals_to_file(path: str | Path, verbosity: int = 0, *, ray: bool = True) -> Iterator[Path]:
    """While a command runs: foveate's own log records go to the terminal at ``verbosity`` (-1: warnings and
    errors, 0: info, 1: debug), every record (foveate's too, Ray's and MLflow's at INFO and above) to ``path``;
    Ray's and MLflow's records reach the terminal only at ERROR and above. Ray's and MLflow's own handlers are
    taken off (their records reach ours), worker output is not forwarded to this process (``RAY_LOG_TO_DRIVER=0``,
    read by :func:`pipeline.runtime.init_ray`; the workers' logs stay in Ray's session folder, which
    ``init_ray`` logs), MLflow's artifact download bars are off, Python warnings are logged, and the C++
    messages Ray writes to this process's stderr go to ``path`` (:func:`_native_stderr_to`). Everything is put
    back on exit. Settings already in the environment win (``RAY_LOG_TO_DRIVER=1`` forwards worker output).
    ``ray``: the command uses Ray (imported here, so that the handler Ray puts on its logger at import is
    taken off)."""
    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    console_level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    env = {
        "RAY_LOG_TO_DRIVER": "0",
        "MLFLOW_CONFIGURE_LOGGING": "false",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }
    env_before = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        os.environ.setdefault(k, v)
    if ray:
        importlib.import_module("ray")  # Ray puts its own handler on the "ray" logger at import: taken off below

    root = logging.getLogger()
    console = _Console(console_level)
    console.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
    console.addFilter(_OwnOrError())
    path.write_text("")  # a fresh file per command; both writers below append (C++ lines land between ours)
    to_file = logging.FileHandler(path, mode="a", encoding="utf-8")
    to_file.setFormatter(logging.Formatter(LOG_FORMAT))
    saved = {
        name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate) for name in ("ray", "mlflow")
    }
    root_level = root.level
    for name in saved:
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    quieted = {n: logging.getLogger(n).level for n in _NOISY}
    for n in _NOISY:
        logging.getLogger(n).setLevel(logging.WARNING)
    root.setLevel(logging.DEBUG if verbosity > 0 else logging.INFO)
    root.addHandler(console)
    root.addHandler(to_file)
    logging.captureWarnings(True)
    try:
        with _native_stderr_to(path):
            logging.getLogger("foveate").info("Ray/MLflow internals: %s", path)
            yield path
    finally:
        logging.captureWarnings(False)
        root.removeHandler(console)
        root.removeHandler(to_file)
        to_file.close()
        root.setLevel(root_level)
        for n, level in quieted.items():
            logging.getLogger(n).setLevel(level)
        for name, (handlers, propagate) in saved.items():
            logging.getLogger(name).handlers[:] = handlers
            logging.getLogger(name).propagate = propagate
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _log_file(module, args: argparse.Namespace) -> Path:
    """The command's log file: ``--log-file``, else the command's own choice (``log_file(args)``: the demo's is
    ``<workdir>/foveate.log``), else ``<tmp>/foveate-logs/<command>-<time>-<pid>.log``."""
    if args.log_file:
        return Path(args.log_file)
    own = getattr(module, "log_file", None)
    if own is not None:
        return Path(own(args))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.gettempdir()) / "foveate-logs" / f"{args.command}-{stamp}-{os.getpid()}.log"


def build_parser(load_commands: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foveate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"foveate {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more log output: debug lines, and Ray's and MLflow's own messages on the terminal as they come",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    parser.add_argument(
        "--log-file",
        default=None,
        metavar="PATH",
        help="where Ray's and MLflow's messages go (and a copy of foveate's): default <workdir>/foveate.log for "
        "the demo, a new file under the temp folder's foveate-logs/ for the other Ray/MLflow commands",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if load_commands is None or name in load_commands:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _setup_environment()
    # SIGTERM (``kill``, ``ray job stop``, a scheduler) ends a command like Ctrl-C: its ``finally`` blocks run
    interrupt.install()
    command = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(load_commands=(command,) if command else ())
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    global _running
    verbosity = -1 if args.quiet else args.verbose
    if _running or args.command not in INTERNALS_COMMANDS or args.verbose:
        if not _running:
            configure_logging(verbosity)
        return _run(module, args)
    _running = True
    try:
        with internals_to_file(_log_file(module, args), verbosity, ray=args.command in RAY_COMMANDS) as path:
            try:
                status = _run(module, args)
            except BaseException as exc:
                if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    logging.getLogger("foveate").error("%s failed; Ray's and MLflow's messages: %s", args.command, path)
                raise
            if status not in (0, 130):
                logging.getLogger("foveate").info("Ray's and MLflow's messages: %s", path)
            return status
    finally:
        _running = False


def _run(module, args: argparse.Namespace) -> int:
    from pipeline.locks import OutputLocked

    try:
        return int(module.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, OutputLocked) as exc:
        logging.getLogger("foveate").error("%s", exc)
        if args.verbose:
            raise
        return 2
    except OSError as exc:
        from pipeline.outputs import WRITE_ERRNOS, describe_os_error

        if exc.errno not in WRITE_ERRNOS or args.verbose:
            raise
        # a read-only target, a full disk: one line naming the file, not a traceback
        logging.getLogger("foveate").error("%s failed: %s", args.command, describe_os_error(exc))
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
