"""The work each Ray actor does, as plain classes testable without a cluster."""

from workers.patches import PatchGrid, PatchReader, SlideInput, forward_slide, gather_patches, lowres_input, prepare_slide
from workers.store import COMPLETE_MARKER, SlideStore, StoreMeta, is_complete, write_store_from_array
from workers.tissue import tissue_mask

__all__ = [
    "PatchGrid",
    "PatchReader",
    "SlideInput",
    "forward_slide",
    "gather_patches",
    "lowres_input",
    "prepare_slide",
    "COMPLETE_MARKER",
    "SlideStore",
    "StoreMeta",
    "is_complete",
    "tissue_mask",
    "write_store_from_array",
]
