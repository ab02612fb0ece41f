"""Deep Gradient Compression (Lin et al., ICLR 2018), all four parts switchable.

Per worker and step (``m`` the momentum, ``n`` workers)::

    g   ← g · min(1, (clip_norm/√n) / ‖g‖)       # local gradient clipping
    u   ← m·u + g                                # momentum correction
    v   ← v + u                                  # accumulate velocity
    thr ← sampled top-ρ threshold of |v|          # ρ: density of the step
    send the first ρ·d entries with |v| ≥ thr     # values + int32 indices
    v, u ← 0 where sent                          # momentum factor masking
    return mean over workers of what was sent    # apply with PLAIN SGD

Momentum lives inside DGC, so the transform that follows must be plain SGD
(``optax.sgd(lr)`` without momentum): see :func:`dgc_sgd` and
:func:`check_followed_by_plain_sgd`.

DGC has two state buffers (u and v) and a threshold rule of its own, so it
is its own optax transform rather than a :class:`jaxcomm.core.Compressor`;
it follows the conventions of :func:`jaxcomm.compress`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import buckets, checks, core, exchange
from jaxcomm.compressors.selection import kth_largest
from jaxcomm.exchange import AxisName

__all__ = [
    "DGCState",
    "check_followed_by_plain_sgd",
    "dgc",
    "dgc_density_schedule",
    "dgc_sgd",
]

# The official code's bounded threshold correction: while fewer than LOWER·k
# or more than UPPER·k entries reach the threshold, scale it by LOWER / UPPER
# (bisect once bracketed), at most ADAPT_ITERS times.
LOWER, UPPER, ADAPT_ITERS = 0.8, 1.3, 10


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


# --- validation ---------------------------------------------------------------------


def _check_momentum(value: Any) -> float:
    return checks.check_float(value, "momentum", low=0, strict=False, high=1)


def _check_clip(value: Any) -> float | None:
    return None if value is None else checks.check_positive(value, "clip_norm")


# --- warm-up schedule ---------------------------------------------------------------


def _densities(
    ratio: float, warmup_epochs: int, warmup_ratios: Sequence[float] | None
) -> tuple[float, ...]:
    """Density of each warm-up epoch, then ``ratio``."""
    if warmup_ratios is None:
        # The paper's 75%, 93.75%, 98.4375%, 99.6% sparsity: each epoch keeps a quarter of
        # the previous one's entries, never fewer than the final ratio.
        warm = [max(ratio, 0.25 ** (e + 1)) for e in range(warmup_epochs)]
    else:
        warm = [checks.check_ratio(r, "warmup_ratios") for r in warmup_ratios]
    return (*warm, ratio)


def _boundaries(warmup_steps: int, warmup_epochs: int) -> list[int]:
    """First step of warm-up epochs 1..E (epoch E = after warm-up): ceil(e·W/E)."""
    return [-(-e * warmup_steps // warmup_epochs) for e in range(1, warmup_epochs + 1)]


def dgc_density_schedule(
    ratio: float = 0.001,
    *,
    warmup_steps: int = 0,
    warmup_epochs: int = 4,
    warmup_ratios: Sequence[float] | None = None,
) -> Callable[[Any], Any]:
    """The fraction of entries DGC sends at a step (1 − sparsity), as a schedule.

    The first ``warmup_steps`` steps are split into ``warmup_epochs`` equal
    "epochs" (step s is in epoch ``floor(s·E/W)``); epoch e sends
    ``warmup_ratios[e]``, by default ``max(ratio, 4^-(e+1))``: the paper's
    exponential warm-up 75%, 93.75%, 98.4375%, 99.6% sparsity over four
    epochs. From step ``warmup_steps`` on: ``ratio`` (99.9% sparsity by
    default).

    Args:
      ratio: density after warm-up, in (0, 1].
      warmup_steps: steps of warm-up, >= 0 (0: none).
      warmup_epochs: warm-up epochs, >= 1.
      warmup_ratios: densities of the warm-up epochs (``warmup_epochs`` of
        them, each in (0, 1]); ``None`` for the paper's.

    Returns:
      ``step -> density``; works on Python ints and on jnp int arrays.

    Example:
      >>> f = dgc_density_schedule(0.001, warmup_steps=400)
      >>> [f(s) for s in (0, 100, 200, 300, 400)]
      [0.25, 0.0625, 0.015625, 0.00390625, 0.001]
    """
    ratio, warmup_steps, warmup_epochs, warmup_ratios = _check_schedule(
        ratio, warmup_steps, warmup_epochs, warmup_ratios
    )
    dens = _densities(ratio, warmup_epochs, warmup_ratios) if warmup_steps else (ratio,)
    bounds = _boundaries(warmup_steps, warmup_epochs) if warmup_steps else []

    def schedule(step):
        if isinstance(step, (int, np.integer)):
            return dens[sum(step >= b for b in bounds)]
        phase = sum((jnp.asarray(step) >= b).astype(jnp.int32) for b in bounds)
        return jnp.asarray(dens, jnp.float32)[phase]

    return schedule


def _check_schedule(ratio, warmup_steps, warmup_epochs, warmup_ratios):
    ratio = checks.check_ratio(ratio)
    warmup_steps = checks.check_int(warmup_steps, "warmup_steps", 0)
    warmup_epochs = checks.check_int(warmup_epochs, "warmup_epochs", 1)
    if warmup_ratios is not None:
        warmup_ratios = tuple(warmup_ratios)
        if len(warmup_ratios) != warmup_epochs:
            raise ValueError(
                f"warmup_ratios: expected {warmup_epochs} densities (one per warm-up epoch), "
                f"got {len(warmup_ratios)}"
            )
    return ratio, warmup_steps, warmup_epochs, warmup_ratios


# --- selection ----------------------------------------------------------------------


def _pack(sel: jax.Array) -> jax.Array:
    """Bool ``(d,)`` -> uint32 ``(ceil(d/32),)`` words; entry i is bit i % 32 of word i // 32."""
    d = sel.shape[0]
    m = -(-d // 32)
    s = jnp.pad(sel, (0, m * 32 - d)).reshape(m, 32).astype(jnp.uint32)
    return jnp.sum(s << jnp.arange(32, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def _first_set(words: jax.Array, cap: int, d: int) -> jax.Array:
    """int32 ``(cap,)``: positions of the first ``cap`` set bits of ``words``, padded with d."""
    return _nth_set(words, jnp.arange(cap, dtype=jnp.int32), d)


def _nth_set(words: jax.Array, ranks: jax.Array, d: int) -> jax.Array:
    """int32: position of the ``ranks[j]``-th set bit (0-based) of ``words``; d past the last.

    A prefix sum over the words' popcounts (d/32 entries, not d), a binary
    search per slot for its word, and the rank-th set bit inside the word: far
    cheaper on XLA:CPU than ``jnp.nonzero(size=)``.
    """
    m = words.shape[0]
    pc = lax.population_count(words).astype(jnp.int32)
    csum = jnp.cumsum(pc)
    j = ranks.astype(jnp.int32) + 1
    w = jnp.searchsorted(csum, j, side="left").astype(jnp.int32)  # word holding the j-th bit
    wc = jnp.minimum(w, m - 1)
    rank = j - 1 - (csum[wc] - pc[wc])  # set bits to skip inside the word
    x = words[wc]
    # the bit position p with exactly `rank` set bits below it: binary search in 5 steps
    pos = jnp.zeros_like(rank)
    for step in (16, 8, 4, 2, 1):
        cand = pos + step
        below = x & ((jnp.uint32(1) << cand.astype(jnp.uint32)) - jnp.uint32(1))
        pos = jnp.where(lax.population_count(below).astype(jnp.int32) <= rank, cand, pos)
    return jnp.where(w < m, wc * 32 + pos, d)


class _Plan(NamedTuple):
    cap: int  # payload slots (k)
    stride: int  # sample stride (1: every entry, exact threshold)
    n_samples: int
    k_samples: int


def _plan(density: float, d: int, sample_ratio: float) -> _Plan:
    """Payload cap and threshold sample for one leaf, as the official code sizes them."""
    cap = core.num_kept(density, d)
    target = max(math.ceil(sample_ratio * d), math.ceil(2 / density))
    stride = 1 if target >= d else d // target
    n_samples = d // stride
    return _Plan(cap, stride, n_samples, core.num_kept(density, n_samples))


def _rotation(step: jax.Array, total: jax.Array) -> jax.Array:
    """A start rank in ``[0, total)`` that moves with the step (Knuth's multiplicative hash)."""
    h = (step.astype(jnp.uint32) + jnp.uint32(1)) * jnp.uint32(2654435761)
    return (h % jnp.maximum(total, 1).astype(jnp.uint32)).astype(jnp.int32)


def _keep(words: jax.Array, count: jax.Array, a: jax.Array, cap: int, step: jax.Array):
    """Indices (int32 ``(cap,)``, padded with d) of the entries of ``words`` that are sent.

    All of them when they fit. When more are selected than fit, the ``cap``
    largest of a window of ``ceil(1.3 cap)`` of them: all of them when the
    threshold correction succeeded (at most 1.3 cap selected), else a window
    of consecutive selected entries starting at a rank that rotates with the
    step, so no position is favoured (keeping the first by position biased
    updates toward early parameters; with ties it was the same ones for ever).
    """
    d = a.shape[0]
    window = min(d, max(cap, math.ceil(UPPER * cap)))
    j = jnp.arange(window, dtype=jnp.int32)
    start = jnp.where(count > window, _rotation(step, count), 0)
    ranks = (start + j) % jnp.maximum(count, 1)
    idx = jnp.where(j < count, _nth_set(words, ranks, d), d)
    if window == cap:
        return idx
    mags = jnp.where(idx < d, a[jnp.minimum(idx, d - 1)], -1.0)  # NaN ranks first in top_k
    return idx[lax.top_k(mags, cap)[1]]


def _select(v: jax.Array, plan: _Plan, offset: jax.Array, step: jax.Array) -> jax.Array:
    """Indices (int32 ``(cap,)``, padded with d) of up to ``cap`` entries with |v| >= thr.

    thr is the ``k_samples``-th largest of ``n_samples`` magnitudes taken at
    ``stride`` from ``offset`` (the official code's strided sample with its
    random start; here the start rotates with the step). When the sample is
    not the whole vector and more than 1.3·cap / fewer than 0.8·cap entries
    reach thr, it is corrected, at most 10 times: scaled by 1.3 / 0.8 as in
    the official code until a too-low and a too-high value are known, then
    bisected between them. (The official code, on too many, re-selects the
    exact top-cap of the selected entries with a sort, and scales by 1.3
    only without that "resample"; pure scaling can oscillate across the
    window, bisection cannot.) If the correction ends with too few selected
    but has seen a threshold selecting too many (ties: all magnitudes equal,
    or a few distinct values as in bf16 buffers, jump from too many to none),
    that threshold is used. Which of the selected are sent: :func:`_keep`.
    Exact zeros are never selected; NaN always is.
    """
    a = jnp.abs(v).astype(jnp.float32)
    if plan.stride == 1:
        sample = a
    else:
        rows = a[: plan.n_samples * plan.stride].reshape(plan.n_samples, plan.stride)
        sample = lax.dynamic_index_in_dim(rows, offset, axis=1, keepdims=False)
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    thr = jnp.maximum(kth_largest(sample, plan.k_samples), tiny)  # NaN stays NaN

    def pack(t):
        words = _pack(~(a < t))  # "not below": NaN entries (or a NaN t) select
        return words, jnp.sum(lax.population_count(words).astype(jnp.int32))

    words, count = pack(thr)
    if plan.stride > 1:
        hi, lo = math.floor(UPPER * plan.cap), math.ceil(LOWER * plan.cap)

        def cond(c):
            _, _, _, count, i, _ = c
            return (i < ADAPT_ITERS) & ((count > hi) | (count < lo))

        def body(c):
            t, below, above, count, i, _ = c
            many = count > hi  # t too low: raise it
            below = jnp.where(many, t, below)  # largest t seen with too many
            above = jnp.where(many, above, t)  # smallest t seen with too few
            step = jnp.where(many, t * jnp.float32(UPPER), t * jnp.float32(LOWER))
            bracketed = (below > 0) & jnp.isfinite(above)
            t = jnp.maximum(jnp.where(bracketed, (below + above) * jnp.float32(0.5), step), tiny)
            words, count = pack(t)
            return t, below, above, count, i + 1, words

        zero = (count * 0).astype(jnp.float32)  # typed like the per-worker values
        init = (thr, zero, zero + jnp.inf, count, jnp.int32(0), words)
        _, below, _, count, _, words = lax.while_loop(cond, body, init)
        # too few, after seeing too many (ties): go back to the too-many threshold
        words, count = lax.cond(
            (count < lo) & (below > 0), lambda: pack(below), lambda: (words, count)
        )
    return _keep(words, count, a, plan.cap, step)


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
    axis_name: AxisName | None = None,
    momentum: float = 0.9,
    nesterov: bool = False,
    momentum_correction: bool = True,
    momentum_masking: bool = True,
    clip_norm: float | None = None,
    warmup_steps: int = 0,
    warmup_epochs: int = 4,
    warmup_ratios: Sequence[float] | None = None,
    sample_ratio: float = 0.01,
    min_size: int = 1024,
    bucket_bytes: int | str | None = buckets.DEFAULT_BUCKET_BYTES,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """Deep Gradient Compression: momentum-corrected, masked, clipped, warmed-up top-k.

    Implements the four parts of Lin et al. (2018), each switchable:

    * **momentum correction** (``momentum_correction``): each worker keeps its
      momentum ``u ← m·u + g`` (Nesterov: ``u ← m·(u + g)`` and ``v`` gets
      ``u + g``, as in the official code) and accumulates the *velocity*
      ``v ← v + u``; what is not sent stays in v.
    * **local gradient clipping** (``clip_norm``): before that, the worker's
      gradient is scaled by ``min(1, (clip_norm/√n) / (‖g‖ + 1e-6))``, ``‖g‖``
      its global norm over all leaves (no communication).
    * **momentum factor masking** (``momentum_masking``): u and v are zeroed
      where entries were sent.
    * **warm-up** (``warmup_steps``): the density rises from 25% to ``ratio``
      exponentially over ``warmup_epochs`` (see :func:`dgc_density_schedule`).

    Selection: the threshold is the top-ρ magnitude of a strided ~1% sample
    of |v| (at least 2/ρ entries; the whole of v when it is that small), with
    the official code's bounded correction while more than 1.3·k / fewer
    than 0.8·k entries reach it (at most 10 rounds: scale by 1.3 / 0.8, then
    bisect once both sides are known, instead of the official sort). The
    first ``k = max(1, ceil(ρ·d))`` entries reaching it are sent (a static
    cap; the rest stay in v): values + int32 indices, all-gathered, summed
    and divided by n. Leaves smaller than ``min_size`` are sent dense
    (``pmean`` of the worker's momentum ``u``, which equals momentum on the
    averaged gradient).

    Wire per worker per step: ``Σ_sparse k·(value bytes + 4) + Σ_dense
    size·value bytes``. With warm-up, each distinct density is a branch of a
    ``lax.switch`` picked by the step count (made identical on all workers
    by a 4-byte all-reduce); the program, and ``jaxcomm.wire_bytes``, hold
    every branch's all-gather (sum them), while a step moves only its own.

    Warning:
      Momentum is applied INSIDE DGC. Follow it with plain SGD,
      ``optax.chain(jaxcomm.dgc(...), optax.sgd(lr))``, or use
      :func:`dgc_sgd`. SGD with momentum or Adam after it applies momentum
      twice; :func:`check_followed_by_plain_sgd` detects that from the
      optimizer state. With ``momentum_correction=False`` the reverse holds:
      DGC only accumulates gradients (``momentum`` must be 0) and the
      momentum goes after it (``optax.sgd(lr, momentum=0.9)``), the paper's
      baseline without correction.

    Args:
      ratio: density after warm-up, in (0, 1] (0.001 = 99.9% sparsity).
      axis_name: mesh axis to average over; ``None`` sparsifies locally.
      momentum: m in [0, 1).
      nesterov: Nesterov momentum as in the official code.
      momentum_correction: accumulate the velocity, not the gradient.
      momentum_masking: zero u and v at sent entries (needs the correction).
      clip_norm: global-norm clipping threshold (before scaling by n^-1/2),
        > 0, or ``None`` for no clipping.
      warmup_steps: warm-up steps, >= 0 (the paper: 4 epochs).
      warmup_epochs: equal parts of the warm-up, >= 1.
      warmup_ratios: density of each warm-up epoch; ``None`` for 4^-(e+1).
      sample_ratio: fraction of |v| sampled for the threshold, in (0, 1].
      min_size: leaves with fewer entries are sent dense.
      bucket_bytes: tensor fusion: every sparse leaf's values and indices go
        in all-gather buckets of at most this many bytes (raw bytes, one
        all-gather each), the dense leaves in all-reduce buckets of one dtype,
        filled from the last leaf to the first. Default ``"auto"``
        (:func:`jaxcomm.buckets.default_bucket_bytes`);
        ``None`` or 0: one collective per array. Bit-identical results.
      state_dtype: dtype of u and v (see :func:`jaxcomm.compress`); the
        payload is sent in the grads' dtype.

    Returns:
      An ``optax.GradientTransformation`` with :class:`DGCState` (u and v in
      the params' dtypes: two extra model copies). Updates come out in the
      dtype they came in; values are sent in it.

    Non-finite gradients: if a worker's (clipped) gradient holds NaN/Inf, its
    u and v are left unchanged that step (``state.nonfinite`` counts it) and
    it sends NaN values, so the NaN reaches every worker's output; wrap the
    chain in :func:`jaxcomm.skip_nonfinite` to skip such steps (not
    ``optax.apply_if_finite``, which decides per worker before the exchange:
    a worker that skips leaves the others waiting in the collective).

    Example:
      >>> tx = optax.chain(
      ...     jaxcomm.dgc(0.001, axis_name="data", warmup_steps=4 * steps_per_epoch),
      ...     optax.sgd(0.1))  # plain SGD: no momentum here

    References:
      Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the
      Communication Bandwidth for Distributed Training", ICLR 2018,
      arXiv:1712.01887. Official code: github.com/synxlin/deep-gradient-compression.
    """
    axis_name = exchange.check_axis_name(axis_name)
    ratio, warmup_steps, warmup_epochs, warmup_ratios = _check_schedule(
        ratio, warmup_steps, warmup_epochs, warmup_ratios
    )
    m = _check_momentum(momentum)
    clip = _check_clip(clip_norm)
    sample_ratio = checks.check_ratio(sample_ratio, "sample_ratio")
    state_dtype = checks.check_state_dtype(state_dtype)
    min_size = checks.check_int(min_size, "min_size", 0)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    if not momentum_correction and m != 0.0:
        raise ValueError(
            f"momentum: with momentum_correction=False DGC only accumulates gradients and "
            f"applies no momentum; pass momentum=0 and put the momentum after it, e.g. "
            f"optax.sgd(lr, momentum={m}) (or use jaxcomm.dgc_sgd). Got momentum={m}"
        )
    dens = _densities(ratio, warmup_epochs, warmup_ratios) if warmup_steps else (ratio,)
    bounds = _boundaries(warmup_steps, warmup_epochs) if warmup_steps else []
    distinct = sorted(set(dens), reverse=True)
    branch_of_phase = [distinct.index(x) for x in dens]

    def init_fn(params):
        core.check_float_leaves(jax.tree_util.tree_leaves_with_path(params), "params")
        zeros = lambda: jax.tree.map(  # noqa: E731
            lambda p: jnp.zeros(
                jnp.shape(p), core.resolve_state_dtype(jnp.result_type(p), state_dtype)
            ),
            params,
        )
        return DGCState(
            count=jnp.zeros((), jnp.int32),
            momentum=zeros() if momentum_correction else None,
            velocity=zeros(),
            nonfinite=jnp.zeros((), jnp.int32),
        )

    def update_fn(updates, state, params=None):
        del params
        _check_state(state, updates, momentum_correction)
        with_path, treedef = jax.tree_util.tree_flatten_with_path(updates)
        core.check_float_leaves(with_path, "updates")
        exchange.check_per_worker(updates, axis_name)
        grads = [g for _, g in with_path]
        n = 1 if axis_name is None else exchange.axis_size(axis_name)

        if clip is not None:
            sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads)
            scale = jnp.minimum(1.0, (clip / math.sqrt(n)) / (jnp.sqrt(sq) + 1e-6))
            grads = [g * scale.astype(g.dtype) for g in grads]
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads]))

        us = treedef.flatten_up_to(state.momentum) if momentum_correction else None
        vs = treedef.flatten_up_to(state.velocity)
        sparse = [i for i, g in enumerate(grads) if g.size >= max(min_size, 1)]
        outputs: list[jax.Array | None] = [None] * len(grads)
        new_v = list(vs)
        new_u, acc = _correct_momentum(grads, us, vs, m, nesterov)
        dense = [i for i in range(len(grads)) if i not in sparse]
        # dense: mean of the momentum = momentum of the mean
        sends = [acc[i].astype(grads[i].dtype) for i in dense]
        # they ride in the values' all-gather (one collective per bucket) unless gathering
        # them costs more bytes than a collective's latency (exchange.dense_rides)
        dense_bytes = sum(x.size * x.dtype.itemsize for x in sends)
        ride = axis_name is not None and bool(sparse) and exchange.dense_rides(n, dense_bytes)
        if axis_name is not None and not ride:
            sends = buckets.pmean(sends, axis_name, bucket_bytes)
        if not ride:
            for i, send in zip(dense, sends):
                outputs[i] = send
        vel = {i: (vs[i] + acc[i]).reshape(-1) for i in sparse}

        def phase(density: float):
            def run():
                outs, vels, moms = [], [], []
                sent = []
                for i in sparse:
                    g, v = grads[i], vel[i]
                    d = v.shape[0]
                    plan = _plan(density, d, sample_ratio)
                    offset = state.count % plan.stride
                    idx = _select(v, plan, offset, state.count)
                    vals = jnp.where(idx < d, v[jnp.minimum(idx, d - 1)], 0)
                    vals = jnp.where(finite, vals, jnp.nan).astype(g.dtype)
                    sent.append((vals, idx))
                means = []  # of the dense leaves, when they ride
                if axis_name is None:
                    received = [(vals[None], idx[None]) for vals, idx in sent]
                else:  # one all-gather per bucket of every leaf's values and indices
                    flat = buckets.all_gather(
                        [x for pair in sent for x in pair] + (sends if ride else []),
                        axis_name,
                        bucket_bytes,
                    )
                    pairs, rows = flat[: 2 * len(sent)], flat[2 * len(sent) :]
                    received = list(zip(pairs[::2], pairs[1::2]))
                    means = [buckets.sum_rows(x) / jnp.asarray(n, x.dtype) for x in rows]
                for i, (vals, idx), (g_vals, g_idx) in zip(sparse, sent, received):
                    g, v = grads[i], vel[i]
                    d = v.shape[0]
                    total = (
                        jnp.zeros((d,), g.dtype)
                        .at[g_idx.reshape(-1)]
                        .add(g_vals.reshape(-1), mode="drop")
                    )
                    outs.append((total / jnp.asarray(n, g.dtype)).reshape(g.shape))
                    # sent entries leave v: v - v is exactly 0 (rounding kept if sent in
                    # a lower precision); masking also zeroes u there.
                    vels.append(v.at[idx].add(-vals.astype(v.dtype), mode="drop"))
                    if momentum_correction and momentum_masking:
                        moms.append(new_u[i].reshape(-1).at[idx].set(0, mode="drop"))
                    elif momentum_correction:
                        moms.append(new_u[i].reshape(-1))
                return outs, _varying(vels), _varying(moms), means

            return run

        if sparse:
            runs = [phase(x) for x in distinct]
            if len(runs) == 1:
                outs, vels, moms, means = runs[0]()
            else:
                ph = sum((state.count >= b).astype(jnp.int32) for b in bounds)
                branch = jnp.asarray(branch_of_phase, jnp.int32)[ph]
                if axis_name is not None:  # identical, and typed invariant, on all workers
                    branch = exchange.agree(branch, axis_name)
                outs, vels, moms, means = lax.switch(branch, runs)
            if ride:
                for i, mean in zip(dense, means):
                    outputs[i] = mean
            for j, i in enumerate(sparse):
                outputs[i] = outs[j]
                new_v[i] = vels[j].reshape(vs[i].shape)
                if momentum_correction:
                    new_u[i] = moms[j].reshape(us[i].shape)

        keep = lambda new, old: jnp.where(finite, new.astype(old.dtype), old)  # noqa: E731
        new_state = DGCState(
            count=optax.safe_int32_increment(state.count),
            momentum=treedef.unflatten([keep(a, b) for a, b in zip(new_u, us)])
            if momentum_correction
            else None,
            velocity=treedef.unflatten([keep(a, b) for a, b in zip(new_v, vs)]),
            nonfinite=state.nonfinite + (~finite).astype(jnp.int32),
        )
        return treedef.unflatten(outputs), new_state

    def _varying(xs: list[jax.Array]) -> list[jax.Array]:
        """Per-worker buffers typed varying in every switch branch (a cast; no data moves)."""
        if axis_name is None or not exchange.is_manual_axis(axis_name):
            return xs
        return [exchange.as_varying(x, axis_name) for x in xs]

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


