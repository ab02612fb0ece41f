"""Random-k: ``k`` random entries, uniform or one per stratum; unbiased without error
feedback (rescaled by ``d/k``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import checks, collectives, core
from jaxcomm.compressors.blocks import require_key
from jaxcomm.compressors.sparse.base import SparseCompressor, scatter_add
from jaxcomm.options import Options, Unpack, take

RandomKState = core.state_type("RandomKState", __name__)


class RandomK(SparseCompressor):
    """``k`` random entries; uniform without replacement or one per stratum.

    ``sampling="uniform"``: k indices uniform without replacement (every
    entry kept with probability k/d; rescale d/k). ``sampling="stratified"``:
    the vector is cut into k contiguous strata of sizes floor/ceil(d/k) and one
    index is drawn uniformly in each (entry in stratum j kept with probability
    1/size_j; rescale size_j). Both keep each entry with the marginal
    probability that makes the rescaled estimate unbiased; stratified costs k
    random numbers instead of a permutation of d.
    """

    state_cls = RandomKState

    needs_key = True

    def __init__(self, ratio: float, *, shared: bool, rescale: bool, sampling: str):
        self.ratio = ratio
        self.kind = "psum" if shared else "all_gather"
        self.per_worker_key = not shared
        self.rescale = rescale
        self.sampling = sampling

    def slots(self, d: int) -> int:
        return core.num_kept(self.ratio, d)

    def _strata(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        k = self.slots(d)
        bounds = (np.arange(k + 1, dtype=np.int64) * d) // k
        return bounds[:-1], np.diff(bounds)

    def _indices(self, key, d: int) -> jax.Array:
        k = self.slots(d)
        if self.sampling == "uniform":
            # The k least of d random 32-bit words, as float32 (XLA's top-k is fast on
            # float32 only; a float holds the word exactly below 2^24, i.e. for ratios up
            # to 1/256, and rounds it above), rotated by a random shift: a uniform k-subset
            # up to ties at the boundary (equal words, or words a float does not tell
            # apart), which top-k gives to the lower index; the shift makes every index's
            # chance exactly k/d all the same. jax.random.choice(replace=False) shuffled all
            # d entries (several sorts): 52x slower at d = 2.4M on one CPU device.
            k_words, k_shift = jax.random.split(key)
            words = jax.random.bits(k_words, (d,), jnp.uint32)
            idx = jax.lax.top_k(-words.astype(jnp.float32), k)[1].astype(jnp.int32)
            shift = jax.random.randint(k_shift, (), 0, d, dtype=jnp.int32)
            return jnp.where(idx >= d - shift, idx - (d - shift), idx + shift)
        lo, size = self._strata(d)
        offs = jnp.floor(jax.random.uniform(key, (k,)) * size).astype(jnp.int32)
        return jnp.asarray(lo, jnp.int32) + jnp.minimum(offs, jnp.asarray(size - 1, jnp.int32))

    def _scale(self, d: int, dtype: Any):
        if not self.rescale:
            return None
        if self.sampling == "uniform":
            return jnp.asarray(d / self.slots(d), dtype)
        return jnp.asarray(self._strata(d)[1], dtype)

    def encode(self, p, key):
        idx = self._indices(key, p.shape[0])
        if self.kind == "psum":
            return (p[idx],), idx
        return (p[idx], idx), None

    def decode(self, payload, aux, d, dtype):
        if self.kind == "psum":
            vals, idx = payload[0], aux
        else:
            vals, idx = payload
        scale = self._scale(d, dtype)
        if scale is not None:
            vals = vals.astype(dtype) * scale
        return scatter_add(d, dtype, idx, vals)

    decode_mean = core.CompressorBase.decode_mean  # payload layouts differ from SparseCompressor's

    def _sent(self, payload, aux):
        return (payload[0], aux) if self.kind == "psum" else payload

    def residual(self, p, payload, aux):
        if self.rescale:
            return core.CompressorBase.residual(self, p, payload, aux)
        return super().residual(p, payload, aux)

    def residual_checked(self, p, e, kept, payload, aux, ok):
        if self.rescale:
            return core.CompressorBase.residual_checked(self, p, e, kept, payload, aux, ok)
        return super().residual_checked(p, e, kept, payload, aux, ok)

    def wire_size(self, d: int, dtype: Any, n_workers: int = 1) -> int:
        # Payload only; the 8-byte key agreement is once per step, not per leaf.
        if self.kind == "psum":  # bf16 sums move 4 bytes on XLA:CPU
            per_entry = collectives.moved_itemsize(dtype)
        else:
            per_entry = jnp.dtype(dtype).itemsize + 4
        return self.slots(d) * per_entry


def randomk(
    ratio: float,
    *,
    shared_indices: bool = True,
    sampling: str = "uniform",
    **options: Unpack[Options],
) -> optax.GradientTransformation:
    """Random-k sparsification: ``k = max(1, ceil(ratio·d))`` random entries per leaf.

    Rule: with ``shared_indices`` every worker draws the same indices from the shared
    key and the values are summed; otherwise each draws its own. Without error
    feedback the values are rescaled (d/k for uniform sampling): unbiased.
    Wire per worker per leaf: ``k·value bytes`` (psum) with ``shared_indices``, else
    ``k·(value bytes + 4)`` (all-gather).

    Args:
      ratio: fraction of entries kept, in (0, 1].
      shared_indices: same indices on every worker (psum of values only).
      sampling: ``"uniform"`` (without replacement) or ``"stratified"`` (one per stratum).
      **options: ``key`` (required; stored in the state, split each step),
        ``axis_name``, ``error_feedback`` (keeps unsent entries; if
        ``False``, rescale), ``min_size``, ``state_dtype``, ``bucket_bytes``:
        see :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = optax.chain(jaxcomm.randomk(0.01, key=jax.random.key(0)), optax.sgd(0.1))

    References:
      Stich et al., "Sparsified SGD with Memory", NeurIPS 2018, arXiv:1809.07599.
      Wangni et al., "Gradient Sparsification ...", NeurIPS 2018, arXiv:1710.09854.
    """
    # Notes. Without ``shared_indices`` the key is folded with the axis index and values + int32
    # indices are all-gathered. ``"uniform"`` costs a permutation of d; ``"stratified"`` (one
    # uniform index in each of k equal strata) costs k random numbers; see :class:`RandomK`. Also:
    # Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed Optimization",
    # NeurIPS 2018, arXiv:1710.09854.
    names = ("key", "axis_name", "error_feedback", "min_size", "state_dtype", "bucket_bytes")
    o = take("randomk", options, names)
    require_key(o["key"], "for randomk")
    if sampling not in ("uniform", "stratified"):
        raise ValueError(f"sampling: expected 'uniform' or 'stratified', got {sampling!r}")
    comp = RandomK(
        checks.check_ratio(ratio),
        shared=bool(shared_indices),
        rescale=not o["error_feedback"],
        sampling=sampling,
    )
    return core.compress(comp, **o)
