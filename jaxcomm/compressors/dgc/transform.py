"""The DGC transform: momentum correction, velocity accumulation, the sampled selection and
one all-gather per bucket.

The four parts of Lin et al. (2018), each switchable in :func:`dgc`:

* **momentum correction** (``momentum_correction``): each worker keeps its
  momentum ``u ← m·u + g`` (Nesterov: ``u ← m·(u + g)`` and ``v`` gets
  ``u + g``, as in the official code) and accumulates the *velocity*
  ``v ← v + u``; what is not sent stays in v. Without it (``momentum=0``,
  the momentum after DGC) it is the paper's baseline without correction.
* **local gradient clipping** (``clip_norm``): before that, the worker's
  gradient is scaled by ``min(1, (clip_norm/√n) / (‖g‖ + 1e-6))``, ``‖g‖``
  its global norm over all leaves (no communication).
* **momentum factor masking** (``momentum_masking``): u and v are zeroed
  where entries were sent.
* **warm-up** (``warmup_steps``): the density rises from 25% to ``ratio``
  exponentially over ``warmup_epochs`` (see :func:`dgc_density_schedule`).

Selection: the threshold is the top-ρ magnitude of a strided ~1% sample of
|v| (at least 2/ρ entries; the whole of v when it is that small), with the
official code's bounded correction while more than 1.3·k / fewer than 0.8·k
entries reach it (at most 10 rounds: scale by 1.3 / 0.8, then bisect once
both sides are known, instead of the official sort). The first ``k = max(1,
ceil(ρ·d))`` entries reaching it are sent (a static cap; the rest stay in v):
values + int32 indices, all-gathered, summed and divided by n. Leaves smaller
than ``min_size`` are sent dense (``pmean`` of the worker's momentum ``u``,
which equals momentum on the averaged gradient), riding in the values'
all-gather unless gathering them costs more bytes than a collective's latency
(:func:`jaxcomm.strategies.dense_rides`). Tensor fusion: every sparse leaf's
values and indices go in all-gather buckets of at most ``bucket_bytes`` (raw
bytes, one all-gather each), the dense leaves in all-reduce buckets of one
dtype, filled from the last leaf to the first
(:func:`jaxcomm.buckets.default_bucket_bytes` for ``"auto"``); results are
bit-identical for any bucket size.

With warm-up, each distinct density is a branch of a ``lax.switch`` picked by
the step count (made identical on all workers by a 4-byte all-reduce); the
program, and ``jaxcomm.wire_bytes``, hold every branch's all-gather (sum
them), while a step moves only its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import buckets, checks, collectives, core, stages, strategies, trees
from jaxcomm.branches import typed_switch
from jaxcomm.compressors.dgc import selection
from jaxcomm.compressors.dgc.schedule import (
    boundaries,
    check_clip,
    check_momentum,
    check_schedule,
    densities,
)
from jaxcomm.options import Options, Unpack, take

#: the common options (:class:`jaxcomm.options.Options`) :func:`dgc` takes, with
#: :data:`jaxcomm.options.DEFAULTS`' defaults
OPTIONS = ("axis_name", "min_size", "bucket_bytes", "state_dtype")


class DGCState(NamedTuple):
    """State of :func:`dgc`.

    Attributes:
      count: int32 ``[]``, updates made (saturates at the int32 maximum); it
        drives the warm-up schedule.
      momentum: u, the local momentum (velocity) buffer; the params' tree
        and shapes, float32 for bf16/fp16 params (``state_dtype``). ``None``
        with ``momentum_correction=False``.
      velocity: v, the accumulated velocity not yet sent (DGC's error
        feedback); the params' tree and shapes, float32 for bf16/fp16 params
        (zero on dense leaves).
      nonfinite: int32 ``[]``, steps in which this worker's gradient held NaN
        or Inf; on those steps u and v were left unchanged.
    """

    count: jax.Array
    momentum: Any
    velocity: Any
    nonfinite: jax.Array


# --- the transform ------------------------------------------------------------------


def _correct_momentum(grads, us, vs, m, nesterov: bool):
    """Momentum correction: the new momentum u (None without it) and what is added to v.

    ``us`` None: no momentum correction, the gradient itself is accumulated.
    """
    new_u = list(us) if us is not None else None
    acc: dict[int, jax.Array] = {}
    for i, g in enumerate(grads):
        x = g.astype(vs[i].dtype)
        if us is not None:
            if nesterov:
                new_u[i] = m * (us[i] + x)
                acc[i] = new_u[i] + x
            else:
                new_u[i] = m * us[i] + x
                acc[i] = new_u[i]
        else:
            acc[i] = x
    return new_u, acc


def dgc(
    ratio: float = 0.001,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    momentum_correction: bool = True,
    momentum_masking: bool = True,
    clip_norm: float | None = None,
    warmup_steps: int = 0,
    warmup_epochs: int = 4,
    warmup_ratios: Sequence[float] | None = None,
    sample_ratio: float = 0.01,
    **options: Unpack[Options],
) -> optax.GradientTransformation:
    """Deep Gradient Compression: momentum-corrected, masked, clipped, warmed-up top-k.

    Rule: each worker accumulates its momentum-corrected velocity ``v`` and sends the
    ``k = max(1, ceil(ρ·d))`` entries above a sampled top-ρ threshold; the update is
    the mean of what was sent (details: :mod:`jaxcomm.compressors.dgc.transform`).
    Wire per worker per step: ``Σ_sparse k·(value bytes + 4) + Σ_dense size·value bytes``.
    Momentum is applied INSIDE DGC: follow it with plain ``optax.sgd(lr)`` or use
    :func:`dgc_sgd`. Skip NaN/Inf steps with :func:`jaxcomm.skip_nonfinite`.

    Args:
      ratio: density after warm-up, in (0, 1] (0.001 = 99.9% sparsity).
      momentum: m in [0, 1). nesterov: Nesterov momentum as in the official code.
      momentum_correction: accumulate the velocity, not the gradient. momentum_masking:
        zero u and v at sent entries (needs the correction).
      clip_norm: global-norm clipping threshold (before scaling by n^-1/2), > 0, or ``None``.
      warmup_steps: warm-up steps, >= 0. warmup_epochs: equal parts of the warm-up, >= 1.
      warmup_ratios: density of each warm-up epoch; ``None`` for 4^-(e+1).
      sample_ratio: fraction of |v| sampled for the threshold, in (0, 1].
      **options: ``axis_name`` (``None`` sparsifies locally), ``min_size`` (leaves with
        fewer entries are sent dense), ``bucket_bytes`` and ``state_dtype`` (the dtype of
        u and v): see :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation`` with :class:`DGCState` (u, v: two model copies).

    Example:
      >>> tx = optax.chain(jaxcomm.dgc(0.001, axis_name="data"), optax.sgd(0.1))

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, arXiv:1712.01887.
    """
    # Notes. The values are all-gathered with int32 indices. SGD with momentum or Adam after DGC
    # applies momentum twice (:func:`check_followed_by_plain_sgd` detects it). With
    # ``momentum_correction=False`` the reverse holds: DGC only accumulates gradients (``momentum``
    # must be 0), the momentum goes after it. The paper's warm-up is 4 epochs (e.g. ``warmup_steps=4
    # * epoch``). Updates, and the values sent, keep the grads' dtype. A worker's NaN/Inf reaches
    # every worker's output. A worker whose (clipped) gradient holds NaN/Inf keeps its u and v that
    # step (``state.nonfinite``) and sends NaN; ``optax.apply_if_finite`` would leave the others
    # waiting in the collective. Official code: github.com/synxlin/deep-gradient-compression.
    schedule = (ratio, warmup_steps, warmup_epochs, warmup_ratios)
    flags = (nesterov, momentum_correction, momentum_masking)
    given = take("dgc", options, OPTIONS)
    common = (given["min_size"], given["bucket_bytes"], given["state_dtype"])
    o = _check_args(given["axis_name"], schedule, flags, momentum, clip_norm, sample_ratio, *common)

    def init_fn(params):
        return _init(o, params)

    def update_fn(updates, state, params=None):
        del params
        return _update(o, updates, state)

    return optax.GradientTransformation(init_fn, update_fn)


def _check_state(state: Any, updates: Any, momentum_correction: bool) -> None:
    if not isinstance(state, DGCState):
        raise TypeError(
            f"state: expected the DGCState made by jaxcomm.dgc(...).init(params), got "
            f"{type(state).__name__}"
        )
    if momentum_correction and state.momentum is None:
        raise ValueError(
            "state: state.momentum is None; it comes from a dgc with momentum_correction=False"
        )
    for name, buf in (("momentum", state.momentum), ("velocity", state.velocity)):
        if buf is not None:
            core.check_residual(buf, updates, f"state.{name}")


class _Options(NamedTuple):
    """:func:`dgc`'s checked options (static), with the warm-up's branches."""

    axis_name: Any
    m: float
    nesterov: bool
    momentum_correction: bool
    momentum_masking: bool
    clip: float | None
    sample_ratio: float
    min_size: int
    bucket_bytes: int | None
    state_dtype: Any
    distinct: list[float]  # the distinct densities, one switch branch each
    bounds: list[int]  # the steps where a warm-up epoch starts
    branch_of_phase: list[int]  # warm-up epoch -> its density's branch


def _check_args(
    axis_name,
    schedule,
    flags,
    momentum,
    clip_norm,
    sample_ratio,
    min_size,
    bucket_bytes,
    state_dtype,
) -> _Options:
    """:func:`dgc`'s arguments checked (errors name the argument)."""
    axis_name = collectives.check_axis_name(axis_name)
    ratio, warmup_steps, warmup_epochs, warmup_ratios = check_schedule(*schedule)
    m = check_momentum(momentum)
    clip = check_clip(clip_norm)
    sample_ratio = checks.check_ratio(sample_ratio, "sample_ratio")
    state_dtype = checks.check_state_dtype(state_dtype)
    min_size = checks.check_int(min_size, "min_size", 0)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    nesterov, momentum_correction, momentum_masking = flags
    if not momentum_correction and m != 0.0:
        raise ValueError(
            f"momentum: with momentum_correction=False DGC only accumulates gradients and "
            f"applies no momentum; pass momentum=0 and put the momentum after it, e.g. "
            f"optax.sgd(lr, momentum={m}) (or use jaxcomm.dgc_sgd). Got momentum={m}"
        )
    dens = densities(ratio, warmup_epochs, warmup_ratios) if warmup_steps else (ratio,)
    bounds = boundaries(warmup_steps, warmup_epochs) if warmup_steps else []
    distinct = sorted(set(dens), reverse=True)
    branch_of_phase = [distinct.index(x) for x in dens]
    return _Options(axis_name, m, *flags, clip, sample_ratio, min_size, bucket_bytes,
                    state_dtype, distinct, bounds, branch_of_phase)  # fmt: skip


