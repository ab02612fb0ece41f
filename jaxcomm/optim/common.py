"""Helpers shared by the optimizers of :mod:`jaxcomm.optim`: arguments, zeros, the NaN rule."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm import core, sync


def check_adam_args(b1: Any, b2: Any, eps: Any, weight_decay: Any) -> float:
    """Validate Adam's arguments (errors name the argument); returns ``eps`` as a float."""
    for name, value in (("b1", b1), ("b2", b2)):
        if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
            raise ValueError(f"{name}: expected a float in [0, 1), got {value!r}")
    eps = core.check_positive(eps, "eps")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"weight_decay: expected a float >= 0, got {weight_decay!r}")
    return eps


# The state-class check the sync wrappers use (same message).
check_state = sync.check_state


def zeros_f32(params: Any) -> Any:
    """A float32 zero for every leaf of ``params`` (moments, accumulators)."""
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)


def learning_rate_at(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> Any:
    return learning_rate(count) if callable(learning_rate) else learning_rate


def all_finite(*trees: Any) -> jax.Array:
    """True iff every leaf of ``trees`` is finite (a bool ``[]``)."""
    leaves = [x for t in trees for x in jax.tree.leaves(t)]
    return jnp.all(jnp.stack([jnp.isfinite(jnp.sum(x * 0)) for x in leaves]))


def keep(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old`` (leaf by leaf): the NaN rule's state."""
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
