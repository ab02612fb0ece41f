"""SparseLoCo: DiLoCo whose outer momentum is a decayed error-feedback buffer, sent top-k and 2-bit.

Every worker runs the inner optimizer for ``every`` steps. At a
synchronisation each worker forms its pseudo-gradient ``delta = anchor -
local params``, folds it into its error buffer ``e = beta·e + delta``, and
sends ``c = Q(TopK(e))``: per chunk of ``chunk`` entries the ``topk``
largest-magnitude entries, their values quantised to ``bits`` bits with a
per-chunk scale. ``e -= c`` keeps what was not sent. The workers' ``c`` are
all-gathered and averaged, and the anchor (the shared model) takes a plain
step ``anchor -= outer_learning_rate · mean(c)``; every worker adopts it.

The codec (one ``(nc, chunk)`` block per leaf, ``nc = ceil(d / chunk)``):

* indices within the chunk, ``ceil(log2(chunk))`` bits each, packed;
* codes ``q`` in ``[0, L]`` (``L = 2**bits - 1``), packed: a value ``v`` of a
  chunk whose largest kept magnitude is ``s`` gets ``q = round((v/s + 1)·L/2)``
  and is decoded as ``s·(2q - L)/L`` (uniform symmetric levels on ``[-s, s]``;
  for 2 bits: ``±s, ±s/3``);
* the scales ``s``, float32, one per chunk.

All of a worker's payload (every leaf) travels as one uint32 buffer in one
all-gather per synchronisation.

Where this differs from the authors' released code (as read in a port of
its optimizer and in the same group's production trainer; the paper's own
repository was not available to check): that code tiles 2-D leaves into
blocks of up to 64 x 64 (here: flat runs of ``chunk`` entries); it quantises
the kept values with one shift and scale per *leaf* from their mean and
standard deviation and decodes each code to its bin's centroid (here: a
max-magnitude scale per chunk and uniform levels); and it averages each
index over the workers that sent it (here: over all workers). The
error-feedback rule, the plain outer step and the defaults ``error_decay =
0.95``, 64 kept of 4,096 (1.6%), 2 bits and ``outer_learning_rate = 1`` are
the same; with ``outer_learning_rate != 1``
that code also scales the buffer's input by it (a squared step), this one
does not.
"""

import itertools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import checks, collectives, trees
from jaxcomm.branches import typed_cond
from jaxcomm.collectives import AxisName
from jaxcomm.compressors import packing
from jaxcomm.sync.averaging import sync_step
from jaxcomm.sync.common import add_updates, updates_to

__all__ = ["SparseLoCoState", "sparseloco", "sparseloco_sync_bytes"]


class SparseLoCoState(NamedTuple):
    """State of :func:`sparseloco`.

    Attributes:
      count: int32 ``[]``, inner steps made (saturates at the int32 maximum).
      local_steps: int32 ``[]``, inner steps since the last synchronisation,
        in ``[0, every)``.
      syncs: int32 ``[]``, synchronisations (outer steps) executed.
      inner_state: state of the inner optimizer (kept across rounds).
      anchor: the shared params after the last outer step (params' tree and
        dtypes; one model copy).
      error: the worker's error-feedback buffer ``e`` (params' tree and shapes;
        float32 for 16-bit params unless ``state_dtype`` says otherwise; one
        model copy). It replaces DiLoCo's outer momentum.
    """

    count: jax.Array
    local_steps: jax.Array
    syncs: jax.Array
    inner_state: Any
    anchor: Any
    error: Any


class _Layout(NamedTuple):
    """Static codec layout of one leaf of ``d`` entries."""

    d: int
    chunk: int  # entries per chunk: min(chunk, d)
    nc: int  # chunks (the last one zero-padded)
    k: int  # entries kept per chunk
    index_bits: int
    bits: int

    @property
    def words(self) -> tuple[int, int, int]:
        """uint32 words of the packed indices, the packed codes and the scales."""
        n = self.nc * self.k
        return (
            packing.packed_size(n, self.index_bits),
            packing.packed_size(n, self.bits),
            self.nc,
        )


def _layout(d: int, chunk: int, topk: int, bits: int) -> _Layout:
    """A leaf smaller than one chunk is one chunk, keeping about the same density."""
    c = min(chunk, d)
    k = topk if c == chunk else max(1, math.ceil(topk * c / chunk))
    return _Layout(d, c, math.ceil(d / c), k, packing.field_bits(c - 1), bits)


