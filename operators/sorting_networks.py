"""Differentiable sorting and selection networks (Petersen et al., "Differentiable Sorting Networks for
Scalable Sorting and Ranking Supervision", ICML 2021; "Monotonic Differentiable Sorting Networks", ICLR 2022;
"Differentiable Top-k Classification Learning", ICML 2022).

A network is a list of layers; a layer is a set of disjoint comparators ``(lo, hi)`` on wires ``0..n-1``: the
comparator writes the minimum of its two wires to ``lo`` and the maximum to ``hi``, so the outputs are in
ascending order and the top-k sit on the last k wires (largest on wire ``n-1``). The relaxed comparator
replaces the hard swap by a mixture with ``alpha = F(beta * (x_hi - x_lo))`` for a symmetric CDF ``F``
(``F(-v) = 1 - F(v)``)::

    x_lo' = alpha * x_lo + (1 - alpha) * x_hi        x_hi' = (1 - alpha) * x_lo + alpha * x_hi

Each layer is the symmetric, doubly-stochastic matrix ``M`` with those 2x2 blocks (identity on idle wires);
the relaxed permutation is ``M_L ... M_1``. Three constructions:

* ``odd_even``: odd-even transposition sort, n layers of adjacent comparators (as in ``diffsort``).
* ``bitonic``: Batcher's bitonic sorter on ``2^ceil(log2 n)`` wires with the lowest ``2^L - n`` wires
  discarded (comparators touching them are dropped, as in ``diffsort``), ``L(L+1)/2`` layers.
* ``splitter_selection``: a top-k selection network built from splitter cascades (the construction used by
  ``difftopk``), far fewer comparators than a full sorter when ``k << n``; only the last k wires are sorted.

Everything is index-based (gathers and ``index_copy``): no dense ``n x n`` layer matrices, and the routing
of selected inputs is propagated forward in O(layers * B * n) per tracked input.
"""

from __future__ import annotations

import functools
import math

import torch

from operators._checks import check_k, check_nonneg, check_positive, check_positive_int, check_scores, check_tensor

__all__ = [
    "DISTRIBUTIONS",
    "NETWORKS",
    "bitonic_network",
    "odd_even_network",
    "relaxed_swap_alpha",
    "soft_sort_network",
    "soft_topk_matrix",
    "sorting_network",
    "splitter_selection_network",
]

Layer = tuple[tuple[int, int], ...]

DISTRIBUTIONS = ("cauchy", "logistic", "logistic_phi", "gaussian", "reciprocal", "optimal")
NETWORKS = ("odd_even", "bitonic", "splitter_selection")


# ----------------------------------------------------------------------------------------------------------------
# network construction (pure Python, cached)


def _check_layers(n: int, layers: list[list[tuple[int, int]]]) -> tuple[Layer, ...]:
    out = []
    for layer in layers:
        if not layer:
            continue
        wires = [w for pair in layer for w in pair]
        assert len(set(wires)) == len(wires), "comparators of one layer must be disjoint"
        assert all(0 <= lo < hi < n for lo, hi in layer)
        out.append(tuple(sorted(layer)))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def odd_even_network(n: int) -> tuple[Layer, ...]:
    """Odd-even transposition sort on n wires: n layers, layer t compares ``(i, i+1)`` for ``i = t mod 2, +2, ...``."""
    n = check_positive_int(n, "n")
    return _check_layers(n, [[(i, i + 1) for i in range(t % 2, n - 1, 2)] for t in range(n)])


@functools.lru_cache(maxsize=64)
def bitonic_network(n: int) -> tuple[Layer, ...]:
    """Bitonic sorter on ``2^ceil(log2 n)`` wires whose lowest ``2^L - n`` wires are discarded.

    Block ``s`` (sorted runs of length ``2^(s+1)``) has layers at distances ``2^s, ..., 1``; runs with an
    odd index ``ix // 2^(s+1)`` are sorted descending. Comparators touching a discarded wire are dropped.
    """
    n = check_positive_int(n, "n")
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    size = 2**depth
    off = size - n
    layers = []
    for block in range(depth):
        for sub in range(block + 1):
            dist = 2 ** (block - sub)
            layer = []
            for start in range(0, size, 2 * dist):
                for ix in range(start, start + dist):
                    a, b = ix, ix + dist
                    if a < off or b < off:
                        continue
                    if (ix >> (block + 1)) & 1:  # descending run: the minimum goes to the upper wire
                        a, b = b, a
                    layer.append((a - off, b - off))  # (min-destination, max-destination)
            layers.append(layer)
    return _as_min_max(n, layers)


