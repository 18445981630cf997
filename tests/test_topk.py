"""hard_topk / perturbed_topk: float64 checks against a slow dense one-hot reference with common noise."""

from __future__ import annotations

import pytest
import torch

import operators.topk as topk_mod
from operators import PerturbedTopK, hard_topk, perturbed_topk

DT = torch.float64


# ---------------------------------------------------------------- slow, obviously-correct dense references
def dense_onehots(scores, k, sigma, noise):
    """Y_s as a dense [B, n, k, N] one-hot tensor (index-sorted top-k of scores + sigma * Z)."""
    pert = scores[:, None, :] + sigma * noise
    idx = torch.topk(pert, k, dim=-1).indices.sort(dim=-1).values  # [B, n, k]
    return torch.nn.functional.one_hot(idx, scores.shape[1]).to(scores.dtype)


def dense_full_vjp(scores, k, sigma, noise, grad_out):
    """grad[b, j] = 1/(n sigma) sum_s Z[b,s,j] sum_{k,d} G[b,k,d] Y_s[b,k,d] (Berthet's estimator, full VJP)."""
    y = dense_onehots(scores, k, sigma, noise)
    n = noise.shape[1]
    # explicit Jacobian estimate J[b, k, d, j] = 1/(n sigma) sum_s Y_s[b,k,d] Z[b,s,j], then contract with G
    jac = torch.einsum("bskd,bsj->bkdj", y, noise) / (n * sigma)
    return y.mean(1), torch.einsum("bkd,bkdj->bj", grad_out, jac)


def dense_diagonal_vjp(scores, k, sigma, noise, grad_out):
    """The paper's appendix backward: einsum('bnkd,bnd->bkd') then einsum('bkd,bkd->bd') (diagonal only)."""
    y = dense_onehots(scores, k, sigma, noise)
    n = noise.shape[1]
    jac_diag = torch.einsum("bnkd,bnd->bkd", y, noise) / (n * sigma)
    return torch.einsum("bkd,bkd->bd", grad_out, jac_diag)


def _run(scores, k, sigma, noise=None, grad_out=None, **kw):
    s = scores.clone().requires_grad_(True)
    num_samples = noise.shape[1] if noise is not None else kw.pop("num_samples", 500)
    out = perturbed_topk(s, k, sigma=sigma, noise=noise, num_samples=num_samples, **kw)
    if grad_out is None:
        return out, None
    (g,) = torch.autograd.grad(out, s, grad_out)
    return out, g


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- hard top-k
def test_hard_topk_indices_sorted_by_position():
    s = torch.tensor([[0.1, 5.0, -1.0, 3.0, 4.0], [9.0, 1.0, 2.0, 3.0, 0.0]])
    assert hard_topk(s, 3).tolist() == [[1, 3, 4], [0, 2, 3]]
    assert hard_topk(s, 5).tolist() == [[0, 1, 2, 3, 4]] * 2
    assert hard_topk(s, 3).dtype == torch.long
    assert hard_topk(torch.tensor([[3, 1, 2]]), 1).tolist() == [[0]]  # integer scores are fine here


# ---------------------------------------------------------------- perturbed top-k vs dense reference
@pytest.mark.parametrize("cv", [False, True])
def test_perturbed_matches_dense_full_vjp_with_common_noise(cv):
    g = _gen(0)
    B, N, k, n, sigma = 3, 9, 3, 64, 0.3
    scores = torch.randn(B, N, generator=g, dtype=DT)
    noise = torch.randn(B, n, N, generator=g, dtype=DT)
    grad_out = torch.randn(B, k, N, generator=g, dtype=DT)
    out, grad = _run(scores, k, sigma, noise, grad_out, control_variate=cv)
    ref_out, ref_grad = dense_full_vjp(scores, k, sigma, noise, grad_out)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-15)
    if cv:
        # same estimator with the two zero-mean corrections written densely
        y = dense_onehots(scores, k, sigma, noise)
        c = torch.einsum("bkd,bskd->bs", grad_out, y)
        c = (c - c.mean(1, keepdim=True)) * n / (n - 1)
        zc = noise - noise.mean(2, keepdim=True)
        ref_grad = torch.einsum("bs,bsj->bj", c, zc) / (n * sigma)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    # the paper's diagonal version is a different (biased) quantity
    diag = dense_diagonal_vjp(scores, k, sigma, noise, grad_out)
    assert (diag - dense_full_vjp(scores, k, sigma, noise, grad_out)[1]).abs().max() > 0.1


