"""foveate pipeline: stages, CLI, config and tracking."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("foveate")
except _metadata.PackageNotFoundError:  # running from a source tree (ray job --working-dir)
    __version__ = "0.1.0"

__all__ = ["__version__"]
