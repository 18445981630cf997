"""sinkhorn_topk (SOFT top-k): vs the paper's dense log-domain Sinkhorn, float64 gradients, limits, errors."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from operators import SinkhornTopK, hard_topk, sinkhorn_topk

DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def dense_sinkhorn(scores, k, eps, iters):
    """The paper's algorithm on the full [B, N, 2] cost matrix, log domain: A = N * Gamma[:, :, 1].

    Anchors y = (0, 1), mu = 1/N, nu = ((N-k)/N, k/N), C_ij = (s_i - y_j)^2. Differentiable by autograd (unrolled).
    """
    b, n = scores.shape
    y = torch.tensor([0.0, 1.0], dtype=scores.dtype)
    cost = (scores[:, :, None] - y) ** 2
    log_mu = torch.full((b, n), -math.log(n), dtype=scores.dtype)
    log_nu = torch.log(torch.tensor([(n - k) / n, k / n], dtype=scores.dtype)).expand(b, 2)
    f = torch.zeros(b, n, dtype=scores.dtype)
    g = torch.zeros(b, 2, dtype=scores.dtype)
    for _ in range(iters):
        g = eps * log_nu - eps * torch.logsumexp((f[:, :, None] - cost) / eps, dim=1)
        f = eps * log_mu - eps * torch.logsumexp((g[:, None, :] - cost) / eps, dim=2)
    plan = torch.exp((f[:, :, None] + g[:, None, :] - cost) / eps)
    return n * plan[:, :, 1]


@pytest.mark.parametrize("k,eps", [(3, 0.5), (3, 0.1), (6.5, 0.2), (1, 1.0)])
def test_matches_dense_log_domain_sinkhorn(k, eps):
    s = torch.rand(2, 10, generator=_gen(0), dtype=DT)
    ref = dense_sinkhorn(s, k, eps, 2000)
    out = sinkhorn_topk(s, k, epsilon=eps)
    torch.testing.assert_close(out, ref, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(out.sum(1), torch.full((2,), float(k), dtype=DT), rtol=0, atol=1e-8)
    # the paper's fixed-point iteration, run to convergence, reaches the same point as the Newton solver
    out_sk = sinkhorn_topk(s, k, epsilon=eps, solver="sinkhorn", max_iter=20000, tol=1e-11)
    torch.testing.assert_close(out_sk, out, rtol=1e-8, atol=1e-9)
    # largest k selected: the mask is increasing in the score
    assert (out.gather(1, s.argsort(1)).diff(dim=1) > 0).all()


def test_gradcheck_and_implicit_gradient_equals_unrolled_sinkhorn():
    s = torch.randn(2, 8, generator=_gen(1), dtype=DT).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: sinkhorn_topk(s, 2.5, epsilon=0.3), (s,))
    assert torch.autograd.gradcheck(lambda s: sinkhorn_topk(s, 6.0, epsilon=2.0), (s,))
    # implicit gradient == autograd through the converged, unrolled dense Sinkhorn of the paper
    g = torch.randn(2, 8, generator=_gen(2), dtype=DT)
    (g_ours,) = torch.autograd.grad(sinkhorn_topk(s, 3, epsilon=1.0), s, g)
    (g_unrolled,) = torch.autograd.grad(dense_sinkhorn(s, 3, 1.0, 300), s, g)
    torch.testing.assert_close(g_ours, g_unrolled, rtol=1e-7, atol=1e-9)
    # shift invariance: gradient sums to zero over patches
    torch.testing.assert_close(g_ours.sum(1), torch.zeros(2, dtype=DT), rtol=0, atol=1e-12)


def test_small_epsilon_gives_hard_topk_and_stays_finite():
    s = torch.randn(3, 40, generator=_gen(3), dtype=DT).requires_grad_(True)
    out = sinkhorn_topk(s, 5, epsilon=1e-7)
    hard = torch.zeros(3, 40, dtype=DT).scatter_(1, hard_topk(s.detach(), 5), 1.0)
    torch.testing.assert_close(out, hard, rtol=0, atol=1e-8)
    (g,) = torch.autograd.grad(out, s, torch.randn(3, 40, generator=_gen(4), dtype=DT))
    assert torch.isfinite(g).all()
    # huge score range relative to epsilon: no overflow, still sums to k
    big = torch.randn(2, 100, generator=_gen(5), dtype=DT) * 1e6
    out = sinkhorn_topk(big, 7.5, epsilon=1e-3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.sum(1), torch.full((2,), 7.5, dtype=DT), rtol=0, atol=1e-6)


def test_float32_batch_independence_permutation_no_inplace_and_shift():
    s = torch.randn(3, 300, generator=_gen(6), dtype=DT)
    s0 = s.clone()
    out = sinkhorn_topk(s, 12, epsilon=0.05)
    assert torch.equal(s, s0)
    torch.testing.assert_close(sinkhorn_topk(s.float(), 12, epsilon=0.05), out.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sinkhorn_topk(s[2:3], 12, epsilon=0.05), out[2:3])
    perm = torch.randperm(300, generator=_gen(7))
    torch.testing.assert_close(sinkhorn_topk(s[:, perm], 12, epsilon=0.05), out[:, perm])
    torch.testing.assert_close(sinkhorn_topk(s + 3.0, 12, epsilon=0.05), out, rtol=1e-9, atol=1e-10)


def test_not_converged_warns(caplog):
    s = torch.rand(1, 50, generator=_gen(8), dtype=DT)
    with caplog.at_level(logging.WARNING, logger="operators.sinkhorn"):
        sinkhorn_topk(s, 5, epsilon=0.001, solver="sinkhorn", max_iter=3)
    assert "not converged" in caplog.text


def test_module_wrapper():
    m = SinkhornTopK(4, epsilon=0.1)
    s = torch.randn(2, 20, generator=_gen(9), dtype=DT)
    torch.testing.assert_close(m(s), sinkhorn_topk(s, 4, epsilon=0.1))
    assert "epsilon=0.1" in repr(m)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda s: sinkhorn_topk(s, 0, epsilon=0.1), ValueError, "k must satisfy 0 < k < N=6"),
        (lambda s: sinkhorn_topk(s, 7, epsilon=0.1), ValueError, "got 7"),
        (lambda s: sinkhorn_topk(s, 2, epsilon=0.0), ValueError, "epsilon must be > 0, got 0.0"),
        (lambda s: sinkhorn_topk(s, 2, epsilon=-1.0), ValueError, "epsilon must be > 0"),
        (lambda s: sinkhorn_topk(s, 2, epsilon=0.1, max_iter=0), ValueError, "max_iter must be an integer >= 1"),
        (lambda s: sinkhorn_topk(s, 2, epsilon=0.1, solver="ipot"), ValueError, "solver must be one of"),
        (lambda s: sinkhorn_topk(s[None], 2, epsilon=0.1), ValueError, r"scores must have shape \[B, N\]"),
        (lambda s: sinkhorn_topk(s.tolist(), 2, epsilon=0.1), TypeError, "scores must be a torch.Tensor"),
        (lambda s: SinkhornTopK(2, epsilon=0), ValueError, "epsilon must be > 0"),
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call(torch.randn(2, 6))


def test_non_finite_scores_rejected():
    s = torch.randn(2, 6)
    s[1, 2] = float("inf")
    with pytest.raises(ValueError, match="scores must be finite"):
        sinkhorn_topk(s, 2, epsilon=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_matches_cpu():
    s = torch.randn(3, 1000, generator=_gen(10), dtype=DT)
    g = torch.randn(3, 1000, generator=_gen(11), dtype=DT)
    res = []
    for dev in ("cpu", "cuda"):
        x = s.to(dev).requires_grad_(True)
        out = sinkhorn_topk(x, 17.5, epsilon=0.05)
        (gr,) = torch.autograd.grad(out, x, g.to(dev))
        res.append((out.detach().cpu(), gr.cpu()))
    torch.testing.assert_close(res[0][0], res[1][0])
    torch.testing.assert_close(res[0][1], res[1][1])
