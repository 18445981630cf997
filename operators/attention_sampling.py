"""Attention sampling: Katharopoulos & Fleuret, "Processing Megapixel Images with Deep Attention-Sampling
Models", ICML 2019.

An attention distribution ``a[B, N]`` over N patches defines the expectation ``E_a[f] = sum_n a_n f_n`` of
patch features ``f_n``. Instead of computing all N features, we sample k patches and return weights ``w`` so
that ``sum_j w_j f(x_{i_j})`` is an unbiased estimator of ``E_a[f]`` *and* its gradient with respect to both
the attention and the features is an unbiased estimator of the exact gradient. Use it as::

    idx, w = attention_sample(a, k, replace=False)     # idx: [B, k], w: [B, k] (differentiable wrt a)
    feats = embed(read_patches(idx))                    # [B, k, D], only k patches read
    pooled = (w.unsqueeze(-1) * feats).sum(1)           # [B, D] ~ E_a[f], unbiased value and gradients

The weights are built with stop-gradients (``sg``) so that the forward value is the estimator and the
backward pass is the paper's gradient estimator; the derivations are in :func:`attention_sample`.
"""

from __future__ import annotations

import torch
from torch import nn

from operators._checks import check_bool, check_k, check_positive_int, check_scores
from operators.topk import slot_modes

__all__ = ["attention_sample", "attention_entropy", "gumbel_noise", "slot_mode_sample", "AttentionSampler"]


def _check_attention(attention: object, name: str = "attention") -> torch.Tensor:
    a = check_scores(attention, name, ndim=2)
    if bool((a < 0).any()):
        raise ValueError(f"{name} must be a probability distribution (entries >= 0), got min {float(a.min())}")
    tol = 1e-8 * a.shape[1] + 1e-10 if a.dtype == torch.float64 else 1e-3
    dev = (a.sum(dim=1, dtype=torch.float64) - 1.0).abs()
    if bool((dev > tol).any()):
        b = int(dev.argmax())
        raise ValueError(
            f"{name} rows must sum to 1 (a distribution over N patches, tolerance {tol:g}), "
            f"got row {b} summing to {float(a[b].sum(dtype=torch.float64)):.8g}"
        )
    return a


def _check_generator(generator: object, device: torch.device) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator must live on the attention's device ({device}), got one on {generator.device}")


