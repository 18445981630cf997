"""A small ResNet feature network for patches (He et al. 2016, basic blocks), written in the project.

No torchvision. Input patches are float ``[M, 3, p, p]`` in ``[0, 1]`` (the model divides the uint8 store pixels
by 255); the network centres them itself. Output is one feature vector per patch, ``[M, feature_dim]``.

Normalisation defaults to GroupNorm: the model embeds the K patches of one slide at a time, and BatchNorm
statistics over the patches of a single slide differ between training and inference. ``norm="batch"`` is
available for experiments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "ResNetConfig",
    "BasicBlock",
    "ResNet",
    "RunningStandardise",
    "running_standardise",
    "feature_moments",
    "set_exact_statistics",
    "encoder_state",
    "architecture_of",
    "check_architecture",
]


@dataclass(frozen=True)
class ResNetConfig:
    """The ResNet's own settings; the model builds them from its ``model.features`` section
    (:meth:`operators.model_config.FeaturesConfig.resnet`, ``kind: resnet``).

    Attributes:
        widths: channels of the 4 (or any number of) stages; the first stage keeps resolution, each later
            stage halves it.
        blocks: basic blocks per stage (same length as ``widths``).
        feature_dim: size of the output feature vector (a linear projection of the pooled last stage).
        norm: ``"group"`` (GroupNorm, default) or ``"batch"`` (BatchNorm2d).
        frozen: no parameter of the network receives gradients and it always runs in eval mode.
        weights: optional path to a ``state_dict`` file (``torch.save``) loaded at construction; nothing is
            downloaded.
    """

    widths: tuple[int, ...] = (16, 32, 64)
    blocks: tuple[int, ...] = (1, 1, 1)
    feature_dim: int = 64
    norm: str = "group"
    frozen: bool = False
    weights: str | None = None

    def __post_init__(self) -> None:
        if len(self.widths) < 1 or any((not isinstance(w, int)) or w < 1 for w in self.widths):
            raise ValueError(f"features.widths must be a non-empty list of positive ints, got {self.widths!r}")
        if len(self.blocks) != len(self.widths) or any((not isinstance(b, int)) or b < 1 for b in self.blocks):
            raise ValueError(
                f"features.blocks must list one positive int per stage ({len(self.widths)} stages), got {self.blocks!r}"
            )
        if not isinstance(self.feature_dim, int) or self.feature_dim < 1:
            raise ValueError(f"features.feature_dim must be a positive int, got {self.feature_dim!r}")
        if self.norm not in ("group", "batch"):
            raise ValueError(f"features.norm must be 'group' or 'batch', got {self.norm!r}")


def running_standardise(
    features: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """``(features - mean) / sqrt(var + eps)`` per feature: ``features[M, D]``, ``mean[D]``, ``var[D]`` -> ``[M, D]``."""
    return (features - mean.to(features.dtype)) / (var.to(features.dtype) + eps).sqrt()


class RunningStandardise(nn.Module):
    """Standardise features with running statistics, in training and at inference alike.

    Unlike BatchNorm, training never normalises with the statistics of the batch itself: a slide's patches are
    standardised by the same mean and variance at training and at inference, so no statistic of one slide is
    subtracted from its own features; the running mean and variance follow the training batches (an exponential
    moving average, ``momentum`` per call; the first training call sets them), without gradient through them.
    The point is scale: the pooled features of a bag vary across slides by a few percent of their magnitude,
    and a linear head on them learns slowly from slide labels (benchmarks/RESULTS.md, "The shape family").

    Shapes: ``forward(features[M, D], stats_rows=None) -> [M, D]``; ``stats_rows`` (an int ``n`` or a bool mask
    ``[M]``): in training, only those rows (the first ``n``) update the statistics, every row is standardised.
    """

    def __init__(self, dim: int, momentum: float = 0.05, eps: float = 1e-5):
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not 0 < momentum <= 1:
            raise ValueError(f"momentum must be in (0, 1], got {momentum!r}")
        self.momentum, self.eps = float(momentum), float(eps)
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, features: torch.Tensor, stats_rows: int | torch.Tensor | None = None) -> torch.Tensor:
        rows = features
        if stats_rows is not None:
            if isinstance(stats_rows, torch.Tensor):
                if stats_rows.dtype != torch.bool or stats_rows.shape != features.shape[:1]:
                    raise ValueError(
                        f"stats_rows must be an int or a bool mask [{features.shape[0]}], got "
                        f"{stats_rows.dtype} {tuple(stats_rows.shape)}"
                    )
                rows = features[stats_rows]
            elif isinstance(stats_rows, bool) or not isinstance(stats_rows, int) or stats_rows < 0:
                raise ValueError(f"stats_rows must be an int >= 0 or a bool mask, got {stats_rows!r}")
            else:
                rows = features[:stats_rows]
        if self.training and rows.shape[0] > 1:
            with torch.no_grad():
                f = rows.detach().to(self.mean.dtype)
                m, v = f.mean(0), f.var(0)
                if int(self.count) == 0:
                    self.mean.copy_(m)
                    self.var.copy_(v)
                else:
                    self.mean.lerp_(m, self.momentum)
                    self.var.lerp_(v, self.momentum)
                self.count += 1
        return running_standardise(features, self.mean, self.var, self.eps)


@contextlib.contextmanager
def feature_moments(norm: RunningStandardise) -> Iterator[torch.Tensor]:
    """Within the block, every call of ``norm`` adds its input rows to the yielded moments ``[2 * D + 1]``
    (float64, CPU: the sum of the rows ``[D]``, the sum of their squares ``[D]``, the row count); ``norm``'s
    statistics are left as they are (set them with :func:`set_exact_statistics`, after summing the moments of
    several workers where there are)."""
    if not isinstance(norm, RunningStandardise):
        raise TypeError(f"norm must be a RunningStandardise, got {type(norm).__name__}")
    dim = norm.mean.numel()
    moments = torch.zeros(2 * dim + 1, dtype=torch.float64)

    def add(_module: nn.Module, args: tuple) -> None:
        f = args[0].detach().reshape(-1, dim).to("cpu", torch.float64)
        moments[:dim] += f.sum(0)
        moments[dim:-1] += (f * f).sum(0)
        moments[-1] += f.shape[0]

    hook = norm.register_forward_pre_hook(add)
    try:
        yield moments
    finally:
        hook.remove()


@torch.no_grad()
def set_exact_statistics(norm: RunningStandardise, moments: torch.Tensor) -> int:
    """Set ``norm``'s mean and (unbiased) variance from :func:`feature_moments`' ``moments`` ``[2 * D + 1]``;
    fewer than two rows leave them as they are. Returns the row count. SWA's ``update_bn`` does the same for
    BatchNorm: statistics of the final weights on the training data instead of a running average of the last
    batches."""
    dim = norm.mean.numel()
    if moments.shape != (2 * dim + 1,):
        raise ValueError(f"moments must have shape ({2 * dim + 1},) for {dim} features, got {tuple(moments.shape)}")
    moments = moments.to(torch.float64)
    n = float(moments[-1])
    if n >= 2:
        mean = moments[:dim] / n
        var = ((moments[dim:-1] - n * mean * mean) / (n - 1)).clamp_min(0.0)
        norm.mean.copy_(mean.to(norm.mean))
        norm.var.copy_(var.to(norm.var))
    return int(n)


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    groups = 8
    while channels % groups:
        groups //= 2
    return nn.GroupNorm(groups, channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (1x1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.n1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.n2 = _norm(norm, cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm(norm, cout))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.n1(self.conv1(x)))
        y = self.n2(self.conv2(y))
        return self.act(y + (x if self.short is None else self.short(x)))


class ResNet(nn.Module):
    """Patch feature network: stem (3x3 conv stride 2 + max-pool), basic-block stages, global average pool,
    linear projection.

    Args:
        cfg: :class:`ResNetConfig`.

    Shapes:
        ``forward(patches[M, 3, p, p] float in [0, 1]) -> features[M, feature_dim]``; ``p >= 8``.
    """

    def __init__(self, cfg: ResNetConfig | None = None):
        super().__init__()
        cfg = cfg or ResNetConfig()
        self.cfg = cfg
        w0 = cfg.widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(3, w0, 3, stride=2, padding=1, bias=False),
            _norm(cfg.norm, w0),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers: list[nn.Module] = []
        cin = w0
        for i, (w, nb) in enumerate(zip(cfg.widths, cfg.blocks)):
            for j in range(nb):
                layers.append(BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1, cfg.norm))
                cin = w
        self.stages = nn.Sequential(*layers)
        self.proj = nn.Linear(cin, cfg.feature_dim)
        self.register_buffer("mean", torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor([0.25, 0.25, 0.25]).view(1, 3, 1, 1), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if cfg.weights:
            path = Path(cfg.weights)
            if not path.is_file():
                raise ValueError(
                    f"features.weights (model.features.init) must be an existing state_dict file, got {cfg.weights!r}"
                )
            state = encoder_state(torch.load(path, map_location="cpu", weights_only=True))
            check_architecture(cfg, state, where=f"model.features.init {cfg.weights!r}")
            self.load_state_dict(state)
        if cfg.frozen:
            self.requires_grad_(False)
            super().train(False)

    @property
    def feature_dim(self) -> int:
        return self.cfg.feature_dim

    def train(self, mode: bool = True) -> ResNet:
        """Frozen networks stay in eval mode."""
        return super().train(mode and not self.cfg.frozen)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if not isinstance(patches, torch.Tensor):
            raise TypeError(f"patches must be a torch.Tensor, got {type(patches).__name__}")
        if patches.dim() != 4 or patches.shape[1] != 3 or not patches.is_floating_point():
            raise ValueError(
                f"patches must be float [M, 3, p, p], got shape {tuple(patches.shape)} dtype {patches.dtype}"
            )
        if patches.shape[0] == 0:
            return patches.new_zeros((0, self.cfg.feature_dim))
        x = (patches - self.mean.to(patches.dtype)) / self.std.to(patches.dtype)
        return self.proj(self.stages(self.stem(x)).mean(dim=(2, 3)))


def encoder_state(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` without the running feature standardisation an earlier version kept inside the ResNet
    (``standardise.*``): it is the model's now (``FoveateModel.feature_norm``), after any encoder."""
    return {k: v for k, v in state_dict.items() if not k.startswith("standardise.")}