def _as_min_max(n: int, layers: list[list[tuple[int, int]]]) -> tuple[Layer, ...]:
    """Comparators given as (min-destination, max-destination) pairs, possibly with lo > hi wire index."""
    out = []
    for layer in layers:
        if not layer:
            continue
        wires = [w for pair in layer for w in pair]
        assert len(set(wires)) == len(wires), "comparators of one layer must be disjoint"
        assert all(0 <= w < n for w in wires)
        out.append(tuple(sorted(layer)))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def splitter_selection_network(n: int, k: int) -> tuple[Layer, ...]:
    """Top-k selection network from splitter cascades (the construction ``difftopk`` uses).

    Built for "top on the low lanes" and mirrored at the end so that the top-k land, sorted ascending, on
    wires ``n-k .. n-1``. A splitter cascade on lanes ``L`` (``|L| = m``) has ``ceil(log2 m)`` layers; layer
    ``i`` compares lanes ``L[j]`` and ``L[j + s]`` (``s = 2^(depth-i-1)``) inside blocks of ``2s``, putting the
    larger value on the earlier lane. Afterwards the lane at position ``j`` of ``L`` is known to have at least
    ``2^popcount(j) - 1`` larger elements above it (its *minimum rank*). Lanes are grouped by minimum rank and
    groups of rank ``< k`` with two or more lanes are split again, ranks ``k-1`` down to the current lowest,
    until nothing changes. Cascades on disjoint lanes share layers (each lane's next free layer is tracked).
    """
    n = check_positive_int(n, "n")
    k = check_k(k, n, "k")
    min_rank = [0] * n
    next_free = [0] * n
    layers: list[list[tuple[int, int]]] = []
    gain = [2 ** bin(j).count("1") - 1 for j in range(n)]

    def cascade(lanes: list[int]) -> list[list[tuple[int, int]]]:
        m = len(lanes)
        depth = math.ceil(math.log2(m))
        out = []
        for i in range(depth):
            s = 2 ** (depth - i - 1)
            pairs = [(lanes[j], lanes[j + s]) for blk in range(0, m, 2 * s) for j in range(blk, min(blk + s, m - s))]
            out.append(pairs)
        return out

    def split_rank(rank: int) -> bool:
        lanes = [lane for lane in range(n) if min_rank[lane] == rank]
        if len(lanes) < 2:
            return False
        ext = cascade(lanes)
        start = max(next_free[lane] for lane in lanes)
        while len(layers) < start + len(ext):
            layers.append([])
        for i, lyr in enumerate(ext):
            layers[start + i].extend(lyr)
        for j, lane in enumerate(lanes):
            min_rank[lane] += gain[j]
            next_free[lane] = start + len(ext)
        return True

    lowest = -1
    changed = True
    while changed:
        changed = False
        for rank in range(k - 1, lowest, -1):
            changed |= split_rank(rank)
        lowest += 1
    # mirror: lane p (gets the max of (p, q), p < q) becomes wire n-1-p, the max-destination
    mirrored = [[(n - 1 - q, n - 1 - p) for p, q in lyr] for lyr in layers]
    return _check_layers(n, mirrored)


def sorting_network(method: str, n: int, k: int) -> tuple[Layer, ...]:
    """The network of ``method`` (one of :data:`NETWORKS`) for ``n`` inputs whose last k wires are the top-k."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    if method == "odd_even":
        return odd_even_network(n)
    if method == "bitonic":
        return bitonic_network(n)
    if method == "splitter_selection":
        return splitter_selection_network(n, k)
    raise ValueError(f"method must be one of {NETWORKS}, got {method!r}")


_INDEX_CACHE: dict[tuple, tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]]] = {}


def _layer_indices(network: tuple[Layer, ...], n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: ``partner[n]`` (the other wire of each wire's comparator, itself when idle) and
    ``sign[n]`` (+1 on min-destination wires, -1 on max-destination wires, 0 when idle)."""
    key = (id(network), n, str(device))
    hit = _INDEX_CACHE.get(key)
    if hit is None or hit[0] is not network:  # the cache keeps the network alive, so ids are not reused
        idx = []
        for layer in network:
            t = torch.tensor(layer, dtype=torch.long)
            partner = torch.arange(n)
            partner[t[:, 0]] = t[:, 1]
            partner[t[:, 1]] = t[:, 0]
            sign = torch.zeros(n)
            sign[t[:, 0]] = 1.0
            sign[t[:, 1]] = -1.0
            idx.append((partner.to(device), sign.to(device)))
        if len(_INDEX_CACHE) > 256:
            _INDEX_CACHE.clear()
        hit = _INDEX_CACHE[key] = (network, idx)
    return hit[1]


