"""Attention sampling (Katharopoulos & Fleuret 2019): unbiased value and gradients, by Monte Carlo.

Monte Carlo checks replicate one small distribution over S rows (rows are independent draws), so one call
gives S i.i.d. estimates; each mean is compared to the exact value in units of its standard error
(|z| < 5 for every component, fixed seed). The inclusive-cumsum variant of a public port is shown to be
biased by the same machinery (|z| > 20).
"""

from __future__ import annotations

import math

import pytest
import torch

from operators import AttentionSampler, attention_entropy, attention_sample, slot_mode_sample
from operators.attention_sampling import gumbel_noise

A0 = torch.tensor([0.42, 0.23, 0.15, 0.12, 0.05, 0.03], dtype=torch.float64)
F0 = torch.tensor([1.5, -2.0, 0.7, 3.0, -1.0, 4.0], dtype=torch.float64)
S = 60_000


def _z(samples: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """z-scores of the Monte Carlo means (samples: [S, ...]) against the exact values."""
    mean = samples.mean(0)
    se = samples.std(0) / math.sqrt(samples.shape[0])
    return (mean - exact) / se.clamp_min(1e-300)


def _mc(replace: bool, k: int, seed: int = 0):
    """Per-row estimates of E_a[f], d/da and d/df for S independent draws."""
    g = torch.Generator().manual_seed(seed)
    a = A0.expand(S, -1).clone().requires_grad_(True)
    f = F0.expand(S, -1).clone().requires_grad_(True)
    idx, w = attention_sample(a, k, replace=replace, generator=g)
    est = (w * f.gather(1, idx)).sum(1)  # [S]
    est.sum().backward()
    return idx, w.detach(), est.detach(), a.grad, f.grad


@pytest.mark.parametrize("replace,k", [(True, 3), (False, 3), (False, 6)])
def test_estimator_value_and_gradients_are_unbiased(replace, k):
    idx, w, est, ga, gf = _mc(replace, k)
    exact = (A0 * F0).sum()
    assert abs(float(_z(est, exact))) < 5
    # d/da of sum_n a_n f_n is f (exactly, not only up to a constant along the simplex)
    assert _z(ga, F0).abs().max() < 5
    # d/df of sum_n a_n f_n is a
    assert _z(gf, A0).abs().max() < 5


def test_with_replacement_forward_weights_are_one_over_k():
    _, w, _, _, _ = _mc(True, 4)
    torch.testing.assert_close(w, torch.full_like(w, 0.25))


def test_without_replacement_draws_distinct_and_first_draw_follows_a():
    idx, _, _, _, _ = _mc(False, 4, seed=1)
    assert all(len(set(r)) == 4 for r in idx[:500].tolist())
    freq = torch.bincount(idx[:, 0], minlength=A0.numel()).double()
    se = torch.sqrt(S * A0 * (1 - A0))
    assert ((freq - S * A0) / se).abs().max() < 5


def _inclusive_port_weights(a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The biased variant: remaining mass 1 - (inclusive cumsum), everything else identical."""
    k = idx.shape[1]
    a_s = a.gather(1, idx)
    remaining = 1.0 - torch.cumsum(a_s.detach(), 1)
    later = torch.arange(k - 1, -1, -1, dtype=a.dtype)
    return (remaining * a_s / a_s.detach() + later * a_s) / k


def test_inclusive_cumsum_variant_is_biased_ours_is_not():
    g = torch.Generator().manual_seed(3)
    a = A0.expand(S, -1).clone()
    f = F0.expand(S, -1).clone().requires_grad_(True)
    idx, w_ours = attention_sample(a, 3, replace=False, generator=g)
    w_incl = _inclusive_port_weights(a, idx)
    exact = (A0 * F0).sum()
    est_ours = (w_ours * F0[idx]).sum(1)
    est_incl = (w_incl * F0[idx]).sum(1)
    assert abs(float(_z(est_ours, exact))) < 5
    assert abs(float(_z(est_incl, exact))) > 20
    # feature gradient (= expected weight per patch) must be a; the inclusive one is not
    (w_incl * f.gather(1, idx)).sum().backward()
    assert _z(f.grad, A0).abs().max() > 20


def test_weights_match_closed_form_and_gradient_of_surrogate():
    a = torch.tensor([[0.1, 0.4, 0.2, 0.3]], dtype=torch.float64, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    idx, w = attention_sample(a, 3, replace=False, generator=g)
    a_s = A = a.detach()[0, idx[0]]
    c_excl = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(a_s, 0)[:-1]])
    expected = ((1 - c_excl) + torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64) * A) / 3
    torch.testing.assert_close(w[0], expected)
    # d w_j / d a_{i_j} = (R_j / a_{i_j} + (k - j)) / k, and no other dependence
    jac = torch.autograd.functional.jacobian(
        lambda x: attention_sample(x, 3, replace=False, generator=torch.Generator().manual_seed(0))[1][0], a.detach()
    )[:, 0, :]
    want = torch.zeros(3, 4, dtype=torch.float64)
    for j in range(3):
        want[j, idx[0, j]] = ((1 - c_excl[j]) / A[j] + (2 - j)) / 3
    torch.testing.assert_close(jac, want)


def test_zero_probability_patches():
    a = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    idx, w = attention_sample(a.expand(200, -1), 3, replace=True, generator=g)
    assert set(idx.unique().tolist()) <= {1, 3}
    idx, w = attention_sample(a, 4, replace=False, generator=g)
    assert set(idx[0, :2].tolist()) == {1, 3}  # positive mass first
    w.sum().backward()
    assert torch.isfinite(w).all() and torch.isfinite(a.grad).all()
    assert w[0, 2:].abs().max() < 1e-12


def test_generator_reproducible_and_float32():
    a = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), 1)
    for replace in (True, False):
        i1, w1 = attention_sample(a, 7, replace=replace, generator=torch.Generator().manual_seed(5))
        i2, w2 = attention_sample(a, 7, replace=replace, generator=torch.Generator().manual_seed(5))
        assert torch.equal(i1, i2) and torch.equal(w1, w2)
        assert i1.dtype == torch.long and i1.shape == (4, 7) and w1.dtype == torch.float32


def test_entropy():
    n = 8
    uni = torch.full((1, n), 1.0 / n, dtype=torch.float64)
    torch.testing.assert_close(attention_entropy(uni), torch.tensor([math.log(n)], dtype=torch.float64))
    onehot = torch.zeros(1, n, dtype=torch.float64)
    onehot[0, 3] = 1
    assert float(attention_entropy(onehot)) == 0.0
    a = torch.tensor([[0.0, 0.3, 0.7]], dtype=torch.float64, requires_grad=True)
    attention_entropy(a).sum().backward()
    want = torch.tensor([[0.0, -(math.log(0.3) + 1), -(math.log(0.7) + 1)]], dtype=torch.float64)
    torch.testing.assert_close(a.grad, want)
    # through a softmax (the usual parametrisation): finite differences
    logits = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: attention_entropy(torch.softmax(x, 1)), (logits,))


def test_module():
    m = AttentionSampler(3, replace=True)
    idx, w = m(torch.full((2, 5), 0.2), generator=torch.Generator().manual_seed(0))
    assert idx.shape == (2, 3) and w.shape == (2, 3)
    assert "k=3" in repr(m)
    with pytest.raises(ValueError, match="k"):
        AttentionSampler(0)
    with pytest.raises(TypeError, match="replace"):
        AttentionSampler(2, replace="yes")


def test_bad_arguments():
    a = torch.full((2, 4), 0.25)
    with pytest.raises(TypeError, match="attention"):
        attention_sample([[0.5, 0.5]], 1, replace=True)
    with pytest.raises(ValueError, match=r"attention.*shape"):
        attention_sample(torch.full((4,), 0.25), 1, replace=True)
    with pytest.raises(ValueError, match=r"attention.*sum to 1.*1\.2"):
        attention_sample(torch.tensor([[0.6, 0.6]]), 1, replace=True)
    with pytest.raises(ValueError, match=r"attention.*>= 0"):
        attention_sample(torch.tensor([[1.5, -0.5]]), 1, replace=True)
    with pytest.raises(ValueError, match=r"attention.*finite"):
        attention_sample(torch.tensor([[float("nan"), 1.0]]), 1, replace=True)
    with pytest.raises(ValueError, match=r"k.*N=4.*5"):
        attention_sample(a, 5, replace=False)
    with pytest.raises(ValueError, match=r"k.*0"):
        attention_sample(a, 0, replace=True)
    with pytest.raises(TypeError, match="k"):
        attention_sample(a, "2", replace=True)
    with pytest.raises(TypeError, match="replace"):
        attention_sample(a, 2, replace=1)
    with pytest.raises(TypeError, match="generator"):
        attention_sample(a, 2, replace=True, generator=0)
    with pytest.raises(ValueError, match="attention"):
        attention_entropy(torch.tensor([[0.2, 0.2]]))
    # with replacement k may exceed N
    idx, _ = attention_sample(a, 9, replace=True)
    assert idx.shape == (2, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_unbiased_and_generator():
    a = A0.cuda().expand(20_000, -1).clone()
    g = torch.Generator(device="cuda").manual_seed(0)
    for replace in (True, False):
        idx, w = attention_sample(a, 3, replace=replace, generator=g)
        assert idx.device.type == "cuda" and w.device.type == "cuda"
        est = (w * F0.cuda()[idx]).sum(1).cpu()
        assert abs(float(_z(est, (A0 * F0).sum()))) < 5
    with pytest.raises(ValueError, match="generator"):
        attention_sample(a, 3, replace=True, generator=torch.Generator())


def test_slot_mode_sample_is_the_per_slot_mode_of_gumbel_top_k_draws():
    """Against a plain loop over the same Gumbel draws: per draw the top k of logits + noise in index order,
    per slot the most frequent cell (ties: the smallest)."""
    from collections import Counter

    b, n, k, m = 3, 12, 4, 25
    logits = torch.randn(b, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    got = slot_mode_sample(logits, k, num_samples=m, generator=torch.Generator().manual_seed(7))
    g = gumbel_noise((m, b, n), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for bi in range(b):
        slots = [sorted(torch.topk(logits[bi] + g[d, bi], k).indices.tolist()) for d in range(m)]
        for j in range(k):
            counts = Counter(s[j] for s in slots)
            top = max(counts.values())
            assert int(got[bi, j]) == min(c for c, v in counts.items() if v == top)
    assert got.dtype == torch.long and got.shape == (b, k)


def test_slot_mode_sample_keeps_the_sure_cells_and_is_the_top_k_at_a_low_temperature():
    logits = torch.zeros(1, 30, dtype=torch.float64)
    logits[0, [3, 11, 27]] = 8.0  # three cells the attention is sure of, 27 filler cells
    got = slot_mode_sample(logits, 3, num_samples=64, generator=torch.Generator().manual_seed(0))
    assert got[0].tolist() == [3, 11, 27]
    # one draw at a very low temperature is the hard top-k, in index order
    s = torch.rand(2, 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = slot_mode_sample(s / 1e-9, 5, num_samples=1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, s.topk(5, dim=1).indices.sort(dim=1).values)
    with pytest.raises(ValueError, match="k"):
        slot_mode_sample(s, 41, num_samples=4)
    with pytest.raises(ValueError, match="num_samples"):
        slot_mode_sample(s, 3, num_samples=0)
