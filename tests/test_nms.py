"""NMS top-k against a brute-force pixel-loop reference, radius/plateau semantics, and the MIST loss."""

from __future__ import annotations

import pytest
import torch

from operators import MISTLoss, mist_loss, nms_topk
from operators.nms import render_gaussian_heatmap


def _reference_nms(hm: torch.Tensor, k: int, radius: int) -> list[tuple[int, int]]:
    """Obviously-correct pixel loops: the documented rule, round by round, then the final fill."""
    h, w = hm.shape
    vals = hm.tolist()

    def before(p, q):  # p precedes q in the total order (score desc, flat index asc)
        (py, px), (qy, qx) = p, q
        return vals[py][px] > vals[qy][qx] or (vals[py][px] == vals[qy][qx] and py * w + px < qy * w + qx)

    def near(p, q):
        return max(abs(p[0] - q[0]), abs(p[1] - q[1])) <= radius

    pixels = [(y, x) for y in range(h) for x in range(w)]
    chosen: list[tuple[int, int]] = []
    while len(chosen) < k:
        free = [p for p in pixels if not any(near(p, c) for c in chosen)]
        if not free:
            break
        maxima = [p for p in free if all(q == p or not near(p, q) or before(p, q) for q in free)]
        maxima.sort(key=lambda p: (-vals[p[0]][p[1]], p[0] * w + p[1]))
        chosen += maxima[: k - len(chosen)]
    rest = sorted((p for p in pixels if p not in chosen), key=lambda p: (-vals[p[0]][p[1]], p[0] * w + p[1]))
    chosen += rest[: k - len(chosen)]
    return [(x, y) for y, x in chosen]


@pytest.mark.parametrize("radius", [0, 1, 2, 3])
def test_matches_bruteforce_reference(radius):
    g = torch.Generator().manual_seed(radius)
    for trial in range(6):
        h, w = 7 + trial % 3, 9 - trial % 2
        # quantised values: many ties and plateaus
        hm = torch.randint(0, 4 if trial % 2 else 50, (3, h, w), generator=g).to(torch.float32)
        for k in (1, 4, 12, h * w):
            coords, scores = nms_topk(hm, k, radius=radius)
            assert coords.shape == (3, k, 2) and coords.dtype == torch.long
            for b in range(3):
                want = _reference_nms(hm[b], k, radius)
                assert [tuple(c) for c in coords[b].tolist()] == want, (radius, trial, k, b)
                torch.testing.assert_close(scores[b], hm[b][coords[b, :, 1], coords[b, :, 0]])


def test_radius_semantics_chebyshev_window():
    for r in (1, 2, 3):
        hm = torch.zeros(1, 12, 12)
        hm[0, 5, 2] = 5.0
        hm[0, 5 + r, 2 - min(r, 2)] = 4.0  # Chebyshev distance r from the 5: suppressed
        hm[0, 5, 2 + r + 1] = 3.0  # distance r + 1 from the 5 and from the 4: survives
        coords, scores = nms_topk(hm, 2, radius=r)
        assert coords[0].tolist() == [[2, 5], [2 + r + 1, 5]]
        assert scores[0].tolist() == [5.0, 3.0]
    # radius 0: plain top-k, ties by row-major order
    hm = torch.tensor([[[1.0, 3.0], [3.0, 2.0]]])
    coords, _ = nms_topk(hm, 4, radius=0)
    assert coords[0].tolist() == [[1, 0], [0, 1], [1, 1], [0, 0]]


def test_plateau_gives_one_maximum_at_its_first_pixel():
    hm = torch.zeros(1, 10, 10)
    hm[0, 3:6, 4:7] = 1.0  # 3x3 plateau
    coords, scores = nms_topk(hm, 1, radius=1)
    assert coords[0].tolist() == [[4, 3]] and scores[0].tolist() == [1.0]
    # the plateau yields exactly one local maximum; with the zero background, further picks follow the fill rule
    for k in (2, 7, 30):
        coords, _ = nms_topk(hm, k, radius=1)
        assert [tuple(c) for c in coords[0].tolist()] == _reference_nms(hm[0], k, 1)
    assert torch.equal(nms_topk(hm, 5, radius=2)[0], nms_topk(hm.clone(), 5, radius=2)[0])  # deterministic


def test_fill_when_fewer_maxima_and_gradient_to_scores():
    hm = torch.zeros(2, 5, 5, dtype=torch.float64)
    hm[:, 2, 2] = 1.0
    hm.requires_grad_(True)
    coords, scores = nms_topk(hm, 25, radius=4)  # a single window covers the map: one max, then fills
    assert coords[0, 0].tolist() == [2, 2]
    assert len({tuple(c) for c in coords[0].tolist()}) == 25  # every pixel exactly once
    scores.sum().backward()
    torch.testing.assert_close(hm.grad, torch.ones_like(hm))


