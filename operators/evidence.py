"""Evidence distillation: a direct learning signal for the scorer from the patches the model did read.

A learned patch selector has a chicken-and-egg problem: the scorer gets gradient only through the classifier's
use of the patches it already picks, so a scorer that starts out ranking the informative cells low may never
read them, and the classifier memorises background instead (``benchmarks/RESULTS.md``). These functions break
the loop with two auxiliary losses computed on every full-resolution patch read in a training step (the
selected cells plus a few uniformly drawn *exploration* cells):

* **instance loss** — an instance head (a linear layer on the patch features) predicts the slide label from
  each patch alone (naive multiple-instance learning: every patch inherits its slide's label). Patches that
  occur in every class (background, distractors) can only learn the class prior, so the head becomes
  *confident* exactly on the patches that carry evidence; this also warms up the feature network on random
  tissue before the scorer has found anything.
* **rank loss** — the scorer's (min–max normalised) scores of the read cells are trained to rank them like the
  instance head's confidence (a RankNet-style weighted pairwise logistic loss, Burges et al. 2005), so a scorer
  that ranks an informative cell low is corrected whenever that cell is read — by the selection or by
  exploration. The targets are detached: the scorer learns *where* the classifier finds evidence, the
  classifier is not pulled towards what the scorer likes. Iterative patch selection (Bergner et al. 2023)
  distils the aggregator's attention into the selection in a similar spirit.

Shapes: ``M`` read patches of one slide, ``C`` classes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["instance_confidence", "instance_loss", "evidence_rank_loss", "neutral_loss"]


def instance_confidence(instance_logits: torch.Tensor) -> torch.Tensor:
    """How decisive each patch is on its own: ``1 - H(softmax(logits)) / log C`` in [0, 1].

    Args:
        instance_logits: ``[M, C]`` (``C >= 2``).

    Returns:
        ``[M]``: 0 for a uniform prediction (no evidence), 1 for a one-hot one. Label-free, so the scorer is
        trained towards cells that are informative for *any* class.
    """
    if not isinstance(instance_logits, torch.Tensor) or instance_logits.dim() != 2 or instance_logits.shape[1] < 2:
        raise ValueError(
            f"instance_logits must be [M, C] with C >= 2, got {getattr(instance_logits, 'shape', type(instance_logits))}"
        )
    logp = F.log_softmax(instance_logits, dim=1)
    ent = -(logp.exp() * logp).sum(1)
    return 1.0 - ent / math.log(instance_logits.shape[1])


def instance_loss(instance_logits: torch.Tensor, target: int | torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every patch's own prediction against the slide label (naive MIL).

    Args:
        instance_logits: ``[M, C]``.
        target: the slide's class index (int or 0-d / 1-element long tensor).

    Returns:
        scalar tensor.
    """
    if not isinstance(instance_logits, torch.Tensor) or instance_logits.dim() != 2:
        raise ValueError(
            f"instance_logits must be [M, C], got {getattr(instance_logits, 'shape', type(instance_logits))}"
        )
    t = int(target)
    if not 0 <= t < instance_logits.shape[1]:
        raise ValueError(f"target must be a class index in [0, {instance_logits.shape[1]}), got {t}")
    tgt = torch.full((instance_logits.shape[0],), t, dtype=torch.long, device=instance_logits.device)
    return F.cross_entropy(instance_logits, tgt)


def neutral_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean KL divergence from the uniform distribution to each patch's own class prediction.

    ``KL(u || softmax(l)) = logsumexp(l) - mean_c(l) - log C`` per patch, averaged over the patches. Applied to
    the single-patch logits of uniformly drawn tissue cells (mostly background and distractors, which occur in
    every class), it teaches the classifier that such *filler* carries no class: with the mean aggregator and
    its linear head the bag's logits are the mean of the patches' own logits, so neutral filler cannot outvote
    the few patches on informative structures, whichever share of the K slots it takes.

    Args:
        logits: ``[M, C]`` (``C >= 2``).

    Returns:
        scalar tensor, >= 0 (up to rounding); 0 when every row is constant (a uniform prediction).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"logits must be [M, C] with C >= 2, got {getattr(logits, 'shape', type(logits))}")
    if logits.shape[0] == 0:
        raise ValueError("logits must hold at least one patch (M >= 1), got M = 0")
    kl = torch.logsumexp(logits, dim=1) - logits.mean(1) - math.log(logits.shape[1])
    return kl.mean()


def evidence_rank_loss(scores: torch.Tensor, evidence: torch.Tensor, *, temperature: float = 0.1) -> torch.Tensor:
    """Weighted pairwise logistic ranking loss: cells with more evidence should score higher.

    ``L = sum_{i,j} w_ij * softplus(-(s_i - s_j) / T) / sum_{i,j} w_ij`` with ``w_ij = max(e_i - e_j, 0)``
    (RankNet with graded relevance; ``e`` is treated as a constant). Zero when every cell has the same
    evidence. Duplicate cells (the same cell read twice) only add equal-score pairs, which carry no weight.

    Args:
        scores: ``[M]`` the scorer's scores of the read cells (differentiable; min–max normalised in [0, 1]).
        evidence: ``[M]`` targets (e.g. :func:`instance_confidence`), detached inside.
        temperature: ``T > 0`` in score units: pairs whose scores differ by much more than ``T`` in the
            right order contribute ~0.

    Returns:
        scalar tensor.
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        raise ValueError(f"scores must be [M], got {getattr(scores, 'shape', type(scores))}")
    if not isinstance(evidence, torch.Tensor) or evidence.shape != scores.shape:
        raise ValueError(
            f"evidence must have the shape of scores {tuple(scores.shape)}, got "
            f"{getattr(evidence, 'shape', type(evidence))}"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    e = evidence.detach().to(scores.dtype)
    w = (e[:, None] - e[None, :]).clamp_min(0)  # [M, M]: i should outrank j by w_ij
    total = w.sum()
    if float(total) <= 0:
        return scores.sum() * 0.0
    diff = (scores[:, None] - scores[None, :]) / temperature
    return (w * F.softplus(-diff)).sum() / total
