"""Aggregators: from the K patch features of a slide to slide logits.

All take ``features[B, K, D]``, ``positions[B, K, 2]`` (patch centres, level-0 ``(x, y)`` divided by the slide
``(width, height)``, so in [0, 1]) and optional per-slot ``weights[B, K]``, and return ``logits[B, C]``.

* ``mean`` — mean of the features (without weights) or the weighted sum ``sum_k w_k f_k`` (with weights: the
  attention-sampling estimator of Katharopoulos & Fleuret 2019 of ``E_a[f]``, or mask-gated features for
  SOFT / LapSum); then a linear head.
* ``max`` — element-wise max over patches; linear head.
* ``vote`` — a soft majority vote: a linear head classifies every patch on its own, and the bag's class
  probabilities are the mean (or ``w``-weighted sum) of the patches' probabilities, ``p = sum_k w_k
  softmax(W f_k + b)``; returns ``log p`` as logits (``softmax(log p) = p``). Every patch's say is bounded by its
  weight, so a few confident patches of another class cannot outweigh a majority (with ``mean``, the bag logits
  are the mean of the patches' logits and one patch with large logits can).
* ``attention_mil`` — attention-based deep MIL pooling of Ilse et al. 2018: ``a = softmax_k(w^T tanh(V h_k))``
  or the gated variant ``w^T (tanh(V h_k) * sigmoid(U h_k))``; ``z = sum_k a_k h_k``; linear head. With
  ``attention="sigmoid"`` the weights are ``sigmoid(s_k) / sum_j sigmoid(s_j)`` of the same logits ``s_k``.
* ``transformer`` — one token per patch (feature projection + an optional Fourier encoding of the patch
  position), a few pre-norm self-attention layers, a linear head on the mean of the encoded tokens (``readout
  "mean"``), the mean of the tokens' logits (``"logit_mean"``) or a CLS token (``"cls"``).

Except ``mean`` (where weights define the estimator), weights are applied by scaling each feature by
``K * w_k`` before pooling, so uniform weights ``1/K`` leave features unchanged.

Mean, max and attention-MIL are invariant to a permutation of the patches; the transformer is invariant to a
permutation applied to features, positions and weights together (no sequence-order encoding).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = [
    "AGGREGATORS",
    "READOUTS",
    "MEAN_SKIP_AGGREGATORS",
    "MeanAggregator",
    "MaxAggregator",
    "VoteAggregator",
    "AttentionMILAggregator",
    "TransformerAggregator",
    "build_aggregator",
    "fourier_position_encoding",
]

AGGREGATORS = ("mean", "max", "vote", "attention_mil", "transformer")
READOUTS = ("mean", "logit_mean", "cls", "gate")  # of the transformer aggregator
MEAN_SKIP_AGGREGATORS = ("attention_mil", "transformer")  # those with a head of their own to add the mean to


def _check(features: torch.Tensor, positions: torch.Tensor | None, weights: torch.Tensor | None) -> None:
    if not isinstance(features, torch.Tensor) or features.dim() != 3:
        raise ValueError(f"features must be a tensor [B, K, D], got {getattr(features, 'shape', type(features))}")
    b, k, _ = features.shape
    if k < 1:
        raise ValueError(f"features must hold at least one patch (K >= 1), got shape {tuple(features.shape)}")
    if positions is not None and tuple(positions.shape) != (b, k, 2):
        raise ValueError(f"positions must be [B, K, 2] = {[b, k, 2]}, got {tuple(positions.shape)}")
    if weights is not None and tuple(weights.shape) != (b, k):
        raise ValueError(f"weights must be [B, K] = {[b, k]}, got {tuple(weights.shape)}")


def _scale(features: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return features
    return features * (weights * features.shape[1]).unsqueeze(-1).to(features.dtype)


def _mean_skip(head: nn.Sequential, dim: int, num_classes: int, dropout: float) -> nn.Module:
    """The mean aggregator's head for ``mean_skip``; zero-initialises the last linear layer of ``head``."""
    nn.init.zeros_(head[-1].weight)
    nn.init.zeros_(head[-1].bias)
    return nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, num_classes))


class _LinearHeadAggregator(nn.Module):
    """Base of the aggregators whose only parameters are a dropout + linear head (``head``, ``[D] -> [C]``)."""

    def __init__(self, dim: int, num_classes: int, *, dropout: float = 0.0):
        super().__init__()
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, num_classes))


