"""SOFT top-k by entropic optimal transport (Xie et al. 2020, *Differentiable Top-k with Optimal Transport*).

The N scores ``s_i`` (source, mass ``1/N`` each) are transported to two anchors ``y_0 = 0`` and ``y_1 = 1``
(target masses ``(N-k)/N`` and ``k/N``) with cost ``C_ij = (s_i - y_j)^2`` and entropic regularisation
``epsilon``. The soft mask is ``A_i = N * Gamma*_{i1}``, the share of score ``i`` sent to the upper anchor, so
the largest k scores are selected. ``A`` lies in ``[0, 1]`` and sums to ``k``.

With two anchors the entropic plan has a closed form up to one scalar: after the row normalisation of a
Sinkhorn step, ``Gamma_{i1} = sigmoid(z_i) / N`` with ``z_i = (2 s_i - tau) / epsilon`` (``C_i1 - C_i0 = 1 - 2 s_i``;
the constant folds into ``tau``), and the column normalisation is the update
``tau <- tau + epsilon * (log S/(N-S) - log k/(N-k))`` with ``S = sum_i sigmoid(z_i)``. So every Sinkhorn
iteration of the paper is O(N) here, with nothing of size ``N x 2`` kept, and the fixed point is the
``tau`` with ``S(tau) = k``. ``solver="sinkhorn"`` runs exactly those iterations (the paper's algorithm, log
domain); ``solver="newton"`` (default) reaches the same fixed point by a bracketed Newton method on the same
log-odds residual, which needs a handful of iterations where Sinkhorn needs O(1/epsilon) of them.

Gradient: implicit differentiation of the fixed point (O(B*N) memory, no unrolling). With
``h_i = A_i (1 - A_i)`` and ``d tau / d s_j = 2 h_j / sum h``: ``grad_s = 2/epsilon * h * (g - sum(g h) / sum h)``.
It is the exact gradient of the converged operator (tests check it against finite differences and against
autograd through an unrolled dense Sinkhorn).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn
from torch.nn import functional as F

from operators._checks import check_k_float, check_positive, check_positive_int, check_scores

__all__ = ["sinkhorn_topk", "SinkhornTopK"]

logger = logging.getLogger(__name__)

_SOLVERS = ("newton", "sinkhorn")


def _log_odds(z: torch.Tensor):
    """log S, log(N - S) and log sum h for ``S = sum sigmoid(z)``, ``h = sigmoid(z) sigmoid(-z)`` (per row).

    ``z`` is overwritten. Underflow of every term gives ``-inf`` (handled by the bracketing in the solver).
    """
    p = torch.sigmoid(z)
    q = torch.sigmoid(z.neg_())
    s = p.sum(dim=1)
    ns = q.sum(dim=1)
    h = torch.einsum("bn,bn->b", p, q)
    return torch.log(s), torch.log(ns), torch.log(h)


def _solve_tau(s2: torch.Tensor, k: float, epsilon: float, max_iter: int, tol: float, solver: str):
    """Fixed point ``tau`` ([B], float64) of the Sinkhorn iteration; ``s2 = 2 * scores`` in float64."""
    bsz, n = s2.shape
    target = math.log(k) - math.log(n - k)
    # bracket: S(lo) >= k >= S(hi) (S decreasing in tau)
    lo = s2.min(dim=1).values - epsilon * target
    hi = s2.max(dim=1).values - epsilon * target
    # start at the hard threshold between the k-th and (k+1)-th largest (exact in the epsilon -> 0 limit)
    kk = min(n - 1, max(1, int(round(k))))
    top = torch.topk(s2, kk + 1, dim=1).values
    tau = 0.5 * (top[:, kk - 1] + top[:, kk])
    tau = torch.minimum(torch.maximum(tau, lo), hi)
    done = torch.zeros(bsz, dtype=torch.bool, device=s2.device)
    it = 0
    s2e = s2 / epsilon
    for it in range(1, max_iter + 1):  # noqa: B007 - `it` is read after the loop (iterations used)
        z = torch.sub(s2e, (tau / epsilon).unsqueeze(1))
        log_s, log_ns, log_h = _log_odds(z)
        phi = log_s - log_ns - target  # > 0: too much mass on the upper anchor -> raise tau
        done = phi.abs() <= tol
        if bool(done.all()):
            break
        if solver == "sinkhorn":
            tau = tau + epsilon * phi
            continue
        lo = torch.where(phi > 0, tau, lo)
        hi = torch.where(phi > 0, hi, tau)
        # d phi / d tau = -(sum h / epsilon) * (1/S + 1/(N - S))
        log_dphi = log_h - math.log(epsilon) + torch.logaddexp(-log_s, -log_ns)
        step = tau + phi * torch.exp(-log_dphi)
        bad = ~torch.isfinite(step) | (step <= lo) | (step >= hi)
        tau = torch.where(done, tau, torch.where(bad, 0.5 * (lo + hi), step))
    if not bool(done.all()):
        logger.warning(
            "sinkhorn_topk: %d of %d rows not converged to tol=%g after max_iter=%d (%s); raise max_iter",
            int((~done).sum()),
            bsz,
            tol,
            max_iter,
            solver,
        )
    logger.debug("sinkhorn_topk: %s solver, %d iterations", solver, it)
    return tau, it


class _SinkhornTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, k, epsilon, max_iter, tol, solver):
        s2 = scores.detach().to(torch.float64).mul_(2.0) if scores.dtype != torch.float64 else scores.detach() * 2.0
        tau, _ = _solve_tau(s2, k, epsilon, max_iter, tol, solver)
        z = s2.sub_(tau.unsqueeze(1)).div_(epsilon)
        ctx.epsilon = epsilon
        ctx.save_for_backward(z)
        return torch.sigmoid(z).to(scores.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_a):
        (z,) = ctx.saved_tensors
        g = grad_a.to(torch.float64)
        h = torch.sigmoid(z).mul_(torch.sigmoid(-z))
        sh = h.sum(dim=1, keepdim=True)
        bad = sh < 1e-290
        if bool(bad.any()):  # every h underflowed: weights softmax(log h), computed in log space
            w = torch.where(bad, torch.softmax(F.logsigmoid(z) + F.logsigmoid(-z), dim=1), h / sh)
            gbar = (g * w).sum(dim=1, keepdim=True)
        else:
            gbar = torch.einsum("bn,bn->b", g, h).unsqueeze(1) / sh
        grad = torch.sub(g, gbar).mul_(h).mul_(2.0 / ctx.epsilon)
        return grad.to(grad_a.dtype), None, None, None, None, None


def sinkhorn_topk(
    scores: torch.Tensor,
    k: float,
    *,
    epsilon: float,
    max_iter: int = 200,
    tol: float = 1e-9,
    solver: str = "newton",
) -> torch.Tensor:
    """SOFT top-k soft mask (Xie et al. 2020): entropic OT of the scores onto anchors 0 and 1.

    Args:
        scores: ``[B, N]`` floating, finite scores, used as given (anchors at 0 and 1 as in the paper; the
            mask depends only on differences of scores, so shifting every score changes nothing).
        k: mass sent to the upper anchor, ``0 < k < N`` (the paper's K; fractional allowed).
        epsilon: entropic regularisation ``> 0``; ``epsilon -> 0`` gives the hard top-k mask.
        max_iter: iterations of the solver (Newton steps or Sinkhorn iterations), ``>= 1``.
        tol: stop when ``|log S/(N-S) - log k/(N-k)| <= tol`` in every row (``S`` = mask sum).
        solver: ``"newton"`` (default, few iterations) or ``"sinkhorn"`` (the paper's fixed-point iteration;
            needs O(1/epsilon) iterations). Both reach the same fixed point.

    Returns:
        ``Tensor[B, N]`` soft mask in ``[0, 1]`` summing to ``k`` per row (to ``tol``), dtype of ``scores``.
        The threshold is solved in float64. Memory O(B*N).
    """
    check_scores(scores, "scores")
    n = scores.shape[1]
    k = check_k_float(k, n)
    epsilon = check_positive(epsilon, "epsilon")
    max_iter = check_positive_int(max_iter, "max_iter")
    tol = check_positive(tol, "tol")
    if solver not in _SOLVERS:
        raise ValueError(f"solver must be one of {_SOLVERS}, got {solver!r}")
    return _SinkhornTopK.apply(scores, k, epsilon, max_iter, tol, solver)


class SinkhornTopK(nn.Module):
    """``nn.Module`` wrapper of :func:`sinkhorn_topk`: ``forward(scores[B, N]) -> Tensor[B, N]``."""

    def __init__(
        self, k: float, epsilon: float, max_iter: int = 200, *, tol: float = 1e-9, solver: str = "newton"
    ) -> None:
        super().__init__()
        self.k = check_positive(k, "k")
        self.epsilon = check_positive(epsilon, "epsilon")
        self.max_iter = check_positive_int(max_iter, "max_iter")
        self.tol = check_positive(tol, "tol")
        if solver not in _SOLVERS:
            raise ValueError(f"solver must be one of {_SOLVERS}, got {solver!r}")
        self.solver = solver

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return sinkhorn_topk(
            scores, self.k, epsilon=self.epsilon, max_iter=self.max_iter, tol=self.tol, solver=self.solver
        )

    def extra_repr(self) -> str:
        return f"k={self.k}, epsilon={self.epsilon}, max_iter={self.max_iter}, solver={self.solver!r}"