def architecture_of(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The ``widths``, ``blocks``, ``feature_dim`` and ``norm`` of the :class:`ResNet` that wrote ``state_dict``
    (read from its tensor names and shapes: a stage starts at each block with a strided shortcut).

    Raises:
        ValueError: ``state_dict`` is not a ResNet state dict of this module.
    """
    if not isinstance(state_dict, Mapping) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"a ResNet state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    blocks = sorted(
        {int(k.split(".")[1]) for k in state_dict if k.startswith("stages.") and k.endswith(".conv1.weight")}
    )
    if "stem.0.weight" not in state_dict or "proj.weight" not in state_dict or blocks != list(range(len(blocks))):
        raise ValueError(
            "not a state_dict of foveate's ResNet (expected stem.0.weight, stages.<i>.conv1.weight, proj.weight), got "
            f"keys {sorted(state_dict)[:6]}{' ...' if len(state_dict) > 6 else ''}"
        )
    widths: list[int] = []
    counts: list[int] = []
    for i in blocks:
        w = int(state_dict[f"stages.{i}.conv1.weight"].shape[0])
        strided = f"stages.{i}.short.0.weight" in state_dict and i > 0
        if not widths or strided:
            widths.append(w)
            counts.append(1)
        else:
            counts[-1] += 1
    if not widths:
        widths, counts = [int(state_dict["stem.0.weight"].shape[0])], [0]
    norm = "batch" if "stem.1.running_mean" in state_dict else "group"
    return {
        "widths": tuple(widths),
        "blocks": tuple(counts),
        "feature_dim": int(state_dict["proj.weight"].shape[0]),
        "norm": norm,
    }


def check_architecture(cfg: ResNetConfig, state_dict: Mapping[str, torch.Tensor], *, where: str) -> None:
    """Raise ``ValueError`` (naming ``where``, the configured and the file's architecture) unless ``state_dict``
    was written by a :class:`ResNet` of ``cfg``'s widths, blocks, feature_dim and norm."""
    found = architecture_of(state_dict)
    want = {
        "widths": tuple(cfg.widths),
        "blocks": tuple(cfg.blocks),
        "feature_dim": cfg.feature_dim,
        "norm": cfg.norm,
    }
    if found != want:
        diff = [k for k in want if want[k] != found[k]]

        def show(d: dict[str, Any]) -> str:
            return ", ".join(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in d.items())

        raise ValueError(
            f"{where}: the encoder's architecture differs from model.features in {diff}: model.features has "
            f"{show(want)}; the pretrained encoder has {show(found)}; set model.features to the encoder's"
        )