def test_generator_noise_convention_and_reproducibility():
    B, N, k, n, sigma = 2, 7, 2, 16, 0.5
    scores = torch.randn(B, N, generator=_gen(1), dtype=DT)
    grad_out = torch.randn(B, k, N, generator=_gen(2), dtype=DT)
    out, grad = _run(scores, k, sigma, grad_out=grad_out, num_samples=n, generator=_gen(3))
    noise = torch.randn(B, n, N, generator=_gen(3), dtype=DT)  # documented: one randn((B, n, N)) draw
    ref_out, ref_grad = dense_full_vjp(scores, k, sigma, noise, grad_out)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)
    torch.manual_seed(5)
    a = perturbed_topk(scores, k, sigma=sigma, num_samples=n)
    torch.manual_seed(5)
    b = perturbed_topk(scores, k, sigma=sigma, num_samples=n)
    assert torch.equal(a, b)


@pytest.mark.parametrize("cv,store", [(False, False), (True, False), (True, True)])
def test_chunked_regenerated_noise_equals_dense_reference(monkeypatch, cv, store):
    """Above the chunk size the noise is drawn per sample chunk; stored, or regenerated in the backward."""
    B, N, k, n, sigma = 2, 11, 3, 37, 0.2
    monkeypatch.setattr(topk_mod, "_NOISE_CHUNK_ELEMENTS", B * N * 5)  # chunks of 5 samples, 8 chunks
    monkeypatch.setattr(topk_mod, "_STORE_NOISE_MAX_BYTES", 1 << 30 if store else 0)
    scores = torch.randn(B, N, generator=_gen(4), dtype=DT)
    grad_out = torch.randn(B, k, N, generator=_gen(5), dtype=DT)
    gen = _gen(6)
    out, grad = _run(scores, k, sigma, grad_out=grad_out, num_samples=n, generator=gen, control_variate=cv)
    g2 = _gen(6)
    noise = torch.cat([torch.randn(B, min(5, n - lo), N, generator=g2, dtype=DT) for lo in range(0, n, 5)], 1)
    assert torch.equal(gen.get_state(), g2.get_state())  # the backward used a copy, not the caller's generator
    ref_out, _ = dense_full_vjp(scores, k, sigma, noise, grad_out)
    _, ref_grad = _run(scores, k, sigma, noise, grad_out, control_variate=cv)  # stored-noise path
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_full_vjp_is_unbiased_and_diagonal_is_not():
    """Against the exact derivative of the smoothed top-k, estimated with common random numbers (CRN)."""
    B, N, k, sigma, n = 1, 5, 2, 0.5, 40000
    scores = torch.tensor([[0.3, -0.2, 0.1, 0.6, 0.0]], dtype=DT)
    grad_out = torch.randn(B, k, N, generator=_gen(7), dtype=DT)
    noise = torch.randn(B, n, N, generator=_gen(8), dtype=DT)
    # CRN central differences of E[<G, Y>] (Y piecewise constant in s for fixed noise; smooth in expectation)
    h = 0.05
    fd = torch.zeros(N, dtype=DT)
    for j in range(N):
        e = torch.zeros(B, N, dtype=DT)
        e[0, j] = h
        fp = (grad_out * dense_onehots(scores + e, k, sigma, noise).mean(1)).sum()
        fm = (grad_out * dense_onehots(scores - e, k, sigma, noise).mean(1)).sum()
        fd[j] = (fp - fm) / (2 * h)
    noise2 = torch.randn(B, n, N, generator=_gen(9), dtype=DT)  # independent noise for the estimators
    _, full = _run(scores, k, sigma, noise2, grad_out, control_variate=True)
    diag = dense_diagonal_vjp(scores, k, sigma, noise2, grad_out)
    _, plain = _run(scores, k, sigma, noise2, grad_out, control_variate=False)
    assert (plain[0] - fd).abs().max() < 0.1 * fd.abs().max(), (plain, fd)
    err_full = (full[0] - fd).abs().max()
    err_diag = (diag[0] - fd).abs().max()
    assert err_full < 0.1 * fd.abs().max(), (full, fd)
    assert err_diag > 3 * err_full, (diag, full, fd)