def _init(o: _Options, params: Any) -> DGCState:
    """:func:`dgc`'s initial state: zero u (with the correction) and v."""
    velocity = trees.zero_state(params, o.state_dtype)  # the params checked
    return DGCState(
        count=jnp.zeros((), jnp.int32),
        momentum=trees.zero_state(params, o.state_dtype) if o.momentum_correction else None,
        velocity=velocity,
        nonfinite=jnp.zeros((), jnp.int32),
    )


def _update(o: _Options, updates: Any, state: DGCState):
    """One DGC step: clip, correct the momentum, send the dense leaves and the selection."""
    _check_state(state, updates, o.momentum_correction)
    _, treedef, grads = trees.leaves(updates, o.axis_name)
    n = 1 if o.axis_name is None else collectives.axis_size(o.axis_name)

    if o.clip is not None:
        sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads)
        scale = jnp.minimum(1.0, (o.clip / math.sqrt(n)) / (jnp.sqrt(sq) + 1e-6))
        grads = [g * scale.astype(g.dtype) for g in grads]
    finite = stages.all_finite(grads)

    us = treedef.flatten_up_to(state.momentum) if o.momentum_correction else None
    vs = treedef.flatten_up_to(state.velocity)
    sparse = [i for i, g in enumerate(grads) if g.size >= max(o.min_size, 1)]
    outputs: list[jax.Array | None] = [None] * len(grads)
    new_v = list(vs)
    new_u, acc = _correct_momentum(grads, us, vs, o.m, o.nesterov)
    dense = [i for i in range(len(grads)) if i not in sparse]
    sends, ride = _dense_sends(o, grads, acc, dense, bool(sparse), n, outputs)
    vel = {i: (vs[i] + acc[i]).reshape(-1) for i in sparse}

    if sparse:
        leaves = (grads, vel, sparse, new_u, sends if ride else [])
        runs = [_phase(o, x, leaves, state.count, finite, n) for x in o.distinct]
        outs, vels, moms, means = _run_phases(o, runs, state.count)
        if ride:
            for i, mean in zip(dense, means):
                outputs[i] = mean
        for j, i in enumerate(sparse):
            outputs[i] = outs[j]
            new_v[i] = vels[j].reshape(vs[i].shape)
            if o.momentum_correction:
                new_u[i] = moms[j].reshape(us[i].shape)

    keep = lambda new, old: stages.keep_unless(finite, new.astype(old.dtype), old)  # noqa: E731
    new_state = DGCState(
        count=optax.safe_int32_increment(state.count),
        momentum=treedef.unflatten([keep(a, b) for a, b in zip(new_u, us)])
        if o.momentum_correction
        else None,
        velocity=treedef.unflatten([keep(a, b) for a, b in zip(new_v, vs)]),
        nonfinite=stages.count_nonfinite(state.nonfinite, finite),
    )
    return treedef.unflatten(outputs), new_state