class MeanAggregator(_LinearHeadAggregator):
    """Mean (or estimator-weighted sum) of patch features, then dropout and a linear head."""

    def forward(
        self, features: torch.Tensor, positions: torch.Tensor | None = None, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check(features, positions, weights)
        if weights is None:
            z = features.mean(1)
        else:
            z = (features * weights.unsqueeze(-1).to(features.dtype)).sum(1)
        return self.head(z)


class MaxAggregator(_LinearHeadAggregator):
    """Element-wise max over patch features, then dropout and a linear head."""

    def forward(
        self, features: torch.Tensor, positions: torch.Tensor | None = None, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check(features, positions, weights)
        return self.head(_scale(features, weights).amax(1))


class VoteAggregator(_LinearHeadAggregator):
    """Soft majority vote: mean (or weighted sum) of per-patch class probabilities; returns their log."""

    def forward(
        self, features: torch.Tensor, positions: torch.Tensor | None = None, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check(features, positions, weights)
        logp = torch.log_softmax(self.head(features), dim=-1)  # [B, K, C]
        if weights is None:
            return torch.logsumexp(logp, dim=1) - math.log(features.shape[1])
        w = weights.to(logp.dtype).clamp_min(0)
        w = w / w.sum(1, keepdim=True).clamp_min(torch.finfo(logp.dtype).tiny)
        return torch.logsumexp(logp + torch.log(w.clamp_min(torch.finfo(logp.dtype).tiny)).unsqueeze(-1), dim=1)


def _sigmoid_attention(logit: torch.Tensor) -> torch.Tensor:
    """Pooling weights ``sigmoid(s_k) / sum_j sigmoid(s_j)`` of attention logits ``s[B, K]`` -> ``[B, K]``."""
    gate = torch.sigmoid(logit)
    return gate / gate.sum(1, keepdim=True)


class AttentionMILAggregator(nn.Module):
    """Attention-based deep MIL pooling (Ilse, Tomczak & Welling 2018), optionally gated.

    ``last_attention`` holds the attention ``[B, K]`` of the latest call (detached), for heatmaps.

    ``attention``: ``"softmax"`` (the paper) or ``"sigmoid"``: weights ``sigmoid(s_k) / sum_j sigmoid(s_j)`` of the
    attention logits ``s_k``, saturating gates under which the patches the attention is sure of weigh about the
    same (a majority of informative patches outweighs a minority); both are uniform when the logits are equal.

    ``mean_skip``: add the mean aggregator and zero-initialise the attention path's head (it starts as the mean
    aggregator; the attention-weighted logits are learnt on top).
    """

    def __init__(
        self,
        dim: int,
        num_classes: int,
        *,
        hidden: int = 128,
        gated: bool = True,
        dropout: float = 0.0,
        attention: str = "softmax",
        mean_skip: bool = False,
    ):
        super().__init__()
        if attention not in ("softmax", "sigmoid"):
            raise ValueError(f"attention must be 'softmax' or 'sigmoid', got {attention!r}")
        self.attention = attention
        self.V = nn.Linear(dim, hidden)
        self.U = nn.Linear(dim, hidden) if gated else None
        self.w = nn.Linear(hidden, 1)
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, num_classes))
        self.skip = _mean_skip(self.head, dim, num_classes, dropout) if mean_skip else None
        self.last_attention: torch.Tensor | None = None

    def forward(
        self, features: torch.Tensor, positions: torch.Tensor | None = None, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check(features, positions, weights)
        h = _scale(features, weights)
        a = torch.tanh(self.V(h))
        if self.U is not None:
            a = a * torch.sigmoid(self.U(h))
        logit = self.w(a).squeeze(-1)  # [B, K]
        if self.attention == "sigmoid":
            att = _sigmoid_attention(logit)
        else:
            att = torch.softmax(logit, dim=1)
        self.last_attention = att.detach()
        out = self.head((att.unsqueeze(-1) * h).sum(1))
        return out if self.skip is None else out + self.skip(h.mean(1))


def fourier_position_encoding(positions: torch.Tensor, num_frequencies: int) -> torch.Tensor:
    """``[..., 2]`` positions in [0, 1] -> ``[..., 4 * num_frequencies]`` of ``sin, cos(2^i * pi * p)``."""
    freqs = (2.0 ** torch.arange(num_frequencies, device=positions.device, dtype=positions.dtype)) * math.pi
    ang = positions.unsqueeze(-1) * freqs  # [..., 2, F]
    return torch.cat([ang.sin(), ang.cos()], dim=-1).flatten(-2)


class TransformerAggregator(nn.Module):
    """Self-attention over patch tokens with a position encoding and a CLS token.

    Args:
        dim: input feature size D.
        num_classes: C.
        hidden: token width (a multiple of ``heads``).
        layers: number of encoder layers.
        heads: attention heads.
        num_frequencies: Fourier frequencies per coordinate of the position encoding; 0: no position encoding
            (the tokens are the patch features alone, and the output does not depend on where the patches are).
        dropout: dropout inside the encoder and before the head.
        readout: ``"mean"`` (default): the mean of the encoded patch tokens (the encoder layers are residual,
            so at initialisation this is close to the mean aggregator and the interactions are learnt on top;
            measured to train the scorer where the CLS readout did not, see ``benchmarks/RESULTS.md``);
            ``"logit_mean"``: every encoded token is classified (final norm + head) and the bag's logits are the
            mean of the tokens' logits, so a bag's prediction is the average of its patches' votes (after they
            have seen each other) and a bag of one patch is that patch's own vote, as with the mean aggregator;
            ``"cls"``: a learnt CLS token; or ``"gate"``: the encoded tokens only decide how much each patch
            counts — a linear map of each normed token gives a gate logit ``s_k``, and the bag is the attention-MIL
            pooling ``sum_k a_k f_k`` of the patch *features* with ``a_k = sigmoid(s_k) / sum_j sigmoid(s_j)``,
            classified by a linear head (attention-MIL whose attention sees the other patches; the classifier
            stays linear in the features). ``last_attention`` holds ``a``.
        mean_skip: add the mean aggregator (a linear head on the mean of the input features) and zero-initialise
            this aggregator's own head, so it starts as the mean aggregator and learns the interactions between
            patches on top of it.
    """

    def __init__(
        self,
        dim: int,
        num_classes: int,
        *,
        hidden: int = 128,
        layers: int = 2,
        heads: int = 4,
        num_frequencies: int = 8,
        dropout: float = 0.0,
        readout: str = "mean",
        mean_skip: bool = False,
    ):
        super().__init__()
        if readout not in READOUTS:
            raise ValueError(f"transformer readout must be one of {list(READOUTS)}, got {readout!r}")
        self.readout = readout
        if hidden % heads:
            raise ValueError(f"aggregator hidden ({hidden}) must be a multiple of heads ({heads})")
        if num_frequencies < 0:
            raise ValueError(f"num_frequencies must be >= 0, got {num_frequencies}")
        self.num_frequencies = num_frequencies
        self.inp = nn.Linear(dim, hidden)
        self.pos = nn.Linear(4 * num_frequencies, hidden) if num_frequencies else None
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        nn.init.normal_(self.cls, std=0.02)
        layer = nn.TransformerEncoderLayer(
            hidden, heads, dim_feedforward=2 * hidden, dropout=dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.gate = nn.Linear(hidden, 1) if readout == "gate" else None
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim if readout == "gate" else hidden, num_classes))
        self.skip = _mean_skip(self.head, dim, num_classes, dropout) if mean_skip else None
        self.last_attention: torch.Tensor | None = None

    def forward(
        self, features: torch.Tensor, positions: torch.Tensor | None = None, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check(features, positions, weights)
        scaled = _scale(features, weights)
        h = self.inp(scaled)
        if self.pos is not None:
            if positions is None:
                raise ValueError("the transformer aggregator with a position encoding needs positions [B, K, 2]")
            h = h + self.pos(fourier_position_encoding(positions.to(h.dtype), self.num_frequencies))
        if self.readout == "mean":
            out = self.head(self.norm(self.encoder(h).mean(1)))
        elif self.readout == "gate":
            att = _sigmoid_attention(self.gate(self.norm(self.encoder(h))).squeeze(-1))
            self.last_attention = att.detach()
            out = self.head((att.unsqueeze(-1) * scaled).sum(1))
        elif self.readout == "logit_mean":
            out = self.head(self.norm(self.encoder(h))).mean(1)
        else:
            tokens = torch.cat([self.cls.expand(h.shape[0], -1, -1).to(h.dtype), h], dim=1)
            out = self.head(self.norm(self.encoder(tokens)[:, 0]))
        return out if self.skip is None else out + self.skip(scaled.mean(1))


def build_aggregator(
    name: str,
    dim: int,
    num_classes: int,
    *,
    hidden: int = 128,
    gated: bool = True,
    layers: int = 2,
    heads: int = 4,
    num_frequencies: int = 8,
    dropout: float = 0.0,
    readout: str = "mean",
    mil_attention: str = "softmax",
    mean_skip: bool = False,
) -> nn.Module:
    """The aggregator called ``name`` (one of :data:`AGGREGATORS`)."""
    if mean_skip and name in AGGREGATORS and name not in MEAN_SKIP_AGGREGATORS:
        raise ValueError(f"mean_skip applies to the {' and '.join(MEAN_SKIP_AGGREGATORS)} aggregators, not {name!r}")
    if name == "mean":
        return MeanAggregator(dim, num_classes, dropout=dropout)
    if name == "max":
        return MaxAggregator(dim, num_classes, dropout=dropout)
    if name == "vote":
        return VoteAggregator(dim, num_classes, dropout=dropout)
    if name == "attention_mil":
        return AttentionMILAggregator(
            dim, num_classes, hidden=hidden, gated=gated, dropout=dropout, attention=mil_attention, mean_skip=mean_skip
        )
    if name == "transformer":
        return TransformerAggregator(
            dim,
            num_classes,
            hidden=hidden,
            layers=layers,
            heads=heads,
            num_frequencies=num_frequencies,
            dropout=dropout,
            readout=readout,
            mean_skip=mean_skip,
        )
    raise ValueError(f"aggregator must be one of {list(AGGREGATORS)}, got {name!r}")
