"""Patch grid, low-res input, tissue cells and PatchReader on real Zarr stores."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
import zarr
from flat_model_config import flat_config
from zarr.storage import LocalStore, WrapperStore

from workers.patches import PatchGrid, PatchReader, cell_tissue_fraction, lowres_input, prepare_slide
from workers.store import write_store_from_array

TILE = 128


def _image(seed: int = 0) -> np.ndarray:
    """1024 x 1000 white slide with a noisy tissue block reaching the right and bottom edges."""
    rng = np.random.default_rng(seed)
    img = np.full((1000, 1024, 3), 245, np.uint8)
    img[300:1000, 400:1024] = rng.integers(0, 256, size=(700, 624, 3), dtype=np.uint8)
    img[300:1000, 400:1024, 1] //= 3  # saturated (pink-ish) so tissue detection finds it
    return img


@pytest.fixture(scope="module")
def store_and_image(tmp_path_factory):
    img = _image()
    st = write_store_from_array(tmp_path_factory.mktemp("st") / "s.zarr", img, tile_size=TILE, min_size=128)
    return st, img


class CountingStore(WrapperStore):
    """Counts every key fetched from the wrapped store (chunk reads)."""

    def __init__(self, store):
        super().__init__(store)
        self.counts: Counter = Counter()

    async def get(self, key, prototype, byte_range=None):
        self.counts[key] += 1
        return await self._store.get(key, prototype, byte_range)


def test_grid_geometry():
    g = PatchGrid.from_size((1000, 700), 128, 100)
    assert g.shape == (math.ceil((700 - 128) / 100) + 1, math.ceil((1000 - 128) / 100) + 1) == (7, 10)
    assert g.extent_l0 == (9 * 100 + 128, 6 * 100 + 128)
    assert g.extent_l0[0] >= 1000 and g.extent_l0[1] >= 700
    xy = g.cell_xy_l0(torch.tensor([0, 1, 10, 69]))
    assert xy.tolist() == [[0, 0], [100, 0], [0, 100], [900, 600]]
    c = g.cell_centres(torch.tensor([0, 69]))
    assert torch.allclose(c, torch.tensor([[64 / 1000, 64 / 700], [964 / 1000, 664 / 700]]))
    assert PatchGrid.from_size((100, 50), 128).shape == (1, 1)
    with pytest.raises(ValueError, match="patch_size"):
        PatchGrid.from_size((100, 100), 0)
    with pytest.raises(ValueError, match="stride"):
        PatchGrid.from_size((100, 100), 16, -1)
    with pytest.raises(ValueError, match=r"\[0, 70\)"):
        g.cell_xy_l0(torch.tensor([70]))


def test_patch_reader_exact_pixels_and_white_padding(store_and_image):
    st, img = store_and_image
    grid = PatchGrid.from_store(st, 96, 80)  # not chunk-aligned, overlapping, edge cells overhang
    gh, gw = grid.shape
    assert grid.extent_l0[0] > 1024 and grid.extent_l0[1] > 1000
    cells = torch.tensor([0, gw - 1, gh * gw - 1, (gh - 1) * gw, 5 * gw + 7, 5 * gw + 7, 5 * gw + 8])
    out = PatchReader(st, grid).read(cells)
    assert out.dtype == torch.uint8 and tuple(out.shape) == (len(cells), 3, 96, 96)
    padded = np.full((grid.extent_l0[1], grid.extent_l0[0], 3), 255, np.uint8)
    padded[:1000, :1024] = img
    for i, c in enumerate(cells.tolist()):
        x, y = grid.cell_xy_l0(torch.tensor(c)).tolist()
        want = padded[y : y + 96, x : x + 96]
        np.testing.assert_array_equal(out[i].permute(1, 2, 0).numpy(), want)
        np.testing.assert_array_equal(out[i].permute(1, 2, 0).numpy(), st.read_region((x, y), 0, (96, 96)))
    # the last cell overhangs both edges: its outside part is white, its inside part is the slide
    x, y = grid.cell_xy_l0(torch.tensor(gh * gw - 1)).tolist()
    last = out[2].permute(1, 2, 0).numpy()
    assert (last[1000 - y :, :] == 255).all() and (last[:, 1024 - x :] == 255).all()
    assert not (last[: 1000 - y, : 1024 - x] == 255).all()


def test_patch_reader_offsets_shift_the_window_with_white_outside_the_slide(store_and_image):
    """Read windows shifted by (dx, dy): each cell's window moves by its offset in level-0 pixels; the parts
    outside the slide (also left of / above the origin) are white."""
    st, img = store_and_image
    grid = PatchGrid.from_store(st, 96, 80)
    gh, gw = grid.shape
    cells = torch.tensor([0, 5 * gw + 7, gh * gw - 1, 5 * gw + 7])
    offsets = torch.tensor([[-20, -7], [13, -5], [9, 30], [-13, 5]])
    out = PatchReader(st, grid).read(cells, offsets)
    pad = 64
    padded = np.full((grid.extent_l0[1] + 2 * pad, grid.extent_l0[0] + 2 * pad, 3), 255, np.uint8)
    padded[pad : pad + 1000, pad : pad + 1024] = img
    for i, c in enumerate(cells.tolist()):
        x, y = (grid.cell_xy_l0(torch.tensor(c)) + offsets[i]).tolist()
        want = padded[pad + y : pad + y + 96, pad + x : pad + x + 96]
        np.testing.assert_array_equal(out[i].permute(1, 2, 0).numpy(), want)
    assert torch.equal(
        PatchReader(st, grid).read(cells, torch.zeros(4, 2, dtype=torch.long)), PatchReader(st, grid).read(cells)
    )
    with pytest.raises(ValueError, match="offsets_l0"):
        PatchReader(st, grid).read(cells, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="offsets_l0"):
        PatchReader(st, grid).read(cells, torch.zeros(4, 2))


def test_patch_reader_reads_each_touched_chunk_once(store_and_image):
    st, _ = store_and_image
    grid = PatchGrid.from_store(st, 96, 80)
    counting = CountingStore(LocalStore(str(st.path), read_only=True))
    st2 = type(st)(st.path)
    st2.levels[0] = zarr.open_array(store=counting, path="0", mode="r")
    gw = grid.shape[1]
    # overlapping patches sharing chunks, plus duplicates
    cells = torch.tensor([0, 1, 2, gw, gw + 1, 4 * gw + 9, 4 * gw + 9, 11 * gw + 3])
    counting.counts.clear()
    out = PatchReader(st2, grid).read(cells)
    chunk_reads = {k: v for k, v in counting.counts.items() if "/c/" in k}
    expected = set()
    for c in cells.tolist():
        x, y = grid.cell_xy_l0(torch.tensor(c)).tolist()
        for cy in range(y // TILE, (min(y + 96, 1000) - 1) // TILE + 1):
            for cx in range(x // TILE, (min(x + 96, 1024) - 1) // TILE + 1):
                expected.add(f"0/c/0/{cy}/{cx}")
    assert set(chunk_reads) == expected
    assert max(chunk_reads.values()) == 1, chunk_reads
    np.testing.assert_array_equal(out.numpy(), PatchReader(st, grid).read(cells).numpy())


def test_patch_reader_bad_input(store_and_image):
    st, _ = store_and_image
    grid = PatchGrid.from_store(st, 128)
    r = PatchReader(st, grid)
    with pytest.raises(ValueError, match="cell indices"):
        r.read(torch.tensor([grid.num_cells]))
    with pytest.raises(TypeError, match="integer"):
        r.read(torch.tensor([0.5]))
    assert tuple(r.read(torch.zeros(0, dtype=torch.long)).shape) == (0, 3, 128, 128)
    with pytest.raises(ValueError, match="level0_size"):
        PatchReader(st, PatchGrid.from_size((512, 512), 128))


def test_lowres_input_matches_levels(store_and_image):
    st, _ = store_and_image
    assert st.downsamples == (1.0, 2.0, 4.0, 8.0)
    cfg = flat_config(patch_size=128, scorer_downsample=8)
    lowres, cell_mask = lowres_input(st, cfg)
    grid = PatchGrid.from_store(st, 128)
    assert grid.extent_l0 == (1024, 1024)
    assert tuple(lowres.shape) == (3, 128, 128) and lowres.dtype == torch.float32
    lvl = st.read_level(3)  # (125, 128, 3)
    want = np.full((128, 128, 3), 255, np.uint8)
    want[:125] = lvl
    torch.testing.assert_close(lowres, torch.from_numpy(want).permute(2, 0, 1).float() / 255)
    # coarser than the coarsest level: area-resampled from it
    low16, _ = lowres_input(st, flat_config(patch_size=128, scorer_downsample=16))
    assert tuple(low16.shape) == (3, 64, 64)
    ref = torch.from_numpy(want).permute(2, 0, 1).float().div(255).reshape(3, 64, 2, 64, 2).mean((2, 4))
    torch.testing.assert_close(low16, ref, atol=0.5 / 255 + 1e-6, rtol=0)  # the view is uint8
    assert cell_mask.dtype == torch.bool and tuple(cell_mask.shape) == grid.shape


@pytest.mark.parametrize("ds", [8.0, 16.0, 3.0, 5.3, 1.7])
def test_lowres_view_in_bands_equals_the_whole_level_resampled(monkeypatch, store_and_image, ds):
    """The banded read (one chunk row per band here) against the whole level read at once and
    F.interpolate(area) on floats, as before: equal without resampling, within 1 (rounding) with it."""
    import torch.nn.functional as F

    import workers.patches as wp

    st, _ = store_and_image
    monkeypatch.setattr(wp, "_LOWRES_BAND_BYTES", 1)  # bands of one chunk row (128 level rows)
    cfg = flat_config(patch_size=96, stride=80, scorer_downsample=ds)
    view, _ = wp.lowres_view(st, cfg)
    grid = PatchGrid.from_store(st, 96, 80)
    ext_w, ext_h = grid.extent_l0
    level = st.best_level_for_downsample(ds)
    lds = st.downsamples[level]
    img = st.read_region((0, 0), level, (math.ceil(ext_w / lds), math.ceil(ext_h / lds)))
    t = torch.from_numpy(img).permute(2, 0, 1).float().div(255)
    size = (max(1, round(ext_h / ds)), max(1, round(ext_w / ds)))
    assert view.dtype == torch.uint8 and tuple(view.shape[1:]) == size
    if tuple(t.shape[1:]) == size:
        assert torch.equal(view, torch.from_numpy(img).permute(2, 0, 1))
    else:
        ref = (F.interpolate(t[None], size=size, mode="area")[0] * 255).round().to(torch.int16)
        diff = (view.to(torch.int16) - ref).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.02


def test_cell_tissue_fraction_brute_force(store_and_image):
    st, _ = store_and_image
    mask, ds = st.tissue_mask()
    assert ds == 8.0
    grid = PatchGrid.from_store(st, 96, 80)
    frac = cell_tissue_fraction(mask, ds, grid)
    big = np.zeros((grid.extent_l0[1] + 8, grid.extent_l0[0] + 8), bool)
    up = np.kron(mask, np.ones((8, 8), bool))
    big[: up.shape[0], : up.shape[1]] = up
    for r in range(grid.shape[0]):
        for c in range(grid.shape[1]):
            x, y = c * 80, r * 80
            # mask-pixel-aligned box covering the cell (the function's rounding: floor / ceil)
            x0, y0 = (x // 8) * 8, (y // 8) * 8
            x1, y1 = -(-(x + 96) // 8) * 8, -(-(y + 96) // 8) * 8
            assert frac[r, c] == pytest.approx(big[y0:y1, x0:x1].mean())
    # the tissue block is x >= 400, y >= 300: cells fully inside are tissue, cells left of it are not
    cfg = flat_config(patch_size=96, stride=80, scorer_downsample=8, tissue_threshold=0.5)
    _, cm = lowres_input(st, cfg)
    assert cm[6, 8] and not cm[0, 0] and not cm[6, 2]
    assert torch.equal(cm, torch.from_numpy(frac >= 0.5))
    _, all_cells = lowres_input(st, flat_config(patch_size=96, stride=80, scorer_downsample=8, tissue_threshold=0.0))
    assert bool(all_cells.all())


def test_prepare_slide_cache(store_and_image):
    st, _ = store_and_image
    cfg = flat_config(patch_size=128, scorer_downsample=8)
    a = prepare_slide(st.path, cfg)
    b = prepare_slide(str(st.path), cfg)
    assert a is b
    assert prepare_slide({"store_path": st.path}, cfg) is a
    c = prepare_slide(st, flat_config(patch_size=64, scorer_downsample=8))
    assert c is not a and c.grid.shape == (16, 16)
    with pytest.raises(TypeError, match="store_or_sample"):
        prepare_slide(42, cfg)


@pytest.mark.parametrize("hw,grid", [((203, 317), (50, 79)), ((256, 256), (64, 64)), ((97, 130), (13, 20))])
def test_cell_strata_of_a_large_view_in_bands_equals_the_whole_view(monkeypatch, hw, grid):
    """Gigapixel memory: the per-cell appearance of a view above the size limit is pooled band by band (no float64
    copy of the view); same descriptors (1e-12) and the same strata as the whole-view pooling; a uint8 view gives
    what its float view (u8 / 255 in float32, as training sees it) gives."""
    import workers.strata as P

    u8 = torch.randint(0, 256, (3, *hw), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    u8[:, : hw[0] // 3, : hw[1] // 2] = 240  # some structure, so the strata are not noise alone
    f32 = u8.to(torch.float32) / 255.0
    whole_desc = P._cell_appearance(f32, *grid)
    whole = P.cell_strata(f32, grid, 8)
    assert torch.equal(P.cell_strata(u8, grid, 8), whole)
    monkeypatch.setattr(P, "_STRATA_WHOLE_PIXELS", 999)  # bands of a few cell rows
    monkeypatch.setattr(P, "_NEAREST_ROWS", 100)  # nearest centres in chunks
    band_desc = P._cell_appearance(u8, *grid)
    assert torch.allclose(band_desc, whole_desc, rtol=0, atol=1e-12)
    assert torch.equal(P.cell_strata(u8, grid, 8), whole)
