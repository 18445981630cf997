"""The ``foveate`` command line (also ``python -m pipeline``).

Each sub-command lives in its own stage module ``pipeline.<name>``, which defines
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status). Modules are imported only
when their command runs, so ``foveate --help`` stays fast. Logging handlers are configured here
and nowhere else.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from pipeline import __version__, interrupt

__all__ = ["main", "build_parser", "COMMANDS"]

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "synth": ("pipeline.synth", "write synthetic slides (SVS / tiled TIFF) with labels.csv"),
    "ingest": ("pipeline.ingest", "tile slide archives into OME-Zarr stores on Ray"),
    "train": ("pipeline.train", "train scorer + selection + features end to end on Ray Train"),
    "score": ("pipeline.score", "batch-score an archive of stores with a trained model"),
    "compare": ("pipeline.compare", "compare the runs of an MLflow experiment"),
    "verify": ("pipeline.verify", "check slide stores against their completion markers (chunk inventory)"),
    "export": ("pipeline.export", "write the chosen patches of a predictions file as GeoJSON (QuPath)"),
    "view": ("pipeline.view", "a local web viewer of slide stores, their tiles and predictions (127.0.0.1)"),
    "demo": ("pipeline.demo", "synth -> ingest -> train -> score -> compare on embedded defaults"),
}


def _setup_environment() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("urllib3", "matplotlib", "PIL", "numcodecs", "alembic", "filelock", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def build_parser(load_commands: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foveate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"foveate {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
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
    configure_logging(-1 if args.quiet else args.verbose)
    module = importlib.import_module(COMMANDS[args.command][0])
    from pipeline.locks import OutputLocked

    try:
        return int(module.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, OutputLocked) as exc:
        logging.getLogger("foveate").error("%s", exc)
        if args.verbose:
            raise
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
