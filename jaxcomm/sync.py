"""Less frequent communication: accumulation, local SGD, DiLoCo, delayed averaging, staleness.

Every wrapper here takes an optax optimizer ``inner`` and decides *when* the
workers talk:

* :func:`accumulate` — average ``every`` micro-batch gradients, then run
  ``inner`` (and the exchange inside it) once.
* :func:`local_sgd` — ``every`` local steps, then parameter averaging;
  ``warmup_steps`` of every-step averaging first (post-local SGD).
* :func:`diloco` — local steps of ``inner``, then an outer optimizer step on
  the pseudo-gradient ``anchor - pmean(local params)``.
* :func:`delayed_averaging` — apply the local gradient now, correct with the
  worker mean when it arrives ``delay`` steps later.
* :func:`stale` — apply gradients ``staleness`` steps late (bounded staleness).
* :func:`skip_nonfinite` — skip a step whose update holds NaN/Inf, on every
  worker alike (the NaN-safe wrapper for any of the above or any jaxcomm chain).

Parameter-averaging methods (:func:`local_sgd`, :func:`diloco`) need
``params`` in ``update(updates, state, params)`` and keep params PER WORKER:
under ``jax.shard_map`` give params, optimizer state and data the leading
worker axis (``in_specs=P("data")``, ``out_specs=P("data")``), as
``experiments/digits.py`` does. Replicas drift apart between
synchronisations and agree right after one.

Sync decisions use ``lax.cond`` on int32 counters in the state, so a step
that does not synchronise executes no collective under ``shard_map``/``pmap``
(under ``vmap`` a cond becomes a select and both branches run). The counters
must be equal on all workers (they are when every worker starts from the same
``init``); workers disagreeing about a sync step would deadlock.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import accounting, buckets, checks, core, exchange
from jaxcomm.collectives import as_varying, varying_names
from jaxcomm.exchange import AxisName

__all__ = [
    "AccumulateState",
    "DiLoCoState",
    "DelayedAveragingState",
    "LocalSGDState",
    "SkipNonfiniteState",
    "StaleState",
    "accumulate",
    "delayed_averaging",
    "diloco",
    "local_sgd",
    "skip_nonfinite",
    "stale",
]


# --- state ------------------------------------------------------------------------


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


class LocalSGDState(NamedTuple):
    """State of :func:`local_sgd`.

    Attributes:
      count: int32 ``[]``, updates made (saturates at the int32 maximum).
      local_steps: int32 ``[]``, steps since the last synchronisation.
      syncs: int32 ``[]``, synchronisations executed.
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


# --- helpers ------------------------------------------------------------------------


def zero_count() -> jax.Array:
    return jnp.zeros((), jnp.int32)


def inc_count(x: jax.Array) -> jax.Array:
    return optax.safe_int32_increment(x)


def typed_cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    """``lax.cond`` whose two branches return values typed alike under ``shard_map``.

    A branch that averages returns values invariant over the mesh axis while
    the other returns per-worker values; ``lax.cond`` rejects the mismatch.
    Both branches are traced abstractly first and each output leaf is then
    marked varying over the union of the axes (a type cast, no data moves).
    """
    t_leaves, treedef = jax.tree.flatten(jax.eval_shape(true_fn, *operands))
    f_leaves = jax.tree.leaves(jax.eval_shape(false_fn, *operands))
    want = [varying_names(a) | varying_names(b) for a, b in zip(t_leaves, f_leaves)]

    def typed(fn):
        def branch(*ops):
            out = jax.tree.leaves(fn(*ops))
            return treedef.unflatten([as_varying(x, tuple(sorted(w))) for x, w in zip(out, want)])

        return branch

    return lax.cond(pred, typed(true_fn), typed(false_fn), *operands)


def add_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates``: ``(p + u)`` in the params' dtype."""
    return jax.tree.map(lambda p, u: (p + u).astype(jnp.result_type(p)), params, updates)


