"""foveate pipeline: stages, CLI, config and tracking; and the lazy Python API (:mod:`pipeline.lazy`:
``open_store``, ``open_heatmap``, ``open_heatmaps``, slide stores and scoring heatmaps as dask arrays)."""

from importlib import metadata as _metadata
from typing import Any

try:
    __version__ = _metadata.version("foveate")
except _metadata.PackageNotFoundError:  # running from a source tree (ray job --working-dir)
    __version__ = "0.1.0"

__all__ = ["__version__", "LazyImage", "open_store", "open_heatmap", "open_heatmaps"]

_LAZY = ("LazyImage", "open_store", "open_heatmap", "open_heatmaps")


def __getattr__(name: str) -> Any:
    """``pipeline.open_store`` etc., imported on first use (the CLI does not pay for dask and zarr at start-up)."""
    if name in _LAZY:
        from pipeline import lazy

        return getattr(lazy, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
