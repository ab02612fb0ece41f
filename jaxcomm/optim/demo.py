"""DeMo (Peng, Quesnelle, Kingma 2024): decoupled momentum, DCT top-k exchange, sign step.

Each worker keeps its own momentum; only the fast-moving part of it (the
largest DCT coefficients of each chunk) is sent, and what is sent is
subtracted from the momentum, which thus doubles as the error-feedback
residual. The update is the sign of the decoded worker mean.

Chunks: the leaf is seen as 2-D (0-D as 1×1, 1-D as 1×size, n-D as
``prod(shape[:-1])×shape[-1]``, where the reference supports 1-D and 2-D
only); each dimension is cut into chunks of its largest divisor ``<=
compression_chunk`` (as the reference does; a prime dimension gets chunks of
1), and ``k = min(compression_topk, chunk entries)`` (the reference's clamp: a
chunk smaller than ``k`` is sent whole). Indices travel as uint8, uint16 or
int32 by the chunk's entries (the reference sends int64).
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import checks, collectives, core, stages, trees
from jaxcomm.collectives import AxisName
from jaxcomm.optim import common

__all__ = ["DeMoState", "chunk_size", "dct_matrix", "demo"]


class DeMoState(NamedTuple):
    """State of :func:`demo`.

    Attributes:
      count: int32 ``[]``, steps taken (the learning-rate schedule's step).
      delta: the decoupled momentum, per worker (params' tree and shapes;
        float32 for 16-bit params, else the param's dtype). What a worker
        sent is subtracted from it, so it also holds the error-feedback
        residual: under ``shard_map`` keep it per worker (``P("data")``).
      nonfinite: int32 ``[]``, steps where some worker's gradient held
        NaN/Inf (the update was NaN on every worker, ``delta`` left unchanged).
    """

    count: jax.Array
    delta: Any
    nonfinite: jax.Array


class Layout(NamedTuple):
    """How one leaf is cut into DCT chunks (static, from its shape).

    Attributes:
      rows, cols: the leaf as a 2-D array (0-D: 1×1; 1-D: 1×size; n-D:
        prod(shape[:-1])×shape[-1]).
      h, w: chunk height and width (:func:`chunk_size` of rows and cols).
      k: coefficients kept per chunk, ``min(compression_topk, h·w)``.
    """

    rows: int
    cols: int
    h: int
    w: int
    k: int

    @property
    def entries(self) -> int:
        return self.h * self.w

    @property
    def chunks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)


def chunk_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is ``<= target`` (the reference's DCT sizes; 1 for 0)."""
    for c in range(min(n, target), 0, -1):
        if n % c == 0:
            return c
    return 1


def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``C`` (float64, ``n×n``): ``X = C·x``, ``x = Cᵀ·X``."""
    k, j = np.arange(n)[:, None], np.arange(n)[None, :]
    scale = np.where(k == 0, math.sqrt(1.0 / n), math.sqrt(2.0 / n))
    return scale * np.cos(math.pi * (2 * j + 1) * k / (2 * n))


def layout(shape: tuple[int, ...], chunk: int, topk: int) -> Layout:
    """The chunking of a leaf of ``shape`` (see :class:`Layout`)."""
    if len(shape) <= 1:
        rows, cols = 1, math.prod(shape)
    else:
        rows, cols = math.prod(shape[:-1]), shape[-1]
    h, w = chunk_size(rows, chunk), chunk_size(cols, chunk)
    return Layout(rows, cols, h, w, min(topk, h * w))


def index_dtype(entries: int) -> Any:
    """The smallest index type for ``entries`` coefficients: uint8, uint16 or int32."""
    if entries <= 2**8:
        return jnp.uint8
    return jnp.uint16 if entries <= 2**16 else jnp.int32


def _mat(n: int, dtype: Any) -> jax.Array:
    return jnp.asarray(dct_matrix(n), dtype)


def encode(x: jax.Array, lay: Layout) -> jax.Array:
    """DCT-II of every chunk of ``x``: ``(chunks, h·w)`` coefficients, row-major in a chunk."""
    y = x.reshape(lay.rows // lay.h, lay.h, lay.cols // lay.w, lay.w)
    hi = jax.lax.Precision.HIGHEST
    c = jnp.einsum("yhxw,bh,dw->yxbd", y, _mat(lay.h, x.dtype), _mat(lay.w, x.dtype), precision=hi)
    return c.reshape(lay.chunks, lay.entries)


def decode(c: jax.Array, lay: Layout, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`encode`: the leaf of ``shape`` from its chunks' coefficients."""
    y = c.reshape(lay.rows // lay.h, lay.cols // lay.w, lay.h, lay.w)
    hi = jax.lax.Precision.HIGHEST
    x = jnp.einsum("yxbd,bh,dw->yhxw", y, _mat(lay.h, c.dtype), _mat(lay.w, c.dtype), precision=hi)
    return x.reshape(shape)


def scatter_mean(vals: jax.Array, idx: jax.Array, lay: Layout, dtype: Any) -> jax.Array:
    """Dense ``(chunks, h·w)`` coefficients from the ``(m, chunks, k)`` sparse ones of m workers.

    Each coefficient is the mean of the values sent for it by the workers
    that sent it (0 where none did), as the reference's ``scatter_reduce``
    with ``reduce="mean", include_self=False``.
    """
    base = jnp.arange(lay.chunks, dtype=jnp.int32)[None, :, None] * lay.entries
    flat = (base + idx.astype(jnp.int32)).ravel()
    size = lay.chunks * lay.entries
    total = jnp.zeros(size, dtype).at[flat].add(vals.astype(dtype).ravel())
    senders = jnp.zeros(size, dtype).at[flat].add(jnp.ones(flat.shape, dtype))
    return (total / jnp.maximum(senders, 1)).reshape(lay.chunks, lay.entries)


def check_args(decay: Any, topk: Any, chunk: Any, weight_decay: Any) -> tuple[float, int, int]:
    """Validate :func:`demo`'s options (errors name the argument and the allowed range)."""
    decay = checks.check_float(decay, "compression_decay", low=0, strict=False, high=1)
    chunk = checks.check_int(chunk, "compression_chunk", 1)
    topk = checks.check_int(topk, "compression_topk", 1, chunk * chunk)
    common.check_weight_decay(weight_decay)
    return decay, topk, chunk


def demo(
    learning_rate: optax.ScalarOrSchedule,
    *,
    compression_decay: float = 0.999,
    compression_topk: int = 32,
    compression_chunk: int = 64,
    weight_decay: float = 0.0,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformation:
    """DeMo (Peng et al. 2024): decoupled momentum, DCT top-k exchange, sign-SGD step.

    Rule per leaf: ``Δ ← β·Δ + lr·g``; per chunk keep the ``k`` largest DCT-II
    coefficients of ``Δ``, ``Δ ← Δ - q`` (``q`` their inverse DCT); all-gather them,
    average each coefficient over the workers that sent it, ``t`` = its inverse DCT;
    update ``-lr·sign(t) - lr·wd·p``. Chain no optimizer after it. The rule in full:
    :mod:`jaxcomm.optim.demo`.
    Wire per worker per step and chunk: ``k`` values plus ``k`` uint8/uint16/int32
    indices (a 64×64 float32 chunk with the defaults: 32·(4 + 2) bytes).
    A NaN/Inf gradient on any worker makes every update NaN and keeps ``delta``;
    integer or bool leaves raise ``TypeError`` (``optax.partition`` them out).

    Args:
      learning_rate: a float or an optax schedule of the step count.
      compression_decay: momentum decay ``β``, a float in [0, 1).
      compression_topk: coefficients kept per chunk, an int in ``[1, compression_chunk²]``.
      compression_chunk: target chunk side, an int >= 1.
      weight_decay: decoupled weight decay (float >= 0), needs ``params``.
      axis_name: mesh axis to average over; ``None``: one worker (compressed locally).

    Returns:
      An optimizer (``optax.GradientTransformation`` of updates) with :class:`DeMoState`.

    Example:
      >>> tx = jaxcomm.demo(1e-3, compression_topk=32, axis_name="data")

    Reference:
      Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization",
      2024, arXiv:2411.19870 (code: github.com/bloc97/DeMo).
    """
    # Notes (bloc97/DeMo's ``DeMo``). ``lr`` is the learning rate at ``count``; it scales both the
    # gradient added to the momentum and the sign step. Each coefficient is the mean of the values
    # the workers that kept it sent (the reference's scatter mean, not the sum over n); what is not
    # sent stays in the momentum (error feedback). Indices are uint8 for chunks of <= 256 entries,
    # uint16 for <= 65536, else int32; two all-gathers per leaf. The update is identical on every
    # worker; ``delta`` is per worker: under ``shard_map`` give the state ``P("data")``, and with a
    # schedule the update too (the step count is per-worker state; or use ``pmap``).
    # ``state.nonfinite`` counts NaN/Inf steps.
    decay, topk, chunk = check_args(
        compression_decay, compression_topk, compression_chunk, weight_decay
    )
    axis_name = collectives.check_axis_name(axis_name)

    def init_fn(params):
        return _init(params)

    def update_fn(updates, state, params=None):
        checks.check_state(state, DeMoState, "demo")
        core.check_residual(state.delta, updates, "state.delta")
        if weight_decay and params is None:
            raise ValueError("params: weight_decay > 0 needs tx.update(updates, state, params)")
        if axis_name is not None:
            collectives.axis_size(axis_name)  # a clear error if the axis is not bound
        collectives.check_per_worker(updates, axis_name)
        lr = jnp.asarray(common.learning_rate_at(learning_rate, state.count), jnp.float32)
        grads, treedef = jax.tree.flatten(updates)
        deltas = treedef.flatten_up_to(state.delta)
        delta, t = _exchange(grads, deltas, lr, (decay, chunk, topk), axis_name)
        delta, t = treedef.unflatten(delta), treedef.unflatten(t)
        return _sign_step(t, delta, state, lr, weight_decay, updates, params)

    return optax.GradientTransformation(init_fn, update_fn)


def _init(params) -> DeMoState:
    """:func:`demo`'s initial state: a zero momentum per leaf (floating params only)."""
    return DeMoState(jnp.zeros((), jnp.int32), trees.zero_state(params), jnp.zeros((), jnp.int32))


def _exchange(grads, deltas, lr, codec, axis_name):
    """Every leaf's new momentum and decoded worker mean ``t`` (lists in the leaves' order);
    ``codec = (decay, chunk, topk)``."""
    decay, chunk, topk = codec
    pairs = [_compress_leaf(g, d, lr, decay, chunk, topk) for g, d in zip(grads, deltas)]
    delta = [d for d, _ in pairs]
    t = [_transmitted(pay, g, d, chunk, topk, axis_name) for (d, pay), g in zip(pairs, grads)]
    return delta, t


def _compress_leaf(g, delta, lr, decay, chunk, topk):
    """One leaf: the new momentum, and the payload (values, indices) to send."""
    lay = layout(jnp.shape(g), chunk, topk)
    delta = decay * delta + lr.astype(delta.dtype) * g.astype(delta.dtype)
    coeffs = encode(delta, lay)
    _, idx = jax.lax.top_k(jnp.abs(coeffs), lay.k)
    vals = jnp.take_along_axis(coeffs, idx, axis=1).astype(g.dtype)
    idx = idx.astype(index_dtype(lay.entries))
    sent = scatter_mean(vals[None], idx[None], lay, delta.dtype)
    return delta - decode(sent, lay, delta.shape), (vals, idx)


def _transmitted(payload, g, delta, chunk, topk, axis_name):
    """One leaf: the decoded mean of every worker's payload (float, the leaf's shape)."""
    lay = layout(jnp.shape(g), chunk, topk)
    vals, idx = payload
    if axis_name is None:
        vals, idx = vals[None], idx[None]
    else:
        vals, idx = collectives.all_gather((vals, idx), axis_name)
    return decode(scatter_mean(vals, idx, lay, delta.dtype), lay, delta.shape)


def _sign_step(t, delta, state, lr, weight_decay, updates, params):
    """The update ``-lr·sign(t) - lr·wd·p`` (NaN on every worker where ``t`` is not finite)
    and the next :class:`DeMoState`."""
    step = jax.tree.map(jnp.sign, t)
    if weight_decay:
        step = jax.tree.map(lambda s, p: s + weight_decay * p.astype(s.dtype), step, params)
    # t is decoded from the gathered payloads: ``ok`` is the same on every worker, and
    # a NaN/Inf there (sign would turn an Inf into ±1) makes every update NaN.
    ok = stages.all_finite(jax.tree.leaves(t))
    out = jax.tree.map(
        lambda s, g: stages.nan_unless(ok, -lr.astype(s.dtype) * s).astype(g.dtype),
        step,
        updates,
    )
    return out, DeMoState(
        count=optax.safe_int32_increment(state.count),
        delta=stages.keep_unless(ok, delta, state.delta),
        nonfinite=stages.count_nonfinite(state.nonfinite, ok),
    )
