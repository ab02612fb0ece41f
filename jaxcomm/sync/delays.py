"""Delayed and stale gradients: :func:`delayed_averaging` and :func:`stale`."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import buckets, checks, collectives
from jaxcomm.branches import typed_cond
from jaxcomm.collectives import AxisName
from jaxcomm.sync.common import check_float_params, inc_count, zero_count


class DelayedAveragingState(NamedTuple):
    """State of :func:`delayed_averaging`.

    Attributes:
      count: int32 ``[]``, updates made (saturates at the int32 maximum).
      head: int32 ``[]``, queue slot holding the oldest correction, in
        ``[0, delay)`` (0 when ``delay == 0``).
      queue: the corrections ``mean_s - g_s`` of the last ``delay`` steps in
        flight: the params' tree with a leading axis of size ``delay`` (``delay``
        model copies); ``None`` when ``delay == 0``.
      inner_state: state of the inner optimizer.
    """

    count: jax.Array
    head: jax.Array
    queue: Any
    inner_state: Any


class StaleState(NamedTuple):
    """State of :func:`stale`.

    Attributes:
      count: int32 ``[]``, updates made (saturates at the int32 maximum).
      head: int32 ``[]``, queue slot holding the oldest gradient, in
        ``[0, staleness)`` (0 when ``staleness == 0``).
      queue: the last ``staleness`` gradients: the params' tree with a leading
        axis of size ``staleness``; ``None`` when ``staleness == 0``.
      inner_state: state of the inner optimizer; untouched during the first
        ``staleness`` steps (no gradient has arrived yet).
    """

    count: jax.Array
    head: jax.Array
    queue: Any
    inner_state: Any


def _queue(params: Any, depth: int) -> Any:
    return jax.tree.map(lambda p: jnp.zeros((depth,) + jnp.shape(p), jnp.result_type(p)), params)


def _push_pop(queue: Any, head: jax.Array, new: Any) -> tuple[Any, Any]:
    """Oldest entries out of ring buffer ``queue`` at ``head``; ``new`` in their place."""
    old = jax.tree.map(lambda q: q[head], queue)
    queue = jax.tree.map(lambda q, x: q.at[head].set(x.astype(q.dtype)), queue, new)
    return old, queue


# --- delays ---------------------------------------------------------------------------


def delayed_averaging(
    inner: optax.GradientTransformation,
    *,
    delay: int,
    axis_name: AxisName | None,
    bucket_bytes: int | str | None = buckets.DEFAULT_BUCKET_BYTES,
) -> optax.GradientTransformation:
    """Delayed gradient averaging: use the local gradient now, the worker mean ``delay`` later.

    Rule: feed ``inner`` with ``g_t + (mean_{t-D} - g_{t-D})``, so the all-reduce of
    ``g_t`` can overlap ``D`` steps of computation (``delay=0``: synchronous).
    Wire: one dense all-reduce of the gradient per step; ``D`` model copies of state.

    Args:
      inner: the optimizer fed the corrected gradients, e.g. ``optax.sgd(0.1)``.
      delay: steps between sending a gradient and using its mean, an int >= 0.
      axis_name: mesh axis to average over; ``None``: one worker (no correction).
      bucket_bytes: tensor fusion of the averaging, default ``"auto"``.

    Returns:
      An ``optax.GradientTransformation`` with :class:`DelayedAveragingState`.

    Example:
      >>> tx = jaxcomm.delayed_averaging(optax.sgd(0.1), delay=4, axis_name="data")

    References:
      Zhu et al., "Delayed Gradient Averaging: Tolerate the Communication Latency
      for Federated Learning", NeurIPS 2021, openreview.net/forum?id=ACFHNxVNvfk.
    """
    # Notes. With ``inner=optax.sgd(lr)`` this is Zhu et al.'s rule ``w -= lr·g_t`` then ``w -=
    # lr·(mean_{t-D} - g_{t-D})``; with a stateful ``inner`` the corrected gradient goes through its
    # state (momentum etc.). After ``D`` further steps with zero gradient (the queue drained) SGD
    # params equal synchronous SGD on the same gradients. The ``D``-deep queue of corrections is in
    # the state (``D`` model copies per worker). In this simulation the all-reduce runs on the step
    # that issues it; its result is held in the queue. Params are per worker when ``delay > 0``;
    # ``params`` are passed through to ``inner``. ``bucket_bytes``: see :func:`jaxcomm.compress`.
    inner = checks.check_tx(inner, "inner")
    delay = checks.check_int(delay, "delay", 0)
    axis_name = collectives.check_axis_name(axis_name)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)

    def init_fn(params):
        check_float_params(params)
        return DelayedAveragingState(
            count=zero_count(),
            head=zero_count(),
            queue=_queue(params, delay) if delay else None,
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None):
        checks.check_state(state, DelayedAveragingState, "delayed_averaging")
        collectives.check_per_worker(updates, axis_name)
        mean = (
            updates
            if axis_name is None
            else buckets.bucketed_pmean(updates, axis_name, bucket_bytes)
        )
        queue, head = state.queue, state.head
        if delay == 0:
            corrected = mean
        else:
            correction = jax.tree.map(lambda m, g: m - g, mean, updates)
            arrived, queue = _push_pop(queue, head, correction)
            corrected = jax.tree.map(lambda g, c: g + c.astype(g.dtype), updates, arrived)
            head = ((head + 1) % delay).astype(jnp.int32)
        u, inner_state = inner.update(corrected, state.inner_state, params)
        return u, DelayedAveragingState(
            count=inc_count(state.count), head=head, queue=queue, inner_state=inner_state
        )

    return optax.GradientTransformation(init_fn, update_fn)


def stale(inner: optax.GradientTransformation, *, staleness: int) -> optax.GradientTransformation:
    """Apply every gradient ``staleness`` steps late: bounded-staleness asynchronous SGD.

    Rule: the gradient of step ``t`` is passed to ``inner`` at step ``t + staleness``;
    during the first ``staleness`` steps the update is zero.
    Wire: ``inner``'s (wrap a communicating chain to average stale gradients).

    Args:
      inner: the optimizer that receives the delayed gradients.
      staleness: steps between computing and applying a gradient, an int >= 0.

    Returns:
      An ``optax.GradientTransformation`` with :class:`StaleState`.

    Example:
      >>> tx = jaxcomm.stale(optax.sgd(0.1), staleness=4)

    References:
      Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel
      Parameter Server", NeurIPS 2013. Lian et al., "Asynchronous Parallel
      Stochastic Gradient for Nonconvex Optimization", NeurIPS 2015, arXiv:1506.08272.
    """
    # Notes. During the first ``staleness`` steps ``inner``'s state does not move; ``staleness=0``
    # is ``inner`` unchanged. Wrap e.g. ``stale(optax.chain(jaxcomm.allreduce(axis_name="data"),
    # optax.sgd(0.1)), staleness=2)``, or a local optimizer for per-worker staleness. The state is a
    # queue of ``staleness`` gradients (``staleness`` model copies); ``params`` are the current
    # ones, passed through to ``inner``.
    inner = checks.check_tx(inner, "inner")
    staleness = checks.check_int(staleness, "staleness", 0)

    def init_fn(params):
        return StaleState(
            count=zero_count(),
            head=zero_count(),
            queue=_queue(params, staleness) if staleness else None,
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None):
        checks.check_state(state, StaleState, "stale")
        if staleness == 0:
            u, inner_state = inner.update(updates, state.inner_state, params)
            return u, state._replace(count=inc_count(state.count), inner_state=inner_state)
        arrived, queue = _push_pop(state.queue, state.head, updates)
        arrived = jax.tree.map(lambda a, g: a.astype(g.dtype), arrived, updates)

        def apply(g, inner_state, params):
            return inner.update(g, inner_state, params)

        def wait(g, inner_state, params):
            shapes, _ = jax.eval_shape(inner.update, g, inner_state, params)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), inner_state

        ready = state.count >= staleness
        u, inner_state = typed_cond(ready, apply, wait, arrived, state.inner_state, params)
        return u, StaleState(
            count=inc_count(state.count),
            head=((state.head + 1) % staleness).astype(jnp.int32),
            queue=queue,
            inner_state=inner_state,
        )

    return optax.GradientTransformation(init_fn, update_fn)
