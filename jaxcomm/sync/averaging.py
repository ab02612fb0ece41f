"""Periodic parameter averaging: :func:`local_sgd` (post-local SGD) and :func:`diloco`."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import buckets, checks, collectives
from jaxcomm.branches import typed_cond
from jaxcomm.collectives import AxisName
from jaxcomm.sync.common import (
    add_updates,
    as_compressor,
    check_compressor_axis,
    check_float_params,
    inc_count,
    updates_to,
    zero_count,
)


class LocalSGDState(NamedTuple):
    """State of :func:`local_sgd`.

    Attributes:
      count: int32 ``[]``, updates made (saturates at the int32 maximum).
      local_steps: int32 ``[]``, steps since the last synchronisation.
      syncs: int32 ``[]``, synchronisations executed: over ``T`` steps
        ``min(T, warmup_steps) + max(0, T - warmup_steps) // every``.
      inner_state: state of the inner optimizer.
      anchor: params after the last synchronisation (params' tree and dtypes;
        one model copy); ``None`` without a compressor.
      compressor_state: state of the compressor (e.g. its error-feedback
        residual); ``None`` without a compressor.
    """

    count: jax.Array
    local_steps: jax.Array
    syncs: jax.Array
    inner_state: Any
    anchor: Any
    compressor_state: Any


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      count: int32 ``[]``, inner steps made (saturates at the int32 maximum).
      local_steps: int32 ``[]``, inner steps since the last outer step.
      syncs: int32 ``[]``, outer steps (synchronisations) executed.
      inner_state: state of the inner optimizer (kept across rounds).
      anchor: the global params after the last outer step (one model copy).
      outer_state: state of the outer optimizer (e.g. Nesterov momentum).
      compressor_state: state of the pseudo-gradient compressor; ``None``
        without one.
    """

    count: jax.Array
    local_steps: jax.Array
    syncs: jax.Array
    inner_state: Any
    anchor: Any
    outer_state: Any
    compressor_state: Any


# --- periodic parameter averaging -----------------------------------------------------


def sync_step(state: Any, every: int, warmup_steps: int) -> jax.Array:
    """Whether this step synchronises: all of the warm-up, then every ``every``-th step."""
    return (state.count < warmup_steps) | (state.local_steps >= every - 1)


def local_sgd(
    inner: optax.GradientTransformation,
    *,
    every: int,
    axis_name: AxisName | None,
    warmup_steps: int = 0,
    compressor: Any = None,
    bucket_bytes: int | str | None = buckets.DEFAULT_BUCKET_BYTES,
) -> optax.GradientTransformation:
    """Local SGD: ``every`` local optimizer steps, then parameter averaging (post-local SGD).

    Rule: each worker applies ``inner``'s update ``u`` to its own params; after
    ``warmup_steps`` synchronous steps, every ``every``-th step returns
    ``pmean(params + u) - params`` (``state.syncs`` counts them). With
    ``compressor`` the delta ``params + u - anchor`` is averaged compressed.
    Wire: one dense (or compressed) model average per sync, nothing between.
    Params must be kept per worker (``shard_map`` ``out_specs=P("data")``).

    Args:
      inner: the local optimizer; it sees only the worker's own gradients.
      every: local steps per synchronisation, an int >= 1 (1: every step).
      axis_name: mesh axis to average over; ``None``: one worker, synchronising is a no-op.
      warmup_steps: number of initial steps that all synchronise, an int >= 0.
      compressor: ``None``, a jaxcomm transform built with the same ``axis_name``
        or a :class:`jaxcomm.Compressor` (wrapped with error feedback, ``min_size=0``).
      bucket_bytes: tensor fusion of the averaging, default ``"auto"`` (:func:`jaxcomm.compress`).

    Returns:
      An ``optax.GradientTransformation`` with :class:`LocalSGDState`; needs ``params``.

    Example:
      >>> tx = jaxcomm.local_sgd(optax.sgd(0.1), every=8, axis_name="data", warmup_steps=100)

    References:
      Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019,
      arXiv:1805.09767. Lin et al., "Don't Use Large Mini-Batches, Use Local
      SGD", ICLR 2020, arXiv:1808.07217 (post-local SGD).
    """
    # Notes. The inner optimizer's state is per worker and never averaged. With ``compressor`` the
    # compressor's own error feedback applies; the anchor, one model copy, is kept in the state; all
    # replicas agree after a synchronisation. Without ``params`` ``update`` raises ``ValueError``
    # naming ``params``. See the module docstring for per-worker params.
    inner = checks.check_tx(inner, "inner")
    every = checks.check_int(every, "every", 1)
    warmup_steps = checks.check_int(warmup_steps, "warmup_steps", 0)
    axis_name = collectives.check_axis_name(axis_name)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    comp = as_compressor(compressor, axis_name)

    def init_fn(params):
        return _local_sgd_init(inner, comp, axis_name, params)

    def update_fn(updates, state, params=None):
        checks.require_params(params, "local_sgd")
        checks.check_state(state, LocalSGDState, "local_sgd")
        collectives.check_per_worker(updates, axis_name)
        u, inner_state = inner.update(updates, state.inner_state, params)
        sync = _local_sgd_sync(comp, axis_name, bucket_bytes)
        is_sync = sync_step(state, every, warmup_steps)
        u, anchor, comp_state, syncs = typed_cond(
            is_sync, sync, _stay, u, params, state.anchor, state.compressor_state, state.syncs
        )
        return u, LocalSGDState(
            count=inc_count(state.count),
            local_steps=jnp.where(is_sync, 0, state.local_steps + 1).astype(jnp.int32),
            syncs=syncs,
            inner_state=inner_state,
            anchor=anchor,
            compressor_state=comp_state,
        )

    return optax.GradientTransformation(init_fn, update_fn)