def _dense_sends(o: _Options, grads, acc, dense, any_sparse: bool, n: int, outputs):
    """The dense leaves' payloads (their accumulated momentum: the mean of the momentum is
    the momentum of the mean) and whether they ride in the values' all-gather; when they do
    not, their means go to ``outputs`` (in place) after their own all-reduce."""
    sends = [acc[i].astype(grads[i].dtype) for i in dense]
    # they ride in the values' all-gather (one collective per bucket) unless gathering
    # them costs more bytes than a collective's latency (strategies.dense_rides)
    dense_bytes = sum(x.size * x.dtype.itemsize for x in sends)
    ride = o.axis_name is not None and any_sparse and strategies.dense_rides(n, dense_bytes)
    if not ride:
        sends = stages.dense_mean(sends, o.axis_name, o.bucket_bytes)
        for i, send in zip(dense, sends):
            outputs[i] = send
    return sends, ride


def _run_phases(o: _Options, runs, count):
    """The branch of this step's density: the only one, or a switch on the warm-up epoch."""
    if len(runs) == 1:
        return runs[0]()
    ph = sum((count >= b).astype(jnp.int32) for b in o.bounds)
    branch = jnp.asarray(o.branch_of_phase, jnp.int32)[ph]
    if o.axis_name is not None:  # identical, and typed invariant, on all workers
        branch = collectives.agree(branch, o.axis_name)
    return typed_switch(branch, runs)


