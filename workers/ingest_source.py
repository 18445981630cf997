"""Open a source slide once and read level-0 pixels from it, fast where possible.

:class:`SlideSource` wraps an OpenSlide handle and, for TIFF-based formats whose level 0 is one tiled TIFF
page (Aperio SVS, generic tiled TIFF), a *direct* reader that decodes the page's tiles itself
(tifffile for the tile index, imagecodecs/libjpeg-turbo for JPEG) instead of going through
``OpenSlide.read_region``: no RGBA conversion, no premultiplication, no tile cache, several times
faster. OpenSlide and imagecodecs both use libjpeg-turbo with the same settings, so the direct reader
gives *identical* pixels; :meth:`SlideSource.open` checks that on a sample tile and falls back to
OpenSlide for the slide if not (and for every other format: DICOM, MRXS, NDPI, ...).

All pixels are RGB composited on white (transparent / out-of-slide is white), channel-last (h, w, 3) uint8.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SlideFile", "SlideSource", "SourceInfo", "SlideOpenError", "composite_on_white", "file_fingerprint"]

log = logging.getLogger(__name__)

_JPEG = 7
_DIRECT_COMPRESSIONS = {1, 5, 7, 8, 32946, 50000}  # none, LZW, JPEG, deflate, deflate, zstd
_DIRECT_VENDORS = {"aperio", "generic-tiff"}


@dataclass(frozen=True)
class SlideFile:
    """One slide file to ingest (found by ``pipeline.ingest_inputs``; what a tiler actor is given).

    Attributes:
        slide_id: store name (``<slide_id>.zarr``), see ``pipeline.ingest_inputs.make_slide_id``.
        path: the file to open (for DICOM: one file of the series; OpenSlide finds the others).
        source: what the manifest reports as source (the file, or the DICOM folder).
        carried: extra CSV-manifest columns (e.g. ``label``) carried into the store manifest.
        files: every file of the slide (several for DICOM).
    """

    slide_id: str
    path: str
    source: str
    carried: dict[str, Any] = field(default_factory=dict)
    files: tuple[str, ...] = ()


class SlideOpenError(Exception):
    """The slide cannot be opened or read; ``str()`` is a one-line reason."""


@dataclass(frozen=True)
class SourceInfo:
    """What ingest needs to know about a source slide (picklable, small)."""

    path: str
    vendor: str
    dimensions: tuple[int, int]
    level_dimensions: tuple[tuple[int, int], ...]
    level_downsamples: tuple[float, ...]
    mpp: tuple[float, float] | None
    fingerprint: str
    direct: bool  # level 0 decoded directly (tifffile + imagecodecs), else OpenSlide read_region
    # JPEG passthrough candidates: per OpenSlide level, (tile_w, tile_h, colorspace) when that level is one
    # tiled JPEG TIFF page readable directly, else None
    jpeg_levels: tuple[tuple[int, int, str] | None, ...] = ()


def composite_on_white(rgba: np.ndarray) -> np.ndarray:
    """(h, w, 4) non-premultiplied RGBA (OpenSlide's PIL output) -> (h, w, 3) RGB over white.

    Exactly PIL's ``Image.alpha_composite(white, img).convert('RGB')``.
    """
    a = rgba[..., 3]
    if a.min() == 255:
        return np.ascontiguousarray(rgba[..., :3])
    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(rgba), "RGBA")
    white = Image.new("RGBA", img.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, img).convert("RGB"))


def file_fingerprint(files: list[str] | tuple[str, ...]) -> str:
    """``sha256:<hex>`` of the files' bytes (in the given order)."""
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def _one_line(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


class SlideSource:
    """An open slide (OpenSlide handle + optional direct TIFF tile reader). Use :meth:`open`."""

    def __init__(self, path: str, osr: Any, info: SourceInfo, tiff: Any | None, direct_pages: dict[int, Any]):
        self.path, self._osr, self.info, self._tiff, self._pages = path, osr, info, tiff, direct_pages
        self._fh = tiff.filehandle if tiff is not None else None
        self._local = threading.local()  # per-thread reused tile buffers

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | Path, *, files: tuple[str, ...] | None = None, allow_direct: bool = True) -> SlideSource:
        """Open ``path``; raises :class:`SlideOpenError` with a one-line reason for any bad input."""
        path = str(path)
        p = Path(path)
        if not p.exists():
            raise SlideOpenError(f"no such file: {path}")
        if p.is_dir():
            raise SlideOpenError(f"is a directory, not a slide file: {path}")
        if p.stat().st_size == 0:
            raise SlideOpenError(f"empty file (0 bytes): {path}")
        import openslide

        try:
            osr = openslide.OpenSlide(path)
        except openslide.OpenSlideUnsupportedFormatError as exc:
            raise SlideOpenError(
                f"not a slide OpenSlide can open (unsupported format, truncated or not an image): {path}"
            ) from exc
        except Exception as exc:
            raise SlideOpenError(f"OpenSlide cannot open {path}: {_one_line(exc)}") from exc
        try:
            props = dict(osr.properties)
            vendor = props.get("openslide.vendor", "unknown")
            mpp = None
            try:
                mx, my = float(props["openslide.mpp-x"]), float(props["openslide.mpp-y"])
                if mx > 0 and my > 0:
                    mpp = (mx, my)
            except (KeyError, ValueError):
                mpp = None
            fp = props.get("openslide.quickhash-1")
            fingerprint = f"quickhash-1:{fp}" if fp else file_fingerprint(list(files or (path,)))
            tiff, pages, jpeg_levels = None, {}, [None] * osr.level_count
            direct = False
            if allow_direct and vendor in _DIRECT_VENDORS:
                tiff, pages, jpeg_levels = _direct_pages(path, osr)
                direct = 0 in pages
            info = SourceInfo(
                path=path,
                vendor=vendor,
                dimensions=tuple(osr.dimensions),
                level_dimensions=tuple(tuple(d) for d in osr.level_dimensions),
                level_downsamples=tuple(float(d) for d in osr.level_downsamples),
                mpp=mpp,
                fingerprint=fingerprint,
                direct=direct,
                jpeg_levels=tuple(jpeg_levels),
            )
            src = cls(path, osr, info, tiff, pages)
            if direct and not src._direct_agrees():
                log.warning("%s: direct tile decoder disagrees with OpenSlide; using OpenSlide read_region", path)
                src._pages = {}
                src.info = SourceInfo(
                    **{**info.__dict__, "direct": False, "jpeg_levels": tuple([None] * osr.level_count)}
                )
            return src
        except SlideOpenError:
            osr.close()
            raise
        except Exception as exc:
            osr.close()
            raise SlideOpenError(f"cannot read {path}: {_one_line(exc)}") from exc

    def close(self) -> None:
        if self._tiff is not None:
            self._tiff.close()
            self._tiff = None
        if self._osr is not None:
            self._osr.close()
            self._osr = None

    # ------------------------------------------------------------------ reading
    def read_l0(self, x: int, y: int, w: int, h: int, *, out: np.ndarray | None = None, pool: Any = None) -> np.ndarray:
        """Level-0 box (x, y, w, h), inside the slide, as (h, w, 3) uint8 RGB over white.

        ``out``: optional C-contiguous (h, w, 3) uint8 array to fill (reused by the tiler: no fresh
        allocation, no page faults per block); returned. ``pool``: optional
        ``concurrent.futures.Executor`` that decodes the tile rows of a direct read in parallel (the
        decoders release the GIL); the file is still read by the calling thread only.
        """
        if out is not None and (out.shape != (h, w, 3) or out.dtype != np.uint8 or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous ({h}, {w}, 3) uint8 array, got {out.shape} {out.dtype}")
        if 0 in self._pages:
            return self._read_direct(0, x, y, w, h, out=out, pool=pool)
        block = self.read_openslide(x, y, w, h)
        if out is None:
            return block
        out[...] = block
        return out

    def read_openslide(self, x: int, y: int, w: int, h: int, level: int = 0) -> np.ndarray:
        """OpenSlide ``read_region`` composited on white, (h, w, 3) uint8 (``x, y`` in level-0 pixels)."""
        import openslide

        try:
            rgba = np.asarray(self._osr.read_region((int(x), int(y)), level, (int(w), int(h))))
        except openslide.OpenSlideError as exc:
            raise SlideOpenError(f"OpenSlide cannot read pixels of {self.path}: {_one_line(exc)}") from exc
        return composite_on_white(rgba)

    def _page_tile(self, level: int, index: int, buf: np.ndarray | None = None) -> np.ndarray | None:
        """Decoded tile ``index`` of a direct level as (th, tw, 3) (None for a missing tile). JPEG tiles are
        decoded into ``buf`` ((th, tw, 3) uint8, C-contiguous) when given."""
        data = self._tile_bytes(level, index)
        return None if data is None else self._decode_tile(level, index, data, buf)

    def _tile_bytes(self, level: int, index: int) -> bytes | None:
        page = self._pages[level]
        off, cnt = page.dataoffsets[index], page.databytecounts[index]
        if not cnt:
            return None
        self._fh.seek(off)
        return self._fh.read(cnt)

    def _decode_tile(self, level: int, index: int, data: bytes, buf: np.ndarray | None) -> np.ndarray:
        page = self._pages[level]
        if page.compression == _JPEG:
            import imagecodecs

            cs = "RGB" if page.photometric == 2 else None
            if buf is not None:
                try:
                    return imagecodecs.jpeg8_decode(data, tables=page.jpegtables, colorspace=cs, out=buf)
                except (ValueError, imagecodecs.JpegError):  # stream of another size than the page's tiles
                    pass
            return imagecodecs.jpeg8_decode(data, tables=page.jpegtables, colorspace=cs)
        out, _idx, _shape = page.decode(data, index, jpegtables=page.jpegtables)
        return out.reshape(out.shape[-3:])[..., :3]

    def _read_direct(
        self, level: int, x: int, y: int, w: int, h: int, *, out: np.ndarray | None = None, pool: Any = None
    ) -> np.ndarray:
        """Decode the tiles covering the box into ``out`` (allocated when None). Tiles are read in file
        order by this thread; JPEG tiles are decoded (GIL released) into a reused per-thread tile buffer,
        one tile row per task when ``pool`` is given."""
        page = self._pages[level]
        tw, th = page.tilewidth, page.tilelength
        ntx = -(-page.imagewidth // tw)
        if out is None:
            out = np.empty((h, w, 3), np.uint8)
        rows = []
        for ty in range(y // th, -(-(y + h) // th)):
            rows.append([(ty, tx, self._tile_bytes(level, ty * ntx + tx)) for tx in range(x // tw, -(-(x + w) // tw))])

        def decode_row(row: list) -> None:
            buf = getattr(self._local, "tile", None)
            if buf is None or buf.shape != (th, tw, 3):
                buf = self._local.tile = np.empty((th, tw, 3), np.uint8)
            for ty, tx, data in row:
                x0, y0 = max(x, tx * tw), max(y, ty * th)
                x1, y1 = min(x + w, (tx + 1) * tw), min(y + h, (ty + 1) * th)
                if data is None:  # missing tile: white
                    out[y0 - y : y1 - y, x0 - x : x1 - x] = 255
                    continue
                tile = self._decode_tile(level, ty * ntx + tx, data, buf)
                out[y0 - y : y1 - y, x0 - x : x1 - x] = tile[y0 - ty * th : y1 - ty * th, x0 - tx * tw : x1 - tx * tw]

        if pool is None or len(rows) < 2:
            for row in rows:
                decode_row(row)
        else:
            for f in [pool.submit(decode_row, row) for row in rows]:
                f.result()
        return out

    def raw_jpeg_tile(self, level: int, tx: int, ty: int) -> tuple[bytes, bytes | None] | None:
        """Compressed JPEG tile (data, JPEGTables) at tile column/row (tx, ty) of an OpenSlide level, or
        None where the tile is absent. Only for levels listed in ``info.jpeg_levels``."""
        page = self._pages[level]
        ntx = -(-page.imagewidth // page.tilewidth)
        i = ty * ntx + tx
        off, cnt = page.dataoffsets[i], page.databytecounts[i]
        if not cnt:
            return None
        self._fh.seek(off)
        return self._fh.read(cnt), page.jpegtables

    def _direct_agrees(self) -> bool:
        """Decode one sample box directly and through OpenSlide; True if identical."""
        W, H = self.info.dimensions
        w, h = min(W, 64), min(H, 64)
        x, y = (W - w) // 2, (H - h) // 2
        try:
            a = self._read_direct(0, x, y, w, h)
        except Exception as exc:
            log.debug("direct read failed: %s", exc)
            return False
        b = self.read_openslide(x, y, w, h)
        return bool(np.array_equal(a, b))


def _direct_pages(path: str, osr: Any) -> tuple[Any, dict[int, Any], list]:
    """Map OpenSlide levels to tifffile pages that can be decoded directly."""
    import tifffile

    jpeg_levels: list = [None] * osr.level_count
    try:
        tiff = tifffile.TiffFile(path)
    except Exception:
        return None, {}, jpeg_levels
    pages: dict[int, Any] = {}
    try:
        tiled = [
            p
            for p in tiff.pages
            if p.is_tiled
            and p.samplesperpixel == 3
            and p.bitspersample == 8
            and p.planarconfig == 1
            and p.compression in _DIRECT_COMPRESSIONS
            and (p.photometric == 2 or (p.photometric == 6 and p.compression == _JPEG))
        ]
        for lvl, (w, h) in enumerate(osr.level_dimensions):
            match = [p for p in tiled if (p.imagewidth, p.imagelength) == (w, h)]
            if len(match) != 1:
                continue
            p = match[0]
            if p.samplesperpixel != 3 or p.planarconfig != 1 or p.bitspersample != 8:
                continue
            pages[lvl] = p
            if p.compression == _JPEG:
                jpeg_levels[lvl] = (p.tilewidth, p.tilelength, "rgb" if p.photometric == 2 else "ycbcr")
    except Exception as exc:
        log.debug("tifffile could not index %s: %s", path, exc)
        tiff.close()
        return None, {}, [None] * osr.level_count
    if 0 not in pages:
        tiff.close()
        return None, {}, [None] * osr.level_count
    return tiff, pages, jpeg_levels


def _remove_dead_scratch(base: Path) -> None:
    """Remove the scratch folders of processes that no longer run (a tiler killed with its copies)."""
    import os
    import shutil

    if not base.is_dir():
        return
    for d in base.glob("p*"):
        try:
            pid = int(d.name[1:])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


REMOTE_SINGLE_FILE = (".svs", ".tif", ".tiff", ".ndpi", ".bif", ".scn", ".svslide", ".qptiff")


class SlideScratch:
    """Local copies of slides that live on object storage (OpenSlide reads local files only).

    :meth:`local` copies a slide URL into ``folder`` once (a temporary name renamed when complete) and returns the
    local path; :meth:`release` deletes a copy. At most ``max_bytes`` of copies exist at a time: older copies are
    released first (``on_evict`` is called before, so the caller can close its handle), and a slide larger than
    the bound fails with :class:`SlideOpenError` naming it. Multi-file formats (MIRAX, VMS, DICOM series) are
    refused from object storage.

    Args:
        folder: scratch folder (created; default ``$FOVEATE_SCRATCH_DIR``, else ``<tmp>/foveate-scratch``), one
            sub-folder per process.
        max_bytes: bound on the copies (default ``$FOVEATE_SCRATCH_MAX_GB`` GB, else 64 GB).
    """

    def __init__(self, folder: str | Path | None = None, max_bytes: int | None = None, on_evict=None):
        import os
        import tempfile

        base = Path(folder or os.environ.get("FOVEATE_SCRATCH_DIR") or Path(tempfile.gettempdir()) / "foveate-scratch")
        self.folder = base / f"p{os.getpid()}"
        _remove_dead_scratch(base)
        if max_bytes is None:
            raw = os.environ.get("FOVEATE_SCRATCH_MAX_GB", "64")
            try:
                max_bytes = int(float(raw) * 1e9)
            except ValueError:
                raise ValueError(f"$FOVEATE_SCRATCH_MAX_GB must be a number of gigabytes, got {raw!r}") from None
        if max_bytes <= 0:
            raise ValueError(f"scratch max_bytes must be > 0, got {max_bytes!r}")
        self.max_bytes = int(max_bytes)
        self.on_evict = on_evict
        self._copies: dict[str, tuple[Path, int]] = {}  # url -> (local path, bytes), oldest first

    @property
    def used_bytes(self) -> int:
        return sum(n for _, n in self._copies.values())

    def local(self, url: str) -> str:
        """The local copy of ``url`` (copied now if needed). Raises SlideOpenError for a missing or too large
        object, or a multi-file format."""
        from workers import storage

        got = self._copies.get(url)
        if got is not None and got[0].is_file():
            self._copies[url] = self._copies.pop(url)  # most recently used last
            return str(got[0])
        name = storage.basename(url)
        if not name.lower().endswith(REMOTE_SINGLE_FILE):
            raise SlideOpenError(
                f"{url}: only single-file slide formats {list(REMOTE_SINGLE_FILE)} are read from object storage "
                "(MIRAX, VMS and DICOM series need their folder: copy them to a local or shared disk)"
            )
        try:
            fs, path = storage.filesystem(url)
            size = int(fs.size(path))
        except FileNotFoundError:
            raise SlideOpenError(f"no such object: {url}") from None
        except Exception as exc:
            raise SlideOpenError(f"cannot read {url}: {type(exc).__name__}: {exc}") from exc
        if size > self.max_bytes:
            raise SlideOpenError(
                f"{url} is {size / 1e9:.2f} GB, more than the scratch bound of {self.max_bytes / 1e9:.2f} GB "
                "($FOVEATE_SCRATCH_MAX_GB)"
            )
        while self._copies and self.used_bytes + size > self.max_bytes:
            self.release(next(iter(self._copies)))
        import hashlib

        self.folder.mkdir(parents=True, exist_ok=True)
        local = self.folder / f"{hashlib.sha1(url.encode()).hexdigest()[:12]}-{name}"
        tmp = local.with_name(local.name + ".part")
        try:
            fs.get_file(path, str(tmp))
            tmp.replace(local)
        except Exception as exc:
            tmp.unlink(missing_ok=True)
            raise SlideOpenError(f"cannot copy {url} to scratch: {type(exc).__name__}: {exc}") from exc
        self._copies[url] = (local, size)
        return str(local)

    def release(self, url: str) -> None:
        """Delete the local copy of ``url`` (if any)."""
        got = self._copies.pop(url, None)
        if got is None:
            return
        if self.on_evict is not None:
            self.on_evict(url)
        got[0].unlink(missing_ok=True)

    def clear(self) -> None:
        for url in list(self._copies):
            self.release(url)
        try:
            self.folder.rmdir()
        except OSError:
            pass
