"""The values :func:`jaxcomm.core.compress`'s update passes between its stages, and the
stages the exchange strategies (:mod:`jaxcomm.strategies`) share.

:func:`jaxcomm.core.compress` runs its update as a sequence of stages (check
the state, the step's key, ``g + e``, leaves grouped into vectors, the
exchange, the new state), passing the values between them in one
:class:`Step`; the options are a :class:`Config`. The exchange is a
strategy's ``run``, which returns the updates as flat leaves and what is
left for the new state, a :class:`Memory`. A strategy composes the stages
below: :func:`encode` every vector (and whether this worker's ``g + e`` is
finite), :func:`decode_groups` what it received, :func:`put_mean` a decoded
mean into the updates (the NaN rule: the update is NaN on every worker when
some worker's ``g + e`` was not finite), :func:`memory` the residuals
``p - decode(own payload)``, kept as they were on such a step.

The transforms that do not fit the flat-vector protocol (PowerSGD, DGC,
DeMo, SparseLoCo) share the smaller stages as well: the NaN rule's
:func:`all_finite`, :func:`nan_unless`, :func:`keep_unless` and
:func:`count_nonfinite`, and :func:`dense_mean`; the update's start and the
zero state are :mod:`jaxcomm.trees`'.
"""

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import buckets
from jaxcomm.collectives import AxisName

Payload = tuple[jax.Array, ...]


class Config(NamedTuple):
    """The static options of one :func:`jaxcomm.core.compress` transform (checked)."""

    axis_name: Any
    error_feedback: bool
    min_size: int
    scope: str
    bucket_bytes: int | None
    strategy: Any
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
      nonfinite: the state's count of non-finite steps, this step counted
        (``int32`` scalar).
    """

    residual: Any
    server: Any
    nonfinite: Any


# --- the stages every transform shares (the NaN rule, the dense mean) -----------------


def all_finite(vecs: Sequence[jax.Array]) -> jax.Array:
    """The NaN rule's test: these arrays (this worker's) all finite, a bool scalar (``True``
    for none), reading every entry."""
    return (
        jnp.all(jnp.stack([jnp.isfinite(jnp.sum(v * 0)) for v in vecs]))
        if vecs
        else jnp.ones((), jnp.bool_)
    )


def nan_unless(ok: jax.Array, x: jax.Array) -> jax.Array:
    """The NaN rule's update: ``x`` where ``ok``, NaN (in ``x``'s dtype) where some worker's
    values were not finite."""
    return jnp.where(ok, x, jnp.asarray(jnp.nan, x.dtype))


def keep_unless(ok: jax.Array, new: Any, old: Any) -> Any:
    """The NaN rule's state: ``new`` where ``ok``, else ``old`` as it was (leaf by leaf)."""
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def count_nonfinite(count: jax.Array, ok: jax.Array) -> jax.Array:
    """The count of non-finite steps (``int32``), this step counted unless ``ok``."""
    return count + (~ok).astype(jnp.int32)


def dense_mean(arrays: list[jax.Array], axis_name: AxisName | None, bucket_bytes: int | None):
    """The worker mean of dense (small) leaves, one all-reduce per bucket; the leaves as they
    are without an axis."""
    if axis_name is None:
        return arrays
    return buckets.bucketed_pmean(arrays, axis_name, bucket_bytes)


def _encode_all(
    compressor: Any,
    vecs: list[jax.Array],
    keys: list[jax.Array | None],
    axis_name: AxisName | None,
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


def flag(ok: jax.Array, payload: Payload, kind: str) -> jax.Array:
    """The NaN rule's per-worker flag: 1 if this worker's ``g + e`` was not finite.

    psum: one entry in the dtype of the last payload array (it joins that
    dtype's bucket: no collective of its own); the sum is > 0 iff some
    worker's flag was set. all_gather: one byte (its bucket then moves bytes).
    """
    dtype = jnp.result_type(payload[-1]) if kind == "psum" and payload else jnp.uint8
    return (~ok).astype(dtype)


def slices(group: list[int], ps: dict[int, jax.Array]) -> list[tuple[int, slice]]:
    """(leaf index, its slice of the group's concatenated vector) for each leaf."""
    if len(group) == 1:
        return [(group[0], slice(None))]
    out, offset = [], 0
    for i in group:
        out.append((i, slice(offset, offset + ps[i].shape[0])))
        offset += ps[i].shape[0]
    return out


def encode(compressor: Any, step: Step, config: Config) -> tuple[list, jax.Array]:
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


def put_mean(
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
        mean = nan_unless(ok, mean)
    for i, sl in slices(group, step.ps):
        outputs[i] = mean[sl].reshape(step.grads[i].shape).astype(step.grads[i].dtype)


def decode_groups(
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
        if n is None:  # the NaN rule is applied by put_mean
            mean, rule = compressor.decode(received[gi], aux, d, dtype), ok
        elif compressor.carries_nonfinite:
            mean, rule = _decode_mean(compressor, received[gi], aux, d, dtype, n), None
        else:  # the codec applies the NaN rule itself
            mean, rule = compressor.decode_mean_checked(received[gi], aux, d, dtype, n, ok), None
        put_mean(compressor, step, group, mean, rule, outputs)


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
    return group_state(parts, group)


def memory(
    compressor: Any, step: Step, state: Any, encoded: list, ok: jax.Array, config: Config
) -> Memory:
    """The residuals after an exchange of the payloads as encoded: ``p - decode(own payload)``.

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
        old = group_state({i: residuals[i].astype(vec.dtype) for i in group}, group)
        # selects, not a lax.cond: a cond copied both branches on XLA:CPU, and its
        # predicate goes to the host on GPU
        kept = functools.partial(_kept, step, group, ok, vec.dtype)
        res = compressor.residual_checked(vec, old, kept, payload, aux, ok)
        for i, sl in slices(group, ps):
            new_res[i] = res[sl].reshape(residuals[i].shape).astype(residuals[i].dtype)
    nonfinite = count_nonfinite(state.nonfinite, ok) if step.groups else state.nonfinite
    return Memory(step.treedef.unflatten(new_res), state.server, nonfinite)


def group_state(tree_leaves: Any, group: list[int]) -> jax.Array | None:
    """A group's leaves of ``tree_leaves`` (indexable by leaf), flat and concatenated."""
    if tree_leaves is None:
        return None
    parts = [tree_leaves[i].reshape(-1) for i in group]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def vector_specs(leaves: list, config: Config) -> list[tuple[int, Any]]:
    """``(d, dtype)`` of each vector compressed on its own, for leaves (arrays or shapes)."""
    big = [x for x in leaves if np.size(x) >= max(config.min_size, 1)]
    if config.scope == "global" and big:
        return [(sum(int(np.size(x)) for x in big), jnp.result_type(*big))]
    return [(int(np.size(x)), jnp.result_type(x)) for x in big]
