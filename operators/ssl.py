"""Self-supervised pretraining of the patch encoder: SimCLR and BYOL, and their augmentations (pure PyTorch).

* SimCLR (Chen et al. 2020, "A Simple Framework for Contrastive Learning of Visual Representations"): two
  augmented views of each patch, an encoder and a projection head, and the NT-Xent loss (:func:`nt_xent`): each
  view must pick its partner among the other ``2N - 2`` views of the batch by cosine similarity / temperature.
* BYOL (Grill et al. 2020, "Bootstrap Your Own Latent"): an online network (encoder, projector, predictor) predicts
  the projection of the other view made by a target network (encoder, projector) whose weights are an exponential
  moving average of the online ones (:func:`ema_update`); the loss is the normalised MSE
  (:func:`byol_loss`, ``2 - 2 cos``), symmetrised over the two views; no negatives.

Augmentations (:func:`augment`, :class:`AugmentSpec`), batched on tensors and drawn from a ``torch.Generator``
(no torchvision): random resized crop with a random flip / 90° rotation (one ``grid_sample``), colour jitter
(brightness, contrast, saturation, a hue rotation in YIQ space), grayscale and Gaussian blur. Patches are float
``[N, 3, s, s]`` in [0, 1] as the ResNet takes them (:mod:`operators.resnet`).

The losses are plain functions; :class:`SimCLR` and :class:`BYOL` are thin modules holding the heads, both with
``forward(view1, view2) -> loss`` (a 0-d tensor).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from operators._checks import check_tensor

__all__ = [
    "OBJECTIVES",
    "AugmentSpec",
    "augment",
    "nt_xent",
    "byol_loss",
    "ema_update",
    "MLPHead",
    "SimCLR",
    "BYOL",
    "build_objective",
]

OBJECTIVES = ("simclr", "byol")


# ---------------------------------------------------------------------------------------------- checks
def _check_pair(a: object, b: object, names: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor(a, names[0])
    check_tensor(b, names[1])
    for t, name in ((a, names[0]), (b, names[1])):
        if t.dim() != 2 or not t.is_floating_point() or t.shape[0] < 1 or t.shape[1] < 1:
            raise ValueError(
                f"{name} must be a float tensor [N, D] with N, D >= 1, got shape {tuple(t.shape)} dtype {t.dtype}"
            )
    if a.shape != b.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return a, b


def _check_number(name: str, v: object, lo: float, hi: float = math.inf, *, lo_open: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        raise ValueError(f"{name} must be a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _check_images(x: object, name: str = "patches") -> torch.Tensor:
    check_tensor(x, name)
    if x.dim() != 4 or x.shape[1] != 3 or not x.is_floating_point():
        raise ValueError(f"{name} must be float [N, 3, s, s], got shape {tuple(x.shape)} dtype {x.dtype}")
    return x


# ---------------------------------------------------------------------------------------------- losses
def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """NT-Xent, the normalised temperature-scaled cross-entropy of SimCLR (Chen et al. 2020, eq. 1).

    With ``u = normalise(cat(z1, z2))`` (``2N`` unit vectors) and ``s_ij = u_i . u_j / temperature``, view ``i``'s
    positive is its other view ``j(i) = (i + N) mod 2N``:
    ``loss = mean_i [ -s_{i j(i)} + log sum_{k != i} exp(s_ik) ]`` over all ``2N`` views.

    Args:
        z1: ``[N, D]`` projections of the first views.
        z2: ``[N, D]`` projections of the second views (row ``n`` of both comes from the same patch).
        temperature: ``> 0``.

    Returns:
        0-d tensor, the mean loss over the ``2N`` views (``log(2N - 1)`` when every similarity is equal).

    Raises:
        TypeError / ValueError: non-tensors, shapes other than equal ``[N, D]``, a temperature that is not a
            finite number ``> 0``.
    """
    _check_pair(z1, z2, ("z1", "z2"))
    t = _check_number("temperature", temperature, 0.0)
    n = z1.shape[0]
    u = F.normalize(torch.cat([z1, z2], 0), dim=1)
    sim = (u @ u.t()) / t
    eye = torch.eye(2 * n, dtype=torch.bool, device=u.device)
    sim = sim.masked_fill(eye, float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(u.device)
    return F.cross_entropy(sim, target)


def byol_loss(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """BYOL's normalised MSE (Grill et al. 2020, eq. 2): ``mean_n || p_n/|p_n| - z_n/|z_n| ||^2 = 2 - 2 cos``.

    The target ``z`` is detached (the stop-gradient of the target network); symmetrise by calling it for both
    view orders.

    Args:
        p: ``[N, D]`` online predictions of one view.
        z: ``[N, D]`` target projections of the other view.

    Returns:
        0-d tensor in [0, 4].
    """
    _check_pair(p, z, ("p", "z"))
    return (2.0 - 2.0 * (F.normalize(p, dim=1) * F.normalize(z.detach(), dim=1)).sum(1)).mean()


@torch.no_grad()
def ema_update(target: nn.Module, online: nn.Module, momentum: float) -> None:
    """``target = momentum * target + (1 - momentum) * online`` for every parameter (BYOL's target network);
    buffers are copied. The two modules must have the same structure.

    Raises:
        ValueError: ``momentum`` outside [0, 1], or modules with different parameter shapes.
    """
    m = _check_number("momentum", momentum, 0.0, 1.0, lo_open=False)
    tp, op = list(target.parameters()), list(online.parameters())
    if len(tp) != len(op) or any(a.shape != b.shape for a, b in zip(tp, op)):
        raise ValueError("target and online must have the same parameters (shapes), got different modules")
    for a, b in zip(tp, op):
        a.lerp_(b.detach(), 1.0 - m)
    for a, b in zip(target.buffers(), online.buffers()):
        a.copy_(b)


# ---------------------------------------------------------------------------------------------- augmentations
@dataclass(frozen=True)
class AugmentSpec:
    """Strengths of the view augmentations (SimCLR's recipe; hue and blur toned down for stained tissue).

    Attributes:
        crop_scale: area fraction range of the random resized crop.
        crop_ratio: aspect ratio range of the crop.
        dihedral: random flip and 90° rotation (the 8 symmetries of a square; tissue has no up).
        jitter_p: probability of colour jitter per view.
        brightness, contrast, saturation: the factor is drawn from ``[1 - v, 1 + v]``.
        hue: the hue rotation angle is drawn from ``[-hue, hue] * pi`` (in YIQ space).
        grayscale_p: probability of a grayscale view.
        blur_p: probability of a Gaussian blur; ``blur_sigma`` its sigma range in output pixels.
    """

    crop_scale: tuple[float, float] = (0.3, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    dihedral: bool = True
    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.1
    grayscale_p: float = 0.2
    blur_p: float = 0.5
    blur_sigma: tuple[float, float] = (0.1, 1.5)

    def __post_init__(self) -> None:
        lo, hi = self.crop_scale
        if not (0 < lo <= hi <= 1):
            raise ValueError(f"crop_scale must be (lo, hi) with 0 < lo <= hi <= 1, got {self.crop_scale!r}")
        lo, hi = self.crop_ratio
        if not (0 < lo <= hi):
            raise ValueError(f"crop_ratio must be (lo, hi) with 0 < lo <= hi, got {self.crop_ratio!r}")
        for name in ("jitter_p", "grayscale_p", "blur_p", "hue"):
            _check_number(name, getattr(self, name), 0.0, 1.0, lo_open=False)
        for name in ("brightness", "contrast", "saturation"):
            _check_number(name, getattr(self, name), 0.0, 1.0, lo_open=False)
        lo, hi = self.blur_sigma
        if not (0 < lo <= hi):
            raise ValueError(f"blur_sigma must be (lo, hi) with 0 < lo <= hi, got {self.blur_sigma!r}")


def _uniform(n: int, lo: float, hi: float, g: torch.Generator, device: torch.device) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=g, device=device)


def _crop_theta(n: int, spec: AugmentSpec, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """``[n, 2, 3]`` affine maps (output -> input, normalised coordinates): a random resized crop, then a random
    element of the dihedral group of the square."""
    area = _uniform(n, *spec.crop_scale, g, device)
    log_r = _uniform(n, math.log(spec.crop_ratio[0]), math.log(spec.crop_ratio[1]), g, device)
    ratio = torch.exp(log_r)
    w = torch.sqrt(area * ratio).clamp(max=1.0)  # crop width / image width
    h = torch.sqrt(area / ratio).clamp(max=1.0)
    cx = (2 * torch.rand(n, generator=g, device=device) - 1) * (1 - w)  # centre so the crop stays inside
    cy = (2 * torch.rand(n, generator=g, device=device) - 1) * (1 - h)
    theta = torch.zeros(n, 2, 3, device=device)
    theta[:, 0, 0], theta[:, 1, 1], theta[:, 0, 2], theta[:, 1, 2] = w, h, cx, cy
    if spec.dihedral:
        k = torch.randint(0, 4, (n,), generator=g, device=device)
        flip = torch.randint(0, 2, (n,), generator=g, device=device).to(theta.dtype) * 2 - 1
        cos = torch.tensor([1.0, 0.0, -1.0, 0.0], device=device)[k]
        sin = torch.tensor([0.0, 1.0, 0.0, -1.0], device=device)[k]
        rot = torch.stack([torch.stack([cos * flip, -sin], -1), torch.stack([sin * flip, cos], -1)], 1)  # [n, 2, 2]
        theta[:, :, :2] = theta[:, :, :2] @ rot
    return theta


def _gray(x: torch.Tensor) -> torch.Tensor:
    """Luma (ITU-R BT.601), ``[N, 1, h, w]``."""
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]).to(x.dtype)


def _hue_rotate(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate the chroma of each image by ``angle[N]`` radians in YIQ space (a linear approximation of a hue
    shift)."""
    to_yiq = torch.tensor(
        [[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]], dtype=x.dtype, device=x.device
    )
    from_yiq = torch.linalg.inv(to_yiq)
    c, s = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    one, zero = torch.ones_like(c), torch.zeros_like(c)
    rot = torch.stack(
        [torch.stack([one, zero, zero], -1), torch.stack([zero, c, -s], -1), torch.stack([zero, s, c], -1)], 1
    )  # [N, 3, 3]
    m = from_yiq @ rot @ to_yiq
    return torch.einsum("nij,njhw->nihw", m, x)


def _blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian blur of each image with its own ``sigma[N]`` (pixels; reflect padding)."""
    n, c, h, w = x.shape
    radius = max(1, min(int(math.ceil(3 * float(sigma.max()))), (min(h, w) - 1) // 2))
    if min(h, w) < 3:
        return x
    t = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-0.5 * (t[None] / sigma[:, None].to(x.dtype)) ** 2)
    k = (k / k.sum(1, keepdim=True)).repeat_interleave(c, 0)  # [N*c, 2r+1]
    y = F.pad(x.reshape(1, n * c, h, w), (radius, radius, radius, radius), mode="reflect")
    y = F.conv2d(y, k[:, None, None, :], groups=n * c)
    y = F.conv2d(y, k[:, None, :, None], groups=n * c)
    return y.reshape(n, c, h, w)


def augment(
    x: torch.Tensor, generator: torch.Generator, spec: AugmentSpec | None = None, *, size: int | None = None
) -> torch.Tensor:
    """One random view of each patch (SimCLR's augmentation pipeline, batched).

    In order: random resized crop (bilinear, resized to ``size``) with a random flip / 90° rotation, colour jitter
    with probability ``jitter_p`` (brightness, contrast, saturation, hue; each factor drawn per view), grayscale
    with probability ``grayscale_p``, Gaussian blur with probability ``blur_p``; clamped to [0, 1]. Every random
    number comes from ``generator`` (on ``x``'s device), so a seeded generator gives the same views.

    Args:
        x: float ``[N, 3, s, s]`` in [0, 1].
        generator: a ``torch.Generator`` on ``x``'s device.
        spec: :class:`AugmentSpec` (default: its defaults).
        size: side of the output views (default: ``s``).

    Returns:
        float ``[N, 3, size, size]`` in [0, 1], ``x``'s dtype and device.
    """
    _check_images(x, "x")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if torch.device(generator.device).type != x.device.type:
        raise ValueError(f"generator must be on x's device ({x.device}), got one on {generator.device}")
    spec = AugmentSpec() if spec is None else spec
    if not isinstance(spec, AugmentSpec):
        raise TypeError(f"spec must be an AugmentSpec or None, got {type(spec).__name__}")
    size = int(x.shape[-1]) if size is None else size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int (pixels) or None, got {size!r}")
    n, dev = x.shape[0], x.device
    if n == 0:
        return x.new_zeros((0, 3, size, size))
    theta = _crop_theta(n, spec, generator, dev).to(x.dtype)
    grid = F.affine_grid(theta, [n, 3, size, size], align_corners=False)
    y = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)

    def draw(p: float) -> torch.Tensor:  # [N, 1, 1, 1] bool: this view gets the transform
        return (torch.rand(n, generator=generator, device=dev) < p).view(n, 1, 1, 1)

    def factor(v: float) -> torch.Tensor:
        return _uniform(n, 1 - v, 1 + v, generator, dev).view(n, 1, 1, 1).to(x.dtype)

    jit = draw(spec.jitter_p)
    b, c, s = factor(spec.brightness), factor(spec.contrast), factor(spec.saturation)
    angle = _uniform(n, -spec.hue * math.pi, spec.hue * math.pi, generator, dev)
    j = (y * b).clamp(0, 1)
    j = ((j - _gray(j).mean((2, 3), keepdim=True)) * c + _gray(j).mean((2, 3), keepdim=True)).clamp(0, 1)
    j = ((j - _gray(j)) * s + _gray(j)).clamp(0, 1)
    j = _hue_rotate(j, angle).clamp(0, 1)
    y = torch.where(jit, j, y)
    y = torch.where(draw(spec.grayscale_p), _gray(y).expand_as(y), y)
    blur = draw(spec.blur_p)
    sigma = _uniform(n, *spec.blur_sigma, generator, dev)
    y = torch.where(blur, _blur(y, sigma), y)
    return y.clamp(0, 1)


# ---------------------------------------------------------------------------------------------- modules
class MLPHead(nn.Sequential):
    """``Linear(in, hidden) -> BatchNorm1d -> ReLU -> Linear(hidden, out)``: SimCLR's projection head, BYOL's
    projector and predictor. ``forward(x[N, in]) -> [N, out]``."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        for name, v in (("in_dim", in_dim), ("hidden", hidden), ("out_dim", out_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        super().__init__(
            nn.Linear(in_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.Linear(hidden, out_dim)
        )


def _check_encoder(encoder: object, feature_dim: object) -> int:
    if not isinstance(encoder, nn.Module):
        raise TypeError(f"encoder must be a torch.nn.Module, got {type(encoder).__name__}")
    if isinstance(feature_dim, bool) or not isinstance(feature_dim, int) or feature_dim < 1:
        raise ValueError(f"feature_dim must be an int >= 1 (the encoder's output size), got {feature_dim!r}")
    return feature_dim


class SimCLR(nn.Module):
    """SimCLR (Chen et al. 2020): ``encoder`` + projection head + :func:`nt_xent`.

    Args:
        encoder: maps ``[N, 3, s, s]`` to ``[N, feature_dim]`` (the patch ResNet).
        feature_dim: the encoder's output size.
        projection_dim: size of the projections the loss compares.
        hidden: hidden size of the head (default: ``feature_dim``).
        temperature: NT-Xent temperature (> 0).

    Shapes:
        ``forward(view1[N, 3, s, s], view2[N, 3, s, s]) -> loss`` (0-d); ``N >= 2`` (BatchNorm in the head).
    """

    def __init__(
        self,
        encoder: nn.Module,
        feature_dim: int,
        projection_dim: int = 64,
        hidden: int | None = None,
        *,
        temperature: float = 0.1,
    ):
        super().__init__()
        d = _check_encoder(encoder, feature_dim)
        self.temperature = _check_number("temperature", temperature, 0.0)
        self.encoder = encoder
        self.head = MLPHead(d, hidden or d, projection_dim)

    def forward(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        _check_images(view1, "view1")
        _check_images(view2, "view2")
        z = self.head(self.encoder(torch.cat([view1, view2], 0)))
        z1, z2 = z.chunk(2, 0)
        return nt_xent(z1, z2, self.temperature)

    def after_step(self) -> None:
        """Nothing to do after an optimizer step (BYOL moves its target there)."""


class BYOL(nn.Module):
    """BYOL (Grill et al. 2020): online encoder + projector + predictor, a target encoder + projector following
    them by EMA (:meth:`after_step`), the symmetrised :func:`byol_loss`.

    Args:
        encoder: the online encoder (the target starts as a copy).
        feature_dim: the encoder's output size.
        projection_dim: size of the projections.
        hidden: hidden size of the projector and predictor (default: ``2 * feature_dim``).
        momentum: EMA momentum of the target (BYOL's tau, in [0, 1]).

    Shapes:
        ``forward(view1[N, 3, s, s], view2[N, 3, s, s]) -> loss`` (0-d, in [0, 8]); ``N >= 2``.
    """

    def __init__(
        self,
        encoder: nn.Module,
        feature_dim: int,
        projection_dim: int = 64,
        hidden: int | None = None,
        *,
        momentum: float = 0.99,
    ):
        super().__init__()
        d = _check_encoder(encoder, feature_dim)
        self.momentum = _check_number("momentum", momentum, 0.0, 1.0, lo_open=False)
        hidden = hidden or 2 * d
        self.encoder = encoder
        self.projector = MLPHead(d, hidden, projection_dim)
        self.predictor = MLPHead(projection_dim, hidden, projection_dim)
        self.target = nn.Sequential(copy.deepcopy(encoder), copy.deepcopy(self.projector)).requires_grad_(False)

    def forward(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        _check_images(view1, "view1")
        _check_images(view2, "view2")
        both = torch.cat([view1, view2], 0)
        p1, p2 = self.predictor(self.projector(self.encoder(both))).chunk(2, 0)
        with torch.no_grad():
            z1, z2 = self.target(both).chunk(2, 0)
        return byol_loss(p1, z2) + byol_loss(p2, z1)

    def after_step(self) -> None:
        """Move the target network towards the online one (:func:`ema_update` with ``momentum``)."""
        ema_update(self.target, nn.Sequential(self.encoder, self.projector), self.momentum)


def build_objective(
    objective: str,
    encoder: nn.Module,
    feature_dim: int,
    *,
    projection_dim: int = 64,
    temperature: float = 0.1,
    momentum: float = 0.99,
) -> SimCLR | BYOL:
    """:class:`SimCLR` or :class:`BYOL` around ``encoder`` (``objective`` one of :data:`OBJECTIVES`)."""
    if objective == "simclr":
        return SimCLR(encoder, feature_dim, projection_dim, temperature=temperature)
    if objective == "byol":
        return BYOL(encoder, feature_dim, projection_dim, momentum=momentum)
    raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {objective!r}")
