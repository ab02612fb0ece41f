"""Gradient accumulation: :func:`accumulate`."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import checks
from jaxcomm.branches import typed_cond
from jaxcomm.sync.common import inc_count, zero_count


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
      count: int32 ``[]``, micro-steps taken (saturates at the int32 maximum).
      mini_step: int32 ``[]``, micro-steps since the last inner update, in
        ``[0, every)``.
      syncs: int32 ``[]``, inner updates executed (= exchanges when ``inner``
        communicates).
      acc: sum of the micro-batch gradients since the last inner update;
        the params' tree, shapes and dtypes.
      inner_state: state of ``inner``; advances only on inner updates.
    """

    count: jax.Array
    mini_step: jax.Array
    syncs: jax.Array
    acc: Any
    inner_state: Any


# --- gradient accumulation ------------------------------------------------------------


def accumulate(inner: optax.GradientTransformation, *, every: int) -> optax.GradientTransformation:
    """Gradient accumulation: run ``inner`` (and its exchange) once per ``every`` micro-steps.

    Rule: micro-batch gradients are summed in the state; every ``every``-th call their
    mean goes through ``inner``, other calls return zero updates: one step of ``inner``
    on a batch ``every`` times larger. Use it instead of ``optax.MultiSteps``.
    Wire: ``inner``'s, on one call in ``every``.

    Args:
      inner: the optimizer to run on the accumulated gradient.
      every: micro-steps per inner update, an int >= 1 (1: ``inner`` itself).

    Returns:
      An ``optax.GradientTransformation`` with :class:`AccumulateState`.

    Example:
      >>> tx = jaxcomm.accumulate(
      ...     optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1)), every=4)

    References:
      Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
      2017, arXiv:1706.02677.
    """
    # Notes. ``inner`` runs inside ``lax.cond``, so the collective and the compressor's state
    # (residuals, keys, counters) advance only on the ``every``-th steps. ``optax.MultiSteps`` in
    # optax 0.2.8 calls the inner update on *every* micro-step (and discards it with ``jnp.where``),
    # so the exchange runs each time; and under ``jax.shard_map`` with per-worker state its
    # ``lax.cond`` branches are typed differently and fail to trace. ``params`` are passed through
    # to ``inner`` (may be ``None`` if ``inner`` does not need them). Goyal et al.: large batches,
    # which accumulation emulates.
    inner = checks.check_tx(inner, "inner")
    every = checks.check_int(every, "every", 1)

    def init_fn(params):
        return AccumulateState(
            count=zero_count(),
            mini_step=zero_count(),
            syncs=zero_count(),
            acc=jax.tree.map(jnp.zeros_like, params),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None):
        checks.check_state(state, AccumulateState, "accumulate")
        acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), state.acc, updates)
        mean = jax.tree.map(lambda a, g: (a / every).astype(g.dtype), acc, updates)

        def step(mean, acc, inner_state, params, syncs):
            u, inner_state = inner.update(mean, inner_state, params)
            return u, jax.tree.map(jnp.zeros_like, acc), inner_state, inc_count(syncs)

        def wait(mean, acc, inner_state, params, syncs):
            shapes, _ = jax.eval_shape(inner.update, mean, inner_state, params)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return zeros, acc, inner_state, syncs

        emit = state.mini_step >= every - 1
        u, acc, inner_state, syncs = typed_cond(
            emit, step, wait, mean, acc, state.inner_state, params, state.syncs
        )
        return u, AccumulateState(
            count=inc_count(state.count),
            mini_step=jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32),
            syncs=syncs,
            acc=acc,
            inner_state=inner_state,
        )

    return optax.GradientTransformation(init_fn, update_fn)
