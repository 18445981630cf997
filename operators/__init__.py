"""Pure-PyTorch operators: patch selection, losses and networks (no Ray, batch-first, CPU and CUDA)."""

from operators.aggregators import (
    AttentionMILAggregator,
    MaxAggregator,
    MeanAggregator,
    TransformerAggregator,
    build_aggregator,
)
from operators.attention_sampling import AttentionSampler, attention_entropy, attention_sample, slot_mode_sample
from operators.encoders import TorchScriptEncoder
from operators.gate import CellGate, fit_cluster_gate, spherical_kmeans, two_means_upper
from operators.lapsum import LapSumTopK, lapsum_topk
from operators.model import FoveateModel, ModelOutput, Selection
from operators.model_config import FeaturesConfig, ModelConfig, SlideGeometry
from operators.nms import MISTLoss, mist_loss, nms_topk, render_gaussian_heatmap
from operators.resnet import ResNet, ResNetConfig
from operators.scorer import ScorerCNN, ScorerConfig, cell_pool, minmax_normalise
from operators.sinkhorn import SinkhornTopK, sinkhorn_topk
from operators.soft_patches import cap_support, combine_patches
from operators.topk import PerturbedTopK, hard_topk, mask_sample, perturbed_topk
from operators.topk_loss import TopKCrossEntropyLoss, topk_cross_entropy

__all__ = [
    # model (H5)
    "AttentionMILAggregator",
    "FeaturesConfig",
    "FoveateModel",
    "MaxAggregator",
    "MeanAggregator",
    "ModelConfig",
    "SlideGeometry",
    "ModelOutput",
    "ResNet",
    "ResNetConfig",
    "ScorerCNN",
    "ScorerConfig",
    "Selection",
    "TorchScriptEncoder",
    "TransformerAggregator",
    "build_aggregator",
    "cap_support",
    "cell_pool",
    "combine_patches",
    "minmax_normalise",
    # selection operators
    "AttentionSampler",
    "LapSumTopK",
    "MISTLoss",
    "PerturbedTopK",
    "SinkhornTopK",
    "TopKCrossEntropyLoss",
    "attention_entropy",
    "attention_sample",
    "slot_mode_sample",
    "hard_topk",
    "lapsum_topk",
    "mask_sample",
    "mist_loss",
    "nms_topk",
    "perturbed_topk",
    # the cluster gate of two-phase training
    "CellGate",
    "fit_cluster_gate",
    "spherical_kmeans",
    "two_means_upper",
    "render_gaussian_heatmap",
    "sinkhorn_topk",
    "topk_cross_entropy",
]
