"""Attention sampling (being implemented)."""

__all__ = ["attention_sample", "attention_entropy", "AttentionSampler", ]


def attention_sample(*args, **kwargs):
    raise NotImplementedError("attention_sample")


def attention_entropy(*args, **kwargs):
    raise NotImplementedError("attention_entropy")


class AttentionSampler:  # placeholder until implemented
    def __init__(self, *a, **k):
        raise NotImplementedError("AttentionSampler")
