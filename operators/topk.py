"""Hard top-k and the perturbed (differentiable) top-k of Cordonnier et al. 2021.

``perturbed_topk`` is the perturbed-optimizer top-k of *Differentiable Patch Selection for Image Recognition*
(Cordonnier, Mahendran, Dosovitskiy, Weissenborn, Uszkoreit, Unterthiner, CVPR 2021), built on
*Learning with Differentiable Perturbed Optimizers* (Berthet et al., NeurIPS 2020).

Forward (``Y_s`` is the index-sorted one-hot top-k indicator of the perturbed scores, shape ``[B, k, N]``)::

    Y[b, :, :] = 1/n * sum_s Y_s[b],     Y_s = onehot(sort(topk(scores[b] + sigma * Z[b, s], k)))

Backward, the full vector-Jacobian product of Berthet's estimator of the Jacobian::

    grad[b, j] = 1/(n*sigma) * sum_s Z[b, s, j] * c[b, s],    c[b, s] = sum_{k,d} G[b, k, d] * Y_s[b, k, d]

The paper's appendix code (``einsum("bnkd,bnd->bkd")`` then ``einsum("bkd,bkd->bd")``) keeps only the
``j == d`` terms, which is biased: e.g. its gradient does not sum to zero over patches. Here nothing of size
``n x k x N`` is ever built: the forward accumulates counts with ``scatter_add_`` and the backward gathers
``G`` at the sampled indices (``c``, shape ``[B, n]``) and contracts ``Z^T c``. The noise is stored when small
(at most ``_STORE_NOISE_MAX_BYTES``) and otherwise regenerated in the backward from the saved generator
state, chunk by chunk (``_NOISE_CHUNK_ELEMENTS``), so peak memory is O(B*k*N + chunk) rather than O(B*n*N).

Noise convention: when ``B*n*N <= _NOISE_CHUNK_ELEMENTS`` the noise is exactly
``torch.randn((B, n, N), generator=generator, dtype=scores.dtype, device=scores.device)``; above that it is
drawn as consecutive chunks ``torch.randn((B, c, N), ...)`` along the sample axis. Pass ``noise=`` to use
your own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from operators._checks import check_bool, check_k, check_nonneg, check_positive_int, check_scores, check_tensor

__all__ = ["hard_topk", "mask_sample", "perturbed_slot_modes", "perturbed_topk", "slot_modes", "PerturbedTopK"]

#: Largest number of noise elements (B * samples * N) drawn at once: above it the samples are drawn and
#: processed in chunks of at most this many elements (the noise convention of the module docstring).
_NOISE_CHUNK_ELEMENTS = 1 << 22
#: The noise is kept for the backward when it takes at most this many bytes, and regenerated chunk by chunk from
#: the saved generator state otherwise (regenerating costs a second round of ``randn``, the dominant cost).
_STORE_NOISE_MAX_BYTES = 256 << 20


def hard_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores of each row, sorted by index (position).

    Args:
        scores: ``[B, N]`` tensor (any real dtype, finite).
        k: number of indices per row, ``1 <= k <= N``.

    Returns:
        ``LongTensor[B, k]``, each row increasing. Ties are broken as ``torch.topk`` breaks them.
    """
    check_scores(scores, "scores", floating=False)
    k = check_k(k, scores.shape[1])
    return torch.topk(scores, k, dim=-1, sorted=False).indices.sort(dim=-1).values


