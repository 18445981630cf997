"""SOFT / Sinkhorn top-k (being implemented)."""

__all__ = ["sinkhorn_topk", "SinkhornTopK", ]


def sinkhorn_topk(*args, **kwargs):
    raise NotImplementedError("sinkhorn_topk")


class SinkhornTopK:  # placeholder until implemented
    def __init__(self, *a, **k):
        raise NotImplementedError("SinkhornTopK")
