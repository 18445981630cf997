"""Hard and perturbed top-k (being implemented)."""

__all__ = ["hard_topk", "perturbed_topk", "PerturbedTopK", ]


def hard_topk(*args, **kwargs):
    raise NotImplementedError("hard_topk")


def perturbed_topk(*args, **kwargs):
    raise NotImplementedError("perturbed_topk")


class PerturbedTopK:  # placeholder until implemented
    def __init__(self, *a, **k):
        raise NotImplementedError("PerturbedTopK")