def test_gradient_sums_to_zero_and_vanishes_for_constant_upstream():
    B, N, k, n, sigma = 2, 12, 3, 400, 0.3
    scores = torch.randn(B, N, generator=_gen(10), dtype=DT)
    grad_out = torch.randn(B, k, N, generator=_gen(11), dtype=DT)
    noise = torch.randn(B, n, N, generator=_gen(12), dtype=DT)
    # control variate: exact invariances
    _, g_cv = _run(scores, k, sigma, noise, grad_out, control_variate=True)
    assert g_cv.sum(1).abs().max() < 1e-12
    const = torch.randn(B, k, 1, generator=_gen(13), dtype=DT).expand(B, k, N)
    _, g_const = _run(scores, k, sigma, noise, const, control_variate=True)
    assert g_const.abs().max() < 1e-12
    # plain estimator: both hold in expectation (the sum is a zero-mean noise term); the diagonal one is biased
    _, g_plain = _run(scores, k, sigma, noise, grad_out)
    z_sum = (noise.sum(2) * torch.einsum("bkd,bskd->bs", grad_out, dense_onehots(scores, k, sigma, noise))).sum(1)
    torch.testing.assert_close(g_plain.sum(1), z_sum / (n * sigma))  # exactly that noise term
    # the diagonal estimator for k = 1 and a constant upstream gradient has a strictly positive expected sum
    ones = torch.ones(B, 1, N, dtype=DT)
    noise_big = torch.randn(B, 4000, N, generator=_gen(14), dtype=DT)
    std = (N / noise_big.shape[1]) ** 0.5 / sigma  # std of the plain estimator's sum: sum_s,j Z_sj / (n sigma)
    assert (dense_diagonal_vjp(scores, 1, sigma, noise_big, ones).sum(1) > 5 * std).all()
    _, g1 = _run(scores, 1, sigma, noise_big, ones)
    assert g1.sum(1).abs().max() < 4 * std


def test_sigma_zero_is_hard_topk_with_zero_gradient():
    scores = torch.randn(3, 20, generator=_gen(15), dtype=DT)
    out, g = _run(scores, 4, 0.0, grad_out=torch.ones(3, 4, 20, dtype=DT), num_samples=10)
    idx = hard_topk(scores, 4)
    assert torch.equal(out, torch.nn.functional.one_hot(idx, 20).to(DT))
    assert torch.equal(g, torch.zeros_like(scores))
    # tiny sigma: identical to hard top-k (scores well separated)
    out_small = perturbed_topk(scores, 4, sigma=1e-9, num_samples=50, generator=_gen(16))
    assert torch.equal(out_small, out)


def test_slots_sum_to_one_and_permutation_equivariance_and_batch_independence():
    B, N, k, n, sigma = 3, 10, 3, 50, 0.4
    scores = torch.randn(B, N, generator=_gen(17), dtype=DT)
    noise = torch.randn(B, n, N, generator=_gen(18), dtype=DT)
    grad_out = torch.randn(B, k, N, generator=_gen(19), dtype=DT)
    out, g = _run(scores, k, sigma, noise, grad_out)
    torch.testing.assert_close(out.sum(2), torch.ones(B, k, dtype=DT))
    # order statistics of positions: the marginal over slots is invariant under permuting patches
    perm = torch.randperm(N, generator=_gen(20))
    out_p, _ = _run(scores[:, perm], k, sigma, noise[:, :, perm])
    torch.testing.assert_close(out_p.sum(1), out.sum(1)[:, perm])
    # batch rows are independent: row 1 alone gives the same output and gradient
    out1, g1 = _run(scores[1:2], k, sigma, noise[1:2], grad_out[1:2])
    torch.testing.assert_close(out1, out[1:2])
    torch.testing.assert_close(g1, g[1:2])


