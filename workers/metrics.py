"""Classification metrics of a set of predictions (plain numpy; used by the trainer and the reports)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["roc_auc", "classification_metrics"]


def roc_auc(y_true: np.ndarray, y_score: np.ndarray) -> float:
    """Binary ROC AUC (Mann–Whitney U with mid-ranks for ties); NaN if only one class is present."""
    y_true = np.asarray(y_true).astype(bool)
    y_score = np.asarray(y_score, dtype=np.float64)
    n_pos, n_neg = int(y_true.sum()), int((~y_true).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(y_score, kind="mergesort")
    ranks = np.empty(len(y_score), dtype=np.float64)
    sorted_scores = y_score[order]
    i = 0
    while i < len(sorted_scores):
        j = i
        while j + 1 < len(sorted_scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = 0.5 * (i + j) + 1.0
        i = j + 1
    return float((ranks[y_true].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def classification_metrics(targets: list[int] | np.ndarray, probs: np.ndarray, prefix: str = "") -> dict[str, float]:
    """Accuracy and AUC (binary: ROC AUC of class 1; multi-class: macro one-vs-rest over the classes present
    with both positives and negatives) from class probabilities ``probs`` (n, C)."""
    targets = np.asarray(targets, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float64).reshape(len(targets), -1)
    if len(targets) == 0:
        return {}
    out = {f"{prefix}accuracy": float((probs.argmax(1) == targets).mean())}
    if probs.shape[1] == 2:
        out[f"{prefix}auc"] = roc_auc(targets == 1, probs[:, 1])
    else:
        aucs = [roc_auc(targets == c, probs[:, c]) for c in range(probs.shape[1])]
        aucs = [a for a in aucs if not math.isnan(a)]
        out[f"{prefix}auc"] = float(np.mean(aucs)) if aucs else float("nan")
    return out