# ----------------------------------------------------------------------------------------------------------------
# relaxed comparator


def relaxed_swap_alpha(
    diff: torch.Tensor, inverse_temperature: float, distribution: str, art_lambda: float = 0.25
) -> torch.Tensor:
    """``alpha = F(beta * diff)`` with ``diff = x_hi - x_lo``: the weight with which each wire keeps its value.

    ``F`` is the CDF named by ``distribution`` (Petersen et al. 2021/2022, as in ``diffsort``/``difftopk``):
    ``logistic`` ``sigmoid(v)``; ``logistic_phi`` ``sigmoid(v / (|diff| + 1e-10)^art_lambda)`` (the ART
    variant); ``gaussian`` ``Phi(v)``; ``reciprocal`` ``(v / (2 + |v|) + 1) / 2``; ``cauchy``
    ``atan(v) / pi + 1/2``; ``optimal`` the monotonic "optimal" sigmoid of the ICLR 2022 paper; all with
    ``v = beta * diff``.
    """
    dt = diff.dtype
    d = diff.float() if dt in (torch.float16, torch.bfloat16) else diff
    beta = inverse_temperature
    if distribution == "logistic":
        out = torch.sigmoid(d * beta)
    elif distribution == "logistic_phi":
        out = torch.sigmoid(d * beta / (d.abs() + 1e-10).pow(art_lambda))
    elif distribution == "gaussian":
        out = 0.5 + 0.5 * torch.erf(d * (beta / math.sqrt(2.0)))
    elif distribution == "reciprocal":
        v = d * beta
        out = 0.5 * (v / (2 + v.abs()) + 1)
    elif distribution == "cauchy":
        out = torch.atan(d * beta) / math.pi + 0.5
    elif distribution == "optimal":
        v = d * beta
        out = (
            torch.clamp(v, -0.25, 0.25)
            + 0.5
            + ((v > 0.25).to(v.dtype) - (v < -0.25).to(v.dtype)) * (0.25 - 1 / 16 / (v.abs() + 1e-10))
        )
    else:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    return out.to(dt)