def test_does_not_modify_inputs_and_module_wrapper():
    scores = torch.randn(2, 8, generator=_gen(21), dtype=DT)
    noise = torch.randn(2, 20, 8, generator=_gen(22), dtype=DT)
    s0, n0 = scores.clone(), noise.clone()
    _run(scores, 2, 0.1, noise, torch.randn(2, 2, 8, dtype=DT))
    assert torch.equal(scores, s0) and torch.equal(noise, n0)
    m = PerturbedTopK(2, num_samples=20, sigma=0.1)
    y = m(scores, generator=_gen(23))
    assert y.shape == (2, 2, 8)
    m.eval()
    torch.testing.assert_close(m(scores), torch.nn.functional.one_hot(hard_topk(scores, 2), 8).to(DT))
    assert "k=2" in repr(m)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda s: perturbed_topk(s, 0), ValueError, "k must satisfy 1 <= k <= N=6, got 0"),
        (lambda s: perturbed_topk(s, 7), ValueError, "k must satisfy 1 <= k <= N=6, got 7"),
        (lambda s: perturbed_topk(s, 2.5), ValueError, "k must be an integer"),
        (lambda s: perturbed_topk(s, 2, sigma=-0.1), ValueError, "sigma must be >= 0, got -0.1"),
        (lambda s: perturbed_topk(s, 2, num_samples=0), ValueError, "num_samples must be an integer >= 1"),
        (lambda s: perturbed_topk(s[0], 2), ValueError, r"scores must have shape \[B, N\]"),
        (lambda s: perturbed_topk(s.long(), 2), ValueError, "floating-point"),
        (lambda s: perturbed_topk(s.tolist(), 2), TypeError, "scores must be a torch.Tensor"),
        (lambda s: perturbed_topk(s, 2, noise=torch.zeros(2, 3, 6)), ValueError, "noise must have shape"),
        (lambda s: perturbed_topk(s, 2, generator=3), TypeError, "generator must be a torch.Generator"),
        (lambda s: hard_topk(s, 7), ValueError, "k must satisfy"),
        (lambda s: PerturbedTopK(2, sigma=-1.0), ValueError, "sigma must be >= 0"),
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call(torch.randn(2, 6))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scores_rejected(bad):
    s = torch.randn(2, 6)
    s[1, 3] = bad
    with pytest.raises(ValueError, match="scores must be finite"):
        perturbed_topk(s, 2)
    with pytest.raises(ValueError, match="scores must be finite"):
        hard_topk(s, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_matches_cpu_with_same_noise():
    scores = torch.randn(2, 30, generator=_gen(24), dtype=DT)
    noise = torch.randn(2, 40, 30, generator=_gen(25), dtype=DT)
    grad_out = torch.randn(2, 3, 30, generator=_gen(26), dtype=DT)
    out_c, g_c = _run(scores, 3, 0.2, noise, grad_out, control_variate=True)
    out_g, g_g = _run(scores.cuda(), 3, 0.2, noise.cuda(), grad_out.cuda(), control_variate=True)
    torch.testing.assert_close(out_g.cpu(), out_c)
    torch.testing.assert_close(g_g.cpu(), g_c)
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = scores.cuda().requires_grad_(True)
    perturbed_topk(s, 3, sigma=0.2, num_samples=40, generator=gen).sum().backward()
    assert s.grad.shape == s.shape


def test_mask_sample_draws_k_distinct_cells_with_the_mask_as_inclusion_probabilities():
    from operators.sinkhorn import sinkhorn_topk
    from operators.topk import mask_sample

    g = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 30, generator=g, dtype=torch.float64)
    k = 6
    mask = sinkhorn_topk(scores, k, epsilon=0.05, max_iter=500)
    assert float(mask.min()) < 0.9 and float(mask.max()) > 0.5  # a soft mask: mass spread near the threshold
    draws = 4000
    counts = torch.zeros_like(mask)
    gen = torch.Generator().manual_seed(1)
    for _ in range(draws):
        idx = mask_sample(mask, k, generator=gen)
        assert idx.shape == (2, k)
        assert bool((idx[:, 1:] > idx[:, :-1]).all())  # increasing: distinct
        counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=counts.dtype))
    # inclusion frequencies match the mask (binomial standard error <= 0.008 at 4000 draws)
    torch.testing.assert_close(counts / draws, mask / mask.sum(1, keepdim=True) * k, rtol=0, atol=0.035)
    # a hard mask is drawn as it is; the same generator state gives the same draw
    hard = torch.zeros(1, 10, dtype=torch.float64)
    hard[0, [1, 4, 7]] = 1.0
    assert mask_sample(hard, 3, generator=torch.Generator().manual_seed(3)).tolist() == [[1, 4, 7]]
    a = mask_sample(mask, k, generator=torch.Generator().manual_seed(9))
    b = mask_sample(mask, k, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b)
    # an entry above 1 after rescaling is certain; the rest share the remaining mass
    tilted = torch.tensor([[1.0, 1.0, 0.49, 0.49, 0.0]], dtype=torch.float64)  # sums to 2.98 for k=3
    for s in range(20):
        idx = mask_sample(tilted, 3, generator=torch.Generator().manual_seed(s))[0].tolist()
        assert idx[:2] == [0, 1] and idx[2] in (2, 3)
    with pytest.raises(ValueError, match="sum to about k"):
        mask_sample(hard, 5)
    with pytest.raises(ValueError, match="k"):
        mask_sample(hard, 11)