def updates_to(new: Any, params: Any, like: Any) -> Any:
    """Updates that move ``params`` to ``new``, in the dtypes of ``like``."""
    return jax.tree.map(lambda a, p, u: (a - p).astype(u.dtype), new, params, like)


def as_compressor(compressor: Any, axis_name: AxisName | None) -> Any:
    """A compressed-averaging transform from a jaxcomm transform or a Compressor."""
    if compressor is None:
        return None
    if isinstance(compressor, core.Compressor):
        if compressor.needs_key:
            raise ValueError(
                "compressor: this Compressor needs a PRNG key; pass the transform instead, e.g. "
                "compressor=jaxcomm.randomk(0.01, key=jax.random.key(0), axis_name=...)"
            )
        return core.compress(compressor, axis_name=axis_name, min_size=0)
    return checks.check_tx(compressor, "compressor")


def check_compressor_axis(comp: Any, params: Any, axis_name: AxisName | None) -> None:
    """The compressor must average over ``axis_name`` itself (abstract trace, no devices)."""
    axes = {c.axis for c in accounting.wire_report(comp, params, 2)}
    if axis_name is None and axes:
        raise ValueError(
            f"compressor: it communicates over {sorted(map(str, axes))} but axis_name=None; "
            f"build both with the same axis_name"
        )
    if axis_name is not None and axes != {axis_name}:
        raise ValueError(
            f"compressor: must average over axis_name={axis_name!r}, i.e. be built with "
            f"axis_name={axis_name!r} (e.g. jaxcomm.topk(0.01, axis_name={axis_name!r})); it "
            f"communicates over {sorted(map(str, axes)) or 'no axis'}"
        )


def check_float_params(params: Any) -> None:
    """Every leaf of ``params`` must be floating point (the outer step of DiLoCo moves each).

    ``TypeError`` naming the first integer/bool leaf and how to leave it out
    (the compressors' check, :func:`jaxcomm.core.check_float_leaves`).
    """
    core.check_float_leaves(jax.tree_util.tree_leaves_with_path(params), "params")


def _queue(params: Any, depth: int) -> Any:
    return jax.tree.map(lambda p: jnp.zeros((depth,) + jnp.shape(p), jnp.result_type(p)), params)


def _push_pop(queue: Any, head: jax.Array, new: Any) -> tuple[Any, Any]:
    """Oldest entries out of ring buffer ``queue`` at ``head``; ``new`` in their place."""
    old = jax.tree.map(lambda q: q[head], queue)
    queue = jax.tree.map(lambda q, x: q.at[head].set(x.astype(q.dtype)), queue, new)
    return old, queue


# --- gradient accumulation ------------------------------------------------------------


