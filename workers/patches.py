"""Patch geometry on a slide store, the scorer's low-res input and patch reading.

* :class:`PatchGrid` — the grid of candidate patches in level-0 pixels: cell ``(r, c)`` (index ``r * Gw + c``)
  covers ``x in [c*stride, c*stride + patch_size)``, ``y in [r*stride, r*stride + patch_size)``. The grid
  covers the whole slide: the last row/column may overhang the slide edge, and those pixels read as white
  (like OpenSlide outside the slide).
* :func:`slide_geometry` — the model's grid, scorer scale and network patch size on one store, in its level-0
  pixels (``ModelConfig.slide_geometry`` with the store's mpp: µm settings give per-slide pixels).
* :func:`lowres_view` — the low-res RGB view (``[3, h, w]`` uint8; :func:`lowres_input` as float in [0, 1])
  covering exactly the grid extent, at ``scorer_downsample`` (from the level
  ``SlideStore.best_level_for_downsample`` picks, resampled with area interpolation where that level is finer,
  read in bands of chunk rows), and the tissue cells ``[Gh, Gw]`` (tissue fraction of the cell
  ``>= tissue_threshold``, from ``store.tissue_mask()``).
* :class:`PatchReader` — full-resolution patches of chosen cells, reading each store chunk they touch
  exactly once per call (chunk-aligned reads, cropped in memory; never a whole-level read), resampled to the
  network's input size when it differs from the cell size (µm patches on slides of another resolution).
* :func:`prepare_slide` / :func:`gather_patches` — one slide's inputs before selection (cached per process) and
  the selected patches read and combined. The chain through the model, with the training losses, is
  :func:`workers.slide_forward.forward_slide`; appearance strata and rarity are :mod:`workers.strata`.

Coordinate frames (level 0, store levels, the patch grid, the scorer's low-res view) are defined once in
:mod:`workers.frames`; names ending in ``_l0`` are level-0 pixels.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from operators.model import Selection
from operators.model_config import ModelConfig, SlideGeometry
from operators.soft_patches import combine_patches, unique_cells
from workers.store import SlideStore

__all__ = [
    "PatchGrid",
    "PatchReader",
    "SlideInput",
    "cell_tissue_fraction",
    "slide_geometry",
    "lowres_input",
    "lowres_view",
    "prepare_slide",
    "recentring",
    "gather_patches",
    "clear_cache",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PatchGrid:
    """Grid of candidate patches in level-0 pixels (see the module docstring).

    Attributes:
        level0_size: slide ``(width, height)``.
        patch_size: cell side in level-0 pixels.
        stride: cell stride in level-0 pixels.
        shape: ``(Gh, Gw)``; ``G = max(1, ceil((size - patch_size) / stride) + 1)`` per axis.
    """

    level0_size: tuple[int, int]
    patch_size: int
    stride: int
    shape: tuple[int, int]

    @classmethod
    def from_size(cls, level0_size: tuple[int, int], patch_size: int, stride: int | None = None) -> PatchGrid:
        """The grid covering a slide of ``level0_size = (width, height)``."""
        if isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size < 1:
            raise ValueError(f"patch_size must be a positive int (level-0 pixels), got {patch_size!r}")
        stride = patch_size if stride is None else stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be a positive int (level-0 pixels) or None, got {stride!r}")
        w, h = int(level0_size[0]), int(level0_size[1])
        if w < 1 or h < 1:
            raise ValueError(f"level0_size must be positive (width, height), got {level0_size!r}")

        def count(size: int) -> int:
            return 1 if size <= patch_size else math.ceil((size - patch_size) / stride) + 1

        return cls((w, h), patch_size, stride, (count(h), count(w)))

    @classmethod
    def from_store(cls, store: SlideStore, patch_size: int, stride: int | None = None) -> PatchGrid:
        """The grid covering ``store``'s level 0."""
        return cls.from_size(store.dimensions, patch_size, stride)

    @property
    def num_cells(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def extent_l0(self) -> tuple[int, int]:
        """``(width, height)`` in level-0 pixels covered by the grid (>= the slide size)."""
        gh, gw = self.shape
        return ((gw - 1) * self.stride + self.patch_size, (gh - 1) * self.stride + self.patch_size)

    def _check_indices(self, indices: Any) -> torch.Tensor:
        idx = torch.as_tensor(indices)
        if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"cell indices must be an integer tensor, got dtype {idx.dtype}")
        idx = idx.long()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_cells):
            raise ValueError(
                f"cell indices must lie in [0, {self.num_cells}) for grid {self.shape}, got range "
                f"[{int(idx.min())}, {int(idx.max())}]"
            )
        return idx

    def neighbours(self, indices: Any, count: int) -> torch.Tensor:
        """The ``count`` (4: edge, 8: edge and corner) grid neighbours of each cell, ``[M] -> [M, count]`` long,
        row-major; a neighbour beyond the grid's edge is the cell itself."""
        if count not in (4, 8):
            raise ValueError(f"count must be 4 or 8, got {count!r}")
        idx = self._check_indices(indices)
        gh, gw = self.shape
        r, c = idx // gw, idx % gw
        steps = [(-1, 0), (0, -1), (0, 1), (1, 0)]
        if count == 8:
            steps = [(-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1)]
        dr = torch.tensor([s[0] for s in steps], dtype=torch.long, device=idx.device)
        dc = torch.tensor([s[1] for s in steps], dtype=torch.long, device=idx.device)
        rr, cc = r[:, None] + dr, c[:, None] + dc
        inside = (rr >= 0) & (rr < gh) & (cc >= 0) & (cc < gw)
        return torch.where(inside, rr * gw + cc, idx[:, None].expand_as(rr))

    def cell_xy_l0(self, indices: Any) -> torch.Tensor:
        """Level-0 ``(x, y)`` of the top-left corner of cells ``indices[...]`` -> long ``[..., 2]``."""
        idx = self._check_indices(indices)
        gw = self.shape[1]
        return torch.stack([(idx % gw) * self.stride, (idx // gw) * self.stride], dim=-1)

    def cell_centres(self, indices: Any) -> torch.Tensor:
        """Patch centres divided by the slide ``(width, height)`` -> float32 ``[..., 2]`` (about [0, 1])."""
        xy = self.cell_xy_l0(indices).to(torch.float32) + self.patch_size / 2.0
        return xy / torch.tensor(self.level0_size, dtype=torch.float32, device=xy.device)


def cell_tissue_fraction(mask: np.ndarray, mask_downsample: float, grid: PatchGrid) -> np.ndarray:
    """Fraction of each cell that is tissue.

    Args:
        mask: ``(h, w)`` bool tissue mask of the slide.
        mask_downsample: level-0 pixels per mask pixel.
        grid: the patch grid.

    Returns:
        ``(Gh, Gw)`` float64 in [0, 1]; the part of a cell outside the slide counts as background.
    """
    mask = np.asarray(mask, dtype=bool)
    if mask.ndim != 2:
        raise ValueError(f"mask must be (h, w), got shape {mask.shape}")
    ii = np.zeros((mask.shape[0] + 1, mask.shape[1] + 1), dtype=np.int64)
    ii[1:, 1:] = mask.astype(np.int64).cumsum(0).cumsum(1)

    def bounds(g: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        start = np.arange(g, dtype=np.float64) * grid.stride
        lo = np.floor(start / mask_downsample + 1e-9).astype(np.int64)
        hi = np.maximum(np.ceil((start + grid.patch_size) / mask_downsample - 1e-9).astype(np.int64), lo + 1)
        return np.clip(lo, 0, size), np.clip(hi, 0, size), hi - lo

    y0, y1, hy = bounds(grid.shape[0], mask.shape[0])
    x0, x1, hx = bounds(grid.shape[1], mask.shape[1])
    s = ii[y1][:, x1] - ii[y0][:, x1] - ii[y1][:, x0] + ii[y0][:, x0]
    return s / (hy[:, None] * hx[None, :]).astype(np.float64)


def slide_geometry(store: SlideStore, cfg: ModelConfig) -> SlideGeometry:
    """``cfg.geometry`` on ``store``: patch size, stride and scorer downsample in the store's level-0 pixels and
    the network's patch side (µm settings resolved with the store's level-0 mpp ``meta.mpp[0]``).

    Raises:
        ConfigError: a µm setting on a store without mpp (the message names the store).
    """
    mpp = store.meta.mpp[0] if store.meta.mpp else None
    return cfg.slide_geometry(mpp, where=f"store {store.path}")


def lowres_input(
    store: SlideStore, cfg: ModelConfig, geometry: SlideGeometry | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scorer's input for one slide as float: :func:`lowres_view` divided by 255.

    Returns:
        ``(lowres[3, h, w] float32 in [0, 1], cell_mask[Gh, Gw] bool)`` (see :func:`lowres_view`).
    """
    view, cell_mask = lowres_view(store, cfg, geometry)
    return view.to(torch.float32).div_(255.0), cell_mask


def lowres_view(
    store: SlideStore, cfg: ModelConfig, geometry: SlideGeometry | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scorer's input for one slide, uint8.

    Args:
        store: the slide store.
        cfg: the model config (its grid and scorer resolution, ``tissue_threshold``).
        geometry: ``slide_geometry(store, cfg)`` when the caller has it.

    Returns:
        ``(lowres[3, h, w] uint8, cell_mask[Gh, Gw] bool)``: the low-res view covering the grid extent
        (``h = round(extent_h / scorer_downsample)`` with the slide's scorer downsample, white beyond the slide)
        and the tissue cells (tissue fraction ``>= tissue_threshold``; a threshold of 0 makes every cell a
        candidate). Reads one low-resolution level (not level 0 unless the store has no coarser level) in bands
        of chunk rows (:func:`_level_view`): besides the uint8 view, memory holds one band, never the whole level
        as float.
    """
    if not isinstance(store, SlideStore):
        raise TypeError(f"store must be a SlideStore, got {type(store).__name__}")
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    geo = slide_geometry(store, cfg) if geometry is None else geometry
    grid = PatchGrid.from_store(store, geo.patch_size, geo.stride)
    ext_w, ext_h = grid.extent_l0
    level = store.best_level_for_downsample(geo.scorer_downsample)
    ds = store.downsamples[level]
    th = max(1, round(ext_h / geo.scorer_downsample))
    tw = max(1, round(ext_w / geo.scorer_downsample))
    view = _level_view(store, level, (math.ceil(ext_w / ds), math.ceil(ext_h / ds)), (th, tw))
    mask, mask_ds = store.tissue_mask()
    frac = cell_tissue_fraction(mask, mask_ds, grid)
    cell_mask = torch.from_numpy(frac >= cfg.geometry.tissue_threshold)
    return view, cell_mask


_LOWRES_BAND_BYTES = 16 * 2**20  # float32 bytes of one band of level rows while resampling (at least a chunk row)


def _level_view(store: SlideStore, level: int, size_lv: tuple[int, int], out_hw: tuple[int, int]) -> torch.Tensor:
    """The top-left ``size_lv = (w, h)`` pixels of store level ``level`` (white beyond it), area-resampled to
    ``out_hw = (th, tw)``: uint8 ``[3, th, tw]``.

    Read in bands of whole chunk rows (each chunk decoded once). Without resampling a band is copied into the
    view. Otherwise the resampling is ``F.interpolate(mode="area")`` (adaptive average pooling: output row ``i``
    averages input rows ``[floor(i*h/th), ceil((i+1)*h/th))``, columns likewise) done separably: as soon as a
    band holds all input rows of some output rows, those rows' bins are averaged (float32, full width), then
    pooled over columns to ``tw``; the input rows the next output row still needs carry over (uint8). Rounded
    to uint8 (half to even; the float path rounded the same means, so values differ by at most 1 near exact
    halves). Peak extra memory: about one band in float32 (:data:`_LOWRES_BAND_BYTES`).
    """
    arr = store.levels[level]
    H, W = int(arr.shape[1]), int(arr.shape[2])
    rw, rh = int(size_lv[0]), int(size_lv[1])
    th, tw = int(out_hw[0]), int(out_hw[1])
    ch = int(arr.chunks[1])
    band_rows = max(ch, (_LOWRES_BAND_BYTES // max(1, rw * 12)) // ch * ch)
    out = torch.empty((3, th, tw), dtype=torch.uint8)

    def rows(a: int, b: int) -> torch.Tensor:  # level rows [a, b), columns [0, rw): uint8 [3, b - a, rw]
        blk = np.full((3, b - a, rw), 255, dtype=np.uint8)
        y1, x1 = min(b, H), min(rw, W)
        if y1 > a and x1 > 0:
            blk[:, : y1 - a, :x1] = arr[:, a:y1, :x1]
        return torch.from_numpy(blk)

    if (rh, rw) == (th, tw):
        for a in range(0, rh, band_rows):
            out[:, a : min(rh, a + band_rows)] = rows(a, min(rh, a + band_rows))
        return out
    i = torch.arange(th + 1, dtype=torch.int64)
    lo, hi = (i[:-1] * rh) // th, (i[1:] * rh + th - 1) // th  # adaptive pooling's row bins
    carry = torch.empty((3, 0, rw), dtype=torch.uint8)  # level rows [start, a) still needed
    start, nxt = 0, 0  # first carried row, next output row
    for a in range(0, rh, band_rows):
        b = min(rh, a + band_rows)
        buf = torch.cat([carry, rows(a, b)], 1)  # level rows [start, b)
        end = nxt
        while end < th and int(hi[end]) <= b:
            end += 1
        if end > nxt:
            r0, n = lo[nxt:end] - start, hi[nxt:end] - lo[nxt:end]
            acc = torch.zeros((3, end - nxt, rw), dtype=torch.float32)
            for t in range(int(n.max())):  # row means over each bin (at most ceil(rh / th) + 1 rows)
                w = (t < n).to(torch.float32)
                acc += buf[:, (r0 + t).clamp(max=buf.shape[1] - 1)].to(torch.float32) * w[None, :, None]
            acc /= n.to(torch.float32)[None, :, None]
            cols = F.adaptive_avg_pool2d(acc[None], (end - nxt, tw))[0]  # then columns (rows unchanged)
            out[:, nxt:end] = cols.round_().clamp_(0, 255).to(torch.uint8)
            nxt = end
        keep = int(lo[nxt]) - start if nxt < th else buf.shape[1]
        carry, start = buf[:, keep:].clone(), start + keep
    return out


class PatchReader:
    """Reads full-resolution (level-0) patches of grid cells from a store.

    Each call reads the chunks the requested patches touch exactly once and crops the patches from them in
    memory: on a local store straight from its chunk files (:class:`workers.chunks.LocalChunkReader`, the same
    pixels without zarr's per-call overhead), otherwise through zarr, adjacent chunks grouped into horizontal
    runs, each run read with one chunk-aligned slice. Pixels beyond the slide are white (255). A call holds the touched chunks in memory,
    so read many cells (e.g. every tissue cell of a large slide) in batches of a few hundred.

    With ``out_size`` different from the cell size (µm patches: a 40x slide's cells have twice the pixels of a
    20x slide's), each patch is read at level 0 and resampled to ``out_size`` pixels: area interpolation when
    shrinking (at an integer factor, the mean of each block: what the store's own 2x pyramid holds), bilinear
    when enlarging, rounded back to uint8; in batches of :data:`_RESAMPLE_BATCH` patches.

    Args:
        store: the slide store (its level-0 array ``store.levels[0]`` is looked up at each call).
        grid: the patch grid on this store.
        out_size: side of the returned patches (None: ``grid.patch_size``, read as they are).
        recentre: shifts of each cell's read window (``[M, 2]`` top-left corners -> ``[M, 2]`` int64 level-0
            ``(dx, dy)``, :class:`workers.recentre.Recentring`), applied when :meth:`read` is given no offsets.
    """

    def __init__(
        self,
        store: SlideStore,
        grid: PatchGrid,
        out_size: int | None = None,
        recentre: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if not isinstance(store, SlideStore):
            raise TypeError(f"store must be a SlideStore, got {type(store).__name__}")
        if not isinstance(grid, PatchGrid):
            raise TypeError(f"grid must be a PatchGrid, got {type(grid).__name__}")
        if tuple(grid.level0_size) != tuple(store.dimensions):
            raise ValueError(f"grid level0_size {grid.level0_size} does not match the store's {store.dimensions}")
        if out_size is not None and (isinstance(out_size, bool) or not isinstance(out_size, int) or out_size < 1):
            raise ValueError(f"out_size must be a positive int (pixels) or None, got {out_size!r}")
        self.store = store
        self.grid = grid
        self.out_size = grid.patch_size if out_size is None else int(out_size)
        self.recentre = recentre
        self._direct: Any = None  # workers.chunks.LocalChunkReader of level 0 (False: read through zarr)

    def read(self, cell_indices: Any, offsets_l0: torch.Tensor | None = None) -> torch.Tensor:
        """Patches of ``cell_indices`` (LongTensor ``[M]``, repeats allowed) -> uint8 ``[M, 3, s, s]``
        (``s = out_size``). ``offsets_l0``: optional ``[M, 2]`` integer ``(dx, dy)`` shifts of each read window in
        level-0 pixels (None: the reader's ``recentre`` shifts, if any); pixels outside the slide read as white
        (255)."""
        if offsets_l0 is None:
            offsets_l0 = self.offsets(cell_indices)
        out = self._read_l0(cell_indices, offsets_l0)
        if self.out_size == self.grid.patch_size:
            return out
        return _resample_patches(out, self.out_size)

    def offsets(self, cell_indices: Any) -> torch.Tensor | None:
        """The level-0 shifts ``[M, 2]`` int64 the reader applies to cells ``[M]`` (None: no ``recentre``)."""
        if self.recentre is None:
            return None
        idx = self.grid._check_indices(cell_indices)
        return self.recentre(self.grid.cell_xy_l0(idx.reshape(-1)).cpu())

    def _read_l0(self, cell_indices: Any, offsets_l0: torch.Tensor | None = None) -> torch.Tensor:
        """The patches at level 0: uint8 ``[M, 3, p, p]`` (``p = grid.patch_size``)."""
        idx = self.grid._check_indices(cell_indices)
        if idx.dim() != 1:
            raise ValueError(f"cell_indices must be a 1-D tensor [M], got shape {tuple(idx.shape)}")
        if offsets_l0 is not None and (
            not isinstance(offsets_l0, torch.Tensor)
            or offsets_l0.shape != (idx.shape[0], 2)
            or offsets_l0.is_floating_point()
        ):
            raise ValueError(
                f"offsets_l0 must be an integer tensor [M, 2] = [{idx.shape[0]}, 2], got "
                f"{getattr(offsets_l0, 'shape', type(offsets_l0))} {getattr(offsets_l0, 'dtype', '')}"
            )
        p = self.grid.patch_size
        m = idx.shape[0]
        out = np.full((m, 3, p, p), 255, dtype=np.uint8)
        if m == 0:
            return torch.from_numpy(out)
        arr = self.store.levels[0]
        H, W = int(arr.shape[1]), int(arr.shape[2])
        th, tw = int(arr.chunks[1]), int(arr.chunks[2])
        xy = self.grid.cell_xy_l0(idx).cpu().numpy()
        if offsets_l0 is not None:
            xy = xy + offsets_l0.cpu().numpy().astype(xy.dtype)
        x0 = np.clip(xy[:, 0], 0, W)
        x1 = np.clip(xy[:, 0] + p, 0, W)
        y0 = np.clip(xy[:, 1], 0, H)
        y1 = np.clip(xy[:, 1] + p, 0, H)
        valid = (x1 > x0) & (y1 > y0)
        needed: dict[int, set[int]] = {}
        for i in np.nonzero(valid)[0]:
            for cy in range(y0[i] // th, (y1[i] - 1) // th + 1):
                needed.setdefault(int(cy), set()).update(range(int(x0[i] // tw), int((x1[i] - 1) // tw) + 1))
        chunks: dict[tuple[int, int], np.ndarray] = {}
        from workers.chunks import read_checked

        if self._direct is None:
            from workers.chunks import local_chunk_reader

            self._direct = local_chunk_reader(arr) or False
        if self._direct and (th, tw) == self._direct.chunk:  # a local store: its chunk files, decoded here
            for cy, cxs in needed.items():
                for cx in cxs:
                    chunks[(cy, cx)] = self._direct.read(cy, cx)
            needed = {}
        for cy, cxs in needed.items():
            run: list[int] = []
            for cx in sorted(cxs) + [None]:  # type: ignore[list-item]
                if run and (cx is None or cx != run[-1] + 1):
                    a, b = run[0], run[-1]
                    sel = (slice(None), slice(cy * th, min((cy + 1) * th, H)), slice(a * tw, min((b + 1) * tw, W)))
                    block = read_checked(arr, sel, str(self.store.path))  # a failed crc32c names the chunk
                    for c in run:
                        chunks[(cy, c)] = block[:, :, (c - a) * tw : (c - a + 1) * tw]
                    run = []
                if cx is not None:
                    run.append(cx)
        for i in np.nonzero(valid)[0]:
            for cy in range(y0[i] // th, (y1[i] - 1) // th + 1):
                for cx in range(x0[i] // tw, (x1[i] - 1) // tw + 1):
                    blk = chunks[(int(cy), int(cx))]
                    gy0, gy1 = max(y0[i], cy * th), min(y1[i], cy * th + blk.shape[1])
                    gx0, gx1 = max(x0[i], cx * tw), min(x1[i], cx * tw + blk.shape[2])
                    out[i, :, gy0 - xy[i, 1] : gy1 - xy[i, 1], gx0 - xy[i, 0] : gx1 - xy[i, 0]] = blk[
                        :, gy0 - cy * th : gy1 - cy * th, gx0 - cx * tw : gx1 - cx * tw
                    ]
        return torch.from_numpy(out)


_RESAMPLE_BATCH = 64  # patches resampled at once (a float32 copy of the batch is made)


def _resample_patches(patches: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 ``[M, 3, p, p]`` -> uint8 ``[M, 3, size, size]`` (area when shrinking, bilinear when enlarging)."""
    m, _, p, _ = patches.shape
    out = torch.empty((m, 3, size, size), dtype=torch.uint8)
    kw = {"mode": "area"} if size < p else {"mode": "bilinear", "align_corners": False}
    for i in range(0, m, _RESAMPLE_BATCH):
        x = patches[i : i + _RESAMPLE_BATCH].to(torch.float32)
        out[i : i + _RESAMPLE_BATCH] = F.interpolate(x, size=(size, size), **kw).round_().clamp_(0, 255).to(torch.uint8)
    return out


@dataclass
class SlideInput:
    """Everything the model needs about one slide before selection (cheap to keep per process).

    Attributes:
        store: the slide store.
        grid: its patch grid.
        lowres_u8: ``[3, h, w]`` uint8 low-res view (see :func:`lowres_view`); :attr:`lowres` is the float one.
        cell_mask: ``[Gh, Gw]`` bool tissue cells.
        reader: a :class:`PatchReader` on the store (patches of ``geometry.patch_input`` pixels).
        geometry: the model's geometry on this slide (:func:`slide_geometry`).
    """

    store: SlideStore
    grid: PatchGrid
    lowres_u8: torch.Tensor
    cell_mask: torch.Tensor
    reader: PatchReader
    strata: dict[int, torch.Tensor] = field(default_factory=dict)  # number of strata -> cell_strata (cached)
    rarity: tuple[int, torch.Tensor] | None = None  # (strata, cell_rarity)
    rare: tuple[int, int, torch.Tensor, torch.Tensor | None] | None = None  # (count, strata, cells, uint8 pixels)
    geometry: SlideGeometry | None = None

    @property
    def lowres(self) -> torch.Tensor:
        """``[3, h, w]`` float32 in [0, 1]."""
        return self.lowres_u8.to(torch.float32) / 255.0

    @property
    def slide_id(self) -> str:
        return self.store.slide_id


_CACHE: OrderedDict[tuple, SlideInput] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_MAX_BYTES = 512 * 2**20


def clear_cache() -> None:
    """Forget the per-process cache of :func:`prepare_slide`."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _resolve_store(store_or_sample: Any) -> SlideStore:
    obj = store_or_sample
    if isinstance(obj, dict):
        for key in ("store", "store_path", "path"):
            if key in obj:
                obj = obj[key]
                break
    else:
        for attr in ("store", "store_path", "path"):
            if not isinstance(obj, (SlideStore, str, Path)) and hasattr(obj, attr):
                obj = getattr(obj, attr)
                break
    if isinstance(obj, SlideStore):
        return obj
    if isinstance(obj, (str, Path)):
        return SlideStore(obj)
    raise TypeError(
        "store_or_sample must be a SlideStore, a store path, a SlideInput, or a sample with a "
        f"'store'/'store_path'/'path' attribute or key; got {type(store_or_sample).__name__}"
    )


def recentring(
    cfg: ModelConfig, geometry: SlideGeometry, lowres: torch.Tensor, cell_mask: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The read shifts of ``cfg.geometry.recentre`` on one slide (:class:`workers.recentre.Recentring`), from its
    low-res view ``[3, h, w]`` and tissue cells; None when it is off."""
    if not cfg.geometry.recentre:
        return None
    from workers.recentre import Recentring

    return Recentring.from_view(lowres, cell_mask, geometry.patch_size, geometry.stride, geometry.scorer_downsample)


def prepare_slide(store_or_sample: Any, cfg: ModelConfig, *, cache: bool = True) -> SlideInput:
    """Grid, low-res input, tissue cells and reader for one slide (cached per process by store path and
    geometry, up to 512 MiB of low-res pixels).

    Args:
        store_or_sample: a :class:`SlideInput` (returned as is), a ``SlideStore``, a store path, or an object
            / dict with a ``store``, ``store_path`` or ``path`` attribute / key.
        cfg: the model config.
        cache: use the per-process cache.
    """
    if isinstance(store_or_sample, SlideInput):
        return store_or_sample
    key_geom = cfg.geometry_key() + (float(cfg.geometry.tissue_threshold),)
    path_key = None
    if cache and isinstance(store_or_sample, (str, Path, SlideStore)):
        from workers.storage import normalize

        loc = store_or_sample.location if isinstance(store_or_sample, SlideStore) else normalize(store_or_sample)
        path_key = (loc,) + key_geom
        with _CACHE_LOCK:
            hit = _CACHE.get(path_key)
            if hit is not None:
                _CACHE.move_to_end(path_key)
                return hit
    store = _resolve_store(store_or_sample)
    if cache and path_key is None:
        path_key = (store.location,) + key_geom
        with _CACHE_LOCK:
            hit = _CACHE.get(path_key)
            if hit is not None:
                _CACHE.move_to_end(path_key)
                return hit
    geo = slide_geometry(store, cfg)
    grid = PatchGrid.from_store(store, geo.patch_size, geo.stride)
    lowres_u8, cell_mask = lowres_view(store, cfg, geo)
    reader = PatchReader(store, grid, geo.patch_input, recentring(cfg, geo, lowres_u8, cell_mask))
    si = SlideInput(store, grid, lowres_u8, cell_mask, reader, geometry=geo)
    if cache:
        with _CACHE_LOCK:
            _CACHE[path_key] = si
            total = sum(v.lowres_u8.numel() for v in _CACHE.values())
            while total > _CACHE_MAX_BYTES and len(_CACHE) > 1:
                _, old = _CACHE.popitem(last=False)
                total -= old.lowres_u8.numel()
    return si


def gather_patches(
    slide: SlideInput,
    selection: Selection,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Read the selected patches of one slide and form each slot's (soft) patch.

    Each distinct cell of ``selection.indices`` is read once; slot ``k`` is
    ``sum_s weights[0, k, s] * patch[indices[0, k, s]]`` (Cordonnier et al. soft patches; memory
    O(K * S) patches).

    Args:
        slide: from :func:`prepare_slide`.
        selection: for this slide (``B = 1``).
        device, dtype: of the returned patches (default: the selection weights' device).

    Returns:
        ``(patches[1, K, 3, s, s] in [0, 1], positions[1, K, 2], cells_read)`` (``s = geometry.patch_input``,
        the reader's ``out_size``): positions are the normalised
        centres of the slots' primary cells (:meth:`PatchGrid.cell_centres`).
    """
    if selection.indices.dim() != 3 or selection.indices.shape[0] != 1:
        raise ValueError(
            f"gather_patches works on one slide: selection.indices must be [1, K, S], got "
            f"{tuple(selection.indices.shape)}"
        )
    device = selection.weights.device if device is None else torch.device(device)
    cells, inverse = unique_cells(selection.indices)
    pix = slide.reader.read(cells.cpu())
    x = pix.to(device=device, dtype=dtype).div_(255.0)
    patches = combine_patches(x, inverse.to(device), selection.weights.to(device=device, dtype=dtype))
    positions = slide.grid.cell_centres(selection.primary.cpu()).to(device=device, dtype=dtype)
    return patches, positions, int(cells.numel())