def test_perturbed_slot_modes_are_the_modes_of_the_perturbed_topk_slots():
    """Against the perturbed top-k's own indicators with the same noise (each slot's cell is one of its most
    frequent) and against a plain loop (per sample the top k of scores + sigma z in index order, per slot the
    most frequent cell, ties: the smallest)."""
    from collections import Counter

    from operators.topk import perturbed_slot_modes

    b, n, k, m, sigma = 3, 15, 4, 33, 0.2
    scores = torch.rand(b, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    z = torch.randn(b, m, n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = perturbed_slot_modes(scores, k, num_samples=m, sigma=sigma, noise=z)
    assert got.dtype == torch.long and got.shape == (b, k)
    y = perturbed_topk(scores, k, num_samples=m, sigma=sigma, noise=z)  # [B, k, N]
    assert torch.equal(y.gather(2, got[..., None])[..., 0], y.max(-1).values)
    for bi in range(b):
        slots = [sorted(torch.topk(scores[bi] + sigma * z[bi, s], k).indices.tolist()) for s in range(m)]
        for j in range(k):
            counts = Counter(sl[j] for sl in slots)
            top = max(counts.values())
            assert int(got[bi, j]) == min(c for c, v in counts.items() if v == top)
    # the same draws from a generator as perturbed_topk's noise convention (one chunk here)
    g1 = torch.Generator().manual_seed(9)
    z9 = torch.randn((b, m, n), generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    assert torch.equal(
        perturbed_slot_modes(scores, k, num_samples=m, sigma=sigma, generator=g1),
        perturbed_slot_modes(scores, k, num_samples=m, sigma=sigma, noise=z9),
    )


def test_perturbed_slot_modes_fill_the_bag_with_the_sure_cells_and_are_the_top_k_without_noise():
    from operators.topk import perturbed_slot_modes

    scores = torch.full((1, 40), 0.5, dtype=torch.float64)
    scores[0, 5:40] += torch.linspace(-0.02, 0.02, 35, dtype=torch.float64)  # a flat run of filler
    scores[0, [2, 9, 30]] = 1.0  # three cells far above it
    got = perturbed_slot_modes(scores, 6, num_samples=64, sigma=0.05, generator=torch.Generator().manual_seed(0))
    assert {2, 9, 30} <= set(got[0].tolist())
    assert len(set(got[0].tolist())) < 6  # the filler seldom wins a slot: sure cells fill several
    s = torch.rand(2, 30, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert torch.equal(
        perturbed_slot_modes(s, 5, num_samples=3, sigma=0.0), s.topk(5, dim=1).indices.sort(dim=1).values
    )
    with pytest.raises(ValueError, match="k"):
        perturbed_slot_modes(s, 31, num_samples=4, sigma=0.1)
    with pytest.raises(ValueError, match="sigma"):
        perturbed_slot_modes(s, 3, num_samples=4, sigma=-1.0)
    with pytest.raises(ValueError, match="noise"):
        perturbed_slot_modes(s, 3, num_samples=4, sigma=0.1, noise=torch.zeros(2, 3, 30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_perturbed_slot_modes_on_cuda_pick_a_mode_of_each_slot():
    """On CUDA (where ``torch.mode`` may break ties differently) each chosen cell is still a most frequent cell of
    its slot in the perturbed top-k's indicators with the same noise, computed on the CPU; a CUDA generator works."""
    from operators.topk import perturbed_slot_modes

    b, n, k, m, sigma = 3, 40, 5, 64, 0.2
    scores = torch.rand(b, n, generator=_gen(31), dtype=DT)
    z = torch.randn(b, m, n, generator=_gen(32), dtype=DT)
    got = perturbed_slot_modes(scores.cuda(), k, num_samples=m, sigma=sigma, noise=z.cuda())
    assert got.is_cuda and got.shape == (b, k)
    y = perturbed_topk(scores, k, num_samples=m, sigma=sigma, noise=z)  # [B, k, N] on the CPU
    assert torch.equal(y.gather(2, got.cpu()[..., None])[..., 0], y.max(-1).values)
    gen = torch.Generator(device="cuda").manual_seed(0)
    idx = perturbed_slot_modes(scores.cuda(), k, num_samples=m, sigma=0.0, generator=gen)
    assert torch.equal(idx.cpu(), scores.topk(k, dim=1).indices.sort(dim=1).values)  # sigma 0: the hard top-k
