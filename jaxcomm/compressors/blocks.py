"""What the quantisers and the sign compressors share: float32 bucket views of a flat
gradient, the static worker count, and the decode summed over an all-gathered payload's
workers without building the ``(n, d)`` intermediate."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm import collectives
from jaxcomm.collectives import AxisName

__all__ = [
    "UNROLL",
    "axis_workers",
    "bucket_view",
    "buckets",
    "require_key",
    "sum_over_workers",
    "unbucket",
]

UNROLL = 16  # workers decoded in one fused pass; more go through a scan


def require_key(key: Any, why: str) -> None:
    if key is None:
        raise TypeError(f"key: a PRNG key is required {why}, e.g. key=jax.random.key(0)")


def axis_workers(axis_name: AxisName | None) -> int:
    """Static number of workers on ``axis_name`` (1 without an axis)."""
    return 1 if axis_name is None else collectives.axis_size(axis_name)


def buckets(p: jax.Array, bucket_size: int) -> jax.Array:
    """``p`` (d,) in float32, zero-padded and cut into ``(ceil(d/b), b)`` buckets."""
    d = p.shape[0]
    nb = math.ceil(d / bucket_size)
    x = p.astype(jnp.float32)
    return jnp.pad(x, (0, nb * bucket_size - d)).reshape(nb, bucket_size)


def unbucket(x: jax.Array, d: int) -> jax.Array:
    """Inverse of :func:`buckets` over the last two axes: ``(..., nb, b) -> (..., d)``."""
    return x.reshape(x.shape[:-2] + (-1,))[..., :d]


def sum_over_workers(decode_one: Callable[..., jax.Array], payload: tuple) -> jax.Array:
    """``Σ_w decode_one(*payload[w])`` over the leading worker axis of an all-gathered payload.

    Up to ``UNROLL`` workers: a sum of n static terms, which XLA fuses into one pass that
    reads every worker's packed codes and writes the ``(d,)`` result once (decode cost
    against a gradient copy: ``python -m experiments.bench.compressors``). More workers
    are streamed through a ``lax.scan`` accumulator. Either way the ``(n, d)``
    intermediate is never built: XLA:CPU reduces a fused ``(n, d)`` expression over its
    major axis far slower.
    """
    n = payload[0].shape[0]
    if n <= UNROLL:
        # a sum of n static terms: XLA fuses it into one pass that writes d once
        total = decode_one(*(x[0] for x in payload))
        for i in range(1, n):
            total = total + decode_one(*(x[i] for x in payload))
        return total
    first = decode_one(*(x[0] for x in payload))

    def body(acc, xs):
        return acc + decode_one(*xs), None

    total, _ = lax.scan(body, first, tuple(x[1:] for x in payload))
    return total


def bucket_view(x: jax.Array, bucket_size: int) -> jax.Array:
    """``(..., d)`` zero-padded to ``(..., ceil(d/b), b)``."""
    d = x.shape[-1]
    nb = math.ceil(d / bucket_size)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * bucket_size - d)])
    return x.reshape(x.shape[:-1] + (nb, bucket_size))