# --- the chain ----------------------------------------------------------------------


def dgc_sgd(
    learning_rate: optax.ScalarOrSchedule,
    ratio: float = 0.001,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    momentum_correction: bool = True,
    **dgc_options: Any,
) -> optax.GradientTransformation:
    """DGC followed by the SGD it needs: momentum in DGC, plain SGD after.

    ``optax.chain(jaxcomm.dgc(ratio, momentum=momentum, ...), optax.sgd(lr))``.
    With ``momentum_correction=False`` the momentum moves to the SGD instead:
    ``optax.chain(jaxcomm.dgc(ratio, momentum=0, momentum_correction=False,
    ...), optax.sgd(lr, momentum=momentum, nesterov=nesterov))``.

    Args:
      learning_rate: SGD learning rate (float or optax schedule).
      ratio: DGC density after warm-up, in (0, 1].
      momentum: momentum in [0, 1).
      nesterov: Nesterov momentum.
      momentum_correction: see :func:`dgc`.
      **dgc_options: any other keyword argument of :func:`dgc` (``axis_name``,
        ``clip_norm``, ``warmup_steps``, ...).

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = jaxcomm.dgc_sgd(0.1, 0.001, axis_name="data", warmup_steps=2000)

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, arXiv:1712.01887.
    """
    if momentum_correction:
        return optax.chain(
            dgc(ratio, momentum=momentum, nesterov=nesterov, **dgc_options),
            optax.sgd(learning_rate),
        )
    m = _check_momentum(momentum)
    return optax.chain(
        dgc(ratio, momentum=0.0, momentum_correction=False, **dgc_options),
        optax.sgd(learning_rate, momentum=m or None, nesterov=nesterov),
    )


