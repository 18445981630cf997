"""The tiled scorer (operators.scorer.tiled_score_map): the same score map and the same gradients as the whole-view
scorer, in float64 to 1e-10, for every depth and for sizes that do not divide into tiles; and its memory grows
with the tile, not with the view."""

from __future__ import annotations

import pytest
import torch
from flat_model_config import flat_config
from torch.utils._python_dispatch import TorchDispatchMode

from operators.model import FoveateModel
from operators.scorer import ScorerCNN, ScorerConfig, scorer_halo, tiled_score_map


def _scorer(layers: int, channels: int = 6, seed: int = 0) -> ScorerCNN:
    torch.manual_seed(seed)
    net = ScorerCNN(ScorerConfig(channels=channels, num_layers=layers, tile=0)).double()
    for p in net.parameters():  # non-trivial biases too, so zero padding at a wrong edge would show
        torch.nn.init.normal_(p, std=0.5)
    return net


@pytest.mark.parametrize("layers", [2, 3, 4, 5])
@pytest.mark.parametrize("hw", [(97, 131), (64, 200), (33, 35)])
@pytest.mark.parametrize("tile", [32, 48])
def test_tiled_map_equals_whole_map_float64(layers, hw, tile):
    net = _scorer(layers)
    x = torch.rand(2, 3, *hw, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    whole = net(x)
    tiled = tiled_score_map(net, x, tile, checkpoint=False)
    assert tiled.shape == whole.shape
    assert torch.allclose(tiled, whole, rtol=0, atol=1e-10), float((tiled - whole).abs().max())


def test_tiled_map_of_a_uint8_view_equals_the_float_view():
    net = _scorer(4)
    u8 = torch.randint(0, 256, (1, 3, 150, 90), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    ref = net(u8.double() / 255.0)
    assert torch.allclose(tiled_score_map(net, u8, 32, checkpoint=False), ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("layers", [2, 4])
def test_tiled_gradients_equal_whole_gradients_float64(layers):
    net = _scorer(layers)
    x = torch.rand(1, 3, 101, 77, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    w = torch.randn(1, 1, 51, 39, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def grads(fn):
        net.zero_grad()
        (fn(x) * w).sum().backward()
        return [p.grad.clone() for p in net.parameters()]

    ref = grads(net)
    for got in (
        grads(lambda v: tiled_score_map(net, v, 32, checkpoint=True)),
        grads(lambda v: tiled_score_map(net, v, 32, checkpoint=False)),
    ):
        for a, b in zip(got, ref):
            assert torch.allclose(a, b, rtol=0, atol=1e-10), float((a - b).abs().max())


def test_model_scores_and_scorer_gradients_do_not_depend_on_tiling():
    cfg = flat_config(k=4, patch_size=32, scorer_downsample=4, scorer=ScorerConfig(channels=8, tile=0, pool="mean"))
    torch.manual_seed(0)
    whole = FoveateModel(cfg).double()
    tiled = FoveateModel(
        flat_config(k=4, patch_size=32, scorer_downsample=4, scorer=ScorerConfig(channels=8, tile=32, pool="mean"))
    ).double()
    tiled.load_state_dict(whole.state_dict())
    lowres = torch.rand(1, 3, 96, 136, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(1, 12, 17, dtype=torch.bool)
    mask[0, :3] = False
    w = torch.randn(12 * 17, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    out = {}
    for name, m in (("whole", whole), ("tiled", tiled)):
        m.zero_grad()
        s = m.score(lowres, mask)
        torch.where(torch.isfinite(s), s * w, torch.zeros_like(s)).sum().backward()
        out[name] = (s.detach(), [p.grad.clone() for p in m.scorer.parameters()])
    s_w, g_w = out["whole"]
    s_t, g_t = out["tiled"]
    assert torch.equal(torch.isfinite(s_w), torch.isfinite(s_t))
    fin = torch.isfinite(s_w)
    assert torch.allclose(s_t[fin], s_w[fin], rtol=0, atol=1e-10)
    for a, b in zip(g_t, g_w):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


class _ConvSizes(TorchDispatchMode):
    """Largest output (elements) of any convolution, forward or backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "convolution" in str(func):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out


def _largest_activation(net: ScorerCNN, side: int, tile: int | None) -> int:
    x = torch.rand(1, 3, side, side, dtype=torch.float64)
    with _ConvSizes() as mode:
        m = net(x) if tile is None else tiled_score_map(net, x, tile, checkpoint=True)
        m.sum().backward()
    return mode.largest


def test_tiled_activation_memory_grows_with_the_tile_not_the_view():
    net = _scorer(4, channels=8)
    halo = scorer_halo(4)
    small, large = _largest_activation(net, 256, 64), _largest_activation(net, 512, 64)
    assert small == large == 8 * (64 + 2 * halo) ** 2  # one tile (+ context) of 8 channels, at any view size
    whole_small, whole_large = _largest_activation(net, 256, None), _largest_activation(net, 512, None)
    assert whole_large == 4 * whole_small  # the whole-view scorer's grows with the view's area
    assert large * 25 < whole_large


def test_tile_arguments_are_checked():
    net = _scorer(4)
    x = torch.rand(1, 3, 40, 40, dtype=torch.float64)
    for bad in (31, 33, 0, True, 64.0):
        with pytest.raises(ValueError, match="tile must be an even int >= 32"):
            tiled_score_map(net, x, bad)
    with pytest.raises(ValueError, match="scorer.tile must be 0"):
        ScorerConfig(tile=30)
