"""LapSum soft top-k (Struski et al. 2025, *LapSum — One Method to Differentiate Them All*).

Each score becomes a probability ``p_i = F((s_i - b) / alpha)`` with ``F`` the standard Laplace CDF
(``F(x) = e^x / 2`` for ``x < 0``, ``1 - e^{-x} / 2`` for ``x >= 0``) and the threshold ``b`` chosen so that
``sum_i p_i = k`` (``0 < k < N``, fractional allowed). ``alpha -> 0`` gives the hard top-k mask.

Closed form for ``b``. With the scores sorted, on the segment of ``b`` where exactly ``m`` scores are ``<= b``
the constraint reads (``t = b / alpha``)::

    1/2 e^{-t} A_m + (N - m) - 1/2 e^{t} C_m = k,   A_m = sum_{s_i <= b} e^{s_i/alpha},  C_m = sum_{s_i > b} e^{-s_i/alpha}

a quadratic in ``e^t`` solved exactly in log space (``log A_m``, ``log C_m`` by log-sum-exp, never
overflowing). Scores above ``b`` contribute at least 1/2 each, so at most ``2k`` of them exceed ``b``: only the
top ``floor(2k) + 2`` scores need sorting (``torch.topk``), the rest enter through one log-sum-exp. This is
the sort + prefix-sum algorithm of the paper restricted to the part of the sorted order that can hold ``b``:
O(N + N log k) instead of O(N log N) (by symmetry ``p(s, k) = 1 - p(-s, N - k)``, the bottom
``2(N - k) + 2`` scores are used when ``k > N/2``). The threshold is solved in float64.

Backward (exact, O(N)): with ``f_i = F'(x_i) = e^{-|x_i|} / 2`` and the implicit derivative
``db/ds_j = f_j / sum f``, the vector-Jacobian product is ``grad_s = f / alpha * (g - sum(g f) / sum(f))``;
for ``alpha``: ``grad_alpha = sum_i g_i f_i / alpha * (xbar - x_i)`` with ``xbar = sum(f x) / sum(f)``.
The weights ``f / sum f`` fall back to ``softmax(-|x|)`` where ``sum f`` underflows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from operators._checks import check_k_float, check_positive, check_scores

__all__ = ["lapsum_topk", "LapSumTopK"]

_TINY = {torch.float16: 1e-4, torch.bfloat16: 1e-30, torch.float32: 1e-30, torch.float64: 1e-290}


def _solve_threshold(scores: torch.Tensor, k: float, alpha: torch.Tensor) -> torch.Tensor:
    """Threshold ``b`` (``[B]``, float64) with ``sum_i F((s_i - b) / alpha) = k``.

    Args:
        scores: ``[B, N]`` scores (any floating dtype; the small sorted part is solved in float64).
        k: target sum, ``0 < k < N``.
        alpha: ``[B, 1]`` positive temperatures.
    """
    scores = scores.detach()
    bsz, n = scores.shape
    # k > N/2: p(s, k) = 1 - p(-s, N - k), i.e. b(s, k) = -b(-s, N - k); work on u = sign * s / alpha
    sign = 1.0 if k <= n / 2 else -1.0
    kk = k if sign > 0 else n - k
    a64 = alpha.detach().to(torch.float64)
    kp = min(n, int(math.floor(2 * kk)) + 2)  # at most floor(2k) scores can exceed b (each adds >= 1/2)
    if kp < n:
        top_raw, top_idx = torch.topk(scores, kp, dim=1, largest=sign > 0, sorted=True)  # u descending
        top = (sign * top_raw.to(torch.float64) / a64).flip(1)  # ascending t_1 <= ... <= t_kp (u units)
        ref_raw = top_raw[:, -1:]  # the smallest u among the top set, >= every other u
        # log sum_{rest} e^{u_i} = t_1 + log sum e^{u_i - t_1}; exponents <= 0, summed in float64
        z = (scores - ref_raw).div_(alpha.to(scores.dtype))
        if sign < 0:
            z.neg_()
        z.exp_().scatter_(1, top_idx, 0.0)
        l_rest = top[:, :1] + torch.log(z.sum(dim=1, keepdim=True, dtype=torch.float64))
        del z
    else:
        top = torch.sort(sign * scores.to(torch.float64) / a64, dim=1).values
        l_rest = torch.full((bsz, 1), float("-inf"), dtype=torch.float64, device=scores.device)
    # LA(j) = log(sum of e^u over rest and top[:j]), LC(j) = log(sum of e^{-u} over top[j:]), j = 0..kp
    la = torch.cat([l_rest, torch.logaddexp(l_rest, torch.logcumsumexp(top, dim=1))], dim=1)
    ninf = torch.full((bsz, 1), float("-inf"), dtype=top.dtype, device=top.device)
    lc = torch.cat([torch.logcumsumexp((-top).flip(1), dim=1).flip(1), ninf], dim=1)
    # sum at b = t_j (j = 1..kp): 1/2 e^{LA(j) - t_j} + (kp - j) - 1/2 e^{LC(j) + t_j}; decreasing in j
    j = torch.arange(1, kp + 1, device=top.device, dtype=top.dtype)
    s_at = 0.5 * torch.exp(la[:, 1:] - top) + (kp - j) - 0.5 * torch.exp(lc[:, 1:] + top)
    jstar = (s_at >= kk).sum(dim=1, keepdim=True)  # number of top-set u <= b: b in [t_jstar, t_jstar+1)
    la_j = la.gather(1, jstar)
    lc_j = lc.gather(1, jstar)
    r = kk - (kp - jstar).to(top.dtype)
    # 1/2 e^{LC} y^2 + r y - 1/2 e^{LA} = 0 for y = e^t > 0, in log space:
    # D = log(|r| + sqrt(r^2 + e^{LA + LC})); t = LA - D (r >= 0) or D - LC (r < 0)
    lr = torch.log(r.abs())
    d = torch.logaddexp(lr, 0.5 * torch.logaddexp(2 * lr, la_j + lc_j))
    t = torch.where(r >= 0, la_j - d, d - lc_j)
    return sign * t.squeeze(1) * a64.squeeze(1)


class _LapSumTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, alpha_rows, k):
        b = _solve_threshold(scores, k, alpha_rows)  # [B] float64
        a = alpha_rows.detach().to(scores.dtype)
        x = torch.sub(scores.detach(), b.to(scores.dtype).unsqueeze(1)).div_(a)
        f = x.abs().neg_().exp_().mul_(0.5)  # Laplace density at x; also the small tail of the CDF
        p = torch.where(x < 0, f, 1.0 - f)
        fa = f.div_(a)  # dp_i/ds_i at fixed b; the only vector the backward needs besides the upstream grad
        ctx.save_for_backward(x, fa, a)
        return p

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_p):
        x, fa, a = ctx.saved_tensors
        g = grad_p
        sfa = fa.sum(dim=1, keepdim=True)
        bad = (sfa * a) < _TINY.get(fa.dtype, 1e-30)
        if bool(bad.any()):  # every density underflowed: weights softmax(-|x|) for the implicit term
            w = torch.where(bad, torch.softmax(-x.abs(), dim=1), fa / sfa)
            gbar = torch.einsum("bn,bn->b", g, w).unsqueeze(1)
        else:
            w = None  # w = fa / sum(fa) (= f / sum f), not materialised
            gbar = torch.einsum("bn,bn->b", g, fa).unsqueeze(1) / sfa
        grad_s = torch.sub(g, gbar).mul_(fa) if ctx.needs_input_grad[0] else None
        grad_a = None
        if ctx.needs_input_grad[1]:
            xbar = torch.einsum("bn,bn->b", x, fa / sfa if w is None else w).unsqueeze(1)
            grad_a = (g * fa * (xbar - x)).sum(dim=1, keepdim=True)
        return grad_s, grad_a, None


def lapsum_topk(scores: torch.Tensor, k: float, *, alpha: float | torch.Tensor) -> torch.Tensor:
    """LapSum soft top-k mask (Struski et al. 2025).

    Args:
        scores: ``[B, N]`` floating, finite scores (not modified).
        k: target mask sum, real with ``0 < k < N`` (fractional allowed).
        alpha: Laplace scale (temperature) ``> 0``: a float, or a tensor of shape ``()``, ``[B]`` or ``[B, 1]``
            (per row); a tensor alpha that requires grad receives its exact gradient.

    Returns:
        ``Tensor[B, N]`` with entries in ``[0, 1]`` summing to ``k`` in every row, same dtype as ``scores``;
        order-preserving (larger score, larger mask). ``alpha -> 0`` tends to the hard top-k mask.
    """
    check_scores(scores, "scores")
    bsz, n = scores.shape
    k = check_k_float(k, n)
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() not in (1, bsz) or alpha.dim() > 2 or (alpha.dim() == 2 and alpha.shape[1] != 1):
            raise ValueError(
                f"alpha must be a float or a tensor of shape (), [B] or [B, 1] with B={bsz}, got shape {tuple(alpha.shape)}"
            )
        if not alpha.is_floating_point() or not bool(torch.isfinite(alpha).all()) or not bool((alpha > 0).all()):
            got = alpha.detach().cpu().flatten()[:8].tolist()
            raise ValueError(f"alpha must be > 0 and finite (floating point), got {got}")
        alpha_rows = alpha.to(device=scores.device).reshape(-1, 1).expand(bsz, 1)
        out = _LapSumTopK.apply(scores, alpha_rows, k)
        return out
    a = check_positive(alpha, "alpha")
    alpha_rows = torch.full((bsz, 1), a, dtype=scores.dtype, device=scores.device)
    return _LapSumTopK.apply(scores, alpha_rows, k)


class LapSumTopK(nn.Module):
    """``nn.Module`` wrapper of :func:`lapsum_topk`.

    Args:
        k: target mask sum, ``0 < k < N``.
        alpha: Laplace scale ``> 0``.
        learn_alpha: make ``log(alpha)`` a trainable parameter.

    ``forward(scores[B, N]) -> Tensor[B, N]``.
    """

    def __init__(self, k: float, alpha: float = 0.1, *, learn_alpha: bool = False) -> None:
        super().__init__()
        self.k = check_positive(k, "k")
        a = check_positive(alpha, "alpha")
        self.learn_alpha = bool(learn_alpha)
        if self.learn_alpha:
            self.log_alpha = nn.Parameter(torch.tensor(math.log(a)))
        else:
            self.alpha = a

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        alpha = self.log_alpha.exp() if self.learn_alpha else self.alpha
        return lapsum_topk(scores, self.k, alpha=alpha)

    def extra_repr(self) -> str:
        alpha = float(self.log_alpha.exp()) if self.learn_alpha else self.alpha
        return f"k={self.k}, alpha={alpha:.4g}, learn_alpha={self.learn_alpha}"