def _local_sgd_init(inner, comp: Any, axis_name: AxisName | None, params) -> LocalSGDState:
    """:func:`local_sgd`'s initial state for ``params``."""
    if comp is not None:
        check_compressor_axis(comp, params, axis_name)
    return LocalSGDState(
        count=zero_count(),
        local_steps=zero_count(),
        syncs=zero_count(),
        inner_state=inner.init(params),
        anchor=None if comp is None else jax.tree.map(jnp.asarray, params),
        compressor_state=None if comp is None else comp.init(params),
    )


def _stay(u, params, *carried):
    """The branch of a step that does not synchronise: ``u`` and the carried state as they are."""
    return (u, *carried)


def _local_sgd_sync(comp: Any, axis_name: AxisName | None, bucket_bytes: int | None):
    """:func:`local_sgd`'s synchronising branch ``(u, params, anchor, comp_state, syncs)``."""

    def sync(u, params, anchor, comp_state, syncs):
        local = add_updates(params, u)
        if comp is not None:  # the delta since the last synchronisation, compressed
            delta = jax.tree.map(lambda x, a: x - a, local, anchor)
            mean, comp_state = comp.update(delta, comp_state, anchor)
            new = add_updates(anchor, mean)
            anchor = new
        elif axis_name is None:
            return u, anchor, comp_state, inc_count(syncs)
        else:
            new = buckets.bucketed_pmean(local, axis_name, bucket_bytes)
        return updates_to(new, params, u), anchor, comp_state, inc_count(syncs)

    return sync


# The paper's outer optimizer (Douillard et al. 2023, Sec. 3): Nesterov SGD, lr 0.7, momentum 0.9.
_DILOCO_OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