def _phase(o: _Options, density: float, leaves, count, finite, n: int):
    """The step at one density: ``run() -> (outputs, velocities, momenta, dense means)`` of
    the sparse leaves (and of the dense ones that ride in the all-gather)."""
    grads, vel, sparse, new_u, riding = leaves

    def run():
        sent = []
        for i in sparse:
            g, v = grads[i], vel[i]
            d = v.shape[0]
            plan = selection.make_plan(density, d, o.sample_ratio)
            offset = count % plan.stride
            idx = selection.select(v, plan, offset, count)
            vals = jnp.where(idx < d, v[jnp.minimum(idx, d - 1)], 0)
            vals = stages.nan_unless(finite, vals).astype(g.dtype)
            sent.append((vals, idx))
        received, means = _gather(o, sent, riding, n)
        outs, vels, moms = [], [], []
        for i, (vals, idx), (g_vals, g_idx) in zip(sparse, sent, received):
            g, v = grads[i], vel[i]
            d = v.shape[0]
            total = (
                jnp.zeros((d,), g.dtype).at[g_idx.reshape(-1)].add(g_vals.reshape(-1), mode="drop")
            )
            outs.append((total / jnp.asarray(n, g.dtype)).reshape(g.shape))
            # sent entries leave v: v - v is exactly 0 (rounding kept if sent in
            # a lower precision); masking also zeroes u there.
            vels.append(v.at[idx].add(-vals.astype(v.dtype), mode="drop"))
            if o.momentum_correction and o.momentum_masking:
                moms.append(new_u[i].reshape(-1).at[idx].set(0, mode="drop"))
            elif o.momentum_correction:
                moms.append(new_u[i].reshape(-1))
        return outs, vels, moms, means

    return run


def _gather(o: _Options, sent, riding, n: int):
    """Every worker's ``(values, indices)`` per sparse leaf, and the means of the riding
    dense leaves: one all-gather per bucket of every leaf's values and indices."""
    means = []  # of the dense leaves, when they ride
    if o.axis_name is None:
        return [(vals[None], idx[None]) for vals, idx in sent], means
    flat = buckets.bucketed_all_gather(
        [x for pair in sent for x in pair] + riding, o.axis_name, o.bucket_bytes
    )
    pairs, rows = flat[: 2 * len(sent)], flat[2 * len(sent) :]
    received = list(zip(pairs[::2], pairs[1::2]))
    means = [buckets.sum_rows(x) / jnp.asarray(n, x.dtype) for x in rows]
    return received, means
