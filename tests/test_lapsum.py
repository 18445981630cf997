"""lapsum_topk: closed-form threshold vs bisection, float64 gradcheck (scores and alpha), limits, errors."""

from __future__ import annotations

import pytest
import torch

from operators import LapSumTopK, hard_topk, lapsum_topk

DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def laplace_cdf(x):
    return torch.where(x < 0, 0.5 * torch.exp(x.clamp(max=0)), 1 - 0.5 * torch.exp(-x.clamp(min=0)))


def reference_lapsum(scores, k, alpha):
    """Slow reference: bisection on b (200 halvings, float64) of sum_i F((s_i - b)/alpha) = k."""
    lo = scores.min(1, keepdim=True).values - 60 * alpha - 60 * alpha * scores.shape[1]
    hi = scores.max(1, keepdim=True).values + 60 * alpha + 60 * alpha * scores.shape[1]
    for _ in range(200):
        mid = (lo + hi) / 2
        too_big = laplace_cdf((scores - mid) / alpha).sum(1, keepdim=True) > k
        lo = torch.where(too_big, mid, lo)
        hi = torch.where(too_big, hi, mid)
    return laplace_cdf((scores - (lo + hi) / 2) / alpha)


@pytest.mark.parametrize(
    "n,k,alpha",
    [(10, 3, 0.5), (10, 7.5, 0.2), (10, 0.3, 1.0), (10, 9.99, 0.05), (300, 64, 0.01), (6, 3, 50.0), (257, 128.5, 0.3)],
)
def test_matches_bisection_reference_and_sums_to_k(n, k, alpha):
    s = torch.randn(3, n, generator=_gen(n), dtype=DT)
    p = lapsum_topk(s, k, alpha=alpha)
    torch.testing.assert_close(p.sum(1), torch.full((3,), float(k), dtype=DT), rtol=0, atol=1e-10)
    torch.testing.assert_close(p, reference_lapsum(s, k, alpha), rtol=1e-9, atol=1e-11)
    assert ((p >= 0) & (p <= 1)).all()
    # order preserving
    order = s.argsort(1)
    assert (p.gather(1, order).diff(dim=1) >= 0).all()


@pytest.mark.parametrize("k", [2.5, 7.25])  # both the top (k <= N/2) and the symmetric (k > N/2) branch
def test_gradcheck_scores_and_alpha(k):
    s = torch.randn(2, 9, generator=_gen(1), dtype=DT).requires_grad_(True)
    alpha = torch.tensor(0.4, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, a: lapsum_topk(s, k, alpha=a), (s, alpha))
    alpha_rows = torch.tensor([0.3, 2.0], dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, a: lapsum_topk(s, k, alpha=a), (s, alpha_rows))
    assert torch.autograd.gradcheck(lambda s: lapsum_topk(s, k, alpha=0.05), (s,))


def test_jacobian_is_the_exact_implicit_one():
    """Exact Jacobian: dp_i/ds_j = f_i/alpha (delta_ij - f_j / sum f) (implicit db/ds), checked densely."""
    s = torch.randn(1, 7, generator=_gen(2), dtype=DT).requires_grad_(True)
    k, alpha = 3.0, 0.7
    jac = torch.autograd.functional.jacobian(lambda s: lapsum_topk(s, k, alpha=alpha), s)[0, :, 0, :]
    p = lapsum_topk(s.detach(), k, alpha=alpha)[0]
    f = torch.minimum(p, 1 - p)  # Laplace density e^{-|x|}/2 equals min(F(x), 1 - F(x))
    expected = f[:, None] / alpha * (torch.eye(7, dtype=DT) - f[None, :] / f.sum())
    torch.testing.assert_close(jac, expected, rtol=1e-10, atol=1e-12)
    # rows of the Jacobian sum to zero (a constant shift of all scores changes nothing)
    torch.testing.assert_close(jac.sum(1), torch.zeros(7, dtype=DT), rtol=0, atol=1e-12)


def test_small_alpha_gives_hard_topk_and_large_scale_is_stable():
    s = torch.randn(4, 50, generator=_gen(3), dtype=DT)
    p = lapsum_topk(s, 5, alpha=1e-6)
    hard = torch.zeros_like(s).scatter_(1, hard_topk(s, 5), 1.0)
    torch.testing.assert_close(p, hard, rtol=0, atol=1e-8)
    # |s - b| / alpha up to ~1e7: no overflow, no NaN, densities all underflow -> softmax fallback in backward
    big = (torch.arange(20, dtype=DT) * 1000.0).repeat(2, 1).requires_grad_(True)
    p = lapsum_topk(big, 3, alpha=0.01)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(1), torch.full((2,), 3.0, dtype=DT))
    (g,) = torch.autograd.grad((p * torch.randn(2, 20, dtype=DT)).sum(), big)
    assert torch.isfinite(g).all()
    p32 = lapsum_topk(torch.randn(2, 1000, generator=_gen(4)) * 1e4, 10.5, alpha=1e-3)
    assert torch.isfinite(p32).all() and abs(float(p32.sum(1).mean()) - 10.5) < 1e-3


