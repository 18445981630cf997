"""Top-k classification loss on differentiable sorting networks: Petersen, Kuehne, Borgelt & Deussen,
"Differentiable Top-k Classification Learning", ICML 2022.

The loss asks the true class to be among the top-k predictions, with k drawn from a distribution
``P_K = (p_1, ..., p_K)`` (``p_k`` = probability of rank budget k; e.g. ``[.5, 0, 0, 0, .5]`` mixes top-1 and
top-5). With ``P[b, i, r]`` the relaxed probability that class i lands at rank r (0 = largest) computed by a
differentiable sorting/selection network (:mod:`operators.sorting_networks`), the probability that the label
y is in the top-k is ``sum_{r<k} P[b, y, r]``, and

    ``q_b = p_1 * softmax(z_b)_y + sum_{k>=2} p_k * sum_{r<k} P[b, y, r]``     (``top1_mode="sm"``)
    ``loss = mean_b -log(q_b * (1 - 2 eps) + eps)``

The top-1 term uses the softmax (the paper's default, more stable than the network's top-1). With ``m``
(top-m preselection) only the true logit and the ``m - 1`` largest other logits enter the network, in that
order (true first, then the others in descending order, as in the authors' ``difftopk``), which makes
n ~ 1000 classes cheap; the softmax of the top-1 term is then over those m logits as well.

Only the label's row of ``P`` is needed: it is propagated forward through the network together with the
logits (O(layers * B * n)), never the ``n x n`` (or ``n x k``) relaxed permutation matrix.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from operators._checks import check_nonneg, check_positive_int, check_scores, check_tensor
from operators.sorting_networks import NETWORKS, _check_relax_args, soft_sort_network, sorting_network

__all__ = ["TopKCrossEntropyLoss", "topk_cross_entropy"]

TOP1_MODES = ("sm", "smce", "sort")
REDUCTIONS = ("mean", "sum", "none")


def _check_p_k(p_k: object) -> tuple[float, ...]:
    if isinstance(p_k, torch.Tensor):
        p_k = p_k.detach().cpu().tolist()
    if isinstance(p_k, (str, bytes)) or not isinstance(p_k, Sequence):
        raise TypeError(f"p_k must be a sequence of probabilities, got {type(p_k).__name__}")
    if len(p_k) == 0:
        raise ValueError("p_k must have at least one entry (P(k=1), P(k=2), ...), got []")
    vals = []
    for i, v in enumerate(p_k):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"p_k[{i}] must be a real number, got {type(v).__name__}")
        if not math.isfinite(float(v)) or float(v) < 0:
            raise ValueError(f"p_k entries must be finite and >= 0, got p_k[{i}]={v!r} in {list(p_k)!r}")
        vals.append(float(v))
    total = sum(vals)
    if abs(total - 1.0) > 1e-4:
        raise ValueError(f"p_k must sum to 1 (within 1e-4), got {list(p_k)!r} summing to {total:.6g}")
    return tuple(vals)


def _check_choice(value: object, name: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _check_labels(labels: object, batch: int, num_classes: int) -> torch.Tensor:
    check_tensor(labels, "labels")
    if labels.dtype != torch.long or labels.shape != (batch,):
        raise ValueError(f"labels must be a LongTensor of shape [B={batch}], got {labels.dtype} {tuple(labels.shape)}")
    if batch and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{int(labels.min())}, {int(labels.max())}]")
    return labels


def topk_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    p_k: Sequence[float],
    *,
    method: str = "odd_even",
    inverse_temperature: float = 2.0,
    distribution: str = "cauchy",
    art_lambda: float = 0.25,
    m: int | None = None,
    top1_mode: str = "sm",
    eps: float = 1e-7,
    reduction: str = "mean",
) -> torch.Tensor:
    """Top-k cross-entropy of Petersen et al. 2022 (see the module docstring for the formula).

    Args:
        logits: ``[B, C]`` class scores (finite, floating).
        labels: LongTensor ``[B]`` in ``[0, C)``.
        p_k: ``(P(K=1), ..., P(K=K))``, non-negative, summing to 1; ``K = len(p_k) <= C``.
        method: ``"odd_even"``, ``"bitonic"`` or ``"splitter_selection"`` (top-K selection network, the
            cheapest for large n).
        inverse_temperature: steepness ``beta > 0`` of the relaxed comparator.
        distribution: relaxation CDF, one of :data:`operators.sorting_networks.DISTRIBUTIONS`.
        art_lambda: exponent of the ``logistic_phi`` relaxation.
        m: optional top-m preselection, ``K < m``; requires ``m < C`` (else pass ``None``).
        top1_mode: ``"sm"`` (softmax for the k=1 term), ``"smce"`` (``p_1 * CE + (1 - p_1) * topk-NLL``
            of the k >= 2 terms) or ``"sort"`` (network only).
        eps: smoothing of the log, ``-log(q (1 - 2 eps) + eps)``, in ``[0, 0.5)``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (``[B]``).

    Returns:
        The loss (scalar, or ``[B]`` for ``reduction="none"``).
    """
    p = _check_p_k(p_k)
    kk = len(p)
    method = _check_choice(method, "method", NETWORKS)
    beta, distribution, lam = _check_relax_args(inverse_temperature, distribution, art_lambda)
    top1_mode = _check_choice(top1_mode, "top1_mode", TOP1_MODES)
    reduction = _check_choice(reduction, "reduction", REDUCTIONS)
    eps = check_nonneg(eps, "eps")
    if eps >= 0.5:
        raise ValueError(f"eps must lie in [0, 0.5), got {eps!r}")
    logits = check_scores(logits, "logits", ndim=2)
    batch, num_classes = logits.shape
    labels = _check_labels(labels, batch, num_classes)
    if kk > num_classes:
        raise ValueError(f"len(p_k) must be <= number of classes C={num_classes}, got len(p_k)={kk}")
    if m is not None:
        m = check_positive_int(m, "m")
        if not kk < m:
            raise ValueError(f"m must be > len(p_k)={kk} (top-m preselection keeps the top-K inside), got m={m}")
        if m >= num_classes:
            raise ValueError(f"m must be < number of classes C={num_classes} (or None for no preselection), got m={m}")

    z = logits
    if m is not None:
        others = z.detach().scatter(1, labels.unsqueeze(1), float("-inf"))
        top_idx = others.topk(m - 1, dim=1, largest=True, sorted=True).indices
        z = torch.cat([z.gather(1, labels.unsqueeze(1)), z.gather(1, top_idx)], dim=1)
        labels = torch.zeros_like(labels)
    n = z.shape[1]

    def nll(q: torch.Tensor) -> torch.Tensor:
        return -torch.log(q * (1 - 2 * eps) + eps)

    need_network = top1_mode == "sort" or any(v != 0 for v in p[1:])
    if need_network:
        network = sorting_network(method, n, kk)
        _, routes = soft_sort_network(
            z, network, inverse_temperature=beta, distribution=distribution, art_lambda=lam, track=labels.unsqueeze(1)
        )
        rank_prob = routes[:, 0, n - kk :].flip(-1)  # [B, K]: P(label at rank r), r = 0 (largest) .. K-1
        in_topk = torch.cumsum(rank_prob, dim=-1)  # [B, K]: P(label in top-(r+1))
    weights = torch.tensor(p, dtype=z.dtype, device=z.device)
    if top1_mode == "sort":
        per = nll((in_topk * weights).sum(-1))
    elif top1_mode == "sm":
        q = p[0] * torch.softmax(z, dim=1).gather(1, labels.unsqueeze(1)).squeeze(1)
        if need_network:
            q = q + (in_topk[:, 1:] * weights[1:]).sum(-1)
        per = nll(q)
    else:  # smce
        ce = F.cross_entropy(z, labels, reduction="none")
        per = p[0] * ce
        if need_network:
            per = per + sum(p[1:]) * nll((in_topk[:, 1:] * weights[1:]).sum(-1))
    if reduction == "none":
        return per
    return per.mean() if reduction == "mean" else per.sum()


class TopKCrossEntropyLoss(nn.Module):
    """Module form of :func:`topk_cross_entropy` (Petersen et al. 2022), settings fixed at construction.

    Args:
        p_k: ``(P(K=1), ..., P(K=K))`` summing to 1, e.g. ``[.5, 0, 0, 0, .5]``.
        method: ``"odd_even"`` (default), ``"bitonic"`` or ``"splitter_selection"``.
        inverse_temperature, distribution, art_lambda, m, top1_mode, eps, reduction: as in
            :func:`topk_cross_entropy`.
        n: optional number of classes, checked against ``m`` here and against the logits in ``forward``.

    ``forward(logits[B, C], labels[B]) -> loss``. The parameter names follow ``difftopk``'s
    ``TopKCrossEntropyLoss`` (``diffsort_method`` there is ``method`` here).
    """

    def __init__(
        self,
        p_k: Sequence[float],
        method: str = "odd_even",
        *,
        inverse_temperature: float = 2.0,
        distribution: str = "cauchy",
        art_lambda: float = 0.25,
        m: int | None = None,
        n: int | None = None,
        top1_mode: str = "sm",
        eps: float = 1e-7,
        reduction: str = "mean",
    ) -> None:
        super().__init__()
        self.p_k = _check_p_k(p_k)
        self.method = _check_choice(method, "method", NETWORKS)
        self.inverse_temperature, self.distribution, self.art_lambda = _check_relax_args(
            inverse_temperature, distribution, art_lambda
        )
        self.top1_mode = _check_choice(top1_mode, "top1_mode", TOP1_MODES)
        self.reduction = _check_choice(reduction, "reduction", REDUCTIONS)
        self.eps = check_nonneg(eps, "eps")
        if self.eps >= 0.5:
            raise ValueError(f"eps must lie in [0, 0.5), got {eps!r}")
        self.n = None if n is None else check_positive_int(n, "n")
        if self.n is not None and len(self.p_k) > self.n:
            raise ValueError(f"len(p_k) must be <= n={self.n}, got len(p_k)={len(self.p_k)}")
        self.m = None if m is None else check_positive_int(m, "m")
        if self.m is not None:
            if not len(self.p_k) < self.m:
                raise ValueError(f"m must be > len(p_k)={len(self.p_k)}, got m={self.m}")
            if self.n is not None and self.m >= self.n:
                raise ValueError(f"m must be < n={self.n} (or None for no preselection), got m={self.m}")
        size = self.m or self.n
        if size is not None and (self.top1_mode == "sort" or any(v != 0 for v in self.p_k[1:])):
            sorting_network(self.method, size, len(self.p_k))  # build (and cache) the network once, early

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.n is not None and isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.shape[1] != self.n:
            raise ValueError(f"logits must have n={self.n} classes, got shape {tuple(logits.shape)}")
        return topk_cross_entropy(
            logits,
            labels,
            self.p_k,
            method=self.method,
            inverse_temperature=self.inverse_temperature,
            distribution=self.distribution,
            art_lambda=self.art_lambda,
            m=self.m,
            top1_mode=self.top1_mode,
            eps=self.eps,
            reduction=self.reduction,
        )

    def extra_repr(self) -> str:
        return (
            f"p_k={list(self.p_k)}, method={self.method!r}, inverse_temperature={self.inverse_temperature}, "
            f"distribution={self.distribution!r}, m={self.m}, top1_mode={self.top1_mode!r}"
        )
