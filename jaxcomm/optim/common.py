"""Helpers shared by the optimizers of :mod:`jaxcomm.optim`: arguments, zeros, the NaN rule."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm import checks, core, stages
from jaxcomm.compressors.sign import ScaledSign


def check_adam_args(b1: Any, b2: Any, eps: Any, weight_decay: Any) -> float:
    """Validate Adam's arguments (errors name the argument); returns ``eps`` as a float."""
    for name, value in (("b1", b1), ("b2", b2)):
        checks.check_float(value, name, low=0, strict=False, high=1)
    eps = checks.check_positive(eps, "eps")
    check_weight_decay(weight_decay)
    return eps


def check_weight_decay(weight_decay: Any) -> float:
    """Validate a ``weight_decay=`` option: a finite float >= 0."""
    return checks.check_float(weight_decay, "weight_decay", low=0, strict=False)


def zeros_f32(params: Any) -> Any:
    """A float32 zero for every leaf of ``params`` (moments, accumulators)."""
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)


def learning_rate_at(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> Any:
    return learning_rate(count) if callable(learning_rate) else learning_rate


def all_finite(*trees: Any) -> jax.Array:
    """True iff every leaf of ``trees`` is finite (a bool ``[]``): :func:`jaxcomm.stages.all_finite`
    over their leaves."""
    return stages.all_finite([x for t in trees for x in jax.tree.leaves(t)])


def momentum_exchange(axis_name, min_size, bucket_bytes, exchange) -> optax.GradientTransformation:
    """1-bit and 0/1 Adam's compressed momentum exchange: the scaled sign with worker and
    server residuals (fp32 state)."""
    # The scale is the mean magnitude (the least-squares scale of a sign vector, as in
    # EF-SignSGD); DeepSpeed's OnebitAdam uses ||x||_2 / sqrt(d). No bias correction in
    # the update, as in the paper and DeepSpeed's OnebitAdam.
    return core.compress(
        ScaledSign(),
        axis_name=axis_name,
        min_size=min_size,
        bucket_bytes=bucket_bytes,
        exchange=exchange,
        state_dtype=jnp.float32,
    )
