"""Cluster gate: which of a frozen scorer's candidate cells enter the bag.

A scorer trained to rank cells puts the informative ones near the top of a slide's ranking, but its scores are no
in/out call: the top K of a slide holds its few informative cells *and* filler, and the filler costs the
classifier what it could learn (``benchmarks/RESULTS.md``, "The shape family, version 2: a gate on the frozen
scorer's candidates"). A single cell's score is too noisy to cut on; the mean score over many cells of one
appearance is not. So the gate decides per *appearance cluster*:

1. the top-N candidates (local maxima) of every training slide are embedded by the encoder as it is when the
   selection is fixed (a frozen copy is kept), standardised and L2-normalised;
2. spherical k-means (k-means++ seeding, the best of several seedings, cosine assignments) groups them into
   ``clusters`` appearance clusters;
3. a cluster is *informative* when its cells' mean score falls in the upper group of a two-means split of the
   clusters' mean scores, each cluster one point whatever its size (weighted by size, a few large low-scored
   clusters pull the cut up and a smaller informative cluster falls out of the bag: RESULTS, "a pretrained encoder
   for the gate").

A slide's bag is then those of its top-N candidates whose nearest cluster is informative (at least its best-scored
candidate); with a ``margin`` > 0, those whose cosine similarity to the nearest informative centroid is within
``margin`` of that to their nearest centroid (a held-out cell of an informative appearance can fall just on the
filler side of a cluster boundary: RESULTS, "a similarity margin"). Label-free: the slide labels are not used, the
scorer's own ranking is, averaged over each cluster.

Shapes: ``M`` candidate cells, ``D`` feature size, ``k`` clusters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["CellGate", "fit_cluster_gate", "spherical_kmeans", "two_means_upper"]


def _check_2d(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty [M, D] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    return x


def spherical_kmeans(
    x: torch.Tensor, k: int, generator: torch.Generator | None = None, iters: int = 50, restarts: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spherical k-means (cosine similarity) with k-means++ seeding, the best of ``restarts`` runs.

    Args:
        x: ``[M, D]`` rows of unit length (not checked; normalise first).
        k: clusters, ``1 <= k``; more than ``M`` are cut to ``M``.
        generator: RNG of the seeding (CPU); the runs draw from it one after the other.
        iters: Lloyd iterations (stops early when the assignments no longer change).
        restarts: independent seedings; the run with the highest objective (the sum of every row's cosine
            similarity to its centroid) is returned (the first on a tie).

    Returns:
        ``(centroids [k', D] unit rows, assignment [M] long)`` with ``k' = min(k, M)``; a cluster that empties
        keeps its previous centroid.
    """
    x = _check_2d("x", x)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 1:
        raise ValueError(f"restarts must be an int >= 1, got {restarts!r}")
    best = None
    for _ in range(restarts):
        cen, assign = _kmeans_once(x, k, generator, iters)
        objective = float((x * cen[assign]).sum())
        if best is None or objective > best[0]:
            best = (objective, cen, assign)
    return best[1], best[2]


