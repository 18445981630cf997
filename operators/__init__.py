"""Pure-PyTorch operators: patch selection, losses and networks (no Ray, batch-first, CPU and CUDA)."""

from operators.attention_sampling import AttentionSampler, attention_entropy, attention_sample
from operators.lapsum import LapSumTopK, lapsum_topk
from operators.nms import MISTLoss, mist_loss, nms_topk
from operators.sinkhorn import SinkhornTopK, sinkhorn_topk
from operators.topk import PerturbedTopK, hard_topk, perturbed_topk
from operators.topk_loss import TopKCrossEntropyLoss

__all__ = [
    "AttentionSampler",
    "LapSumTopK",
    "MISTLoss",
    "PerturbedTopK",
    "SinkhornTopK",
    "TopKCrossEntropyLoss",
    "attention_entropy",
    "attention_sample",
    "hard_topk",
    "lapsum_topk",
    "mist_loss",
    "nms_topk",
    "perturbed_topk",
    "sinkhorn_topk",
]
