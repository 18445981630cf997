"""Shared argument validation for the operators (private).

Every check raises ``TypeError`` for a wrong Python type and ``ValueError`` naming the argument, the value
given and what is allowed, as the project's standard asks. All checks are cheap: the finiteness check is one
reduction over the tensor (it synchronises on CUDA; pass ``check_finite=False`` to skip it where a caller
has already checked).
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "check_bool",
    "check_k",
    "check_k_float",
    "check_nonneg",
    "check_positive",
    "check_positive_int",
    "check_scores",
    "check_tensor",
]


def check_tensor(x: object, name: str) -> torch.Tensor:
    """Raise ``TypeError`` unless ``x`` is a ``torch.Tensor``; return it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_scores(
    scores: object,
    name: str = "scores",
    *,
    ndim: int = 2,
    floating: bool = True,
    check_finite: bool = True,
    min_last: int = 1,
) -> torch.Tensor:
    """Validate a batch-first score tensor.

    Args:
        scores: the tensor to check.
        name: argument name used in error messages.
        ndim: required rank (2 for ``[B, N]``, 3 for ``[B, H, W]``).
        floating: require a floating-point dtype.
        check_finite: reject NaN / ±inf entries.
        min_last: minimum size of every non-batch dimension (``N >= min_last``).

    Returns:
        ``scores`` unchanged.
    """
    check_tensor(scores, name)
    if scores.dim() != ndim:
        want = {2: "[B, N]", 3: "[B, H, W]"}.get(ndim, f"rank {ndim}")
        raise ValueError(f"{name} must have shape {want} (rank {ndim}), got shape {tuple(scores.shape)}")
    if floating and not scores.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got dtype {scores.dtype}"
        )
    if scores.shape[0] < 1 or any(s < min_last for s in scores.shape[1:]):
        raise ValueError(
            f"{name} must have B >= 1 and every other dimension >= {min_last}, got shape {tuple(scores.shape)}"
        )
    if check_finite and scores.numel() and not bool(torch.isfinite(scores).all()):
        n_bad = int((~torch.isfinite(scores)).sum())
        raise ValueError(
            f"{name} must be finite, got {n_bad} non-finite entries (NaN or inf) in shape {tuple(scores.shape)}"
        )
    return scores


def _is_int(k: object) -> bool:
    if isinstance(k, bool):
        return False
    if isinstance(k, numbers.Integral):
        return True
    if isinstance(k, torch.Tensor) and k.dim() == 0 and not k.is_floating_point() and k.dtype != torch.bool:
        return True
    return False


def check_k(k: object, n: int, name: str = "k") -> int:
    """Integer selection size with ``1 <= k <= n``; return it as a Python ``int``.

    Floats with an integral value (``3.0``) are rejected: pass an ``int``.
    """
    if not _is_int(k):
        if isinstance(k, (numbers.Real, torch.Tensor)) and not isinstance(k, bool):
            raise ValueError(f"{name} must be an integer with 1 <= {name} <= N={n}, got {k!r} ({type(k).__name__})")
        raise TypeError(f"{name} must be an int, got {type(k).__name__}")
    kk = int(k)
    if kk < 1 or kk > n:
        raise ValueError(f"{name} must satisfy 1 <= {name} <= N={n}, got {kk}")
    return kk


def check_k_float(k: object, n: int, name: str = "k") -> float:
    """Real (possibly fractional) selection size with ``0 < k < n``; return it as a Python ``float``."""
    if isinstance(k, torch.Tensor) and k.dim() == 0 and k.dtype != torch.bool:
        k = k.item()
    if isinstance(k, bool) or not isinstance(k, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(k).__name__}")
    kk = float(k)
    if not math.isfinite(kk) or not (0.0 < kk < n):
        raise ValueError(f"{name} must satisfy 0 < {name} < N={n} (fractional allowed), got {k!r}")
    return kk


def _real(x: object, name: str) -> float:
    if isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype != torch.bool:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return v


def check_nonneg(x: object, name: str) -> float:
    """Finite real ``x >= 0``; return it as a ``float``."""
    v = _real(x, name)
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {x!r}")
    return v


def check_positive(x: object, name: str) -> float:
    """Finite real ``x > 0``; return it as a ``float``."""
    v = _real(x, name)
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {x!r}")
    return v


def check_positive_int(x: object, name: str, minimum: int = 1) -> int:
    """Integer ``x >= minimum``; return it as an ``int``."""
    if not _is_int(x):
        if isinstance(x, numbers.Real) and not isinstance(x, bool):
            raise ValueError(f"{name} must be an integer >= {minimum}, got {x!r} ({type(x).__name__})")
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    v = int(x)
    if v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v}")
    return v


def check_bool(x: object, name: str) -> bool:
    """A Python ``bool``; return it."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} ({x!r})")
    return x