def gumbel_noise(
    shape: torch.Size | tuple[int, ...],
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log U)``, ``U ~ Uniform(0, 1)`` clamped to ``[tiny, 1 - eps]`` (finite).

    Adding it to log-probabilities (or ``logits / T``) and taking the top k draws k indices without replacement
    from the softmax (Gumbel-top-k).
    """
    u = torch.rand(shape, generator=generator, device=device, dtype=dtype)
    finfo = torch.finfo(dtype)
    return -torch.log(-torch.log(u.clamp(min=finfo.tiny, max=1.0 - finfo.eps)))


def _safe_ratio(a: torch.Tensor) -> torch.Tensor:
    """``a / sg(a)``: value 1 (0 where a == 0), gradient ``1 / a`` (0 where a == 0)."""
    a_det = a.detach()
    pos = a_det > 0
    return torch.where(pos, a / torch.where(pos, a_det, torch.ones_like(a_det)), torch.zeros_like(a))


def attention_sample(
    attention: torch.Tensor,
    k: int,
    *,
    replace: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Sample k patches from the attention distribution and return the unbiased-estimator weights.

    Katharopoulos & Fleuret 2019 (with replacement: the paper's estimator; without replacement: the
    paper's sequential estimator, as in the authors' ``ats`` code). For any features ``f[B, N, ...]`` the
    returned pair gives

        ``F_hat = sum_j w[:, j] * f[b, idx[:, j]]``   with   ``E[F_hat] = sum_n a_n f_n``  (value),
        ``E[dF_hat/df_n] = a_n``  and  ``E[dF_hat/da_n] = f_n``  (gradients, per row b).

    **With replacement** (``replace=True``): ``i_1..i_k`` i.i.d. from ``a`` (multinomial),
    ``F_hat = 1/k sum_j f_{i_j}``. Gradient wrt ``a`` by the paper's trick: ``w_j = a_{i_j} / sg(a_{i_j}) / k``
    (forward ``1/k``), so ``dF_hat/da_n = 1/k sum_j [i_j = n] f_n / a_n``, whose expectation is ``f_n``.

    **Without replacement** (``replace=False``, needs ``k <= N``): ``i_1..i_k`` drawn sequentially without
    replacement (Gumbel-top-k: the order of ``argsort(log a + Gumbel)`` has the law of sequential sampling,
    Kool et al. 2019). With ``c_j = sum_{l<j} a_{i_l}`` the *exclusive* cumulative sum of the sampled
    probabilities and ``R_j = 1 - c_j`` the mass still available at draw j,

        ``Y_j = sum_{l<j} a_{i_l} f_{i_l} + R_j f_{i_j}``  and  ``F_hat = 1/k sum_j Y_j``.

    ``E[Y_j | i_<j] = sum_{l<j} a_{i_l} f_{i_l} + R_j sum_{n not drawn} (a_n / R_j) f_n = E_a[f]``, so every
    ``Y_j`` is unbiased. (Using the *inclusive* sum ``1 - c_j - a_{i_j}``, as a public PyTorch port does,
    biases the value and the feature gradient.) Collecting the coefficient of each ``f_{i_j}``:

        ``w_j = ( R_j + (k - j) a_{i_j} ) / k``   (j = 1..k)   — the forward weights.

    Gradient wrt ``a``: per draw, ``grad E[Y_j | i_<j] = E[grad Y_j + (Y_j - b) grad log p(i_j | i_<j)]``
    with ``p(i_j | i_<j) = a_{i_j} / R_j`` and the baseline ``b = sum_{l<j} a_{i_l} f_{i_l}`` (constant given
    ``i_<j``). Written out, this estimator is
    ``g_j = sum_{l<j} f_{i_l} e_{i_l} + (R_j / a_{i_j}) f_{i_j} e_{i_j}`` with expectation exactly ``f``
    (and the score term of the earlier draws has zero mean since ``E[Y_j | i_<j]`` does not depend on them).
    It is the gradient of the surrogate ``Y_j = sum_{l<j} a_{i_l} f_{i_l} + sg(R_j) (a_{i_j}/sg(a_{i_j})) f_{i_j}``,
    hence the differentiable weights

        ``w_j = ( sg(R_j) a_{i_j} / sg(a_{i_j}) + (k - j) a_{i_j} ) / k``.

    Permuting ``(indices, weights)`` jointly (e.g. sorting by patch index) leaves the estimator unchanged.

    Args:
        attention: ``[B, N]`` floating tensor, rows are distributions (entries >= 0, rows sum to 1 within
            1e-3 in float32 / ~1e-8·N in float64). Zero entries are never drawn with replacement; without
            replacement they are drawn only after all positive ones (then with weight ~0 and zero gradient).
        k: number of samples, ``k >= 1`` (and ``k <= N`` without replacement).
        replace: sample with (``True``) or without (``False``) replacement. Keyword-only, no default.
        generator: optional ``torch.Generator`` on the attention's device, for reproducible draws.

    Returns:
        ``(indices, weights)``: ``indices`` LongTensor ``[B, k]`` in draw order, ``weights`` ``[B, k]`` of the
        attention's dtype, differentiable wrt ``attention`` as described above.

    Raises:
        TypeError: attention not a tensor, replace not a bool, generator of the wrong type.
        ValueError: wrong rank, non-finite or negative entries, rows not summing to 1, bad k.
    """
    replace = check_bool(replace, "replace")
    a = _check_attention(attention)
    n = a.shape[1]
    k = check_positive_int(k, "k") if replace else check_k(k, n, "k")
    _check_generator(generator, a.device)

    if replace:
        with torch.no_grad():
            idx = torch.multinomial(
                a.detach().float() if a.dtype in (torch.float16, torch.bfloat16) else a.detach(),
                k,
                replacement=True,
                generator=generator,
            )
        a_s = a.gather(1, idx)
        return idx, _safe_ratio(a_s) / k

    with torch.no_grad():
        u_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
        gumbel = gumbel_noise(a.shape, generator=generator, device=a.device, dtype=u_dtype)
        keys = torch.log(a.detach().to(u_dtype)) + gumbel  # log 0 = -inf: zero-probability patches come last
        idx = torch.topk(keys, k, dim=1, largest=True, sorted=True).indices
    a_s = a.gather(1, idx)  # [B, k], differentiable
    a_det = a_s.detach()
    remaining = (1.0 - (torch.cumsum(a_det, dim=1) - a_det)).clamp_min(0.0)  # R_j = 1 - exclusive cumsum
    later = torch.arange(k - 1, -1, -1, device=a.device, dtype=a.dtype)  # k - j for j = 1..k
    weights = (remaining * _safe_ratio(a_s) + later * a_s) / k
    return idx, weights


