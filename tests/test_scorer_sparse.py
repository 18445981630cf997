"""The scorer's sparse backward (operators.scorer.sparse_grad_cell_scores): the same cell scores as the whole-view
scorer and, in float64 to 1e-10, the same parameter gradients, whichever cells carry a gradient; and a training
step of the model with ``selection_grad = 0`` (every shipped config) gives the scorer the gradients of the plain
whole-view backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flat_model_config import flat_config

import operators.model as model_module
from operators.model import FoveateModel
from operators.resnet import ResNetConfig
from operators.scorer import ScorerCNN, ScorerConfig, cell_pool, score_map, sparse_grad_cell_scores
from workers.patches import clear_cache
from workers.slide_forward import forward_slide
from workers.store import write_store_from_array


def _scorer(layers: int, pool: str, tile: int = 0, seed: int = 0) -> ScorerCNN:
    torch.manual_seed(seed)
    net = ScorerCNN(ScorerConfig(channels=6, num_layers=layers, pool=pool, tile=tile)).double()
    for p in net.parameters():  # non-trivial biases too, so a crop padded at a wrong edge would show
        torch.nn.init.normal_(p, std=0.5)
    return net


def _grads(net: ScorerCNN, raw: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((raw * weight).sum(), list(net.parameters())))


@pytest.mark.parametrize("layers", [2, 3, 4])
@pytest.mark.parametrize("pool", ["max", "mean"])
@pytest.mark.parametrize(
    "view, grid, patch, stride",
    [((64, 48), (16, 12), 16, 16), ((67, 45), (16, 11), 64, 64), ((130, 90), (20, 15), 100, 96)],
)
def test_sparse_backward_equals_whole_view_backward_float64(layers, pool, view, grid, patch, stride):
    net = _scorer(layers, pool)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, 3, *view), dtype=torch.uint8, generator=gen)
    n = grid[0] * grid[1]
    weight = torch.zeros(2, n, dtype=torch.float64)
    cells = torch.randperm(2 * n, generator=gen)[:9]
    weight.view(-1)[cells] = torch.randn(9, dtype=torch.float64, generator=gen)
    weight.view(-1)[0] = 1.0  # a corner cell: its crop is cut by the view's border
    weight.view(-1)[n - 1] = -1.0
    ref_raw = cell_pool(score_map(net, x), grid, patch, stride, mode=pool)[:, 0]
    ref = _grads(net, ref_raw, weight)
    for dense_fraction in (1.0, 1e-9):  # the crops; the whole view re-run
        raw = sparse_grad_cell_scores(net, x, grid, patch, stride, mode=pool, dense_fraction=dense_fraction)
        assert torch.allclose(raw, ref_raw, rtol=0, atol=1e-12)
        for a, b in zip(_grads(net, raw, weight), ref):
            assert torch.allclose(a, b, rtol=0, atol=1e-10), float((a - b).abs().max())


def test_sparse_backward_of_a_tiled_view_and_a_constant_region():
    """A view scored tile by tile, with a constant block (equal scores: ties inside max-pooled cells)."""
    net = _scorer(4, "max", tile=32)
    x = torch.randint(0, 256, (1, 3, 150, 110), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    x[:, :, 40:100, 20:80] = 200
    grid = (25, 18)
    weight = torch.zeros(1, 25 * 18, dtype=torch.float64)
    weight[0, [0, 7 * 18 + 5, 10 * 18 + 8, 12 * 18 + 9, 24 * 18 + 17]] = torch.tensor(
        [0.3, -1.0, 2.0, 0.5, 1.5], dtype=torch.float64
    )
    ref = _grads(net, cell_pool(score_map(net, x), grid, 48, 48, mode="max")[:, 0], weight)
    got = _grads(net, sparse_grad_cell_scores(net, x, grid, 48, 48, mode="max"), weight)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), float((a - b).abs().max())


def test_no_gradient_anywhere_gives_no_parameter_gradient_and_arguments_are_checked():
    net = _scorer(4, "mean")
    x = torch.rand(1, 3, 32, 32, dtype=torch.float64)
    raw = sparse_grad_cell_scores(net, x, (4, 4), 8, 8)
    (raw * 0).sum().backward()
    assert all(p.grad is None or not bool(p.grad.any()) for p in net.parameters())
    with pytest.raises(ValueError, match="must not require gradients"):
        sparse_grad_cell_scores(net, x.clone().requires_grad_(), (4, 4), 8, 8)
    with pytest.raises(ValueError, match="mode must be"):
        sparse_grad_cell_scores(net, x, (4, 4), 8, 8, mode="median")
    with pytest.raises(ValueError, match="dense_fraction"):
        sparse_grad_cell_scores(net, x, (4, 4), 8, 8, dense_fraction=0.0)
    with pytest.raises(TypeError, match="ScorerCNN"):
        sparse_grad_cell_scores(torch.nn.Conv2d(3, 1, 3), x, (4, 4), 8, 8)


def _slide_store(tmp_path):
    rng = np.random.default_rng(0)
    img = np.full((1024, 1024, 3), 240, np.uint8)
    img[64:960, 64:960] = np.clip(np.array([200, 130, 185]) + rng.integers(-20, 20, (896, 896, 3)), 0, 255)
    for y, x in [(200, 200), (640, 704), (320, 768)]:
        img[y : y + 48, x : x + 48] = (60, 30, 100)
    return write_store_from_array(tmp_path / "s.zarr", img, tile_size=256, min_size=64)


@pytest.mark.parametrize("selector", ["perturbed", "sinkhorn", "attention"])
def test_a_training_step_gives_the_scorer_the_whole_view_gradients(tmp_path, monkeypatch, selector):
    """forward_slide in training with the evidence losses, the rare bag, the rarity prior and the neutral cells
    (selection_grad 0): every parameter's gradient equals the one of the plain whole-view backward."""
    store = _slide_store(tmp_path)
    cfg = flat_config(
        selector=selector,
        patch_size=64,
        scorer_downsample=4.0,
        k=4,
        num_samples=16,
        scorer=ScorerConfig(channels=8, pool="max"),
        features=ResNetConfig(widths=(8, 16), blocks=(1, 1), feature_dim=16),
        instance_weight=0.01,
        rank_weight=0.1,
        evidence="label",
        selection_grad=0.0,
        explore_cells=4,
        explore_strata=4,
        rare_cells=4,
        neutral_cells=2,
        nms_radius=1,
        max_support=1,
    )
    torch.manual_seed(0)
    model = FoveateModel(cfg).double()
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return sparse_grad_cell_scores(*args, **kwargs)

    def dense(scorer, lowres, grid_shape, patch_size, stride, *, mode="mean", dense_fraction=0.5):
        return cell_pool(score_map(scorer, lowres), grid_shape, patch_size, stride, mode=mode)[:, 0]

    grads = {}
    for name, fn in (("sparse", counted), ("dense", dense)):
        monkeypatch.setattr(model_module, "sparse_grad_cell_scores", fn)
        clear_cache()
        model.zero_grad()
        out = forward_slide(
            model, store, training=True, sigma=0.05, generator=torch.Generator().manual_seed(3), target=1, rarity=0.5
        )
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(1, -1), torch.tensor([1]))
        (loss + sum(v.sum() for v in out.aux_losses.values())).backward()
        grads[name] = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert calls, "the sparse path was not taken"
    assert set(grads["sparse"]) == set(grads["dense"])
    scorer_grads = [k for k in grads["dense"] if k.startswith("scorer.")]
    assert scorer_grads and any(bool(grads["dense"][k].any()) for k in scorer_grads)
    for k, ref in grads["dense"].items():
        assert torch.allclose(grads["sparse"][k], ref, rtol=0, atol=1e-10), (
            k,
            float((grads["sparse"][k] - ref).abs().max()),
        )