def _kmeans_once(
    x: torch.Tensor, k: int, generator: torch.Generator | None, iters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    k = min(k, m)
    first = int(torch.randint(m, (1,), generator=generator))
    cen = [x[first]]
    dist = 1.0 - x @ x[first]  # cosine distance to the nearest centroid so far
    for _ in range(1, k):
        p = dist.clamp_min(0)
        i = int(torch.multinomial(p / p.sum(), 1, generator=generator)) if float(p.sum()) > 0 else int(dist.argmax())
        cen.append(x[i])
        dist = torch.minimum(dist, 1.0 - x @ x[i])
    c = torch.stack(cen)
    assign = (x @ c.T).argmax(1)
    for _ in range(iters):
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        norms = sums.norm(dim=1, keepdim=True)
        c = torch.where(norms > 0, sums / norms.clamp_min(1e-12), c)
        new = (x @ c.T).argmax(1)
        if torch.equal(new, assign):
            break
        assign = new
    return c, assign


def two_means_upper(values: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The upper group of the exact weighted two-means split of 1-D ``values``.

    Among the cuts of the sorted values, the one that maximises the between-group variance
    ``W_lo * W_hi * (mean_hi - mean_lo)^2`` (weighted means and totals; Otsu's criterion).

    Args:
        values: ``[k]``.
        weights: ``[k]`` >= 0 (default all 1); values of weight 0 take no part in the cut (they are in the upper
            group when above it).

    Returns:
        ``[k]`` bool, True in the upper group; all True when fewer than two values have weight.
    """
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.numel() == 0:
        raise ValueError(
            f"values must be a non-empty [k] tensor, got {getattr(values, 'shape', type(values).__name__)}"
        )
    v = values.double()
    w = torch.ones_like(v) if weights is None else weights.double()
    if w.shape != v.shape or bool((w < 0).any()):
        raise ValueError(f"weights must be [k] = {tuple(v.shape)} and >= 0, got {tuple(w.shape)}")
    live = w > 0
    if int(live.sum()) < 2:
        return torch.ones_like(live)
    vs, order = v[live].sort()
    ws = w[live][order]
    cw, cvw = ws.cumsum(0), (vs * ws).cumsum(0)
    w_lo, w_hi = cw[:-1], cw[-1] - cw[:-1]
    m_lo, m_hi = cvw[:-1] / w_lo, (cvw[-1] - cvw[:-1]) / w_hi
    between = w_lo * w_hi * (m_hi - m_lo) ** 2
    between = torch.where(vs[1:] > vs[:-1], between, torch.full_like(between, -1.0))  # cut only between distinct
    if float(between.max()) < 0:
        return torch.ones_like(live)
    cut = vs[int(between.argmax()) + 1]
    return v >= cut


def fit_cluster_gate(
    features: torch.Tensor,
    scores: torch.Tensor,
    clusters: int,
    generator: torch.Generator | None = None,
    restarts: int = 8,
    ranks: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Fit the gate's clusters on candidate cells (see the module docstring).

    Args:
        features: ``[M, D]`` the encoder's features of the training slides' candidates.
        scores: ``[M]`` their scores (any monotone scale; only means over clusters are compared).
        clusters: k.
        generator: RNG of the k-means seeding.
        restarts: k-means seedings, the best kept (:func:`spherical_kmeans`): one seeding alone can merge an
            informative appearance with filler into one cluster of middling score that falls out of the bag.
        ranks: ``[M]`` each candidate's position in its slide's ranking (0 = the slide's best), or None. Given, a
            cluster is informative by its cells' mean rank (lower is better) instead of their mean score: the
            scores of a slide's lower-ranked candidates spread the filler clusters' mean scores down, and with
            many candidates per slide the two-means cut of mean scores then falls between filler clusters
            (RESULTS, "the candidates miss the glyphs, not the gate").

    Returns:
        ``{"mean": [D], "std": [D], "centroids": [k', D], "informative": [k'] bool, "assignment": [M] long}``
        (``k' = min(k, M)``); features are standardised by ``mean`` / ``std`` and L2-normalised before the
        cosine assignment.
    """
    features = _check_2d("features", features).double()
    if not isinstance(scores, torch.Tensor) or scores.shape != features.shape[:1]:
        raise ValueError(
            f"scores must be [M] = {tuple(features.shape[:1])}, got {getattr(scores, 'shape', type(scores).__name__)}"
        )
    mean, std = features.mean(0), features.std(0, unbiased=False).clamp_min(1e-6)
    x = nn.functional.normalize((features - mean) / std, dim=1)
    cen, assign = spherical_kmeans(x, clusters, generator, restarts=restarts)
    k = cen.shape[0]
    size = torch.bincount(assign, minlength=k).double()
    if ranks is not None:
        if not isinstance(ranks, torch.Tensor) or ranks.shape != scores.shape:
            raise ValueError(
                f"ranks must be [M] = {tuple(scores.shape)}, got {getattr(ranks, 'shape', type(ranks).__name__)}"
            )
        stat = -ranks.double()  # higher is better, as a score
    else:
        stat = scores.double()
    mean_stat = torch.zeros(k, dtype=torch.float64).index_add_(0, assign, stat) / size.clamp_min(1)
    informative = two_means_upper(mean_stat, (size > 0).double())  # one point per (non-empty) cluster
    return {"mean": mean, "std": std, "centroids": cen, "informative": informative, "assignment": assign}


class CellGate(nn.Module):
    """The fitted gate: a frozen encoder (or none: the model's own, when that one is frozen), the feature
    standardisation, the cluster centroids and which clusters are informative. Unfitted it keeps every candidate.

    Args:
        encoder: the frozen copy of the feature network (kept in eval mode, no gradients), or None.
        feature_dim: D.
        clusters: k.
        margin: keep a candidate whose cosine similarity to the nearest informative centroid is at least that to
            its nearest centroid minus ``margin`` (>= 0; 0: its nearest cluster is informative).
        fits: F independent k-means fits (the seedings of one drawn after the other's from one generator); a
            candidate is kept when at least :attr:`min_votes` fits keep it (see ``agree``). One fit's best-of-restarts
            can still merge an informative appearance with filler (RESULTS, "a union of k-means fits"); F = 1 is a
            single fit.
        agree: the share of the F fits that must keep a candidate, in [0, 1]: ``max(1, ceil(agree * F))`` fits;
            0 (default): any fit (the union), 0.5: a majority, 1: every fit.
    """

    def __init__(
        self,
        encoder: nn.Module | None,
        feature_dim: int,
        clusters: int,
        margin: float = 0.0,
        fits: int = 1,
        agree: float = 0.0,
    ):
        super().__init__()
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin <= 2:
            raise ValueError(f"margin must be a number in [0, 2] (a cosine-similarity gap), got {margin!r}")
        if isinstance(fits, bool) or not isinstance(fits, int) or fits < 1:
            raise ValueError(f"fits must be an int >= 1 (independent k-means fits), got {fits!r}")
        if isinstance(clusters, bool) or not isinstance(clusters, int) or clusters < 1:
            raise ValueError(f"clusters must be an int >= 1, got {clusters!r}")
        if isinstance(agree, bool) or not isinstance(agree, (int, float)) or not 0 <= agree <= 1:
            raise ValueError(
                f"agree must be a number in [0, 1] (the share of fits that must keep a cell), got {agree!r}"
            )
        self.margin = float(margin)
        self.fits = fits
        self.agree = float(agree)
        self.min_votes = max(1, math.ceil(self.agree * fits - 1e-9))  # fits that must keep a candidate
        self.clusters = clusters
        self.encoder = encoder
        if encoder is not None:
            encoder.requires_grad_(False).eval()
        self.register_buffer("mean", torch.zeros(feature_dim))
        self.register_buffer("std", torch.ones(feature_dim))
        # fit f's centroids are rows f*k .. (f+1)*k - 1 (one fit: [k, D], as a gate of one fit always was)
        self.register_buffer("centroids", torch.zeros(fits * clusters, feature_dim))
        self.register_buffer("informative", torch.ones(fits * clusters, dtype=torch.bool))
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))

    def train(self, mode: bool = True) -> CellGate:
        super().train(mode)
        if self.encoder is not None:
            self.encoder.eval()  # frozen: its normalisation statistics never follow a training batch
        return self

    @property
    def is_fitted(self) -> bool:
        return bool(self.fitted)

    def fit(
        self,
        features: torch.Tensor,
        scores: torch.Tensor,
        generator: torch.Generator | None = None,
        ranks: torch.Tensor | None = None,
    ) -> dict:
        """:func:`fit_cluster_gate` ``fits`` times on ``features [M, D]`` (from :meth:`encode`), ``scores [M]`` and
        optionally ``ranks [M]``, the k-means seedings drawn one fit after the other from ``generator`` (the first
        fit is the fit of a one-fit gate); stores the results (fewer candidates than clusters: the spare centroids
        are never nearest, marked not informative). Returns the first fit, with ``"kept"``: ``[M]`` bool, the
        candidates at least :attr:`min_votes` fits keep."""
        f_cpu, s_cpu = features.detach().cpu(), scores.detach().cpu()
        r_cpu = None if ranks is None else ranks.detach().cpu()
        dt, k_max = self.centroids.dtype, self.clusters
        results = []
        self.centroids.zero_()
        self.informative.zero_()
        for f in range(self.fits):
            fit = fit_cluster_gate(f_cpu, s_cpu, k_max, generator, ranks=r_cpu)
            k = fit["centroids"].shape[0]
            self.centroids[f * k_max : f * k_max + k] = fit["centroids"].to(dt)
            self.informative[f * k_max : f * k_max + k] = fit["informative"]
            results.append(fit)
        first = results[0]  # every fit standardises the same features the same way
        self.mean.copy_(first["mean"].to(dt))
        self.std.copy_(first["std"].to(dt))
        self.fitted.fill_(True)
        votes = torch.zeros(f_cpu.shape[0], dtype=torch.long)
        for fit in results:
            votes += fit["informative"][fit["assignment"]].long()
        return {**first, "kept": votes >= self.min_votes}

    def similarities(self, features: torch.Tensor) -> torch.Tensor:
        """``features [M, D]`` -> ``[M, F*k]`` cosine similarity to each centroid of every fit (after the fitted
        standardisation; fit f's are columns ``f*k .. (f+1)*k - 1``); -inf for the spare centroids of a fit on
        fewer candidates than clusters."""
        x = nn.functional.normalize((_check_2d("features", features) - self.mean) / self.std, dim=1)
        live = self.centroids.norm(dim=1) > 0
        return (x @ self.centroids.T).masked_fill(~live, float("-inf"))

    def assign(self, features: torch.Tensor) -> torch.Tensor:
        """``features [M, D]`` -> ``[M, F]`` nearest cluster of each fit (cosine, after the fitted
        standardisation), as an index into that fit's ``k`` clusters; ``[M]`` for a gate of one fit."""
        a = self.similarities(features).view(features.shape[0], self.fits, self.clusters).argmax(2)
        return a[:, 0] if self.fits == 1 else a

    def vote_counts(self, features: torch.Tensor) -> torch.Tensor:
        """``features [M, D]`` -> ``[M]`` long: how many of the F fits keep each candidate (its nearest cluster
        informative, or within ``margin`` of one); F for every candidate while unfitted."""
        m = features.shape[0]
        if not self.is_fitted:
            return torch.full((m,), self.fits, dtype=torch.long, device=features.device)
        sim = self.similarities(features).view(m, self.fits, self.clusters)
        info = self.informative.view(self.fits, self.clusters)
        nearest = sim.argmax(2)  # [M, F]
        k = info.gather(1, nearest.T).T  # [M, F]: each fit's nearest cluster informative
        if self.margin > 0:
            best_in = sim.masked_fill(~info[None], float("-inf")).max(2).values
            k = k | (best_in >= sim.max(2).values - self.margin)
        return k.sum(1)

    def keep(self, features: torch.Tensor) -> torch.Tensor:
        """``features [M, D]`` of a slide's candidates, best-scored first -> ``[M]`` bool: in an informative
        cluster (or within ``margin`` of one) of at least :attr:`min_votes` fits (:meth:`vote_counts`); the first
        candidate kept when none is. All True while unfitted."""
        return self.keep_by_votes(self.vote_counts(features))

    def keep_by_votes(self, votes: torch.Tensor) -> torch.Tensor:
        """``votes [M]`` (:meth:`vote_counts` of a slide's candidates, best-scored first) -> ``[M]`` bool, as
        :meth:`keep`: at least :attr:`min_votes`, the first candidate kept when none is."""
        k = votes >= self.min_votes
        if not bool(k.any()):
            k[0] = True
        return k
