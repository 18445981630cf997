"""Differentiable sorting/selection networks and the top-k cross-entropy of Petersen et al. 2022.

Reference: the authors' ``difftopk`` package (test-only dependency), dense code paths only (its sparse paths
need torch-sparse). Its splitter-selection network exists only in sparse form there; its comparator
matrices (plain numpy) are run through difftopk's own dense executor instead.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from operators import TopKCrossEntropyLoss
from operators.sorting_networks import (
    DISTRIBUTIONS,
    NETWORKS,
    bitonic_network,
    odd_even_network,
    soft_sort_network,
    soft_topk_matrix,
    sorting_network,
    splitter_selection_network,
)
from operators.topk_loss import topk_cross_entropy

difftopk = pytest.importorskip("difftopk")
from difftopk.functional import execute_topk  # noqa: E402
from difftopk.networks import get_sorting_network, sparse_splitter_selection_network  # noqa: E402


def _their_dense_network(method: str, n: int, k: int):
    if method == "splitter_selection":
        return [[torch.from_numpy(a).float() for a in layer[:4]] for layer in sparse_splitter_selection_network(n, k)]
    return get_sorting_network(method, n, "cpu")


@pytest.mark.parametrize("method", NETWORKS)
def test_hard_limit_selects_sorted_topk(method):
    g = torch.Generator().manual_seed(0)
    for n in list(range(2, 18)) + [31, 64]:
        for k in sorted({1, min(3, n), n if method != "splitter_selection" else min(5, n)}):
            x = torch.randn(8, n, generator=g, dtype=torch.float64)
            net = sorting_network(method, n, k)
            p = soft_topk_matrix(x, net, k, inverse_temperature=1e7, distribution="logistic")
            got = torch.einsum("bi,bik->bk", x, p)
            torch.testing.assert_close(got, x.sort(1, descending=True).values[:, :k], atol=1e-6, rtol=0)
            # a hard selection: P is (numerically) 0/1
            assert ((p - p.round()).abs() < 1e-6).all()


def test_network_sizes():
    assert len(odd_even_network(7)) == 7
    assert len(bitonic_network(8)) == 6 and all(len(layer) == 4 for layer in bitonic_network(8))
    sel = splitter_selection_network(1000, 5)
    full = bitonic_network(1000)
    assert sum(map(len, sel)) < sum(map(len, full)) / 3
    assert len(sel) < len(full)


@pytest.mark.parametrize("method", NETWORKS)
@pytest.mark.parametrize("n", [5, 8, 13])
def test_soft_topk_matrix_matches_difftopk(method, n):
    k = 3
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, generator=g)
    theirs_net = _their_dense_network(method, n, k)
    for dist in DISTRIBUTIONS:
        _, theirs = execute_topk(theirs_net, x, k, steepness=3.0, art_lambda=0.4, distribution=dist)
        net = sorting_network(method, n, k)
        ours = soft_topk_matrix(x, net, k, inverse_temperature=3.0, distribution=dist, art_lambda=0.4)
        torch.testing.assert_close(ours.flip(-1), theirs, atol=2e-6, rtol=1e-5, msg=f"{method} {dist}")


@pytest.mark.parametrize("method", NETWORKS)
def test_routes_are_rows_of_the_doubly_stochastic_matrix(method):
    n, k = 11, 4
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, n, generator=g, dtype=torch.float64)
    net = sorting_network(method, n, k)
    track = torch.arange(n).expand(3, -1)
    y, routes = soft_sort_network(x, net, inverse_temperature=1.3, track=track)
    torch.testing.assert_close(routes.sum(2), torch.ones(3, n, dtype=torch.float64))  # each input fully routed
    torch.testing.assert_close(routes.sum(1), torch.ones(3, n, dtype=torch.float64))  # each wire a convex mix
    torch.testing.assert_close(torch.einsum("bi,biw->bw", x, routes), y)
    p = soft_topk_matrix(x, net, k, inverse_temperature=1.3)
    torch.testing.assert_close(routes[:, :, n - k :].flip(-1), p)


CASES = [
    # (our method, difftopk dense method, m, top1_mode, distribution)
    ("odd_even", "odd_even", None, "sm", "cauchy"),
    ("odd_even", "odd_even", 8, "smce", "logistic_phi"),
    ("bitonic", "bitonic__non_sparse", None, "sort", "logistic"),
    ("bitonic", "bitonic__non_sparse", 8, "sm", "cauchy"),
    ("splitter_selection", "odd_even", None, "smce", "gaussian"),
    ("splitter_selection", "odd_even", 9, "sm", "cauchy"),
    ("splitter_selection", "odd_even", None, "sort", "reciprocal"),
]


@pytest.mark.parametrize("ours,theirs,m,mode,dist", CASES)
def test_loss_and_gradient_match_difftopk(ours, theirs, m, mode, dist, capsys):
    n, p_k = 20, [0.4, 0.1, 0.0, 0.2, 0.3]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, n, generator=g, requires_grad=True)
    y = torch.randint(0, n, (6,), generator=g)
    ref = difftopk.TopKCrossEntropyLoss(theirs, 1.7, p_k, n, m=m, distribution=dist, top1_mode=mode, art_lambda=0.3)
    if ours == "splitter_selection":  # difftopk has it only as a sparse network: run its matrices densely
        ref.top_k_net.sorting_network = _their_dense_network(ours, m or n, len(p_k))
    l_ref = ref(x, y)
    (g_ref,) = torch.autograd.grad(l_ref, x)
    loss = TopKCrossEntropyLoss(
        p_k, ours, inverse_temperature=1.7, distribution=dist, art_lambda=0.3, m=m, n=n, top1_mode=mode
    )
    l_ours = loss(x, y)
    (g_ours,) = torch.autograd.grad(l_ours, x)
    torch.testing.assert_close(l_ours, l_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method", NETWORKS)
@pytest.mark.parametrize("m", [None, 5])
def test_gradcheck_float64(method, m):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 9, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 4, 8])

    def f(z):
        return topk_cross_entropy(
            z, y, [0.3, 0.3, 0.4], method=method, inverse_temperature=1.5, distribution="logistic", m=m
        )

    assert torch.autograd.gradcheck(f, (x,))


def test_pk_one_is_softmax_cross_entropy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=g, dtype=torch.float64)
    y = torch.randint(0, 12, (5,), generator=g)
    ce = F.cross_entropy(x, y)
    # exact limit: -log(softmax_y (1 - 2 eps) + eps), = cross-entropy for eps = 0
    loss = TopKCrossEntropyLoss([1.0])(x, y)
    want = -torch.log(torch.softmax(x, 1)[torch.arange(5), y] * (1 - 2e-7) + 1e-7).mean()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(TopKCrossEntropyLoss([1.0], eps=0.0)(x, y), ce, rtol=1e-12, atol=1e-12)
    assert abs(float(loss - ce)) < 1e-5
    torch.testing.assert_close(TopKCrossEntropyLoss([1.0], top1_mode="smce", eps=0.0)(x, y), ce)
    # P_K = [0, 1]: with a very steep relaxation, the loss is ~0 when the label is in the top-2, large otherwise
    x2 = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    per = topk_cross_entropy(
        x2, torch.tensor([1, 2]), [0.0, 1.0], inverse_temperature=1e6, distribution="logistic", reduction="none"
    )
    assert per[0] < 1e-5 and per[1] > 10


def test_many_classes_with_preselection():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1000, generator=g, requires_grad=True)
    y = torch.randint(0, 1000, (4,), generator=g)
    loss = TopKCrossEntropyLoss([0.5, 0, 0, 0, 0.5], "splitter_selection", m=16, n=1000)
    val = loss(x, y)
    val.backward()
    assert torch.isfinite(val) and torch.isfinite(x.grad).all()
    # only the label and the 15 largest other logits of each row receive gradient
    assert ((x.grad != 0).sum(1) <= 16).all()
    assert (x.grad[torch.arange(4), y] < 0).all()  # raising the true logit lowers the loss
    # and without preselection (a full selection network over 1000 classes) it still runs
    val_full = TopKCrossEntropyLoss([0.5, 0, 0, 0, 0.5], "splitter_selection")(x.detach()[:1], y[:1])
    assert torch.isfinite(val_full)


def test_bad_arguments():
    x, y = torch.randn(2, 10), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"p_k must sum to 1.*0\.9"):
        TopKCrossEntropyLoss([0.5, 0.4])
    with pytest.raises(ValueError, match=r"p_k.*>= 0"):
        TopKCrossEntropyLoss([1.5, -0.5])
    with pytest.raises(ValueError, match="p_k"):
        TopKCrossEntropyLoss([])
    with pytest.raises(TypeError, match="p_k"):
        TopKCrossEntropyLoss(0.5)
    with pytest.raises(ValueError, match=r"m must be > len\(p_k\)=3.*m=3"):
        TopKCrossEntropyLoss([0.5, 0.25, 0.25], m=3)
    with pytest.raises(ValueError, match=r"m must be < n=10.*m=10"):
        TopKCrossEntropyLoss([0.5, 0.5], m=10, n=10)
    with pytest.raises(ValueError, match=r"m must be < number of classes C=10"):
        TopKCrossEntropyLoss([0.5, 0.5], m=12)(x, y)
    with pytest.raises(ValueError, match=r"method must be one of.*'quick'"):
        TopKCrossEntropyLoss([1.0], "quick")
    with pytest.raises(ValueError, match=r"distribution must be one of.*'laplace'"):
        TopKCrossEntropyLoss([1.0], distribution="laplace")
    with pytest.raises(ValueError, match=r"inverse_temperature must be > 0.*-1"):
        TopKCrossEntropyLoss([1.0], inverse_temperature=-1)
    with pytest.raises(ValueError, match=r"top1_mode must be one of"):
        TopKCrossEntropyLoss([1.0], top1_mode="max")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        TopKCrossEntropyLoss([1.0])(x, torch.tensor([1, 10]))
    with pytest.raises(ValueError, match=r"labels must be a LongTensor"):
        TopKCrossEntropyLoss([1.0])(x, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"logits must have n=12 classes"):
        TopKCrossEntropyLoss([1.0], n=12)(x, y)
    with pytest.raises(ValueError, match=r"len\(p_k\) must be <= number of classes C=10"):
        TopKCrossEntropyLoss([0.0] * 11 + [1.0])(x, y)
    with pytest.raises(ValueError, match=r"logits.*finite"):
        TopKCrossEntropyLoss([1.0])(torch.tensor([[math.inf, 0.0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"k must satisfy 1 <= k <= N=4"):
        splitter_selection_network(4, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", NETWORKS)
def test_cuda_matches_cpu(method):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 50, generator=g, dtype=torch.float64)
    y = torch.randint(0, 50, (8,), generator=g)
    loss = TopKCrossEntropyLoss([0.5, 0.2, 0.3], method, m=12)
    xc = x.cuda().requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    lc, ls = loss(xc, y.cuda()), loss(xs, y)
    lc.backward()
    ls.backward()
    torch.testing.assert_close(lc.cpu(), ls)
    torch.testing.assert_close(xc.grad.cpu(), xs.grad)