def _encode(e: jax.Array, lay: _Layout) -> jax.Array:
    """The worker's payload for flat ``e``: one uint32 vector of ``sum(lay.words)`` words."""
    x = jnp.pad(e.astype(jnp.float32), (0, lay.nc * lay.chunk - lay.d)).reshape(lay.nc, lay.chunk)
    _, idx = lax.top_k(jnp.abs(x), lay.k)  # NaN/Inf rank first: they reach the scale
    vals = jnp.take_along_axis(x, idx, axis=1)
    scale = jnp.max(jnp.abs(vals), axis=1)
    levels = 2**lay.bits - 1
    safe = jnp.where(scale == 0, 1.0, scale)[:, None]
    code = jnp.clip(jnp.round((vals / safe + 1) * (levels / 2)), 0, levels)
    return jnp.concatenate(
        [
            packing.pack(idx.reshape(-1), lay.index_bits),
            packing.pack(code.astype(jnp.uint32).reshape(-1), lay.bits),
            lax.bitcast_convert_type(scale, jnp.uint32),
        ]
    )


def _decode_mean(words: jax.Array, lay: _Layout) -> jax.Array:
    """Mean over the leading (worker) axis of the decoded payloads: flat float32 ``(d,)``."""
    n = words.shape[0]
    wi, wc, _ = lay.words
    idx = packing.unpack(words[:, :wi], lay.index_bits, lay.nc * lay.k)
    code = packing.unpack(words[:, wi : wi + wc], lay.bits, lay.nc * lay.k).astype(jnp.float32)
    scale = lax.bitcast_convert_type(words[:, wi + wc :], jnp.float32)
    levels = 2**lay.bits - 1
    code = code.reshape(n, lay.nc, lay.k)
    vals = scale[:, :, None] * ((2 * code - levels) / levels)
    rows = jnp.broadcast_to(jnp.arange(lay.nc)[None, :, None], vals.shape)
    dense = jnp.zeros((lay.nc, lay.chunk), jnp.float32)
    dense = dense.at[rows, idx.reshape(vals.shape).astype(jnp.int32)].add(vals)
    return (dense / n).reshape(-1)[: lay.d]


def _outer_step(anchor, error, local, layouts, beta, alpha, axis_name):
    """EF update, encode, exchange, decode: the new anchor and error buffer (leaf lists)."""
    es = [beta * e + (a - x).astype(e.dtype) for a, e, x in zip(anchor, error, local, strict=True)]
    payloads = [_encode(e.reshape(-1), lay) for e, lay in zip(es, layouts)]
    sizes = [p.shape[0] for p in payloads]
    own = jnp.concatenate(payloads)
    gathered = own[None] if axis_name is None else collectives.all_gather(own, axis_name)
    offsets = [0, *itertools.accumulate(sizes)]
    new_anchor, new_error = [], []
    for i, (a, e, lay) in enumerate(zip(anchor, es, layouts)):
        lo, hi = offsets[i], offsets[i + 1]
        sent = _decode_mean(own[None, lo:hi], lay).reshape(e.shape)
        mean = sent if axis_name is None else _decode_mean(gathered[:, lo:hi], lay)
        new_error.append(e - sent.astype(e.dtype))
        step = a.astype(jnp.float32) - alpha * mean.reshape(a.shape)
        new_anchor.append(step.astype(a.dtype))
    return new_anchor, new_error


def _check_options(every, outer_learning_rate, error_decay, chunk, topk, bits):
    every = checks.check_int(every, "every", 1)
    alpha = checks.check_positive(outer_learning_rate, "outer_learning_rate")
    beta = checks.check_float(
        error_decay, "error_decay", low=0, strict=False, high=1, high_strict=False
    )
    chunk = checks.check_int(chunk, "chunk", 1)
    topk = checks.check_int(topk, "topk", 1, chunk)
    bits = checks.check_int(bits, "bits", 1, 16)
    return every, alpha, beta, chunk, topk, bits


def sparseloco_sync_bytes(params: Any, *, chunk: int = 4096, topk: int = 64, bits: int = 2) -> int:
    """Bytes one worker contributes to the all-gather of one synchronisation.

    ``4 · sum over leaves of (ceil(nc·k·index_bits/32) + ceil(nc·k·bits/32) +
    nc)``: packed indices, packed codes and one float32 scale per chunk. It is
    what :func:`jaxcomm.wire_bytes` reports for a :func:`sparseloco` step (a
    step that synchronises); the mean per inner step is this divided by
    ``every``.
    """
    leaves = jax.tree.leaves(params)
    return 4 * sum(sum(_layout(math.prod(jnp.shape(p)), chunk, topk, bits).words) for p in leaves)


