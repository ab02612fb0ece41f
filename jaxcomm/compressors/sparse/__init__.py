"""Sparsifiers: top-k, random-k and the fast strided-block threshold top-k.

With error feedback (the default) the kept values are sent raw and what is
not sent stays in the residual. Without it, random-k rescales what it sends
so that the compressed gradient is unbiased.
"""

from jaxcomm.compressors.selection import kth_largest
from jaxcomm.compressors.sparse.random_k import RandomK, RandomKState, randomk
from jaxcomm.compressors.sparse.strided_threshold import (
    Threshold,
    ThresholdState,
    threshold,
    threshold_usage,
)
from jaxcomm.compressors.sparse.top_k import TopK, TopKState, topk

__all__ = [
    "topk",
    "randomk",
    "threshold",
    "threshold_usage",
    "TopK",
    "RandomK",
    "Threshold",
    "TopKState",
    "RandomKState",
    "ThresholdState",
    "kth_largest",
]
