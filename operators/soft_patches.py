"""Soft patches: the weighted combination of patches that soft top-k indicators describe, on a capped support.

Cordonnier et al. 2021 feed slot ``k`` of the feature network with ``sum_n Y[k, n] * patch_n``, where
``Y[k, :]`` is the (perturbed) top-k indicator of slot ``k`` (the mean over noise samples of the index-sorted
one-hot indicators: a probability vector over the N cells). Reading all N patches is impossible at slide
scale, so we keep, per slot, the ``S = max_support`` cells with the largest indicator values and renormalise:

    w[k, s] = Y[k, n_s] / sum_{s'} Y[k, n_s'],        patch_k = sum_s w[k, s] * patch_{n_s}

Memory is O(K * S) patches, never O(N).

Bias of the cap: when the indicator mass of a slot is spread over more than S cells, the dropped cells'
contribution is lost and the kept ones are scaled up by ``1 / kept_mass``; the forward is then the
conditional mean given the top-S support, not ``E[patch]``, and the gradient w.r.t. the dropped indicator
entries is zero. The renormalisation adds a gradient component constant across the support of a slot, which
the perturbed top-k backward annihilates (its Jacobian maps constants along N to zero, every slot summing to
one), so with S >= the true support the result is exactly Cordonnier's. The bias grows with sigma (the
indicators spread) and shrinks as sigma decays; :func:`cap_support` returns the kept mass per slot so the
trainer can log it. Entries of the support with zero weight are pointed at the slot's first cell so they
cost no read.
"""

from __future__ import annotations

import torch

__all__ = ["cap_support", "combine_patches", "unique_cells"]


def cap_support(indicators: torch.Tensor, max_support: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot, the ``S = min(max_support, N)`` largest indicator entries, renormalised to sum to one.

    Args:
        indicators: ``[B, K, N]`` non-negative, each slot summing to about one (``perturbed_topk`` output).
        max_support: S, the cap (>= 1).

    Returns:
        ``(indices[B, K, S] long, weights[B, K, S], kept_mass[B, K])``: cell indices sorted by decreasing
        weight (zero-weight entries repeat the slot's first index), differentiable weights summing to one per
        slot, and the indicator mass kept before renormalisation (detached).
    """
    if not isinstance(indicators, torch.Tensor) or indicators.dim() != 3:
        raise ValueError(f"indicators must be a tensor [B, K, N], got {getattr(indicators, 'shape', type(indicators))}")
    if isinstance(max_support, bool) or not isinstance(max_support, int) or max_support < 1:
        raise ValueError(f"max_support must be an int >= 1, got {max_support!r}")
    s = min(max_support, indicators.shape[-1])
    vals, idx = torch.topk(indicators, s, dim=-1)  # sorted, descending
    mass = vals.sum(-1, keepdim=True)
    empty = mass <= 0
    if bool(empty.any()):  # a slot with no mass (cannot happen for a valid indicator): fall back to its top cell
        onehot = torch.zeros_like(vals)
        onehot[..., 0] = 1.0
        vals = torch.where(empty, onehot, vals)
        mass = torch.where(empty, torch.ones_like(mass), mass)
    weights = vals / mass
    idx = torch.where(vals > 0, idx, idx[..., :1])
    return idx, weights, mass.squeeze(-1).detach()


def unique_cells(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct cells of ``indices`` (any shape) and where each entry points among them.

    Returns:
        ``(cells[U] sorted, inverse)`` with ``cells[inverse] == indices``.
    """
    cells, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    return cells, inverse


def combine_patches(patches: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[b, k] = sum_s weights[b, k, s] * patches[indices[b, k, s]]``.

    Args:
        patches: ``[U, C, p, p]`` float, each distinct cell once.
        indices: ``[B, K, S]`` long into ``patches``.
        weights: ``[B, K, S]`` float (differentiable).

    Returns:
        ``[B, K, C, p, p]``; gradients flow to ``weights`` and ``patches``.
    """
    if patches.dim() != 4:
        raise ValueError(f"patches must be [U, C, p, p], got shape {tuple(patches.shape)}")
    if indices.dim() != 3 or tuple(weights.shape) != tuple(indices.shape):
        raise ValueError(
            f"indices and weights must both be [B, K, S], got {tuple(indices.shape)} and {tuple(weights.shape)}"
        )
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= patches.shape[0]):
        raise ValueError(
            f"indices must lie in [0, {patches.shape[0]}), got range [{int(indices.min())}, {int(indices.max())}]"
        )
    if indices.shape[-1] == 1:
        return patches[indices[..., 0]] * weights[..., 0, None, None, None].to(patches.dtype)
    gathered = patches[indices]  # [B, K, S, C, p, p]: O(K * S) patches
    return torch.einsum("bks,bkschw->bkchw", weights.to(patches.dtype), gathered)