def slot_mode_sample(
    logits: torch.Tensor,
    k: int,
    *,
    num_samples: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """K cells drawn as the slot modes of ``num_samples`` Gumbel-top-k draws from ``softmax(logits)``.

    Each draw takes K cells without replacement from the attention ``softmax(logits)`` (Gumbel-top-k) and lists
    them in increasing cell index (the slots of Cordonnier et al.'s perturbed top-k indicators); slot ``j`` of the
    result is the cell found most often in slot ``j`` over the draws (ties: ``torch.mode``'s pick, the smallest
    index on the CPU). This is the bag the perturbed top-k with ``max_support = 1`` reads, with the draws of
    attention sampling: the cells the attention is sure of are in every draw and keep their slots, filler cells
    that change from draw to draw seldom win one, so each confident cell gets about one slot and the bag is not
    one object drawn K times (as a with-replacement draw at a low temperature) nor K - 3 filler cells (as one
    draw without replacement).
    The indices are not differentiable; pair them with weights that carry the attention's gradient. Memory: the
    ``num_samples x B x N`` noise, as the perturbed top-k's.

    Args:
        logits: ``[B, N]`` float, finite: the attention's logits (e.g. ``scores / T``).
        k: cells per bag, ``1 <= k <= N``.
        num_samples: Gumbel-top-k draws, ``>= 1`` (1: one draw without replacement, in index order).
        generator: optional ``torch.Generator`` for the Gumbel noise.

    Returns:
        ``[B, k]`` long cell indices (a cell may fill several slots).
    """
    logits = check_scores(logits, "logits", ndim=2)
    b, n = logits.shape
    k = check_k(k, n, "k")
    num_samples = check_positive_int(num_samples, "num_samples")
    _check_generator(generator, logits.device)
    g = gumbel_noise((num_samples, b, n), generator=generator, device=logits.device, dtype=logits.dtype)
    draws = torch.topk(logits.detach().unsqueeze(0) + g, k, dim=-1).indices  # [M, B, k]
    return slot_modes(draws.transpose(0, 1))  # [B, k]: the most frequent cell per slot


def attention_entropy(attention: torch.Tensor) -> torch.Tensor:
    r"""Entropy ``H(a) = -sum_n a_n log a_n`` of each attention row (with ``0 log 0 = 0``).

    Katharopoulos & Fleuret 2019: the entropy regulariser that keeps the attention from collapsing onto a
    few patches (which would make the sampled estimator's gradient high-variance). Maximise it, i.e. add
    ``- lambda * attention_entropy(a).mean()`` to the loss.

    Args:
        attention: ``[B, N]`` rows that are distributions (validated as in :func:`attention_sample`).

    Returns:
        ``[B]`` entropies in nats, differentiable (finite gradient ``-(log a_n + 1)``; 0 at ``a_n = 0``).
    """
    a = _check_attention(attention)
    pos = a > 0
    safe = torch.where(pos, a, torch.ones_like(a))
    return -(torch.where(pos, a * torch.log(safe), torch.zeros_like(a))).sum(dim=1)


class AttentionSampler(nn.Module):
    """Thin module around :func:`attention_sample` with fixed ``k`` and ``replace``.

    Args:
        k: number of patches to sample per row.
        replace: with (``True``) or without (``False``) replacement.

    ``forward(attention[B, N], generator=None) -> (indices[B, k], weights[B, k])``.
    """

    def __init__(self, k: int, *, replace: bool = False) -> None:
        super().__init__()
        self.k = check_positive_int(k, "k")
        self.replace = check_bool(replace, "replace")

    def forward(
        self, attention: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return attention_sample(attention, self.k, replace=self.replace, generator=generator)

    def extra_repr(self) -> str:
        return f"k={self.k}, replace={self.replace}"
