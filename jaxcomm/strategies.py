"""The exchange strategies of :func:`jaxcomm.core.compress`'s update pipeline.

:func:`jaxcomm.core.compress` runs its update as a sequence of stages (check
the state, the step's key, ``g + e``, leaves grouped into vectors, the
exchange, the new state), passing the values between them in one
:class:`Step`. The exchange is one of the strategies below, chosen once per
trace (from ``axis_name``, ``exchange=`` and the axis size); each has the
same signature, ``(compressor, step, state, config) -> (updates, memory)``:
the updates as flat leaves, and the new error-feedback memory (:class:`Memory`).

- :func:`local`: no axis; every vector is encoded and decoded here.
- :func:`gather`: the payloads are summed (``kind="psum"``) or all-gathered,
  bucketed, with the dense leaves and the NaN rule's flag.
- :func:`two_phase`: :func:`jaxcomm.exchange.two_phase`, with a server residual.
- :func:`reduce_scatter`: :func:`jaxcomm.exchange.reduce_scatter`, shard-shaped updates.

Each strategy encodes, exchanges, decodes, applies the NaN rule (the update
is NaN on every worker when some worker's ``g + e`` was not finite) and
updates the residuals, keeping them as they were on such a step.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm import buckets, collectives, exchange

Payload = tuple[jax.Array, ...]


class Config(NamedTuple):
    """The static options of one :func:`jaxcomm.core.compress` transform (checked)."""

    axis_name: Any
    error_feedback: bool
    min_size: int
    scope: str
    bucket_bytes: int | None
    mode: str
    state_cls: type


class Step(NamedTuple):
    """The values one update passes from stage to stage (leaf lists in tree order).

    Attributes:
      treedef: the updates' tree structure.
      with_path: ``(path, leaf)`` of every update leaf.
      grads: the update leaves.
      residuals: the residual leaves (``None`` without error feedback).
      new_key: the state's next key; step_key: this step's key (``None``
        for deterministic compressors).
      compressible: indices of the leaves compressed; dense: the set of the
        others (plain means).
      ps: leaf index -> flat ``g + e`` in the gradient's dtype (what is encoded);
        ps_state: the same in the residual's dtype, where that differs.
      groups: leaf indices compressed as one vector (``scope``); vecs: each
        group's vector; keys: each group's key (or ``None``).
    """

    treedef: Any
    with_path: list
    grads: list
    residuals: list | None
    new_key: Any = None
    step_key: Any = None
    compressible: list | None = None
    dense: set | None = None
    ps: dict | None = None
    ps_state: dict | None = None
    groups: list | None = None
    vecs: list | None = None
    keys: list | None = None


class Memory(NamedTuple):
    """What a strategy leaves for the new state.

    Attributes:
      residual: the new residual tree (``None`` without error feedback).
      server: the new server residual tree (two-phase) or the state's, kept.
      nonfinite: the state's count of non-finite steps, where the strategy
        counted this step (:func:`local`, :func:`gather`); else ``None``, and
      ok: whether every worker's ``g + e`` was finite, counted after the
        state's step count (:func:`two_phase`, :func:`reduce_scatter`).
    """

    residual: Any
    server: Any
    nonfinite: Any = None
    ok: Any = None


Strategy = Callable[[Any, Step, Any, Config], tuple[list, Memory]]


def _encode_all(
    compressor: Any,
    vecs: list[jax.Array],
    keys: list[jax.Array | None],
    axis_name: collectives.AxisName | None,
    bucket_bytes: int | None,
) -> list[tuple[Payload, Any]]:
    """``(payload, aux)`` of every vector.

    A compressor whose workers must first agree on a value per vector (the
    optional ``agrees = True`` with ``to_agree(p, key)`` -> array, max over
    workers, then ``encode_agreed(p, key, agreed)``; e.g. TernGrad's shared scale) gets all
    vectors' values agreed in one bucketed all-reduce, not one per leaf.
    """
    if axis_name is not None and vecs and compressor.agrees:
        values = [compressor.to_agree(v, k) for v, k in zip(vecs, keys)]
        agreed = buckets.bucketed_pmax(values, axis_name, bucket_bytes)
        out = [compressor.encode_agreed(v, k, a) for v, k, a in zip(vecs, keys, agreed)]
    else:
        out = [compressor.encode(v, k) for v, k in zip(vecs, keys)]
    return [(tuple(payload), aux) for payload, aux in out]


def _decode_mean(
    compressor: Any, received: Payload, aux: Any, d: int, dtype: Any, n: int
) -> jax.Array:
    """Mean over ``n`` workers of the decoded (summed or gathered) payloads."""
    return compressor.decode_mean(received, aux, d, dtype, n)


def _flag(ok: jax.Array, payload: Payload, kind: str) -> jax.Array:
    """The NaN rule's per-worker flag: 1 if this worker's ``g + e`` was not finite.

    psum: one entry in the dtype of the last payload array (it joins that
    dtype's bucket: no collective of its own); the sum is > 0 iff some
    worker's flag was set. all_gather: one byte (gathered buckets are bytes).
    """
    dtype = jnp.result_type(payload[-1]) if kind == "psum" and payload else jnp.uint8
    return (~ok).astype(dtype)


def _slices(group: list[int], ps: dict[int, jax.Array]) -> list[tuple[int, slice]]:
    """(leaf index, its slice of the group's concatenated vector) for each leaf."""
    if len(group) == 1:
        return [(group[0], slice(None))]
    out, offset = [], 0
    for i in group:
        out.append((i, slice(offset, offset + ps[i].shape[0])))
        offset += ps[i].shape[0]
    return out


def _all_finite(vecs: list[jax.Array]) -> jax.Array:
    """This worker's vectors all finite (bool scalar), reading every entry."""
    return (
        jnp.all(jnp.stack([jnp.isfinite(jnp.sum(v * 0)) for v in vecs]))
        if vecs
        else jnp.ones((), jnp.bool_)
    )


def _encode(compressor: Any, step: Step, config: Config) -> tuple[list, jax.Array]:
    """Every group's ``(payload, aux)`` and whether this worker's ``g + e`` is all finite.

    Top-k and threshold look only at what they selected, which includes any
    NaN/Inf (their ``all_finite``); agreed over the axis by the exchange.
    """
    encoded = _encode_all(compressor, step.vecs, step.keys, config.axis_name, config.bucket_bytes)
    ok = jnp.all(
        jnp.stack(
            [
                compressor.all_finite(vec, payload, aux)
                for vec, (payload, aux) in zip(step.vecs, encoded)
            ]
        )
        if step.vecs
        else jnp.ones((), jnp.bool_)
    )
    return encoded, ok


def _put_mean(
    compressor: Any,
    step: Step,
    group: list[int],
    mean: jax.Array,
    ok: jax.Array | None,
    outputs: list,
) -> None:
    """Write a group's decoded mean into ``outputs``, NaN where some worker's was not finite
    (``ok=None``: the mean holds that rule already)."""
    if ok is not None and not compressor.carries_nonfinite:
        # some worker's gradient was not finite: the update is NaN on every worker
        mean = jnp.where(ok, mean, jnp.asarray(jnp.nan, mean.dtype))
    for i, sl in _slices(group, step.ps):
        outputs[i] = mean[sl].reshape(step.grads[i].shape).astype(step.grads[i].dtype)


def _decode_groups(
    compressor: Any,
    step: Step,
    received: list[Payload],
    encoded: list,
    ok: jax.Array,
    n: int | None,
    outputs: list,
) -> None:
    """Decode every group's received payloads into ``outputs`` (the sum where ``n`` is None)."""
    for gi, group in enumerate(step.groups):
        vec, (_, aux) = step.vecs[gi], encoded[gi]
        d, dtype = vec.shape[0], vec.dtype
        if n is None:  # the NaN rule is applied by _put_mean
            mean, rule = compressor.decode(received[gi], aux, d, dtype), ok
        elif compressor.carries_nonfinite:
            mean, rule = _decode_mean(compressor, received[gi], aux, d, dtype, n), None
        else:  # the codec applies the NaN rule itself
            mean, rule = compressor.decode_mean_checked(received[gi], aux, d, dtype, n, ok), None
        _put_mean(compressor, step, group, mean, rule, outputs)


def _kept(step: Step, group: list[int], ok: jax.Array, dtype: Any) -> jax.Array:
    """The group's ``where(ok, p, e)`` (``p = g + e`` as :func:`jaxcomm.core._add_memory`
    forms it), bit for bit, written ``where(ok, e - (-g), e)``: an expression of its own,
    so that XLA fuses it from ``g`` and ``e`` and does not write ``p`` out for it and the
    encoder to read (``e - (-g)`` is ``g + e`` in IEEE arithmetic; as ``g + e`` it was
    merged with the encoder's ``p``)."""
    parts = {}
    for i in group:
        e = step.residuals[i].reshape(-1)
        g = step.grads[i].reshape(-1).astype(e.dtype)
        parts[i] = jnp.where(ok, e - (-g), e).astype(dtype)
    return _group_state(parts, group)


def _memory(
    compressor: Any, step: Step, state: Any, encoded: list, ok: jax.Array, config: Config
) -> Memory:
    """The residuals after :func:`local` or :func:`gather`: ``p - decode(own payload)``.

    Left unchanged on a step where some worker's ``g + e`` was not finite
    (counted in ``nonfinite``).
    """
    if not config.error_feedback:
        return Memory(None, state.server, state.nonfinite)
    residuals, ps, ps_state = step.residuals, step.ps, step.ps_state
    new_res = list(residuals)
    for gi, group in enumerate(step.groups):
        vec, (payload, aux) = step.vecs[gi], encoded[gi]
        if any(i in ps_state for i in group):  # the residual's precision
            dtype = jnp.result_type(*[residuals[i].dtype for i in group])
            vec = (
                jnp.concatenate([ps_state.get(i, ps[i]).astype(dtype) for i in group])
                if len(group) > 1
                else ps_state[group[0]]
            )
        old = _group_state({i: residuals[i].astype(vec.dtype) for i in group}, group)
        # selects, not a lax.cond: a cond copied both branches on XLA:CPU, and its
        # predicate goes to the host on GPU
        kept = functools.partial(_kept, step, group, ok, vec.dtype)
        res = compressor.residual_checked(vec, old, kept, payload, aux, ok)
        for i, sl in _slices(group, ps):
            new_res[i] = res[sl].reshape(residuals[i].shape).astype(residuals[i].dtype)
    nonfinite = state.nonfinite
    if step.groups:
        nonfinite = nonfinite + (~ok).astype(jnp.int32)
    return Memory(step.treedef.unflatten(new_res), state.server, nonfinite)


def local(compressor: Any, step: Step, state: Any, config: Config) -> tuple[list, Memory]:
    """No axis (``axis_name=None``): every vector encoded and decoded on this worker."""
    encoded, ok = _encode(compressor, step, config)
    outputs = [g if i in step.dense else None for i, g in enumerate(step.grads)]
    received = [
        payload if compressor.kind == "psum" else tuple(x[None] for x in payload)
        for payload, _ in encoded
    ]
    _decode_groups(compressor, step, received, encoded, ok, None, outputs)
    return outputs, _memory(compressor, step, state, encoded, ok, config)


def _wire(
    compressor: Any, step: Step, encoded: list, ok: jax.Array, config: Config, outputs: list
) -> tuple[list[Payload], jax.Array, int]:
    """Dense leaves (plain means, into ``outputs``) and payloads over the axis, in leaf order.

    Bucketed, one collective per bucket; the NaN rule's flag rides in the
    first bucket (see :func:`_flag`). Returns every group's received payload,
    whether every worker's ``g + e`` was finite, and the number of workers.
    """
    n = collectives.axis_size(config.axis_name)
    first = {group[0]: gi for gi, group in enumerate(step.groups)}
    summed, gathered = [], []  # (leaf or group id, array)
    dest = summed if compressor.kind == "psum" else gathered
    # the small leaves ride in the payload's all-gather as raw words (one collective per
    # bucket) unless gathering them costs more bytes than a collective's latency
    dense_bytes = sum(step.grads[i].size * step.grads[i].dtype.itemsize for i in step.dense)
    ride = dest is gathered and step.groups and exchange.dense_rides(n, dense_bytes)
    for i in range(len(step.grads)):
        if i in step.dense:
            (gathered if ride else summed).append((("leaf", i), step.grads[i]))
        if i in first:
            dest.extend((("group", first[i]), x) for x in encoded[first[i]][0])
    if step.groups and not compressor.carries_nonfinite:
        dest.append((("flag", 0), _flag(ok, encoded[-1][0], compressor.kind)))
    sums = buckets.bucketed_psum([x for _, x in summed], config.axis_name, config.bucket_bytes)
    gath = buckets.bucketed_all_gather(
        [x for _, x in gathered], config.axis_name, config.bucket_bytes
    )
    parts: dict[int, list[jax.Array]] = {gi: [] for gi in range(len(step.groups))}
    for (tag, j), x in zip([t for t, _ in summed] + [t for t, _ in gathered], sums + gath):
        if tag == "leaf":
            x = buckets.sum_rows(x) if ride else x  # as the all-reduce adds
            outputs[j] = x / jnp.asarray(n, x.dtype)
        elif tag == "flag":
            ok = ~jnp.any(x > 0)
        else:
            parts[j].append(x)
    return [tuple(parts[gi]) for gi in range(len(step.groups))], ok, n


def gather(compressor: Any, step: Step, state: Any, config: Config) -> tuple[list, Memory]:
    """The payloads summed (``kind="psum"``) or all-gathered over the axis, bucketed."""
    encoded, ok = _encode(compressor, step, config)
    outputs: list[jax.Array | None] = [None] * len(step.grads)
    received, ok, n = _wire(compressor, step, encoded, ok, config, outputs)
    _decode_groups(compressor, step, received, encoded, ok, n, outputs)
    return outputs, _memory(compressor, step, state, encoded, ok, config)


def _group_state(tree_leaves: Any, group: list[int]) -> jax.Array | None:
    """A group's leaves of ``tree_leaves`` (indexable by leaf), flat and concatenated."""
    if tree_leaves is None:
        return None
    parts = [tree_leaves[i].reshape(-1) for i in group]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _two_phase_memory(
    step: Step, group: list[int], own: jax.Array, server: jax.Array, ok: jax.Array, new: tuple
) -> None:
    """A group's residual ``p - own`` and server residual, into ``new = (residuals, servers)``."""
    residuals, (new_res, new_srv) = step.residuals, new
    dtype = jnp.result_type(*[residuals[i].dtype for i in group])
    vec = _group_state({i: step.ps_state.get(i, step.ps[i]) for i in group}, group).astype(dtype)
    res = vec - own.astype(dtype)
    for i, sl in _slices(group, step.ps):
        r = res[sl].reshape(residuals[i].shape).astype(residuals[i].dtype)
        new_res[i] = jnp.where(ok, r, residuals[i])
        new_srv[i] = server[sl].reshape(residuals[i].shape)


def two_phase(compressor: Any, step: Step, state: Any, config: Config) -> tuple[list, Memory]:
    """:func:`jaxcomm.exchange.two_phase` for the payloads; error feedback on both sides."""
    ok = _all_finite(step.vecs)
    axis_name, bucket_bytes, ef = config.axis_name, config.bucket_bytes, config.error_feedback
    n = collectives.axis_size(axis_name)
    outputs: list[jax.Array | None] = [None] * len(step.grads)
    dense_ids = sorted(step.dense)
    server_leaves = step.treedef.flatten_up_to(state.server) if ef else None
    servers = [_group_state(server_leaves, g) for g in step.groups]
    dense = [step.grads[i] for i in dense_ids]  # ride in both phases
    means, own, new_servers, ok, sums = exchange.two_phase(
        compressor, step.vecs, step.keys, servers, ok, axis_name, bucket_bytes, dense
    )
    for i, x in zip(dense_ids, sums):
        outputs[i] = x / jnp.asarray(n, x.dtype)
    new = (list(step.residuals), list(server_leaves)) if ef else None
    for gi, group in enumerate(step.groups):
        _put_mean(compressor, step, group, means[gi], ok, outputs)
        if ef:
            _two_phase_memory(step, group, own[gi], new_servers[gi], ok, new)
    if not ef:
        return outputs, Memory(None, None, ok=ok)
    return outputs, Memory(step.treedef.unflatten(new[0]), step.treedef.unflatten(new[1]), ok=ok)


def reduce_scatter(compressor: Any, step: Step, state: Any, config: Config) -> tuple[list, Memory]:
    """:func:`jaxcomm.exchange.reduce_scatter`: this worker's shard of each leaf's mean.

    Every leaf's first dimension is a multiple of the axis size (checked
    when the strategy is chosen); the update has shape ``(shape[0] // n, *shape[1:])``.
    """
    ok = _all_finite(step.vecs)
    axis_name, bucket_bytes, grads = config.axis_name, config.bucket_bytes, step.grads
    n = collectives.axis_size(axis_name)
    shard = [(g.shape[0] // n,) + g.shape[1:] for g in grads]
    outputs: list[jax.Array | None] = [None] * len(grads)
    dense_ids = sorted(step.dense)
    sums = buckets.bucketed_psum_scatter(
        [grads[i].reshape(-1) for i in dense_ids], axis_name, bucket_bytes
    )
    for i, x in zip(dense_ids, sums):
        outputs[i] = (x / jnp.asarray(n, x.dtype)).reshape(shard[i])
    chunks, own, ok = exchange.reduce_scatter(
        compressor, step.vecs, step.keys, ok, axis_name, bucket_bytes
    )
    new_res = list(step.residuals) if config.error_feedback else None
    for gi, group in enumerate(step.groups):
        (i,) = group  # scope="leaf"
        chunk = chunks[gi][: grads[i].size // n]
        if not compressor.carries_nonfinite:
            chunk = jnp.where(ok, chunk, jnp.asarray(jnp.nan, chunk.dtype))
        outputs[i] = chunk.reshape(shard[i]).astype(grads[i].dtype)
        if config.error_feedback:
            dtype = step.residuals[i].dtype
            res = step.ps_state.get(i, step.ps[i]).astype(dtype) - own[gi].astype(dtype)
            new_res[i] = jnp.where(ok, res.reshape(step.residuals[i].shape), step.residuals[i])
    residual = step.treedef.unflatten(new_res) if config.error_feedback else None
    return outputs, Memory(residual, state.server, ok=ok)