def _check_relax_args(inverse_temperature: float, distribution: str, art_lambda: float) -> tuple[float, str, float]:
    beta = check_positive(inverse_temperature, "inverse_temperature")
    if not isinstance(distribution, str):
        raise TypeError(f"distribution must be a str, got {type(distribution).__name__}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    lam = check_nonneg(art_lambda, "art_lambda")
    return beta, distribution, lam


def _check_network(network: object, n: int) -> tuple[Layer, ...]:
    if not isinstance(network, tuple) or not all(isinstance(layer, tuple) for layer in network):
        raise TypeError("network must be a tuple of layers as returned by sorting_network()")
    top = max((w for layer in network for pair in layer for w in pair), default=0)
    if top >= n:
        raise ValueError(f"network has wires up to {top} but the input has only N={n} entries")
    return network


# ----------------------------------------------------------------------------------------------------------------
# execution


def soft_sort_network(
    x: torch.Tensor,
    network: tuple[Layer, ...],
    *,
    inverse_temperature: float,
    distribution: str = "cauchy",
    art_lambda: float = 0.25,
    track: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the relaxed network on ``x`` and route selected inputs through it.

    Args:
        x: ``[B, n]`` values (floating).
        network: layers from :func:`sorting_network` (wires ``< n``).
        inverse_temperature: ``beta > 0`` (steepness of the relaxed comparator).
        distribution: one of :data:`DISTRIBUTIONS`.
        art_lambda: exponent of ``logistic_phi``.
        track: optional LongTensor ``[B, r]`` of input positions whose routing to be returned.

    Returns:
        ``(y, routes)``: ``y[B, n]`` the relaxed network output (ascending; for a selection network only the
        last k wires are ordered), ``routes[B, r, n]`` with ``routes[b, t, w]`` the weight of input
        ``track[b, t]`` in output wire ``w`` (rows of the relaxed permutation matrix; ``None`` without
        ``track``). Cost O(layers * B * n * (1 + r)).
    """
    x = check_scores(x, "x", ndim=2)
    network = _check_network(network, x.shape[1])
    beta, distribution, lam = _check_relax_args(inverse_temperature, distribution, art_lambda)
    routes = None
    if track is not None:
        check_tensor(track, "track")
        if track.dim() != 2 or track.shape[0] != x.shape[0] or track.dtype != torch.long:
            raise ValueError(f"track must be a LongTensor [B={x.shape[0]}, r], got {track.dtype} {tuple(track.shape)}")
        if track.numel() and (int(track.min()) < 0 or int(track.max()) >= x.shape[1]):
            raise ValueError(
                f"track entries must lie in [0, {x.shape[1]}), got range [{int(track.min())}, {int(track.max())}]"
            )
        routes = torch.zeros(x.shape[0], track.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
        routes.scatter_(2, track.unsqueeze(-1), 1.0)
    for partner, sign in _layer_indices(network, x.shape[1], x.device):
        x, swap = _relaxed_layer(x, partner, sign, beta, distribution, lam)
        if routes is not None:
            routes = routes + swap.unsqueeze(1) * (routes[:, :, partner] - routes)
    return x, routes


def _relaxed_layer(
    x: torch.Tensor, partner: torch.Tensor, sign: torch.Tensor, beta: float, distribution: str, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer on all wires at once: ``x' = x + (1 - alpha) (x[partner] - x)``.

    For a comparator ``(lo, hi)`` both wires see the same ``v = x_hi - x_lo`` (via ``sign``), hence the same
    ``alpha``, and this is exactly ``x_lo' = alpha x_lo + (1 - alpha) x_hi``, ``x_hi' = (1 - alpha) x_lo +
    alpha x_hi``; idle wires are their own partner and stay put. Returns ``(x', 1 - alpha)``.
    """
    diff = x[:, partner] - x
    swap = 1 - relaxed_swap_alpha(diff * sign.to(x.dtype), beta, distribution, lam)
    return x + swap * diff, swap


def soft_topk_matrix(
    x: torch.Tensor,
    network: tuple[Layer, ...],
    k: int,
    *,
    inverse_temperature: float,
    distribution: str = "cauchy",
    art_lambda: float = 0.25,
) -> torch.Tensor:
    """Relaxed top-k assignment ``P[B, n, k]``: ``P[b, i, j]`` is the weight of input i at rank j (0 = largest).

    ``P = (M_L ... M_1)^T E`` restricted to the k top output wires, composed backwards from those wires
    (``M^T = M`` for every layer), O(layers * B * n * k). ``P[b, :, :m].sum(-1)`` is the soft membership
    of each input in the top-m (m <= k). Equals ``difftopk``'s dense ``X`` with its columns reversed.

    Args:
        x: ``[B, n]`` values; network, inverse_temperature, distribution, art_lambda as in
            :func:`soft_sort_network`; k: ``1 <= k <= n``.

    Returns:
        ``[B, n, k]`` of x's dtype.
    """
    x = check_scores(x, "x", ndim=2)
    b, n = x.shape
    k = check_k(k, n, "k")
    network = _check_network(network, n)
    beta, distribution, lam = _check_relax_args(inverse_temperature, distribution, art_lambda)
    idx = _layer_indices(network, n, x.device)
    swaps = []
    for partner, sign in idx:
        x, swap = _relaxed_layer(x, partner, sign, beta, distribution, lam)
        swaps.append(swap)
    p = torch.zeros(b, n, k, dtype=x.dtype, device=x.device)
    ranks = torch.arange(k, device=x.device)
    p[:, n - 1 - ranks, ranks] = 1.0
    for (partner, _), swap in zip(reversed(idx), reversed(swaps)):
        p = p + swap.unsqueeze(-1) * (p[:, partner] - p)
    return p
