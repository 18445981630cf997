"""Re-centring of a cell's read on what it holds (workers.recentre, model.geometry.recentre)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.recentre import Recentring, background_luminance, content_map, recentre_offsets, tissue_pixels


def _reference(content: np.ndarray, xy: np.ndarray, patch: int, d: int, max_shift: int) -> np.ndarray:
    """One mean-shift step on the content map blown up to level 0 (every low-res pixel d x d level-0 pixels): the
    centroid of the level-0 pixels each window covers."""
    pad = 4 * patch
    fine = np.pad(np.kron(content, np.ones((d, d))), pad)
    out = []
    for x0, y0 in xy:
        win = fine[y0 + pad : y0 + pad + patch, x0 + pad : x0 + pad + patch]
        m = win.sum()
        ys, xs = np.mgrid[0:patch, 0:patch]
        cx = x0 + ((xs + 0.5) * win).sum() / m
        cy = y0 + ((ys + 0.5) * win).sum() / m
        dx = min(max(cx - patch / 2 - x0, -max_shift), max_shift)
        dy = min(max(cy - patch / 2 - y0, -max_shift), max_shift)
        out.append((round(dx), round(dy)))
    return np.array(out)


def test_moves_the_window_onto_a_blob_and_clips():
    content = torch.zeros(16, 16)
    content[6:8, 9:11] = 1.0  # a 2x2 low-res blob: level-0 x 36..44, y 24..32 at d = 4 (centre (40, 28))
    xy = torch.tensor([[28, 16], [32, 20], [0, 0]])  # 16-px windows; the last one sees no content
    shifts = recentre_offsets(content, xy, patch=16, downsample=4, max_shift=8, iters=5)
    # the first two end centred on the blob (window corner (32, 20)); the third has nothing and stays
    assert shifts.tolist() == [[4, 4], [0, 0], [0, 0]]
    clipped = recentre_offsets(content, xy[:1], patch=16, downsample=4, max_shift=2, iters=5)
    assert clipped.tolist() == [[2, 2]]
    assert recentre_offsets(content, xy, 16, 4, 0).tolist() == [[0, 0]] * 3
    assert recentre_offsets(content, xy[:0], 16, 4, 8).shape == (0, 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_a_level0_reference(seed):
    """Fractional window overlaps equal the centroid over the level-0 pixels the window covers (float64)."""
    rng = np.random.default_rng(seed)
    content = rng.random((12, 14)) ** 4  # a few strong pixels
    d, patch, max_shift = 4, 12, 6
    xy = np.stack([rng.integers(0, 14 * d - patch, 20), rng.integers(0, 12 * d - patch, 20)], 1)
    got = recentre_offsets(torch.from_numpy(content), torch.from_numpy(xy), patch, d, max_shift, iters=1)
    np.testing.assert_array_equal(got.numpy(), _reference(content, xy, patch, d, max_shift))


def test_content_map_is_darkness_under_the_tissue_median():
    lowres = torch.full((3, 4, 4), 200, dtype=torch.uint8)
    lowres[:, 0, 0] = 100  # a dark pixel
    lowres[:, 3, 3] = 255  # background, brighter than the tissue: no content
    tissue = torch.ones(4, 4, dtype=torch.bool)
    tissue[3, 3] = False
    bg = background_luminance(lowres, tissue)
    assert bg == pytest.approx(200 / 255, abs=1e-6)
    c = content_map(lowres, bg)
    assert c[0, 0] == pytest.approx(100 / 255, abs=1e-6) and c[3, 3] == 0 and c[1, 1] == 0
    torch.testing.assert_close(content_map(lowres.float() / 255, bg), c)
    assert background_luminance(lowres, torch.zeros(4, 4, dtype=torch.bool)) == bg  # no tissue: every pixel
    with pytest.raises(ValueError, match=r"lowres must be a tensor \[3, h, w\]"):
        content_map(torch.zeros(4, 4), bg)
    with pytest.raises(ValueError, match="tissue must be"):
        background_luminance(lowres, tissue[:2])


@pytest.mark.parametrize("seed", [0, 1])
def test_recentring_of_a_view_equals_the_shifts_on_its_content_map(seed):
    """Recentring computes the content around the requested cells only: the same shifts as on the whole map,
    cells at the view's edges included (beyond the view: no content)."""
    g = torch.Generator().manual_seed(seed)
    lowres = torch.randint(120, 230, (3, 20, 24), dtype=torch.uint8, generator=g)
    cell_mask = torch.ones(10, 12, dtype=torch.bool)
    r = Recentring.from_view(lowres, cell_mask, patch=16, stride=8, downsample=4)
    xy = torch.stack([torch.arange(0, 96, 8).repeat(10), torch.arange(0, 80, 8).repeat_interleave(12)], 1)
    want = recentre_offsets(content_map(lowres, r.background), xy, 16, 4, 4)
    assert torch.equal(r(xy), want) and want.abs().max() > 0


