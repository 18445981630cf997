"""Pure-PyTorch operators: patch selection, losses and networks (no Ray, batch-first, CPU and CUDA)."""

_LAZY = {  # name -> module: imported on first use, so `import operators.errors` (e.g. by the tiler) does not load torch
    "AttentionMILAggregator": "operators.aggregators",
    "MaxAggregator": "operators.aggregators",
    "MeanAggregator": "operators.aggregators",
    "TransformerAggregator": "operators.aggregators",
    "build_aggregator": "operators.aggregators",
    "AttentionSampler": "operators.attention_sampling",
    "attention_entropy": "operators.attention_sampling",
    "attention_sample": "operators.attention_sampling",
    "slot_mode_sample": "operators.attention_sampling",
    "TorchScriptEncoder": "operators.encoders",
    "CellGate": "operators.gate",
    "fit_cluster_gate": "operators.gate",
    "spherical_kmeans": "operators.gate",
    "two_means_upper": "operators.gate",
    "LapSumTopK": "operators.lapsum",
    "lapsum_topk": "operators.lapsum",
    "FoveateModel": "operators.model",
    "ModelOutput": "operators.model",
    "Selection": "operators.model",
    "FeaturesConfig": "operators.model_config",
    "ModelConfig": "operators.model_config",
    "SlideGeometry": "operators.model_config",
    "MISTLoss": "operators.nms",
    "mist_loss": "operators.nms",
    "nms_topk": "operators.nms",
    "render_gaussian_heatmap": "operators.nms",
    "ResNet": "operators.resnet",
    "ResNetConfig": "operators.resnet",
    "ScorerCNN": "operators.scorer",
    "ScorerConfig": "operators.scorer",
    "cell_pool": "operators.scorer",
    "minmax_normalise": "operators.scorer",
    "SinkhornTopK": "operators.sinkhorn",
    "sinkhorn_topk": "operators.sinkhorn",
    "cap_support": "operators.soft_patches",
    "combine_patches": "operators.soft_patches",
    "PerturbedTopK": "operators.topk",
    "hard_topk": "operators.topk",
    "mask_sample": "operators.topk",
    "perturbed_topk": "operators.topk",
    "TopKCrossEntropyLoss": "operators.topk_loss",
    "topk_cross_entropy": "operators.topk_loss",
}

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


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'operators' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
