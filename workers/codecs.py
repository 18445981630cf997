"""Zarr v3 chunk codec that stores each (3, h, w) uint8 chunk as ONE RGB JPEG image.

NGFF needs channel-first ``(c, y, x)`` arrays, while JPEG compresses an interleaved ``(h, w, 3)`` image:
a generic per-chunk JPEG codec would encode the three channels as three grey images (three times the
size, no chroma subsampling). :class:`JpegRGBCodec` is an *array -> bytes* codec (it replaces zarr's
``bytes`` codec) that transposes each chunk to ``(h, w, 3)`` and encodes it as one colour JPEG with
imagecodecs (libjpeg-turbo); decoding transposes back.

Metadata in ``zarr.json``::

    "codecs": [{"name": "foveate.jpeg", "configuration": {"quality": 90, "colorspace": "ycbcr"}}]

``colorspace`` is the colour space *inside* the JPEG streams: ``ycbcr`` for JPEGs foveate encodes and
for passthrough tiles of YCbCr sources; ``rgb`` for passthrough tiles of sources (Aperio SVS) that store
un-transformed RGB in JPEG (TIFF photometric RGB), which must be decoded without colour conversion.

Where foveate is installed, zarr-python >= 3 finds the codec by itself: ``pyproject.toml`` declares it in the
``zarr.codecs`` entry-point group (``"foveate.jpeg" = "workers.codecs:JpegRGBCodec"``), which zarr loads the first
time an array names it, so ``zarr.open_array("slide.zarr/0")`` and ome-zarr-py need no import. The
:func:`register_codec` call at the bottom registers the same class under the same qualified name (one registry
entry: harmless next to the entry point) for source checkouts that are not installed::

    import zarr, workers.codecs          # importing registers "foveate.jpeg" with zarr
    z = zarr.open_array("slide.zarr/0")  # (3, h, w) uint8

Without foveate installed, copy this file (it needs only numpy, zarr and imagecodecs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import imagecodecs
import numpy as np
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.array_spec import ArraySpec
from zarr.core.buffer import Buffer, NDBuffer
from zarr.registry import register_codec

__all__ = [
    "CODEC_NAME",
    "JpegRGBCodec",
    "encode_jpeg_chunk",
    "encode_jpeg_hwc",
    "decode_jpeg_chunk",
    "merge_jpeg_tables",
]

CODEC_NAME = "foveate.jpeg"
_COLORSPACES = ("ycbcr", "rgb")


def encode_jpeg_chunk(chunk_chw: np.ndarray, quality: int = 90) -> bytes:
    """Encode a (3, h, w) uint8 chunk as one YCbCr JPEG (4:2:0) of size (h, w)."""
    if chunk_chw.ndim != 3 or chunk_chw.shape[0] != 3 or chunk_chw.dtype != np.uint8:
        raise ValueError(f"chunk must be (3, h, w) uint8, got {chunk_chw.shape} {chunk_chw.dtype}")
    hwc = np.ascontiguousarray(np.moveaxis(chunk_chw, 0, -1))
    return bytes(imagecodecs.jpeg8_encode(hwc, level=int(quality)))


def encode_jpeg_hwc(hwc: np.ndarray, quality: int = 90) -> bytes:
    """Encode an (h, w, 3) uint8 image as one YCbCr JPEG (the bytes :class:`JpegRGBCodec` stores for its
    channel-first transpose)."""
    return bytes(imagecodecs.jpeg8_encode(np.ascontiguousarray(hwc), level=int(quality)))


def decode_jpeg_chunk(data: bytes, colorspace: str = "ycbcr") -> np.ndarray:
    """Decode one JPEG stream to a (3, h, w) uint8 array (``colorspace``: 'ycbcr' or 'rgb', see module doc)."""
    cs = "RGB" if colorspace == "rgb" else None
    hwc = imagecodecs.jpeg8_decode(data, colorspace=cs)
    if hwc.ndim == 2:
        hwc = np.repeat(hwc[..., None], 3, axis=-1)
    return np.ascontiguousarray(np.moveaxis(hwc, -1, 0))


def merge_jpeg_tables(tables: bytes | None, tile: bytes) -> bytes:
    """Make an abbreviated TIFF JPEG tile self-contained by inserting the JPEGTables segments.

    TIFF stores shared quantisation/Huffman tables once (tag JPEGTables, ``SOI ... EOI``) and tiles as
    abbreviated streams (``SOI ... EOI`` without tables). The merged stream is ``SOI + tables + tile``;
    no pixel is decoded.
    """
    if not tables:
        return bytes(tile)
    if tables[:2] != b"\xff\xd8" or tile[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG stream (no SOI marker)")
    body = tables[2:-2] if tables[-2:] == b"\xff\xd9" else tables[2:]
    return b"\xff\xd8" + bytes(body) + bytes(tile[2:])


@dataclass(frozen=True)
class JpegRGBCodec(ArrayBytesCodec):
    """Array->bytes codec: a (3, h, w) uint8 chunk <-> one RGB JPEG image (see module doc)."""

    is_fixed_size = False
    quality: int = 90
    colorspace: str = "ycbcr"

    def __init__(self, *, quality: int = 90, colorspace: str = "ycbcr") -> None:
        if not (1 <= int(quality) <= 100):
            raise ValueError(f"quality must be in [1, 100], got {quality!r}")
        if colorspace not in _COLORSPACES:
            raise ValueError(f"colorspace must be one of {_COLORSPACES}, got {colorspace!r}")
        object.__setattr__(self, "quality", int(quality))
        object.__setattr__(self, "colorspace", colorspace)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JpegRGBCodec:
        return cls(**(data.get("configuration") or {}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": CODEC_NAME, "configuration": {"quality": self.quality, "colorspace": self.colorspace}}

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        chunk_shape = getattr(chunk_grid, "chunk_shape", None)
        if len(shape) != 3 or (chunk_shape is not None and chunk_shape[0] != 3):
            raise ValueError(
                f"{CODEC_NAME} needs (3, h, w) arrays with chunks (3, th, tw); got shape {shape} chunks {chunk_shape}"
            )
        np_dtype = dtype.to_native_dtype() if hasattr(dtype, "to_native_dtype") else np.dtype(dtype)
        if np.dtype(np_dtype) != np.uint8:
            raise ValueError(f"{CODEC_NAME} needs uint8 data, got {np_dtype}")

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        arr = decode_jpeg_chunk(chunk_bytes.to_bytes(), self.colorspace)
        if arr.shape != tuple(chunk_spec.shape):
            raise ValueError(f"JPEG chunk decodes to {arr.shape}, array chunk is {tuple(chunk_spec.shape)}")
        return chunk_spec.prototype.nd_buffer.from_ndarray_like(arr)

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        arr = np.asarray(chunk_array.as_ndarray_like())
        return chunk_spec.prototype.buffer.from_bytes(encode_jpeg_chunk(arr, self.quality))

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: ArraySpec) -> int:
        raise NotImplementedError


register_codec(CODEC_NAME, JpegRGBCodec)