def test_arguments():
    c = torch.zeros(4, 4)
    xy = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="xy_l0 must be an integer tensor"):
        recentre_offsets(c, xy.float(), 8, 2, 2)
    with pytest.raises(ValueError, match="patch must be an int >= 1"):
        recentre_offsets(c, xy, 0, 2, 2)
    with pytest.raises(ValueError, match="max_shift must be an int >= 0"):
        recentre_offsets(c, xy, 8, 2, -1)
    with pytest.raises(ValueError, match="downsample must be a positive number"):
        recentre_offsets(c, xy, 8, 0, 2)


def test_tissue_pixels_and_from_view():
    cell_mask = torch.tensor([[True, False], [False, False]])
    t = tissue_pixels(cell_mask, stride=8, downsample=4, hw=(4, 4))  # each cell's stride block = 2x2 pixels
    assert t.tolist() == [[True, True, False, False], [True, True, False, False]] + [[False] * 4] * 2
    r = Recentring.from_view(torch.zeros(3, 4, 4), cell_mask, patch=16, stride=8, downsample=4)
    assert (r.patch, r.max_shift, r.downsample) == (16, 4, 4.0)


def test_reader_and_slide_read_where_the_shift_says(tmp_path):
    """A store with one dark square: with model.geometry.recentre the reader's patch of a cell that holds it off
    centre is the patch read at the shifted corner, and forward_slide reports that corner."""
    from operators.model_config import GeometryConfig, ModelConfig
    from workers.patches import PatchReader, clear_cache, prepare_slide
    from workers.store import SlideStore, write_store_from_array

    img = np.full((256, 256, 3), 200, np.uint8)
    img[100:124, 140:164] = 40  # a 24-px dark square, centre (152, 112)
    write_store_from_array(tmp_path / "s.zarr", img, tile_size=64, min_size=32)
    store = SlideStore(tmp_path / "s.zarr")
    cfg = ModelConfig(geometry=GeometryConfig(patch_size=32, scorer_downsample=4.0, recentre=True))
    clear_cache()
    si = prepare_slide(store, cfg, cache=False)
    g = si.grid  # stride 16: cell (row 6, col 8) has corner (128, 96), the square 8..32 px off its centre
    cell = torch.tensor([6 * g.shape[1] + 8])
    shift = si.reader.offsets(cell)
    assert shift.tolist() == [[8, 0]]  # onto the square's centre (x: 8 = half the stride); y holds it centred
    direct = PatchReader(store, g).read(cell, offsets_l0=shift)
    torch.testing.assert_close(si.reader.read(cell), direct)
    plain = prepare_slide(
        store, ModelConfig(geometry=GeometryConfig(patch_size=32, scorer_downsample=4.0)), cache=False
    )
    assert plain.reader.offsets(cell) is None
    assert not torch.equal(plain.reader.read(cell), direct)
