"""LapSum top-k (being implemented)."""

__all__ = ["lapsum_topk", "LapSumTopK", ]


def lapsum_topk(*args, **kwargs):
    raise NotImplementedError("lapsum_topk")


class LapSumTopK:  # placeholder until implemented
    def __init__(self, *a, **k):
        raise NotImplementedError("LapSumTopK")
