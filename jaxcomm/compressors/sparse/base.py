"""What the sparsifiers share: a payload of ``(values, int32 indices)``, all-gathered
and scatter-added into a dense vector."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm import core


def scatter_add(
    d: int, dtype: Any, idx: jax.Array, vals: jax.Array, fill: jax.Array | None = None
) -> jax.Array:
    """Dense ``(d,)`` zeros (or the scalar ``fill``) with ``vals`` added at ``idx``."""
    base = jnp.zeros((d,), dtype) if fill is None else jnp.full((d,), fill, dtype)
    return base.at[idx.reshape(-1)].add(vals.reshape(-1).astype(dtype))


class SparseCompressor(core.CompressorBase):
    """Payload ``(values, int32 indices)``, all-gathered and scatter-added."""

    kind = "all_gather"

    def decode(self, payload, aux, d, dtype):
        vals, idx = payload
        return scatter_add(d, dtype, idx, vals)

    def _sent(self, payload, aux):
        """``(values, indices)`` this worker sent."""
        return payload

    def residual(self, p, payload, aux):
        vals, idx = self._sent(payload, aux)
        # p[idx] - p[idx] is exactly 0: sent entries leave nothing behind.
        return p.at[idx].add(-vals)

    def residual_checked(self, p, e, kept, payload, aux, ok):
        # What was sent, subtracted from kept (one pass over g and e, p not written
        # out). Where not ok the indices point past the end and are dropped: adding
        # -0.0 instead would flush subnormal residual entries on XLA:CPU.
        vals, idx = self._sent(payload, aux)
        idx = jnp.where(ok, idx, p.shape[0])
        return kept().at[idx].add(-vals, mode="drop")

    def decode_mean(self, received, aux, d, dtype, n):
        vals, idx = received
        # scale the n*k received values, not the dense d-vector
        return scatter_add(d, dtype, idx, vals.astype(dtype) / jnp.asarray(n, dtype))


def decode_mean_checked(self, received, aux, d, dtype, n, ok):
    """:meth:`SparseCompressor.decode_mean` with the NaN rule in the fill the values are added to
    (NaN + x is NaN): no select over ``d``. Bit for bit the select's result for top-k and
    threshold (tests/test_golden.py holds it). Random-k keeps the default select (its
    decode rescales after the sum; with this fill its golden digests changed)."""
    vals, idx = received
    fill = jnp.where(ok, jnp.zeros((), dtype), jnp.asarray(jnp.nan, dtype))
    return scatter_add(d, dtype, idx, vals.astype(dtype) / jnp.asarray(n, dtype), fill)