def accumulate(inner: optax.GradientTransformation, *, every: int) -> optax.GradientTransformation:
    """Gradient accumulation: run ``inner`` (and its exchange) once per ``every`` micro-steps.

    Micro-batch gradients are summed in the state; on every ``every``-th call
    their mean goes through ``inner`` (e.g. a jaxcomm compressed exchange
    chained with an optimizer) inside ``lax.cond``, so the collective and
    the compressor's state (residuals, keys, counters) advance only on those
    steps. Other calls return zero updates. The result equals one step of
    ``inner`` on a batch ``every`` times larger.

    Use this instead of ``optax.MultiSteps`` around jaxcomm transforms: in
    optax 0.2.8 ``MultiSteps`` calls the inner update on *every* micro-step
    (and discards it with ``jnp.where``), so the exchange runs each time; and
    under ``jax.shard_map`` with per-worker state its ``lax.cond`` branches
    are typed differently and fail to trace.

    Args:
      inner: the optimizer to run on the accumulated gradient.
      every: micro-steps per inner update, an int >= 1 (1: ``inner`` itself).

    Returns:
      An ``optax.GradientTransformation`` with :class:`AccumulateState`.
      ``params`` are passed through to ``inner`` (may be ``None`` if ``inner``
      does not need them).

    Example:
      >>> tx = jaxcomm.accumulate(
      ...     optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1)), every=4)

    References:
      Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1
      Hour", 2017, arXiv:1706.02677 (large batches, which accumulation
      emulates).
    """
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

    Each worker applies ``inner``'s update ``u`` to its own params. After the
    first ``warmup_steps`` steps (which all synchronise: post-local SGD's
    phase of ordinary synchronous training) every ``every``-th step is a
    synchronisation: it returns ``pmean(params + u) - params``, so all
    replicas land on the average. Over ``T`` steps that is
    ``min(T, warmup_steps) + max(0, T - warmup_steps) // every``
    synchronisations (``state.syncs`` counts them as they execute). The inner
    optimizer's state is per worker and never averaged.

    With ``compressor``, what is averaged is the parameter delta since the
    last synchronisation, ``params + u - anchor``, compressed (with the
    compressor's own error feedback); the anchor (one model copy) is kept in
    the state. All replicas again agree after a synchronisation.

    Params must be kept per worker (see the module docstring): under
    ``jax.shard_map`` use ``out_specs=P("data")`` for params and state.

    Args:
      inner: the local optimizer (e.g. ``optax.sgd(0.1, momentum=0.9)``); it
        sees only the worker's own gradients.
      every: local steps per synchronisation, an int >= 1 (1: synchronous
        parameter averaging every step).
      axis_name: mesh axis to average over; ``None``: a single worker, the
        synchronisation is a no-op.
      warmup_steps: number of initial steps that all synchronise, an int >= 0.
      compressor: ``None``, a jaxcomm transform built with the same
        ``axis_name`` (e.g. ``jaxcomm.topk(0.01, axis_name="data")``) or a
        :class:`jaxcomm.Compressor` (wrapped with error feedback and
        ``min_size=0``).
      bucket_bytes: tensor fusion of the averaging, default ``"auto"`` (see
        :func:`jaxcomm.compress`).

    Returns:
      An ``optax.GradientTransformation`` with :class:`LocalSGDState`; its
      ``update`` requires ``params`` (``ValueError`` naming ``params``
      otherwise).

    Example:
      >>> tx = jaxcomm.local_sgd(optax.sgd(0.1), every=8, axis_name="data", warmup_steps=100)
      >>> updates, state = tx.update(grads, state, params)  # per-worker params

    References:
      Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019,
      arXiv:1805.09767. Lin et al., "Don't Use Large Mini-Batches, Use Local
      SGD", ICLR 2020, arXiv:1808.07217 (post-local SGD).
    """
    inner = checks.check_tx(inner, "inner")
    every = checks.check_int(every, "every", 1)
    warmup_steps = checks.check_int(warmup_steps, "warmup_steps", 0)
    axis_name = exchange.check_axis_name(axis_name)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    comp = as_compressor(compressor, axis_name)

    def init_fn(params):
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

    def update_fn(updates, state, params=None):
        checks.require_params(params, "local_sgd")
        checks.check_state(state, LocalSGDState, "local_sgd")
        exchange.check_per_worker(updates, axis_name)
        u, inner_state = inner.update(updates, state.inner_state, params)

        def sync(u, params, anchor, comp_state, syncs):
            local = add_updates(params, u)
            if comp is not None:
                delta = jax.tree.map(lambda x, a: x - a, local, anchor)
                mean, comp_state = comp.update(delta, comp_state, anchor)
                new = add_updates(anchor, mean)
                anchor = new
            elif axis_name is None:
                return u, anchor, comp_state, inc_count(syncs)
            else:
                new = buckets.pmean(local, axis_name, bucket_bytes)
            return updates_to(new, params, u), anchor, comp_state, inc_count(syncs)

        def stay(u, params, anchor, comp_state, syncs):
            return u, anchor, comp_state, syncs

        is_sync = sync_step(state, every, warmup_steps)
        u, anchor, comp_state, syncs = typed_cond(
            is_sync, sync, stay, u, params, state.anchor, state.compressor_state, state.syncs
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

    Every worker runs ``inner`` on its own params. On every ``every``-th step
    the pseudo-gradient ``delta = anchor - pmean(params + u)`` is formed, the
    outer optimizer updates the anchor (``anchor += outer(delta)``), and every
    worker adopts the new anchor: the step returns ``anchor - params``. The
    inner state is kept across rounds (as in the paper). With
    ``outer=optax.sgd(1.0)`` this is exactly :func:`local_sgd`.

    With ``compressor``, each worker sends its own ``anchor - (params + u)``
    through the compressor (with error feedback, so what is not sent is
    carried to the next round) and the outer optimizer sees the compressed
    mean.

    Params must be kept per worker (see the module docstring).

    Args:
      inner: the inner (local) optimizer, e.g. ``optax.adamw(4e-4)``.
      every: inner steps per outer step (H in the paper), an int >= 1.
      axis_name: mesh axis to average over; ``None``: a single worker.
      outer: the outer optimizer; default
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` as in the paper.
      compressor: ``None``, a jaxcomm transform built with the same
        ``axis_name`` or a :class:`jaxcomm.Compressor` (wrapped with error
        feedback and ``min_size=0``).
      bucket_bytes: tensor fusion of the averaging, default ``"auto"`` (see
        :func:`jaxcomm.compress`).

    Returns:
      An ``optax.GradientTransformation`` with :class:`DiLoCoState`; its
      ``update`` requires ``params`` (``ValueError`` naming ``params``
      otherwise). ``init`` takes floating-point params only (the outer step
      moves every leaf): an integer or bool leaf raises ``TypeError`` naming it.

    Example:
      >>> tx = jaxcomm.diloco(optax.adamw(1e-3), every=500, axis_name="data")
      >>> tx = jaxcomm.diloco(optax.sgd(0.5), every=8, axis_name="data",
      ...                     compressor=jaxcomm.topk(0.1, axis_name="data"))

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of
      Language Models", 2023, arXiv:2311.08105.
    """
    inner = checks.check_tx(inner, "inner")
    outer = checks.check_tx(outer, "outer")
    every = checks.check_int(every, "every", 1)
    axis_name = exchange.check_axis_name(axis_name)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    comp = as_compressor(compressor, axis_name)

    def init_fn(params):
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

    def update_fn(updates, state, params=None):
        checks.require_params(params, "diloco")
        checks.check_state(state, DiLoCoState, "diloco")
        exchange.check_per_worker(updates, axis_name)
        u, inner_state = inner.update(updates, state.inner_state, params)

        def sync(u, params, anchor, outer_state, comp_state, syncs):
            local = add_updates(params, u)
            if comp is not None:
                drift = jax.tree.map(lambda a, x: a - x, anchor, local)
                delta, comp_state = comp.update(drift, comp_state, anchor)
            else:
                mean = local if axis_name is None else buckets.pmean(local, axis_name, bucket_bytes)
                delta = jax.tree.map(lambda a, m: a - m, anchor, mean)
            step, outer_state = outer.update(delta, outer_state, anchor)
            anchor = add_updates(anchor, step)
            return updates_to(anchor, params, u), anchor, outer_state, comp_state, inc_count(syncs)

        def stay(u, params, anchor, outer_state, comp_state, syncs):
            return u, anchor, outer_state, comp_state, syncs

        is_sync = sync_step(state, every, 0)
        u, anchor, outer_state, comp_state, syncs = typed_cond(
            is_sync,
            sync,
            stay,
            u,
            params,
            state.anchor,
            state.outer_state,
            state.compressor_state,
            state.syncs,
        )
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


# --- delays ---------------------------------------------------------------------------


def delayed_averaging(
    inner: optax.GradientTransformation,
    *,
    delay: int,
    axis_name: AxisName | None,
    bucket_bytes: int | str | None = buckets.DEFAULT_BUCKET_BYTES,
) -> optax.GradientTransformation:
    """Delayed gradient averaging: use the local gradient now, the worker mean ``delay`` later.

    Each step the worker's gradient ``g_t`` starts an all-reduce whose result
    ``mean_t`` is needed only ``delay`` steps later (so the communication can
    overlap ``delay`` steps of computation). The optimizer is fed
    ``g_t + (mean_{t-D} - g_{t-D})``: the local gradient plus the correction
    for the local gradient used ``D`` steps ago. With ``inner=optax.sgd(lr)``
    this is Zhu et al.'s rule ``w -= lr·g_t`` then ``w -= lr·(mean_{t-D} -
    g_{t-D})``; with a stateful ``inner`` the corrected gradient goes through
    its state (momentum etc.). After ``D`` further steps with zero gradient
    (the queue drained) SGD params equal synchronous SGD on the same gradients.

    The ``D``-deep queue of corrections is in the state (``D`` model copies per
    worker). In this simulation the all-reduce runs on the step that issues
    it; its result is held in the queue. Params are per worker when
    ``delay > 0``. ``delay=0`` is synchronous averaging.

    Args:
      inner: the optimizer fed the corrected gradients, e.g. ``optax.sgd(0.1)``.
      delay: steps between sending a gradient and using its mean, an int >= 0.
      axis_name: mesh axis to average over; ``None``: a single worker (the
        correction is zero).
      bucket_bytes: tensor fusion of the averaging, default ``"auto"`` (see
        :func:`jaxcomm.compress`).

    Returns:
      An ``optax.GradientTransformation`` with :class:`DelayedAveragingState`;
      ``params`` are passed through to ``inner``.

    Example:
      >>> tx = jaxcomm.delayed_averaging(optax.sgd(0.1), delay=4, axis_name="data")

    References:
      Zhu, Lin, Lu, Lin & Han, "Delayed Gradient Averaging: Tolerate the
      Communication Latency for Federated Learning", NeurIPS 2021,
      openreview.net/forum?id=ACFHNxVNvfk.
    """
    inner = checks.check_tx(inner, "inner")
    delay = checks.check_int(delay, "delay", 0)
    axis_name = exchange.check_axis_name(axis_name)
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
        exchange.check_per_worker(updates, axis_name)
        mean = updates if axis_name is None else buckets.pmean(updates, axis_name, bucket_bytes)
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

    The gradient computed at step ``t`` (at params ``w_t``) is passed to
    ``inner`` at step ``t + staleness``, the behaviour of asynchronous SGD
    whose updates always arrive ``staleness`` steps late. During the first
    ``staleness`` steps nothing has arrived: the update is zero and ``inner``'s
    state does not move. Wrap a communicating chain to average stale gradients
    (``stale(optax.chain(jaxcomm.allreduce(axis_name="data"), optax.sgd(0.1)),
    staleness=2)``) or a local optimizer for per-worker staleness.

    Args:
      inner: the optimizer that receives the delayed gradients.
      staleness: steps between computing and applying a gradient, an int >= 0
        (0: ``inner`` unchanged).

    Returns:
      An ``optax.GradientTransformation`` with :class:`StaleState` (a queue of
      ``staleness`` gradients, ``staleness`` model copies); ``params`` are the
      current ones, passed through to ``inner``.

    Example:
      >>> tx = jaxcomm.stale(optax.sgd(0.1), staleness=4)

    References:
      Ho et al., "More Effective Distributed ML via a Stale Synchronous
      Parallel Parameter Server", NeurIPS 2013. Lian et al., "Asynchronous
      Parallel Stochastic Gradient for Nonconvex Optimization", NeurIPS 2015,
      arXiv:1506.08272.
    """
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


# --- skipping non-finite steps ---------------------------------------------------------


class SkipNonfiniteState(NamedTuple):
    """State of :func:`skip_nonfinite`.

    Attributes:
      inner_state: state of the wrapped transform, as of the last applied step.
      notfinite_count: int32 ``[]``, consecutive skipped steps (0 after an applied one).
      total_notfinite: int32 ``[]``, skipped steps in all.
      last_finite: bool ``[]``, whether the last step was applied.
    """

    inner_state: Any
    notfinite_count: jax.Array
    total_notfinite: jax.Array
    last_finite: jax.Array


def skip_nonfinite(
    inner: optax.GradientTransformation,
    *,
    axis_name: AxisName | None = None,
    max_consecutive_errors: int | None = None,
) -> optax.GradientTransformation:
    """Skip steps whose update holds NaN/Inf, with one decision shared by all workers.

    ``optax.apply_if_finite`` checks each worker's *gradient* and runs the
    inner update (and the collectives in it) inside a ``lax.cond``, so with a
    NaN on one worker the others enter a collective it does not: a type error
    under ``jax.shard_map``, a rendezvous abort (a hang on NCCL) under
    ``jax.pmap``. This wrapper runs ``inner.update`` on every worker, every
    step, and decides from its *output*, after the exchange: if any update
    leaf holds NaN/Inf the step is skipped (zero updates, ``inner``'s state
    kept as it was, counters included) and ``state.total_notfinite`` counts it.

    Every jaxcomm transform follows the NaN rule (a non-finite gradient on any
    worker makes the update non-finite on every worker; see
    :func:`jaxcomm.compress`), so for them the decision is the same on every
    worker without another collective. Pass ``axis_name`` when the update is
    per worker on some steps: :func:`local_sgd` / :func:`diloco` between
    synchronisations, or a chain whose exchange is not jaxcomm's. The
    decision is then agreed with one 4-byte all-reduce (a max over workers),
    so every worker skips the same steps and the sync counters stay equal.

    Args:
      inner: the transform to protect, e.g.
        ``optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1))``.
      axis_name: ``None`` (decide from the update, relying on the NaN rule) or
        the mesh axis to agree the decision over.
      max_consecutive_errors: ``None`` (skip for ever) or an int >= 0: after
        more than this many consecutive skipped steps the next non-finite
        update is applied, as ``optax.apply_if_finite`` does, so a run that
        has truly diverged shows it.

    Returns:
      An ``optax.GradientTransformation`` with :class:`SkipNonfiniteState`.

    Example:
      >>> tx = jaxcomm.skip_nonfinite(
      ...     optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1)))
    """
    inner = checks.check_tx(inner, "inner")
    axis_name = exchange.check_axis_name(axis_name)
    if max_consecutive_errors is not None:
        max_consecutive_errors = checks.check_int(
            max_consecutive_errors, "max_consecutive_errors", 0
        )

    def init_fn(params):
        return SkipNonfiniteState(
            inner_state=inner.init(params),
            notfinite_count=zero_count(),
            total_notfinite=zero_count(),
            last_finite=jnp.ones((), jnp.bool_),
        )

    def update_fn(updates, state, params=None):
        checks.check_state(state, SkipNonfiniteState, "skip_nonfinite")
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        leaves = [u for u in jax.tree.leaves(new_updates) if jnp.issubdtype(u.dtype, jnp.inexact)]
        finite = (
            jnp.all(jnp.stack([jnp.isfinite(jnp.sum(u * 0)) for u in leaves]))
            if leaves
            else jnp.ones((), jnp.bool_)
        )
        if axis_name is not None:
            finite = exchange.agree((~finite).astype(jnp.int32), axis_name) == 0
        apply = finite
        if max_consecutive_errors is not None:
            apply = apply | (state.notfinite_count >= max_consecutive_errors)

        def pick(new, old):
            return jnp.where(apply, new, old) if hasattr(new, "dtype") else new

        out = jax.tree.map(lambda u: jnp.where(apply, u, jnp.zeros_like(u)), new_updates)
        return out, SkipNonfiniteState(
            inner_state=jax.tree.map(pick, new_inner, state.inner_state),
            notfinite_count=jnp.where(finite, 0, inc_count(state.notfinite_count)).astype(
                jnp.int32
            ),
            total_notfinite=state.total_notfinite + (~finite).astype(jnp.int32),
            last_finite=finite,
        )

    return optax.GradientTransformation(init_fn, update_fn)
