"""Top-k: the entries of largest magnitude, selected exactly (``lax.top_k``)."""

from __future__ import annotations

import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import checks, core
from jaxcomm.compressors.sparse.base import SparseCompressor, decode_mean_checked
from jaxcomm.options import Options, Unpack, take

TopKState = core.state_type("TopKState", __name__)


class TopK(SparseCompressor):
    """The ``k = max(1, ceil(ratio*d))`` entries of largest magnitude (exact ``lax.top_k``)."""

    state_cls = TopKState

    def __init__(self, ratio: float):
        self.ratio = ratio

    def slots(self, d: int) -> int:
        return core.num_kept(self.ratio, d)

    def encode(self, p, key):
        _, idx = lax.top_k(jnp.abs(p), self.slots(p.shape[0]))
        return (p[idx], idx.astype(jnp.int32)), None

    decode_mean_checked = decode_mean_checked

    def all_finite(self, p, payload, aux):
        # lax.top_k ranks NaN and Inf above every finite magnitude: if p has a
        # non-finite entry, the first selected value is one.
        return jnp.all(jnp.isfinite(payload[0]))


def topk(ratio: float, **options: Unpack[Options]) -> optax.GradientTransformation:
    """Top-k sparsification with error feedback.

    Rule: each worker keeps the ``k = max(1, ceil(ratio·d))`` largest-magnitude entries
    of ``p = g + e``; the update is the mean of every worker's entries.
    Wire per worker per leaf: ``k·(value bytes + 4)``, all-gathered (cost grows with n).

    Args:
      ratio: fraction of entries kept, in (0, 1].
      **options: ``axis_name``, ``error_feedback``, ``scope`` (``"leaf"``: k
        per leaf; ``"global"``: k of the whole flattened tree of compressible
        leaves), ``min_size``, ``state_dtype``, ``bucket_bytes``: see
        :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1))

    References:
      Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017,
      arXiv:1704.05021. Stich et al., "Sparsified SGD with Memory", arXiv:1809.07599.
    """
    # Notes. Values and int32 indices are sent; jaxcomm.netsim has the all-gather's break-even
    # vs a ring. ``e`` is the residual; every worker's entries are scatter-added into zeros and
    # divided by n.
    names = ("axis_name", "error_feedback", "scope", "min_size", "state_dtype", "bucket_bytes")
    o = take("topk", options, names)
    return core.compress(TopK(checks.check_ratio(ratio)), **o)
