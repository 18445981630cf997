"""Self-supervised objectives and augmentations (operators/ssl.py): float64 references and gradient checks."""

from __future__ import annotations

import math

import pytest
import torch

from operators.resnet import ResNet, ResNetConfig
from operators.ssl import BYOL, AugmentSpec, SimCLR, augment, build_objective, byol_loss, ema_update, nt_xent

torch.set_num_threads(1)


def _nt_xent_loop(z1: torch.Tensor, z2: torch.Tensor, t: float) -> torch.Tensor:
    """Chen et al. 2020, Algorithm 1, written out view by view."""
    z = torch.cat([z1, z2])
    n2 = z.shape[0]
    n = n2 // 2

    def sim(a, b):
        return float(a @ b / (a.norm() * b.norm()))

    total = 0.0
    for i in range(n2):
        j = (i + n) % n2
        denom = sum(math.exp(sim(z[i], z[k]) / t) for k in range(n2) if k != i)
        total += -math.log(math.exp(sim(z[i], z[j]) / t) / denom)
    return torch.tensor(total / n2, dtype=torch.float64)


@pytest.mark.parametrize("n,d,t", [(1, 3, 0.5), (4, 5, 0.1), (7, 2, 1.0)])
def test_nt_xent_matches_the_loop(n, d, t):
    g = torch.Generator().manual_seed(n * 10 + d)
    z1, z2 = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, d, generator=g, dtype=torch.float64)
    torch.testing.assert_close(nt_xent(z1, z2, t), _nt_xent_loop(z1, z2, t), rtol=1e-12, atol=1e-12)
    # equal similarities everywhere: log(2N - 1); the views' own scale does not matter
    ones = torch.ones(n, d, dtype=torch.float64)
    torch.testing.assert_close(nt_xent(ones, 3 * ones, t), torch.tensor(math.log(2 * n - 1), dtype=torch.float64))


def test_byol_loss_is_two_minus_two_cos_and_stops_the_target_gradient():
    g = torch.Generator().manual_seed(0)
    p, z = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    ref = torch.stack([2 - 2 * (a @ b) / (a.norm() * b.norm()) for a, b in zip(p, z)]).mean()
    torch.testing.assert_close(byol_loss(p, z), ref, rtol=1e-12, atol=1e-12)
    assert float(byol_loss(p, 5 * p)) == pytest.approx(0.0, abs=1e-12)
    z.requires_grad_(True)
    byol_loss(p.requires_grad_(True), z).backward()
    assert z.grad is None and p.grad is not None


def test_gradcheck_both_losses():
    g = torch.Generator().manual_seed(1)
    z1 = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    z2 = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: nt_xent(a, b, 0.2), (z1, z2))
    target = torch.randn(5, 3, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a: byol_loss(a, target), (z1,))


def test_arguments_are_checked():
    z = torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"z1 and z2 must have the same shape, got \(3, 2\) and \(2, 2\)"):
        nt_xent(z, z[:2])
    with pytest.raises(ValueError, match=r"temperature must be a finite number in \(0, inf\], got 0"):
        nt_xent(z, z, 0)
    with pytest.raises(TypeError, match="z1 must be a torch.Tensor, got list"):
        nt_xent([1.0], z)
    with pytest.raises(ValueError, match=r"p must be a float tensor \[N, D\]"):
        byol_loss(torch.ones(3, dtype=torch.long), z)
    with pytest.raises(ValueError, match=r"momentum must be a finite number in \[0, 1\], got 1.5"):
        ema_update(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), 1.5)
    with pytest.raises(ValueError, match="objective must be one of \\['simclr', 'byol'\\], got 'moco'"):
        build_objective("moco", torch.nn.Identity(), 4)
    with pytest.raises(ValueError, match=r"x must be float \[N, 3, s, s\]"):
        augment(torch.rand(2, 1, 8, 8), torch.Generator())
    with pytest.raises(TypeError, match="generator must be a torch.Generator, got int"):
        augment(torch.rand(2, 3, 8, 8), 0)
    with pytest.raises(ValueError, match="crop_scale must be"):
        AugmentSpec(crop_scale=(0.5, 2.0))


def test_ema_update():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    expected = 0.9 * a.weight.detach() + 0.1 * b.weight.detach()
    ema_update(a, b, 0.9)
    torch.testing.assert_close(a.weight.detach(), expected)


def test_augment_is_seeded_in_range_and_keeps_the_dihedral_group_exact():
    x = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    a = augment(x, torch.Generator().manual_seed(3), size=12)
    b = augment(x, torch.Generator().manual_seed(3), size=12)
    assert a.shape == (8, 3, 12, 12) and torch.equal(a, b) and 0 <= float(a.min()) and float(a.max()) <= 1
    assert not torch.equal(a, augment(x, torch.Generator().manual_seed(4), size=12))
    # the whole patch, no colour change: each view is one of the 8 symmetries of the square, pixel for pixel
    spec = AugmentSpec(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), jitter_p=0, grayscale_p=0, blur_p=0)
    y = augment(x.double(), torch.Generator().manual_seed(5), spec)
    for xi, yi in zip(x.double(), y):
        group = [torch.rot90(v, k, (1, 2)) for v in (xi, xi.flip(2)) for k in range(4)]
        assert min(float((yi - s).abs().max()) for s in group) < 1e-9
    # grayscale always: three equal channels
    gray = augment(x, torch.Generator().manual_seed(6), AugmentSpec(grayscale_p=1.0))
    torch.testing.assert_close(gray[:, 0], gray[:, 1])


@pytest.mark.parametrize("objective", ["simclr", "byol"])
def test_objectives_learn_on_a_tiny_batch(objective):
    torch.manual_seed(0)
    enc = ResNet(ResNetConfig(widths=(4, 8), blocks=(1, 1), feature_dim=8))
    model = build_objective(objective, enc, 8, projection_dim=8, temperature=0.5, momentum=0.9)
    assert isinstance(model, SimCLR if objective == "simclr" else BYOL)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    v1, v2 = augment(x, g), augment(x, g)
    losses = []
    for _ in range(15):
        loss = model(v1, v2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.after_step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    if objective == "byol":  # the target moved towards the online network, and takes no gradient
        assert all(not p.requires_grad for p in model.target.parameters())
        assert not torch.equal(model.target[0].proj.weight, model.encoder.proj.weight)
