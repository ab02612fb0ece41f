"""The exchange algorithms: ring all-reduce, hierarchical, two-phase and compressed reduce-scatter.

Built on the collectives of :mod:`jaxcomm.collectives` (the only place jaxcomm
communicates; each records what it sends in the :mod:`jaxcomm.ledger` while
:func:`jaxcomm.accounting.wire_report` traces) and the tensor fusion of
:mod:`jaxcomm.buckets`:

* :func:`ring_allreduce`: the bandwidth-optimal all-reduce written out as
  neighbour exchanges (``ppermute``);
* :func:`hierarchical`: dense on a fast mesh axis, a compressed transform on
  the slow one;
* :func:`two_phase` and :func:`reduce_scatter`: the compressed all-reduce
  that scales (all-to-all of compressed chunks, all-gather of compressed
  means) and its first phase alone, which the strategies of
  :mod:`jaxcomm.strategies` run (``exchange="two_phase"``, ``"auto"``,
  ``"reduce_scatter"``).

The collectives have one home, :mod:`jaxcomm.collectives` (over a pytree)
and :mod:`jaxcomm.buckets` (``bucketed_*``, over a list); the byte ledger is
:mod:`jaxcomm.ledger`.
"""

import importlib
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import buckets, collectives

# names that lived here before and moved to the module that owns them: still found here,
# with a DeprecationWarning naming the one import path (imported by name when asked for:
# jaxcomm.strategies is built on this module)
_MOVED = dict.fromkeys(
    "AxisName agree all_gather all_to_all as_varying axis_index axis_size bound_axis_size "
    "check_axis_name check_per_worker is_manual_axis moved_itemsize pmean ppermute psum "
    "psum_scatter".split(),
    "jaxcomm.collectives",
) | dict.fromkeys("BACKENDS MARKER Collective backend recording".split(), "jaxcomm.ledger")
_MOVED |= dict.fromkeys(["DENSE_RIDE_BYTES", "EXCHANGES", "dense_rides"], "jaxcomm.strategies")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"jaxcomm.exchange.{name} moved: import it from {_MOVED[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ring_allreduce(tree: Any, axis_name: str) -> Any:
    """Sum over workers by a ring: reduce-scatter then all-gather, by ``ppermute``.

    The bandwidth-optimal algorithm behind NCCL/Horovod all-reduce (Baidu
    2017; Patarasuk & Yuan 2009), written out as ``2(n-1)`` neighbour
    exchanges of one chunk (``ceil(size/n)`` entries): each worker sends
    ``2(n-1)/n·S`` bytes in all. A reference implementation, equal to
    ``lax.psum`` up to float summation order; its compiled HLO shows the
    collective-permutes. Each leaf is reduced separately.

    Args:
      tree: pytree of arrays (one worker's values).
      axis_name: a single mesh axis name.

    Returns:
      The pytree summed over workers (the same values on every worker).
      Under ``jax.shard_map`` the result is typed *varying* (it is built from
      point-to-point messages, which shard_map cannot prove equal), so return
      it with ``out_specs=P(axis)`` or pass ``check_vma=False``.

    References:
      Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters
      of workstations", JPDC 2009.
    """
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name: ring_allreduce runs over one axis (a str), got {axis_name!r}")
    n = collectives.axis_size(axis_name)
    return jax.tree.map(lambda x: _ring_leaf(x, axis_name, n), tree)