_MOMENTUM_FIELDS = ("trace", "mu", "momentum", "momentum_buffer")


def check_followed_by_plain_sgd(opt_state: Any) -> None:
    """Raise if a DGC with momentum is followed by a transform that keeps momentum.

    Walks an optimizer state (e.g. ``tx.init(params)`` of an ``optax.chain``)
    in chain order. After a :class:`DGCState` holding momentum, any state with
    a momentum-like field (``trace``: ``optax.sgd(momentum=...)``,
    ``optax.trace``; ``mu``: Adam, AdamW, Lion, ...) means momentum is applied
    twice.

    Args:
      opt_state: the state of the whole optimizer.

    Raises:
      ValueError: naming the offending state.

    Example:
      >>> tx = optax.chain(jaxcomm.dgc(axis_name="data"), optax.sgd(0.1, momentum=0.9))
      >>> check_followed_by_plain_sgd(tx.init(params))  # ValueError
    """

    def is_state(x):
        return isinstance(x, tuple) and hasattr(x, "_fields")

    def walk(node):  # states in chain order, wrappers before what they wrap
        if is_state(node):
            yield node
            if isinstance(node, DGCState):
                return
        if isinstance(node, (tuple, list)):
            for child in node:
                yield from walk(child)
        elif isinstance(node, dict):
            for child in node.values():
                yield from walk(child)

    seen_dgc = False
    for node in walk(opt_state):
        if isinstance(node, DGCState):
            if seen_dgc and node.momentum is not None:
                raise ValueError("opt_state: two DGC transforms with momentum in one chain")
            seen_dgc = seen_dgc or node.momentum is not None
            continue
        if seen_dgc:
            found = [f for f in _MOMENTUM_FIELDS if f in node._fields]
            if found:
                raise ValueError(
                    f"opt_state: {type(node).__name__} (field {found[0]!r}) follows a DGC that "
                    f"already applies momentum; use plain SGD after DGC, e.g. optax.chain("
                    f"jaxcomm.dgc(...), optax.sgd(lr)) or jaxcomm.dgc_sgd(lr, ...)"
                )
