"""The work each Ray actor does, as plain classes testable without a cluster."""

from workers.store import COMPLETE_MARKER, SlideStore, StoreMeta, is_complete, write_store_from_array
from workers.tissue import tissue_mask

__all__ = [
    "PatchGrid",
    "PatchReader",
    "SlideInput",
    "forward_slide",
    "gather_patches",
    "lowres_input",
    "lowres_view",
    "prepare_slide",
    "slide_geometry",
    "COMPLETE_MARKER",
    "SlideStore",
    "StoreMeta",
    "is_complete",
    "tissue_mask",
    "write_store_from_array",
]


# workers.patches imports torch: load it on first use so ingest/tiling processes do not pay for it
_LAZY_PATCHES = (
    "PatchGrid",
    "PatchReader",
    "SlideInput",
    "forward_slide",
    "gather_patches",
    "lowres_input",
    "lowres_view",
    "prepare_slide",
    "slide_geometry",
)


def __getattr__(name: str):
    if name in _LAZY_PATCHES:
        from workers import patches

        return getattr(patches, name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