def _ring_leaf(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    if n == 1:
        return x
    size = x.size
    c = -(-size // n)
    chunks = jnp.pad(x.reshape(-1), (0, n * c - size)).reshape(n, c)
    me = collectives.axis_index(axis_name)
    right = [(i, (i + 1) % n) for i in range(n)]
    # reduce-scatter: after step s, chunk (me - s - 1) holds s + 2 workers' sum.
    for s in range(n - 1):
        received = collectives.ppermute(chunks[(me - s) % n], axis_name, right)
        chunks = chunks.at[(me - s - 1) % n].add(received)
    # worker `me` now holds the full sum of chunk (me + 1); pass the sums around.
    for s in range(n - 1):
        received = collectives.ppermute(chunks[(me + 1 - s) % n], axis_name, right)
        chunks = chunks.at[(me - s) % n].set(received)
    return chunks.reshape(-1)[:size].reshape(x.shape)


# --- two-level (hierarchical) exchange -----------------------------------------


class HierarchicalState(NamedTuple):
    """State of :func:`hierarchical`.

    Attributes:
      inner: state of the wrapped transform; with ``inner_size`` it is sized
        for this worker's 1/``inner_size`` shard of every leaf (flattened).
    """

    inner: Any


def hierarchical(
    tx: optax.GradientTransformation,
    *,
    inner_axis: str,
    inner_size: int | None = None,
    bucket_bytes: int | str | None = 25 * 2**20,
) -> optax.GradientTransformation:
    """Two-level exchange on a 2-D mesh: dense on the fast axis, ``tx`` on the slow one.

    Rule: average densely over ``inner_axis`` (within a node), then run ``tx`` (built
    over the slow axis) on a 1/``inner_size`` shard per worker (``inner_size`` given)
    or on the whole gradient (``None``, keeps leaf shapes, e.g. for PowerSGD).
    Wire: only ``tx``'s payload crosses the slow links (sharded: a node sends what one
    worker would for the whole model).

    Args:
      tx: the transform for the slow axis, or any optax chain containing one.
      inner_axis: the fast mesh axis name (e.g. ``"local"``).
      inner_size: workers on ``inner_axis``; ``None`` for the replicated form.
      bucket_bytes: inner-axis collective buckets (:mod:`jaxcomm.buckets`; ``"auto"``).

    Returns:
      An ``optax.GradientTransformation`` returning the mean over both axes.

    Example:
      >>> tx = jaxcomm.hierarchical(jaxcomm.topk(0.01, axis_name="node"),
      ...                           inner_axis="local", inner_size=8)
    """
    # Notes. Sharded (``inner_size`` given, the efficient form): each of the node's ``inner_size``
    # workers runs ``tx`` on a 1/``inner_size`` shard of every leaf, so its slow-link bytes are
    # ``tx``'s bytes for a shard; ``tx`` sees flat shards (use it for element-wise compressors; leaf
    # shapes are lost). Replicated (``inner_size=None``): every worker of a node sends the same
    # payload. ``bucket_bytes``: the inner axis's reduce-scatter / all-gather (or dense mean) go one
    # collective per bucket of this many bytes; ``None``: one per leaf; ``tx`` buckets its own
    # slow-axis exchange. Bytes: ``jaxcomm.wire_bytes(tx, params, {"node": 4, "local": 8},
    # axis="node")`` on ``jax.make_mesh((4, 8), ("node", "local"))``.
    if not isinstance(inner_axis, str):
        raise TypeError(f"inner_axis: expected a mesh axis name (str), got {inner_axis!r}")
    if inner_size is not None and (
        isinstance(inner_size, bool) or not isinstance(inner_size, int) or inner_size < 1
    ):
        raise ValueError(f"inner_size: expected an int >= 1 or None, got {inner_size!r}")
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)

    def init_fn(params):
        if inner_size is None:
            return HierarchicalState(tx.init(params))
        shards = jax.tree.map(
            lambda p: jnp.zeros((_shard_len(p, inner_size),), jnp.result_type(p)), params
        )
        return HierarchicalState(tx.init(shards))

    def update_fn(updates, state, params=None):
        if not isinstance(state, HierarchicalState):
            raise TypeError(
                f"state: expected the HierarchicalState made by this transform's init, got "
                f"{type(state).__name__}"
            )
        collectives.check_per_worker(updates, (inner_axis,))
        if inner_size is None:
            updates = buckets.bucketed_pmean(updates, inner_axis, bucket_bytes)
            out, inner = tx.update(updates, state.inner, params)
            return out, HierarchicalState(inner)
        out, inner = _sharded_update(
            tx, updates, state.inner, params, inner_axis, inner_size, bucket_bytes
        )
        return out, HierarchicalState(inner)

    return optax.GradientTransformation(init_fn, update_fn)


def _shard_len(x, inner_size: int) -> int:
    """Entries of one worker's shard of leaf ``x`` (its flat length over ``inner_size``, up)."""
    return -(-int(np.size(x)) // inner_size)


def _flat_padded(x, inner_size: int):
    """Leaf ``x`` flattened and zero-padded to ``inner_size`` shards."""
    x = jnp.reshape(x, (-1,))
    return jnp.pad(x, (0, inner_size * _shard_len(x, inner_size) - x.shape[0]))


def _sharded_update(tx, updates, inner_state, params, inner_axis, inner_size, bucket_bytes):
    """:func:`hierarchical`'s sharded form: ``tx`` on this worker's shard of the node mean."""
    n = collectives.axis_size(inner_axis)
    if n != inner_size:
        raise ValueError(
            f"inner_size: the transform was built for {inner_size} workers on "
            f"{inner_axis!r} but the axis has {n}"
        )
    # reduce-scatter over the inner axis: each of the node's workers holds the node-mean of a
    # 1/inner_size shard of every leaf (flattened, padded) ...
    leaves, treedef = jax.tree.flatten(updates)
    sums = buckets.bucketed_psum_scatter(
        [_flat_padded(g, inner_size) for g in leaves], inner_axis, bucket_bytes
    )
    shards = treedef.unflatten([s / jnp.asarray(n, s.dtype) for s in sums])
    shard_params = None
    if params is not None:
        me = collectives.axis_index(inner_axis)
        shard_params = jax.tree.map(
            lambda p: lax.dynamic_slice_in_dim(
                _flat_padded(p, inner_size),
                me * _shard_len(p, inner_size),
                _shard_len(p, inner_size),
            ),
            params,
        )
    # ... tx compresses and exchanges that shard over the slow axis ...
    out_shards, inner = tx.update(shards, inner_state, shard_params)
    # ... and an all-gather over the inner axis reassembles the leaf
    gathered = buckets.bucketed_all_gather(jax.tree.leaves(out_shards), inner_axis, bucket_bytes)
    out = [o.reshape(-1)[: np.size(g)].reshape(jnp.shape(g)) for o, g in zip(gathered, leaves)]
    return treedef.unflatten(out), inner


# --- two-phase compressed all-reduce -------------------------------------------------


def _phase_one(compressor, vecs, keys, axis_name, bucket_bytes, flag, dense=()):
    """Chunk, compress each chunk, all-to-all: worker j gets every worker's chunk j.

    Returns ``(layout, keys for a second compression, own, received, flags,
    dense_chunks)``: per vector ``(d, c)``; what this worker's chunks decode
    to, ``(d,)``; the n received payloads of chunk j (leading axis: sender);
    if ``flag`` (bool scalar) is given, every worker's flag as a ``(n, 1)``
    uint8 (riding in the same all-to-all), else ``None``; and per array of
    ``dense`` (uncompressed, riding as raw words too) the sum over workers of
    its chunk j, ``(ceil(size/n),)``.
    """
    n = collectives.axis_size(axis_name)
    layout, chunk_keys, phase1, own = [], [], [], []
    for v, k in zip(vecs, keys):
        d = v.shape[0]
        c = -(-d // n)
        layout.append((d, c))
        rows = jnp.pad(v, (0, n * c - d)).reshape(n, c)
        if k is None:
            payload, _ = jax.vmap(lambda x: compressor.encode(x, None))(rows)
            chunk_keys.append(None)
        else:
            ks = jax.vmap(lambda j, k=k: jax.random.fold_in(k, j))(jnp.arange(n))
            payload, _ = jax.vmap(compressor.encode)(rows, ks)
            chunk_keys.append(jax.random.fold_in(k, n))
        payload = tuple(payload)
        phase1.append(payload)
        dec = jax.vmap(
            lambda *pl, c=c, dt=v.dtype: compressor.decode(tuple(x[None] for x in pl), None, c, dt)
        )(*payload)
        own.append(dec.reshape(-1)[:d])
    flat = [x for p in phase1 for x in p]
    flat += [_dense_rows(x, n) for x in dense]
    if flag is not None:
        flat.append(jnp.broadcast_to((~flag).astype(jnp.uint8), (n, 1)))
    moved = buckets.bucketed_all_to_all(flat, axis_name, bucket_bytes)
    received, i = [], 0
    for payload in phase1:
        received.append(tuple(moved[i : i + len(payload)]))
        i += len(payload)
    dense_chunks = [buckets.sum_rows(x) for x in moved[i : i + len(dense)]]
    flags = moved[-1] if flag is not None else None
    return layout, chunk_keys, own, received, flags, dense_chunks


def _dense_rows(x: jax.Array, n: int) -> jax.Array:
    """``x`` flat, zero-padded to n chunks: ``(n, ceil(size/n))``, row j for worker j."""
    c = -(-x.size // n)
    return jnp.pad(x.reshape(-1), (0, n * c - x.size)).reshape(n, c)


def reduce_scatter(
    compressor: Any,
    vecs: list[jax.Array],
    keys: list[jax.Array | None],
    ok: jax.Array,
    axis_name: collectives.AxisName,
    bucket_bytes: int | None,
) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
    """Compressed reduce-scatter: this worker's chunk of the worker mean of each vector.

    Phase one of :func:`two_phase` alone: every chunk compressed, one
    all-to-all (per bucket), worker j decodes and averages chunk j. A worker
    sends ``(n-1)/n·s``. For sharded (ZeRO/FSDP-style) training: chunk j of a
    leaf whose first dimension is a multiple of n is worker j's shard along
    that dimension.

    Returns ``(chunks, own, ok)``: per vector the ``(c,)`` mean of chunk j
    (``c = ceil(d/n)``, zero-padded past d); what this worker's payloads
    decode to, ``(d,)``, for its residual; whether every worker's vectors
    were finite (the flags ride in the all-to-all).
    """
    n = collectives.axis_size(axis_name)
    layout, _, own, received, flags, _ = _phase_one(
        compressor, vecs, keys, axis_name, bucket_bytes, flag=ok
    )
    chunks = [
        compressor.decode_mean(rec, None, c, v.dtype, n)
        for v, (d, c), rec in zip(vecs, layout, received)
    ]
    return chunks, own, ~jnp.any(flags > 0)


def two_phase(
    compressor: Any,
    vecs: list[jax.Array],
    keys: list[jax.Array | None],
    servers: list[jax.Array | None],
    ok: jax.Array,
    axis_name: collectives.AxisName,
    bucket_bytes: int | None,
    dense: Sequence[jax.Array] = (),
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array | None], jax.Array, list[jax.Array]]:
    """Compressed all-reduce that scales: reduce-scatter compressed chunks, all-gather means.

    For each flat vector ``v`` (d entries) on n workers (chunks of
    ``c = ceil(d/n)``, the last one zero-padded):

    1. every chunk is compressed on its own; an all-to-all gives worker j
       every worker's compressed chunk j (one per bucket of all vectors);
    2. worker j decodes and averages chunk j once (O(d) work in all,
       independent of n), adds its *server* error-feedback residual for that
       chunk, compresses the result with ``compressor.server_codec()`` (the
       compressor itself unless it names another, e.g. 2-bit's per-chunk
       scale) and keeps what was not sent;
    3. an all-gather of the compressed means; every worker decodes them all.

    Per-worker traffic is ``2(n-1)/n·s`` for a compressed size ``s``, the
    ring all-reduce's at the compressed size, against ``(n-1)·s`` received
    by the all-gather exchange (DeepSpeed's compressed all-reduce of 1-bit
    Adam; Tang et al. 2021).

    Args:
      compressor: a :class:`jaxcomm.Compressor` with ``kind="all_gather"``.
      vecs: per-worker flat vectors (already ``g + e``), in the dtype to encode.
      keys: per-worker keys (or ``None``), one per vector.
      servers: per vector, the server residual (shape ``(d,)``, only this
        worker's chunk is used) or ``None`` without server error feedback.
      ok: bool scalar, this worker's vectors all finite (the NaN rule: the
        flags ride in the all-gather).
      axis_name: the mesh axis; bucket_bytes: as for every exchange.
      dense: arrays summed over the workers uncompressed (the small leaves),
        riding as raw words in both phases: their chunks in the all-to-all,
        the chunk sums in the all-gather, a ring all-reduce's bytes and no
        collective of their own.

    Returns:
      ``(means, own, servers, ok, sums)``: the worker means (d,) in each
      vector's dtype; what this worker's phase-1 payloads decode to (d,), for
      its own residual ``v - own``; the new server residuals; whether every
      worker's vectors were finite; the sums over workers of ``dense``.
    """
    n = collectives.axis_size(axis_name)
    me = collectives.axis_index(axis_name)
    layout, chunk_keys, own, received, _, dense_chunks = _phase_one(
        compressor, vecs, keys, axis_name, bucket_bytes, flag=None, dense=dense
    )
    server = compressor.server_codec()  # phase two's codec
    phase2, new_servers = [], []
    for v, (d, c), rec, k, srv in zip(vecs, layout, received, chunk_keys, servers):
        mean = compressor.decode_mean(rec, None, c, v.dtype, n)  # my chunk, all workers
        payload, new_server = _server_encode(server, mean, srv, k, v.dtype, d, c, n, me)
        phase2.append(payload)
        new_servers.append(new_server)
    # the NaN rule's flag (1 byte) rides in the all-gather: every worker sees all n
    flat = [x for p in phase2 for x in p] + dense_chunks + [(~ok).astype(jnp.uint8)]
    gathered = buckets.bucketed_all_gather(flat, axis_name, bucket_bytes)
    ok = ~jnp.any(gathered[-1] > 0)
    sums = [
        rows.reshape(-1)[: x.size].reshape(x.shape)
        for x, rows in zip(dense, gathered[len(flat) - 1 - len(dense) : -1])
    ]
    new_servers = [
        s if s is None else jnp.where(ok, s, old) for s, old in zip(new_servers, servers)
    ]
    return _decode_means(server, vecs, layout, phase2, gathered), own, new_servers, ok, sums


def _server_encode(server, mean, srv, k, dtype, d: int, c: int, n: int, me):
    """Phase two of :func:`two_phase` on this worker's chunk: ``mean`` plus its slice of the
    server residual ``srv`` (if any) encoded by ``server``; the payload and the new residual."""
    if srv is not None:
        padded = jnp.pad(srv, (0, n * c - d))
        s_state = mean.astype(srv.dtype) + lax.dynamic_slice_in_dim(padded, me * c, c)
        s = s_state.astype(dtype)
    else:
        s = mean
    payload, aux = server.encode(s, k)
    payload = tuple(payload)
    if srv is None:
        return payload, None
    r = server.residual(s_state, payload, aux).astype(srv.dtype)
    return payload, lax.dynamic_update_slice_in_dim(padded, r, me * c, 0)[:d]


def _decode_means(server, vecs, layout, phase2, gathered) -> list[jax.Array]:
    """Every worker's phase-two payloads (the all-gathered ``gathered`` rows, in the order of
    ``phase2``) decoded by ``server``: the worker mean (d,) of each vector."""
    means, i = [], 0
    for v, (d, c), payload in zip(vecs, layout, phase2):
        rows = gathered[i : i + len(payload)]
        i += len(payload)
        dec = jax.vmap(
            lambda *pl, c=c, dt=v.dtype: server.decode(tuple(x[None] for x in pl), None, c, dt)
        )(*rows)
        means.append(dec.reshape(-1)[:d])
    return means