def sparseloco(
    inner: optax.GradientTransformation,
    *,
    every: int,
    axis_name: AxisName | None,
    outer_learning_rate: float = 1.0,
    error_decay: float = 0.95,
    chunk: int = 4096,
    topk: int = 64,
    bits: int = 2,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """SparseLoCo: local steps, then a top-k, 2-bit, error-feedback-compressed outer step.

    Rule, every ``every``-th step: ``e = error_decay·e + (anchor - (params + u))``,
    send ``c = Q(TopK(e))`` per chunk, ``e -= c``, ``anchor -= α·mean(c)``; every
    worker adopts the anchor. Wire: :func:`sparseloco_sync_bytes` per sync and worker
    (one all-gather); other steps send nothing. Skip NaN/Inf steps with
    :func:`jaxcomm.skip_nonfinite`.

    Args:
      inner: the inner (local) optimizer, e.g. ``optax.adamw(1e-3)``.
      every: inner steps per synchronisation (H in the paper), an int >= 1.
      axis_name: mesh axis to average over; ``None``: one worker (the compression still runs).
      outer_learning_rate: ``alpha``, a float > 0.
      error_decay: ``beta``, the decay of the error buffer, in [0, 1].
      chunk: entries per chunk, an int >= 1 (the last chunk of a leaf is zero-padded).
      topk: entries kept per chunk, an int in [1, chunk].
      bits: bits per kept value, an int in [1, 16].
      state_dtype: the error buffer's (``None``: float32 for 16-bit params, else theirs).

    Returns:
      An ``optax.GradientTransformation`` with :class:`SparseLoCoState`; needs ``params``.

    Example:
      >>> tx = jaxcomm.sparseloco(optax.adamw(1e-3), every=30, axis_name="data")

    References:
      Sarfi, Thérien, Lidin & Belilovsky, "Communication Efficient LLM
      Pre-training with SparseLoCo", 2025, arXiv:2508.15706. Douillard et al., "DiLoCo",
      2023, arXiv:2311.08105.
    """
    # Notes. The codec: see the module docstring. The decayed error buffer stands in for outer
    # momentum; it and the inner state are per worker and kept across rounds (params too, see
    # :mod:`jaxcomm.sync`). A NaN/Inf pseudo-gradient reaches every worker's anchor and the error
    # buffer (the NaN rule). A leaf smaller than ``chunk`` is one chunk; a leaf of ``d < chunk``
    # entries keeps ``max(1, ceil(topk·d/chunk))``. Updates keep the params' dtypes. See also
    # Douillard et al., "DiLoCo", 2023, arXiv:2311.08105.
    inner = checks.check_tx(inner, "inner")
    every, alpha, beta, chunk, topk, bits = _check_options(
        every, outer_learning_rate, error_decay, chunk, topk, bits
    )
    axis_name = collectives.check_axis_name(axis_name)
    state_dtype = checks.check_state_dtype(state_dtype)

    def init_fn(params):
        return _init(inner, state_dtype, params)

    def update_fn(updates, state, params=None):
        checks.require_params(params, "sparseloco")
        checks.check_state(state, SparseLoCoState, "sparseloco")
        collectives.check_per_worker(updates, axis_name)
        u, inner_state = inner.update(updates, state.inner_state, params)
        outer = _outer_branch(params, (chunk, topk, bits), beta, alpha, axis_name)
        is_sync = sync_step(state, every, 0)
        u, anchor, error, syncs = typed_cond(
            is_sync, outer, _stay, u, params, state.anchor, state.error, state.syncs
        )
        count = optax.safe_int32_increment(state.count)
        local_steps = jnp.where(is_sync, 0, state.local_steps + 1).astype(jnp.int32)
        return u, SparseLoCoState(count, local_steps, syncs, inner_state, anchor, error)

    return optax.GradientTransformation(init_fn, update_fn)


def _init(inner: optax.GradientTransformation, state_dtype: Any, params) -> SparseLoCoState:
    """:func:`sparseloco`'s initial state for ``params`` (floating-point leaves only)."""
    error = trees.zero_state(params, state_dtype)  # the params checked first
    zero = jnp.zeros((), jnp.int32)
    return SparseLoCoState(
        count=zero,
        local_steps=zero,
        syncs=zero,
        inner_state=inner.init(params),
        anchor=jax.tree.map(jnp.asarray, params),
        error=error,
    )


def _outer_branch(params, codec: tuple[int, int, int], beta, alpha, axis_name):
    """:func:`sparseloco`'s synchronising branch ``(u, params, anchor, error, syncs)`` for
    params shaped as ``params``, ``codec = (chunk, topk, bits)``."""
    # A NaN/Inf is always among the kept entries (top-k by magnitude), so it reaches its
    # chunk's scale and every worker's anchor; the error buffer holds it too.
    chunk, topk, bits = codec
    treedef = jax.tree.structure(params)
    layouts = [_layout(math.prod(jnp.shape(p)), chunk, topk, bits) for p in jax.tree.leaves(params)]

    def outer(u, params, anchor, error, syncs):
        local = jax.tree.leaves(add_updates(params, u))
        leaves = jax.tree.leaves
        new_anchor, new_error = _outer_step(
            leaves(anchor), leaves(error), local, layouts, beta, alpha, axis_name
        )
        anchor, error = treedef.unflatten(new_anchor), treedef.unflatten(new_error)
        return (
            updates_to(anchor, params, u),
            anchor,
            error,
            optax.safe_int32_increment(syncs),
        )

    return outer


def _stay(u, params, anchor, error, syncs):
    """The branch of a step that does not synchronise: ``u`` and the state as they are."""
    return u, anchor, error, syncs