def test_float32_agrees_with_float64_and_ties():
    s = torch.randn(3, 500, generator=_gen(5), dtype=DT)
    p64 = lapsum_topk(s, 20.5, alpha=0.1)
    torch.testing.assert_close(lapsum_topk(s.float(), 20.5, alpha=0.1), p64.float(), rtol=1e-4, atol=1e-5)
    tied = torch.zeros(2, 8, dtype=DT)
    torch.testing.assert_close(lapsum_topk(tied, 3, alpha=1.0), torch.full((2, 8), 3 / 8, dtype=DT))


def test_permutation_equivariance_batch_independence_no_inplace():
    s = torch.randn(3, 40, generator=_gen(6), dtype=DT)
    s0 = s.clone()
    g = torch.randn(3, 40, generator=_gen(7), dtype=DT)
    sr = s.clone().requires_grad_(True)
    p = lapsum_topk(sr, 6.5, alpha=0.2)
    (grad,) = torch.autograd.grad(p, sr, g)
    assert torch.equal(s, s0)
    perm = torch.randperm(40, generator=_gen(8))
    torch.testing.assert_close(lapsum_topk(s[:, perm], 6.5, alpha=0.2), p[:, perm].detach())
    s1 = s[1:2].clone().requires_grad_(True)
    p1 = lapsum_topk(s1, 6.5, alpha=0.2)
    (g1,) = torch.autograd.grad(p1, s1, g[1:2])
    torch.testing.assert_close(p1, p[1:2].detach())
    torch.testing.assert_close(g1, grad[1:2])


def test_module_wrapper_learns_alpha():
    m = LapSumTopK(3, alpha=0.5, learn_alpha=True)
    s = torch.randn(2, 10, generator=_gen(9), dtype=DT)
    out = m(s)
    torch.testing.assert_close(out.sum(1), torch.full((2,), 3.0, dtype=DT))
    (out[:, 0]).sum().backward()
    assert m.log_alpha.grad is not None and torch.isfinite(m.log_alpha.grad)
    assert "k=3" in repr(LapSumTopK(3, alpha=0.5))


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda s: lapsum_topk(s, 0, alpha=0.1), ValueError, "k must satisfy 0 < k < N=6"),
        (
            lambda s: lapsum_topk(s, 6, alpha=0.1),
            ValueError,
            r"k must satisfy 0 < k < N=6 \(fractional allowed\), got 6",
        ),
        (lambda s: lapsum_topk(s, -1.5, alpha=0.1), ValueError, "got -1.5"),
        (lambda s: lapsum_topk(s, 2, alpha=0.0), ValueError, "alpha must be > 0, got 0.0"),
        (lambda s: lapsum_topk(s, 2, alpha=-1), ValueError, "alpha must be > 0"),
        (lambda s: lapsum_topk(s, 2, alpha=torch.tensor([1.0, -1.0])), ValueError, "alpha must be > 0"),
        (lambda s: lapsum_topk(s, 2, alpha=torch.ones(3)), ValueError, "alpha must be a float or a tensor of shape"),
        (lambda s: lapsum_topk(s, "2", alpha=1.0), TypeError, "k must be a real number"),
        (lambda s: lapsum_topk(s[0], 2, alpha=1.0), ValueError, r"scores must have shape \[B, N\]"),
        (lambda s: lapsum_topk(s.numpy(), 2, alpha=1.0), TypeError, "scores must be a torch.Tensor"),
        (lambda s: lapsum_topk(s.int(), 2, alpha=1.0), ValueError, "floating-point"),
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call(torch.randn(2, 6))


def test_non_finite_scores_rejected():
    s = torch.randn(2, 6)
    s[0, 0] = float("nan")
    with pytest.raises(ValueError, match="scores must be finite"):
        lapsum_topk(s, 2, alpha=1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_matches_cpu():
    s = torch.randn(3, 1000, generator=_gen(10), dtype=DT)
    g = torch.randn(3, 1000, generator=_gen(11), dtype=DT)
    outs = []
    for dev in ("cpu", "cuda"):
        x = s.to(dev).requires_grad_(True)
        p = lapsum_topk(x, 17.5, alpha=0.05)
        (gr,) = torch.autograd.grad(p, x, g.to(dev))
        outs.append((p.detach().cpu(), gr.cpu()))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])