def test_render_and_mist_loss_zero_at_target():
    loc = torch.tensor([[[3.0, 4.0], [10.0, 2.5]]], dtype=torch.float64)
    t = render_gaussian_heatmap(loc, 8, 14, sigma=1.5)
    assert t.shape == (1, 8, 14)
    assert float(t[0, 4, 3]) == 1.0  # peak 1 at an integer location (x=3, y=4)
    torch.testing.assert_close(t[0, 4, 5], torch.exp(torch.tensor(-4.0 / 4.5, dtype=torch.float64)))
    for combine in ("max", "sum"):
        target = render_gaussian_heatmap(loc, 8, 14, sigma=1.5, combine=combine)
        assert float(mist_loss(target.clone(), loc, sigma=1.5, combine=combine)) == 0.0
    s = render_gaussian_heatmap(loc, 8, 14, sigma=1.5, combine="sum")
    m = render_gaussian_heatmap(loc, 8, 14, sigma=1.5, combine="max")
    assert (s >= m).all() and (m <= 1).all()
    # integer locations from nms_topk are accepted
    coords, _ = nms_topk(t, 2, radius=2)
    assert coords[0].tolist() == [[3, 4], [10, 2]] or coords[0].tolist() == [[3, 4], [10, 3]]
    assert float(mist_loss(t, coords, sigma=1.5)) < 0.01


def test_mist_loss_value_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    hm = torch.rand(2, 6, 7, generator=g, dtype=torch.float64, requires_grad=True)
    loc = torch.tensor([[[1.2, 1.7], [5.1, 4.4]], [[3.3, 2.2], [0.4, 5.0]]], dtype=torch.float64, requires_grad=True)
    val = mist_loss(hm, loc, sigma=1.3)
    want = ((hm - render_gaussian_heatmap(loc, 6, 7, sigma=1.3)) ** 2).mean()
    torch.testing.assert_close(val, want)
    for combine in ("max", "sum"):
        assert torch.autograd.gradcheck(
            lambda a, b, combine=combine: mist_loss(a, b, sigma=1.3, combine=combine, detach_target=False),
            (hm, loc),
        )
    # default: the locations are constants of the heatmap stage
    mist_loss(hm, loc, sigma=1.3).backward()
    assert loc.grad is None and hm.grad is not None
    per = MISTLoss(1.3, reduction="none")(hm.detach(), loc.detach())
    assert per.shape == (2,)
    torch.testing.assert_close(per.mean(), val.detach())


def test_bad_arguments():
    hm = torch.rand(2, 5, 5)
    with pytest.raises(ValueError, match=r"heatmap.*shape"):
        nms_topk(torch.rand(5, 5), 1, radius=1)
    with pytest.raises(ValueError, match=r"k must satisfy 1 <= k <= N=25, got 26"):
        nms_topk(hm, 26, radius=1)
    with pytest.raises(ValueError, match=r"radius.*>= 0.*-1"):
        nms_topk(hm, 2, radius=-1)
    with pytest.raises(ValueError, match=r"radius"):
        nms_topk(hm, 2, radius=1.5)
    with pytest.raises(TypeError, match=r"radius"):
        nms_topk(hm, 2, radius="1")
    with pytest.raises(ValueError, match=r"heatmap.*finite"):
        nms_topk(torch.full((1, 2, 2), float("nan")), 1, radius=0)
    with pytest.raises(ValueError, match=r"locations must have shape \[B=2, K, 2\]"):
        mist_loss(hm, torch.zeros(2, 3), sigma=1.0)
    with pytest.raises(ValueError, match=r"sigma must be > 0"):
        mist_loss(hm, torch.zeros(2, 1, 2), sigma=0.0)
    with pytest.raises(ValueError, match=r"combine must be one of"):
        MISTLoss(1.0, combine="mean")
    with pytest.raises(ValueError, match=r"reduction must be one of"):
        mist_loss(hm, torch.zeros(2, 1, 2), sigma=1.0, reduction="avg")
    with pytest.raises(TypeError, match=r"detach_target"):
        mist_loss(hm, torch.zeros(2, 1, 2), sigma=1.0, detach_target=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    hm = torch.randint(0, 5, (4, 40, 50), generator=g).to(torch.float32)
    for radius in (0, 2):
        c_cpu, s_cpu = nms_topk(hm, 30, radius=radius)
        c_gpu, s_gpu = nms_topk(hm.cuda(), 30, radius=radius)
        assert torch.equal(c_gpu.cpu(), c_cpu) and torch.equal(s_gpu.cpu(), s_cpu)
    loc = torch.rand(4, 3, 2, generator=g) * 40
    torch.testing.assert_close(mist_loss(hm.cuda(), loc.cuda(), sigma=2.0).cpu(), mist_loss(hm, loc, sigma=2.0))