def diloco(
    inner: optax.GradientTransformation,
    *,
    every: int,
    axis_name: AxisName | None,
    outer: optax.GradientTransformation = _DILOCO_OUTER,
    compressor: Any = None,
    bucket_bytes: int | str | None = buckets.DEFAULT_BUCKET_BYTES,
) -> optax.GradientTransformation:
    """DiLoCo: ``every`` inner steps per worker, then an outer step on the averaged drift.

    Rule: every worker runs ``inner`` on its own params; every ``every``-th step
    ``delta = anchor - pmean(params + u)``, ``anchor += outer(delta)``, and the step
    returns ``anchor - params``. ``outer=optax.sgd(1.0)`` is :func:`local_sgd`.
    Wire: one dense (or compressed) model average per round, nothing between.
    Params must be kept per worker (see :mod:`jaxcomm.sync`).

    Args:
      inner: the inner (local) optimizer, e.g. ``optax.adamw(4e-4)``.
      every: inner steps per outer step (H in the paper), an int >= 1.
      axis_name: mesh axis to average over; ``None``: a single worker.
      outer: the outer optimizer; default ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      compressor: ``None``, a jaxcomm transform built with the same ``axis_name``
        or a :class:`jaxcomm.Compressor` (wrapped with error feedback, ``min_size=0``).
      bucket_bytes: tensor fusion of the averaging, default ``"auto"`` (:func:`jaxcomm.compress`).

    Returns:
      An ``optax.GradientTransformation`` with :class:`DiLoCoState`; needs float ``params``.

    Example:
      >>> tx = jaxcomm.diloco(optax.adamw(1e-3), every=500, axis_name="data")

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of
      Language Models", 2023, arXiv:2311.08105.
    """
    # Notes. The inner state is kept across rounds (as in the paper). With ``compressor``, each
    # worker sends its own ``anchor - (params + u)`` through the compressor (with error feedback, so
    # what is not sent is carried to the next round) and the outer optimizer sees the compressed
    # mean. ``update`` without ``params`` raises ``ValueError`` naming ``params``; ``init`` takes
    # floating-point params only (the outer step moves every leaf): an integer or bool leaf raises
    # ``TypeError`` naming it. The default outer optimizer is the paper's.
    inner = checks.check_tx(inner, "inner")
    outer = checks.check_tx(outer, "outer")
    every = checks.check_int(every, "every", 1)
    axis_name = collectives.check_axis_name(axis_name)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    comp = as_compressor(compressor, axis_name)

    def init_fn(params):
        return _diloco_init(inner, outer, comp, axis_name, params)

    def update_fn(updates, state, params=None):
        checks.require_params(params, "diloco")
        checks.check_state(state, DiLoCoState, "diloco")
        collectives.check_per_worker(updates, axis_name)
        u, inner_state = inner.update(updates, state.inner_state, params)
        sync = _diloco_sync(outer, comp, axis_name, bucket_bytes)
        is_sync = sync_step(state, every, 0)
        carried = (state.anchor, state.outer_state, state.compressor_state, state.syncs)
        u, *carried = typed_cond(is_sync, sync, _stay, u, params, *carried)
        anchor, outer_state, comp_state, syncs = carried
        return u, DiLoCoState(
            count=inc_count(state.count),
            local_steps=jnp.where(is_sync, 0, state.local_steps + 1).astype(jnp.int32),
            syncs=syncs,
            inner_state=inner_state,
            anchor=anchor,
            outer_state=outer_state,
            compressor_state=comp_state,
        )

    return optax.GradientTransformation(init_fn, update_fn)


def _diloco_init(inner, outer, comp: Any, axis_name: AxisName | None, params) -> DiLoCoState:
    """:func:`diloco`'s initial state for ``params`` (floating-point leaves only)."""
    check_float_params(params)
    if comp is not None:
        check_compressor_axis(comp, params, axis_name)
    anchor = jax.tree.map(jnp.asarray, params)
    return DiLoCoState(
        count=zero_count(),
        local_steps=zero_count(),
        syncs=zero_count(),
        inner_state=inner.init(params),
        anchor=anchor,
        outer_state=outer.init(anchor),
        compressor_state=None if comp is None else comp.init(params),
    )


def _diloco_sync(outer, comp: Any, axis_name: AxisName | None, bucket_bytes: int | None):
    """:func:`diloco`'s outer step ``(u, params, anchor, outer_state, comp_state, syncs)``."""

    def sync(u, params, anchor, outer_state, comp_state, syncs):
        local = add_updates(params, u)
        if comp is not None:  # each worker's own drift, through the compressor
            drift = jax.tree.map(lambda a, x: a - x, anchor, local)
            delta, comp_state = comp.update(drift, comp_state, anchor)
        else:
            mean = (
                local
                if axis_name is None
                else buckets.bucketed_pmean(local, axis_name, bucket_bytes)
            )
            delta = jax.tree.map(lambda a, m: a - m, anchor, mean)
        step, outer_state = outer.update(delta, outer_state, anchor)
        anchor = add_updates(anchor, step)
        return updates_to(anchor, params, u), anchor, outer_state, comp_state, inc_count(syncs)

    return sync