def mask_sample(mask: torch.Tensor, k: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw ``k`` distinct indices per row with inclusion probabilities equal to a soft top-k mask.

    Systematic sampling in a random order (Madow 1949): the entries are put in a random order, laid end to end
    as intervals of length ``mask[i]`` on ``[0, k)``, and the ``k`` points ``u, u + 1, ..., u + k - 1``
    (``u ~ U[0, 1)``) pick the entries whose intervals they fall in. Every entry is drawn with probability exactly
    ``mask[i]`` and at most once (its interval is at most 1 long), and every draw has exactly ``k`` entries: a
    cell the mask holds at 1 is always drawn, the mass a soft top-k spreads over the cells near its threshold
    is shared out among them at random. (A soft top-k mask, e.g. :func:`operators.sinkhorn.sinkhorn_topk` or
    :func:`operators.lapsum.lapsum_topk`, sums to ``k`` up to its solver's tolerance; the row is rescaled to sum
    to ``k`` exactly, entries clipped to ``[0, 1]`` with the excess shared among the others.)

    Args:
        mask: ``[B, N]`` real, entries in ``[0, 1]`` (up to rounding), each row summing to about ``k``.
        k: number of indices per row, ``1 <= k <= N``.
        generator: RNG for the order and the offset ``u`` (on the mask's device).

    Returns:
        ``LongTensor[B, k]``, each row increasing (distinct indices).
    """
    check_scores(mask, "mask", floating=True)
    k = check_k(k, mask.shape[1])
    m = mask.detach().to(torch.float64).clamp(0.0, 1.0)
    total = m.sum(1, keepdim=True)
    if bool((total <= 0).any()):
        raise ValueError("mask must have a positive sum in every row, got a row of zeros")
    if bool(((total - k).abs() > 0.01 * k).any()):
        raise ValueError(f"mask rows must sum to about k={k} (a soft top-k mask), got sums {total.flatten().tolist()}")
    for _ in range(m.shape[1]):  # rescale to sum k; entries pushed to >= 1 become certain and leave the rescaling
        full = m >= 1.0
        rest = (m * ~full).sum(1, keepdim=True)
        need = k - full.sum(1, keepdim=True).to(m.dtype)
        m = torch.where(full, torch.ones_like(m), m * (need / rest.clamp_min(1e-300)))
        if not bool((m > 1.0).any()):
            break
    m = m.clamp(0.0, 1.0)
    b, n = m.shape
    order = torch.rand((b, n), generator=generator, device=m.device, dtype=torch.float64).argsort(dim=1)
    c = m.gather(1, order).cumsum(1)
    c[:, -1] = float(k)  # exact end, whatever the rounding
    u = torch.rand((b, 1), generator=generator, device=m.device, dtype=torch.float64)
    points = u + torch.arange(k, device=m.device, dtype=torch.float64)[None]
    pos = torch.searchsorted(c, points, right=True).clamp_max(n - 1)
    return order.gather(1, pos).sort(dim=1).values


def _check_generator_and_noise(
    scores: torch.Tensor, num_samples: int, generator: torch.Generator | None, noise: torch.Tensor | None
) -> None:
    """The perturbed top-k's ``generator`` (a ``torch.Generator`` on the scores' device, or None) and ``noise``
    (None or ``[B, num_samples, N]``) arguments."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and torch.device(generator.device).type != scores.device.type:
        raise ValueError(f"generator must be on scores.device ({scores.device}), got a generator on {generator.device}")
    if noise is not None:
        check_tensor(noise, "noise")
        want = (scores.shape[0], num_samples, scores.shape[1])
        if tuple(noise.shape) != want:
            raise ValueError(f"noise must have shape [B, num_samples, N] = {want}, got {tuple(noise.shape)}")


def slot_modes(draws: torch.Tensor) -> torch.Tensor:
    """The slot modes of several top-k draws: ``draws[B, M, k]`` (each draw's k distinct cells, any order) ->
    ``[B, k]`` long.

    Each draw lists its cells in increasing index (the slots of the perturbed top-k's indicators); slot ``j`` of
    the result is the cell found most often in slot ``j`` over the ``M`` draws (ties: ``torch.mode``'s pick, the
    smallest index on the CPU). A cell may fill several slots.
    """
    if not isinstance(draws, torch.Tensor) or draws.dim() != 3 or draws.dtype != torch.long:
        raise ValueError(f"draws must be a long tensor [B, M, k], got {getattr(draws, 'shape', type(draws))}")
    return torch.mode(torch.sort(draws, dim=-1).values, dim=1).values


def perturbed_slot_modes(
    scores: torch.Tensor,
    k: int,
    *,
    num_samples: int,
    sigma: float,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cells the perturbed top-k reads with one cell per slot: per slot, its most frequent cell.

    With the noise of :func:`perturbed_topk`, slot ``j`` of the result is the argmax over cells of
    ``perturbed_topk(scores, k, ...)[:, j, :]`` (the slot's empirical distribution; ties: the smallest index on
    the CPU), computed without the ``[B, k, N]`` indicators: the top-k of each perturbed row
    ``scores + sigma * Z[:, s]`` in increasing index, then :func:`slot_modes`. The cells the scores rank far
    above the rest are in every sample and keep their slots; cells near the threshold change from sample to
    sample and seldom win one, so the confident cells fill the bag (some twice) and the filler is mostly left
    out. Not differentiable (indices).

    Args:
        scores: ``[B, N]`` finite floating scores.
        k: cells per row, ``1 <= k <= N``.
        num_samples: perturbations ``n >= 1``.
        sigma: noise standard deviation ``>= 0`` (0: every sample is the hard top-k).
        generator: RNG for the noise (``perturbed_topk``'s noise convention, chunk by chunk).
        noise: optional ``[B, num_samples, N]`` standard-normal noise to use instead of drawing it.

    Returns:
        ``LongTensor[B, k]``. Memory: one noise chunk (``_NOISE_CHUNK_ELEMENTS``) plus ``B x n x k`` indices.
    """
    check_scores(scores, "scores")
    bsz, n = scores.shape
    k = check_k(k, n)
    num_samples = check_positive_int(num_samples, "num_samples")
    sigma = check_nonneg(sigma, "sigma")
    _check_generator_and_noise(scores, num_samples, generator, noise)
    with torch.no_grad():
        draws = [idx for _, _, _, idx in _noisy_topk_chunks(scores.detach(), k, num_samples, sigma, generator, noise)]
    return slot_modes(torch.cat(draws, dim=1))


def _sample_chunks(batch: int, num_samples: int, n: int) -> list[tuple[int, int]]:
    per = max(1, _NOISE_CHUNK_ELEMENTS // max(1, batch * n))
    return [(s, min(num_samples, s + per)) for s in range(0, num_samples, per)]


def _noisy_topk_chunks(
    scores: torch.Tensor,
    k: int,
    num_samples: int,
    sigma: float,
    generator: torch.Generator | None,
    noise: torch.Tensor | None,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """The perturbed top-k's draws, one noise chunk at a time (arguments already validated; ``scores`` detached).

    Yields ``(lo, hi, z, idx)``: samples ``lo:hi``, their standard-normal noise ``z[B, hi - lo, N]`` in the
    scores' dtype (``noise`` as given, in one chunk; else drawn from ``generator`` chunk by chunk,
    ``_sample_chunks``: the noise convention) and ``idx[B, hi - lo, k]``, the top-k cells of each perturbed row
    ``scores + sigma * z`` in increasing index. One perturbed-scores buffer serves every chunk of one size.
    """
    bsz, n = scores.shape
    chunks = [(0, num_samples)] if noise is not None else _sample_chunks(bsz, num_samples, n)
    buf = None
    for lo, hi in chunks:
        if noise is not None:
            z = noise.to(dtype=scores.dtype, device=scores.device)
        else:
            z = torch.randn((bsz, hi - lo, n), generator=generator, dtype=scores.dtype, device=scores.device)
        if buf is None or buf.shape != z.shape:
            buf = torch.empty_like(z)
        torch.add(scores.unsqueeze(1), z, alpha=sigma, out=buf)  # perturbed scores
        yield lo, hi, z, torch.topk(buf, k, dim=-1, sorted=False).indices.sort(dim=-1).values


def _clone_generator(state: torch.Tensor, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.set_state(state)
    return g


class _PerturbedTopK(torch.autograd.Function):
    """Autograd function behind :func:`perturbed_topk` (arguments already validated)."""

    @staticmethod
    def forward(ctx, scores, k, num_samples, sigma, generator, noise, control_variate):
        bsz, n = scores.shape
        out = torch.zeros((bsz, k, n), dtype=scores.dtype, device=scores.device)
        ctx.sigma, ctx.num_samples, ctx.control_variate = sigma, num_samples, control_variate
        ctx.noise_dtype = scores.dtype
        ctx.shape = (bsz, n)
        if sigma == 0.0:
            # every sample equals the hard top-k: exact one-hot, zero gradient
            idx = torch.topk(scores, k, dim=-1, sorted=False).indices.sort(dim=-1).values
            out.scatter_(2, idx.unsqueeze(-1), 1.0)
            ctx.mode = "zero"
            return out

        nbytes = bsz * num_samples * n * scores.element_size()
        ctx.mode = "stored" if noise is not None or nbytes <= _STORE_NOISE_MAX_BYTES else "regen"
        if ctx.mode == "regen":
            ctx.gen_state = generator.get_state()
            ctx.gen_device = generator.device
        idx_all = torch.empty((bsz, num_samples, k), dtype=torch.long, device=scores.device)
        stored, chunks = [], []
        for lo, hi, z, idx in _noisy_topk_chunks(scores.detach(), k, num_samples, sigma, generator, noise):
            idx_all[:, lo:hi] = idx  # [B, c, k]
            chunks.append((lo, hi))
            if ctx.mode == "stored":
                stored.append(z)
        ctx.chunks = chunks
        idx_t = idx_all.transpose(1, 2)  # [B, k, n]
        out.scatter_add_(2, idx_t, torch.ones((1, 1, 1), dtype=out.dtype, device=out.device).expand(idx_t.shape))
        out.div_(num_samples)
        ctx.save_for_backward(idx_all, *stored)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.mode == "zero":
            return torch.zeros(ctx.shape, dtype=grad_out.dtype, device=grad_out.device), *([None] * 6)
        bsz, n = ctx.shape
        num_samples, sigma = ctx.num_samples, ctx.sigma
        idx_all, *stored = ctx.saved_tensors
        # c[b, s] = sum_{k,d} G[b,k,d] Y_s[b,k,d] = sum_k G[b, k, idx[b, s, k]]   (a gather, no one-hot)
        c = grad_out.gather(2, idx_all.transpose(1, 2)).sum(dim=1)  # [B, n]
        if ctx.control_variate and num_samples > 1:
            # leave-one-out baseline: c_s - mean_{t != s} c_t = n/(n-1) (c_s - mean c); independent of Z_s
            c = (c - c.mean(dim=1, keepdim=True)) * (num_samples / (num_samples - 1))
        grad = torch.zeros((bsz, n), dtype=grad_out.dtype, device=grad_out.device)
        zbar_c = torch.zeros((bsz,), dtype=grad_out.dtype, device=grad_out.device)
        gen = _clone_generator(ctx.gen_state, ctx.gen_device) if ctx.mode == "regen" else None
        for i, (lo, hi) in enumerate(ctx.chunks):
            if stored:
                z = stored[i]
            else:
                z = torch.randn((bsz, hi - lo, n), generator=gen, dtype=ctx.noise_dtype, device=grad_out.device)
                z = z.to(grad_out.dtype)
            cc = c[:, lo:hi]
            grad.add_(torch.bmm(cc.unsqueeze(1), z).squeeze(1))  # Z^T c
            if ctx.control_variate:
                zbar_c.add_((z.mean(dim=2) * cc).sum(dim=1))
        if ctx.control_variate:
            # centre the noise over patches: top-k is shift-invariant, so E[mean_j(Z) c] = 0 (still unbiased),
            # and the gradient then sums to exactly zero over patches
            grad.sub_(zbar_c.unsqueeze(1))
        grad.div_(num_samples * sigma)
        return grad, *([None] * 6)


def perturbed_topk(
    scores: torch.Tensor,
    k: int,
    *,
    num_samples: int = 500,
    sigma: float = 0.05,
    generator: torch.Generator | None = None,
    control_variate: bool = False,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable top-k by Gaussian perturbation (Cordonnier et al. 2021; Berthet et al. 2020).

    Args:
        scores: ``[B, N]`` floating, finite scores, used as given (no normalisation here; the paper's
            per-row min-max normalisation belongs to the scorer head).
        k: number of selected patches, ``1 <= k <= N``.
        num_samples: number ``n`` of Gaussian perturbations, ``>= 1``.
        sigma: noise standard deviation ``>= 0``; any value per call (decay schedules live with training).
            ``sigma == 0`` returns exactly the hard top-k one-hot and a zero gradient.
        generator: ``torch.Generator`` on ``scores.device`` for the noise. ``None`` draws a seed from the
            default generator (so ``torch.manual_seed`` makes runs reproducible).
        control_variate: if True, the backward uses two zero-mean corrections that keep the estimator
            unbiased and reduce its variance: a leave-one-out baseline over samples
            (``c_s - mean_{t != s} c_t``, when ``num_samples >= 2``; the gradient is then exactly zero for
            upstream gradients constant along N) and noise centred over patches (``Z - mean_j Z``; the
            gradient then sums to exactly zero over patches). False gives the plain estimator of the formula above.
        noise: optional ``[B, num_samples, N]`` standard-normal noise to use instead of drawing it (stored for
            the backward); for tests and common-random-number comparisons.

    Returns:
        ``Tensor[B, k, N]`` of the scores' dtype: slot ``i`` (patches in increasing index order) is the
        empirical distribution of the ``i``-th selected index; every slot sums to 1 over N.

    Memory: O(B*k*N) for output and gradient plus O(B*n*k) indices plus the noise while it takes at most
    ``_STORE_NOISE_MAX_BYTES`` (256 MiB); above that only one chunk of ``_NOISE_CHUNK_ELEMENTS`` elements
    is alive at a time and the noise is regenerated in the backward from the saved generator state.
    """
    check_scores(scores, "scores")
    bsz, n = scores.shape
    k = check_k(k, n)
    num_samples = check_positive_int(num_samples, "num_samples")
    sigma = check_nonneg(sigma, "sigma")
    control_variate = check_bool(control_variate, "control_variate")
    _check_generator_and_noise(scores, num_samples, generator, noise)
    if noise is not None:
        noise = noise.to(dtype=scores.dtype, device=scores.device)
    elif sigma > 0 and generator is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=scores.device)
        generator.manual_seed(seed)
    return _PerturbedTopK.apply(scores, k, num_samples, sigma, generator, noise, control_variate)


class PerturbedTopK(nn.Module):
    """``nn.Module`` wrapper of :func:`perturbed_topk`.

    Args:
        k: number of selected patches.
        num_samples: Gaussian perturbations per call.
        sigma: default noise level; change ``module.sigma`` (or pass ``sigma=`` to ``forward``) for schedules.
        control_variate: see :func:`perturbed_topk`.
        hard_in_eval: in ``eval()`` mode return the hard top-k one-hot (``sigma = 0``), as the paper does at
            inference.

    ``forward(scores[B, N], *, sigma=None, generator=None) -> Tensor[B, k, N]``.
    """

    def __init__(
        self,
        k: int,
        num_samples: int = 500,
        sigma: float = 0.05,
        *,
        control_variate: bool = False,
        hard_in_eval: bool = True,
    ) -> None:
        super().__init__()
        self.k = check_positive_int(k, "k")
        self.num_samples = check_positive_int(num_samples, "num_samples")
        self.sigma = check_nonneg(sigma, "sigma")
        self.control_variate = check_bool(control_variate, "control_variate")
        self.hard_in_eval = check_bool(hard_in_eval, "hard_in_eval")

    def forward(
        self, scores: torch.Tensor, *, sigma: float | None = None, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        s = self.sigma if sigma is None else sigma
        if self.hard_in_eval and not self.training:
            s = 0.0
        return perturbed_topk(
            scores,
            self.k,
            num_samples=self.num_samples,
            sigma=s,
            generator=generator,
            control_variate=self.control_variate,
        )

    def extra_repr(self) -> str:
        return (
            f"k={self.k}, num_samples={self.num_samples}, sigma={self.sigma}, "
            f"control_variate={self.control_variate}, hard_in_eval={self.hard_in_eval}"
        )
