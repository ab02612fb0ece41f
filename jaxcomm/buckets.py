"""Tensor fusion: one collective per bucket of payloads, not one per leaf.

Over real processes every collective pays a fixed latency on top of its
bytes, and XLA:CPU neither combines all-gathers nor sends the operands of a
multi-operand all-reduce together. So jaxcomm packs the payloads of all leaves
that go through the same collective into one flat buffer per *bucket*,
exchanges it with one single-operand collective, and cuts the result back
into per-leaf payloads (Horovod's Tensor Fusion; PyTorch DDP's gradient
buckets). Only the transport changes: every leaf's payload arrives bit for
bit as a per-leaf collective would deliver it.

* Buckets are filled from the **last** payload to the first (the order in
  which backprop produces gradients, as DDP does), each up to
  ``bucket_bytes``; a payload larger than that gets a bucket of its own.
* **psum** buckets hold one dtype each (summing bit-cast floats would be
  wrong): payloads are grouped by dtype, then packed back to back
  (:func:`pack`).
* **all_gather** (and all-to-all) buckets mix dtypes: each payload is
  bit-cast to the widest unsigned word every payload of the bucket splits
  into (``uint16`` for a cast's words, ``uint32`` when every payload is 4
  bytes wide, ``uint8`` beside a byte code; exact sizes, no padding), the
  words packed, gathered, and bit-cast back. A payload of the word's width
  is bit-cast for free; one in bytes would be reassembled byte by byte on
  decode (a shift-and-reduce per payload on XLA:CPU). A byte-sized payload
  (the NaN flag beside top-k's values and indices) makes the bucket bytes.
  16-bit floats travel as their raw bits, so XLA:CPU's promotion of bf16
  collectives to f32 does not apply to them.
* Buckets are exchanged one after another: each bucket's buffer waits for
  the previous bucket's result (a data dependency, see ``_after``), so XLA's
  all-reduce combiner cannot merge independent buckets back into one
  multi-operand all-reduce, whose operands XLA:CPU would exchange one by one
  anyway. The compiled program holds exactly one single-operand collective
  per bucket of several payloads, in bucket order (a payload larger than a
  bucket goes as it is: XLA may combine its all-reduce with a neighbour's).
* ``bucket_bytes=None`` (or 0): one collective per payload array, as before.
* ``bucket_bytes="auto"`` (the default): :func:`default_bucket_bytes` of
  the backend and the collective, resolved when the exchange is traced:
  25 MiB (PyTorch DDP's ``bucket_cap_mb``) on GPU/TPU; on CPU 1 MiB for
  the sums (all-reduce, reduce-scatter) and 25 MiB for the all-gathers and
  all-to-alls. On CPU packing a dense gradient into a bucket and cutting it
  out again are memory copies that cost about what a loopback collective
  of the same bytes costs, so only small payloads gain from sharing a sum:
  with 2 processes ResNet-18's dense all-reduce in 25 MiB buckets took
  1.66x its per-leaf time, in 1 MiB buckets 0.76x. The gathered payloads
  are compressed and few buckets suit them: ResNet-18's EF-sign took 0.61x
  per leaf in 25 MiB buckets, 0.76x in 1 MiB ones (one run, cases in a
  random order each round: ``experiments/results/buckets.md``).

The bucketed collectives take a *list* of arrays and carry their own names
(:func:`bucketed_psum`, :func:`bucketed_pmax`, :func:`bucketed_pmean`,
:func:`bucketed_psum_scatter`, :func:`bucketed_all_to_all`,
:func:`bucketed_all_gather`); the collectives over a pytree, one per leaf,
are :mod:`jaxcomm.collectives`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import collectives
from jaxcomm.collectives import AxisName

__all__ = [
    "ACCELERATOR_BUCKET_BYTES",
    "CPU_BUCKET_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "GATHER_SUM_BYTES",
    "bucketed_all_gather",
    "bucketed_all_to_all",
    "bucketed_pmax",
    "bucketed_pmean",
    "bucketed_psum",
    "bucketed_psum_scatter",
    "check_bucket_bytes",
    "default_bucket_bytes",
    "gathers_sum",
    "pack",
    "plan",
    "sum_over",
]

ACCELERATOR_BUCKET_BYTES = 25 * 2**20
"""Bucket size on GPU/TPU: 25 MiB, PyTorch DDP's ``bucket_cap_mb``."""

CPU_BUCKET_BYTES = 2**20
"""Bucket size of the sums on CPU: 1 MiB (see the module's notes)."""

_SUMS = ("all_reduce", "reduce_scatter")

DEFAULT_BUCKET_BYTES = "auto"
"""Default ``bucket_bytes`` of every transform: the backend's (:func:`default_bucket_bytes`)."""


def default_bucket_bytes(platform: str | None = None, kind: str = "all_reduce") -> int:
    """Bytes per bucket for ``bucket_bytes="auto"`` on ``platform`` (default: JAX's backend).

    :data:`CPU_BUCKET_BYTES` for the sums (``kind`` ``"all_reduce"`` or
    ``"reduce_scatter"``) on ``"cpu"``, else :data:`ACCELERATOR_BUCKET_BYTES`.
    """
    platform = jax.default_backend() if platform is None else platform
    if platform == "cpu" and kind in _SUMS:
        return CPU_BUCKET_BYTES
    return ACCELERATOR_BUCKET_BYTES


def _resolve(bucket_bytes: int | str | None, kind: str) -> int | None:
    return default_bucket_bytes(kind=kind) if bucket_bytes == "auto" else bucket_bytes


def check_bucket_bytes(value: Any) -> int | str | None:
    """Validate a ``bucket_bytes`` option: an int >= 0, ``"auto"``, or None (0, None: no buckets).

    ``"auto"`` stays ``"auto"`` (resolved per collective when the exchange is
    traced, so that building a transform does not start JAX's backend).
    """
    if value is None:
        return None
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"bucket_bytes: expected an int >= 0 (bytes per bucket), 'auto' (the backend's "
            f"default) or None (one collective per leaf), got {value!r}"
        )
    if value < 0:
        raise ValueError(
            f"bucket_bytes: expected an int >= 0 (bytes per bucket), 'auto' (the backend's "
            f"default) or None (one collective per leaf), got {value}"
        )
    return int(value) or None


def _nbytes(x: jax.Array) -> int:
    return int(np.prod(jnp.shape(x), dtype=np.int64)) * jnp.result_type(x).itemsize


def plan(
    sizes: Sequence[int], keys: Sequence[Any], bucket_bytes: int | str | None
) -> list[list[int]]:
    """Buckets of item indices, filled from the last item to the first.

    Items with different ``keys`` never share a bucket; a bucket holds at most
    ``bucket_bytes`` unless a single item is larger (it is then alone).
    Buckets are listed in the order they fill (the first holds the last item).
    ``"auto"``: :func:`default_bucket_bytes` of JAX's backend.

    Example:
      >>> plan([4, 4, 4], ["f", "f", "f"], 8)
      [[2, 1], [0]]
    """
    if bucket_bytes == "auto":
        bucket_bytes = default_bucket_bytes()
    if not bucket_bytes:
        return [[i] for i in reversed(range(len(sizes)))]
    out: list[list[int]] = []
    open_: dict[Any, tuple[list[int], int]] = {}
    for i in reversed(range(len(sizes))):
        cur = open_.get(keys[i])
        if cur is None or cur[1] + sizes[i] > bucket_bytes:
            cur = ([], 0)
            out.append(cur[0])
        cur[0].append(i)
        open_[keys[i]] = (cur[0], cur[1] + sizes[i])
    return out


def _after(buf: jax.Array, prev: jax.Array | None) -> jax.Array:
    """``buf`` itself, but computed from ``prev`` too: the next bucket waits for the last.

    XLA's all-reduce combiner merges independent all-reduces into one
    multi-operand instruction (XLA:CPU then exchanges the operands one by one
    again), and it looks through an ``optimization_barrier``. A data
    dependency stops it: ``buf[0]`` is rewritten with ``buf[i]``, where
    ``i = |prev[0]| < -1`` is always false, i.e. 0, but not provably so to
    XLA. (A one-element buffer gets no dependency: XLA folds the clamped read.)
    """
    if prev is None or prev.size == 0 or buf.shape[0] == 0:
        return buf
    p0 = prev.reshape(-1)[0].astype(jnp.float32)
    i = (jnp.abs(p0) < -1.0).astype(jnp.int32)
    return lax.dynamic_update_slice_in_dim(buf, lax.dynamic_slice_in_dim(buf, i, 1), 0, axis=0)


def pack(
    pieces: Sequence[jax.Array], axis_name: AxisName, prev: jax.Array | None = None
) -> jax.Array:
    """The ``pieces`` (one dtype) side by side along their last axis, after ``prev``.

    1-D pieces give one flat buffer; pieces ``(n, c_i)`` give ``(n, sum c_i)``
    (row j holds every piece's row j). Written with one in-place
    ``dynamic_update_slice`` per piece into a zero buffer, not with
    ``concatenate``, which XLA:CPU compiled into a slow loop (against a
    hand-fused concatenate: ``experiments/results/buckets.json``). The pieces
    are moved as unsigned words of their width: on XLA:CPU a chain of bf16
    updates was much slower than the same chain on their uint16 bits. With
    ``prev`` the buffer waits for it (:func:`_after`).
    """
    dtype = jnp.dtype(pieces[0].dtype)
    word = _WORDS.get(dtype.itemsize) if dtype != jnp.bool_ else None
    if word is not None and dtype != word:  # see above: move bits, not floats
        bits = [lax.bitcast_convert_type(x, word) for x in pieces]
        return lax.bitcast_convert_type(pack(bits, axis_name, prev), dtype)
    lead = tuple(pieces[0].shape[:-1])
    total = sum(int(x.shape[-1]) for x in pieces)
    buf = collectives.as_varying(jnp.zeros(lead + (total,), dtype), axis_name)
    offset = 0
    for x in pieces:
        if x.shape[-1]:
            buf = lax.dynamic_update_slice_in_dim(
                buf, collectives.as_varying(x, axis_name), offset, axis=-1
            )
        offset += int(x.shape[-1])
    return _after(buf.reshape(-1), prev).reshape(buf.shape)


_WORDS = {1: jnp.dtype(jnp.uint8), 2: jnp.dtype(jnp.uint16), 4: jnp.dtype(jnp.uint32)}


def _alone(bucket: list[int], arrays: Sequence[jax.Array], bucket_bytes) -> bool:
    """Whether ``bucket`` is one array larger than a bucket: then it goes as it is.

    Packing it would only copy it (and chaining it after the bucket before,
    :func:`_after`, writes into it: a copy of the whole array when it is a
    buffer the program may not overwrite). XLA may combine its collective
    with a neighbour's into one multi-operand instruction, whose operands
    XLA:CPU exchanges one by one: the same collectives.
    """
    return len(bucket) == 1 and _nbytes(arrays[bucket[0]]) > bucket_bytes


def _exact(x: jax.Array) -> jax.Array:
    """``x`` held to its own dtype's bits: a 16-bit float payload is rounded to 16 bits.

    XLA may keep a bf16/fp16 value in float32 up to the collective
    (``xla_allow_excess_precision``) when it fuses the producer; a bucket
    (:func:`pack`) moves the payload's 16-bit words, which rounds it. The
    per-payload exchange rounds it too, so both exchange the same values and
    agree bit for bit (DGC's dense bf16 leaves differed in the last bit).
    """
    word = _WORDS.get(jnp.dtype(x.dtype).itemsize)
    if not jnp.issubdtype(x.dtype, jnp.floating) or word is None or x.dtype.itemsize != 2:
        return x
    bits = lax.optimization_barrier(lax.bitcast_convert_type(x, word))
    return lax.bitcast_convert_type(bits, x.dtype)


GATHER_SUM_BYTES = 256 * 2**10
"""Across CPU processes, a sum whose operand times the workers is at most this many
bytes is an all-gather and a local sum (:func:`sum_over`)."""


def gathers_sum(nbytes: int, n: int) -> bool:
    """Whether :func:`sum_over` gathers an operand of ``nbytes`` over ``n`` workers.

    On CPU across processes (``jax.process_count() > 1``: gloo), when
    ``n * nbytes <= GATHER_SUM_BYTES``. Within one process (fake devices) an
    all-reduce is a memory operation, so it stays one.
    """
    return (
        jax.default_backend() == "cpu"
        and jax.process_count() > 1
        and n * nbytes <= GATHER_SUM_BYTES
    )


def sum_over(x: jax.Array, axis_name: AxisName, *, gather: bool | None = None) -> jax.Array:
    """Sum of ``x`` over ``axis_name``: ``psum``, or a gather and a local sum when small.

    Where :func:`gathers_sum` (or ``gather=True``), every worker all-gathers
    the ``n`` operands and adds them worker by worker itself (the same on
    every worker). Over gloo a small all-reduce cost about 3x an all-gather
    of the same operand (a probe, 2 processes, a 1.6 kB operand: 1.53 vs 0.48
    ms added to a step; the steps: ``experiments/results/step_parts.md``); on 2 workers
    the gather receives the bytes a ring all-reduce does, on n it receives
    n/2 times as many, hence the bound. The adds follow XLA:CPU's all-reduce
    (bf16 in float32), so on fake CPU devices the result is bit for bit
    ``psum``'s (``tests/test_buckets.py``).
    """
    if gather is None:
        gather = gathers_sum(_nbytes(x), collectives.axis_size(axis_name))
    if not gather:
        return collectives.psum(x, axis_name)
    return sum_rows(collectives.all_gather(x, axis_name))


def sum_rows(rows: jax.Array) -> jax.Array:
    """The sum of ``rows``' leading axis (the workers), as XLA:CPU's all-reduce adds.

    Worker by worker, bf16 in float32 (a ``jnp.sum`` over the axis is free to
    add in another order): a gathered operand summed here equals its ``psum``
    bit for bit on fake CPU devices.
    """
    wide = jnp.float32 if rows.dtype == jnp.bfloat16 else None
    total = rows[0] if wide is None else rows[0].astype(wide)
    for w in range(1, rows.shape[0]):
        total = total + (rows[w] if wide is None else rows[w].astype(wide))
    return total.astype(rows.dtype)


def _reduce(arrays: Sequence[jax.Array], axis_name: AxisName, bucket_bytes, op) -> list:
    arrays = [jnp.asarray(x) for x in arrays]
    out: list[jax.Array | None] = [None] * len(arrays)
    keys = [jnp.result_type(x) for x in arrays]
    prev = None
    bucket_bytes = _resolve(bucket_bytes, "all_reduce")
    for bucket in plan([_nbytes(x) for x in arrays], keys, bucket_bytes):
        if not bucket_bytes or _alone(bucket, arrays, bucket_bytes):
            out[bucket[0]] = op(_exact(arrays[bucket[0]]), axis_name)
            continue
        flat = pack([arrays[i].reshape(-1) for i in bucket], axis_name, prev)
        total = prev = op(flat, axis_name)
        offset = 0
        for i in bucket:
            size = arrays[i].size
            out[i] = total[offset : offset + size].reshape(arrays[i].shape)
            offset += size
    return out


def bucketed_psum(
    arrays: Sequence[jax.Array], axis_name: AxisName, bucket_bytes: int | None
) -> list[jax.Array]:
    """Sum of every array over ``axis_name``: one all-reduce per bucket of one dtype.

    Across CPU processes a small bucket is all-gathered and summed locally
    (:func:`sum_over`).

    Args:
      arrays: per-worker arrays, any shapes and dtypes (in leaf order).
      axis_name: the mesh axis.
      bucket_bytes: bytes per bucket; ``None``: one all-reduce per array.

    Returns:
      The sums, a list in the order of ``arrays``, with their shapes and dtypes.
    """
    return _reduce(arrays, axis_name, bucket_bytes, sum_over)


def bucketed_pmax(
    arrays: Sequence[jax.Array], axis_name: AxisName, bucket_bytes: int | None
) -> list[jax.Array]:
    """Elementwise max over workers (``collectives.agree``), one all-reduce per bucket."""
    return _reduce(arrays, axis_name, bucket_bytes, collectives.agree)


def bucketed_pmean(tree: Any, axis_name: AxisName, bucket_bytes: int | None) -> Any:
    """Mean of every leaf of ``tree`` over ``axis_name``, in the leaf's dtype, bucketed."""
    leaves, treedef = jax.tree.flatten(tree)
    n = collectives.axis_size(axis_name)
    sums = bucketed_psum(leaves, axis_name, bucket_bytes)
    return treedef.unflatten([s / jnp.asarray(n, s.dtype) for s in sums])


def bucketed_psum_scatter(
    arrays: Sequence[jax.Array], axis_name: AxisName, bucket_bytes: int | None
) -> list[jax.Array]:
    """This worker's chunk of the sum of each ``(n * c_i,)`` array: one reduce-scatter per bucket.

    Worker j gets entries ``[j * c_i, (j + 1) * c_i)`` of every summed array,
    as :func:`jaxcomm.collectives.psum_scatter` gives for one array. A bucket
    (one dtype) lays its arrays out as ``(n, sum c_i)``, so that the j-th
    contiguous block of the bucket is every array's chunk j.
    """
    arrays = [jnp.asarray(x) for x in arrays]
    n = collectives.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(arrays)
    keys = [jnp.result_type(x) for x in arrays]
    prev = None
    bucket_bytes = _resolve(bucket_bytes, "reduce_scatter")
    for bucket in plan([_nbytes(x) for x in arrays], keys, bucket_bytes):
        if not bucket_bytes or _alone(bucket, arrays, bucket_bytes):
            out[bucket[0]] = collectives.psum_scatter(arrays[bucket[0]], axis_name)
            continue
        rows = pack([arrays[i].reshape(n, -1) for i in bucket], axis_name, prev)
        shard = prev = collectives.psum_scatter(rows.reshape(-1), axis_name)
        offset = 0
        for i in bucket:
            c = arrays[i].shape[0] // n
            out[i] = shard[offset : offset + c]
            offset += c
    return out


def _word_of(arrays: Sequence[jax.Array]) -> jnp.dtype:
    """The widest unsigned word (at most 4 bytes) every payload of the bucket splits into.

    Item sizes are powers of two, so the smallest divides every other: a bucket
    of 16-bit payloads moves ``uint16`` words, each payload bit-cast to and from
    its own width (no byte shuffling on decode). One byte-sized payload (a NaN
    flag beside top-k's values and indices) makes the whole bucket bytes: the
    bytes on the wire stay exactly the payloads' (the closed forms of
    ``wire_bytes``).
    """
    return _WORDS[min(4, *(jnp.dtype(x.dtype).itemsize for x in arrays))]


def _to_words(x: jax.Array, word: jnp.dtype, lead: tuple[int, ...] = ()) -> jax.Array:
    """``x`` as ``lead + (words,)`` of ``word`` (its raw bits, in order)."""
    flat = x.reshape(lead + (-1,))
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.uint8)
    if flat.dtype == word:
        return flat
    return lax.bitcast_convert_type(flat, word).reshape(lead + (-1,))


def _from_words(w: jax.Array, dtype: Any, shape: tuple[int, ...]) -> jax.Array:
    """``(n, words)`` -> ``(n, *shape)`` of ``dtype`` (:func:`_to_words` undone)."""
    dtype = jnp.dtype(dtype)
    n, size = w.shape[0], jnp.dtype(w.dtype).itemsize
    if dtype == jnp.bool_:
        x = w != 0
    elif dtype.itemsize == size:
        x = lax.bitcast_convert_type(w, dtype)
    else:
        x = lax.bitcast_convert_type(w.reshape(n, -1, dtype.itemsize // size), dtype)
    return x.reshape((n,) + tuple(shape))


def _cut(moved: jax.Array, parts: list[tuple[int, Any, tuple[int, ...]]]) -> list[jax.Array]:
    """The moved ``(n, words)`` buffer cut back into its ``parts``: ``(bytes, dtype, shape)``
    of each, in bucket order; each returned ``(n, *shape)`` in its dtype."""
    size, offset, out = jnp.dtype(moved.dtype).itemsize, 0, []
    for nbytes, dtype, shape in parts:
        out.append(_from_words(moved[:, offset : offset + nbytes // size], dtype, shape))
        offset += nbytes // size
    return out


def bucketed_all_to_all(
    arrays: Sequence[jax.Array], axis_name: AxisName, bucket_bytes: int | None
) -> list[jax.Array]:
    """Row exchange (:func:`jaxcomm.collectives.all_to_all`) of ``(n, ...)`` arrays, bucketed.

    Each array's rows are bit-cast to the bucket's word (:func:`_word_of`), a
    bucket lays them out as ``(n, total words)`` (row j: every array's row j),
    one all-to-all moves the bucket, and the rows are cut back and bit-cast to
    their dtypes.
    """
    arrays = [jnp.asarray(x) for x in arrays]
    n = collectives.axis_size(axis_name)
    out: list[jax.Array | None] = [None] * len(arrays)
    sizes = [_nbytes(x) // n for x in arrays]  # bytes per row
    prev = None
    bucket_bytes = _resolve(bucket_bytes, "all_to_all")
    for bucket in plan([s * n for s in sizes], [None] * len(arrays), bucket_bytes):
        if not bucket_bytes or _alone(bucket, arrays, bucket_bytes):
            out[bucket[0]] = collectives.all_to_all(arrays[bucket[0]], axis_name)
            continue
        word = _word_of([arrays[i] for i in bucket])
        rows = [_to_words(arrays[i], word, (n,)) for i in bucket]
        moved = prev = collectives.all_to_all(pack(rows, axis_name, prev), axis_name)
        parts = [(sizes[i], arrays[i].dtype, arrays[i].shape[1:]) for i in bucket]
        for i, x in zip(bucket, _cut(moved, parts)):
            out[i] = x
    return out


def bucketed_all_gather(
    arrays: Sequence[jax.Array], axis_name: AxisName, bucket_bytes: int | None
) -> list[jax.Array]:
    """Every worker's copy of every array: one all-gather of raw words per bucket.

    Args:
      arrays: per-worker arrays, any shapes and dtypes (in leaf order).
      axis_name: the mesh axis.
      bucket_bytes: bytes (per worker) per bucket; ``None``: one all-gather
        per array, in its own dtype.

    Returns:
      A list in the order of ``arrays``: each ``(n, *shape)`` in its dtype.
    """
    arrays = [jnp.asarray(x) for x in arrays]
    out: list[jax.Array | None] = [None] * len(arrays)
    sizes = [_nbytes(x) for x in arrays]
    prev = None
    bucket_bytes = _resolve(bucket_bytes, "all_gather")
    for bucket in plan(sizes, [None] * len(arrays), bucket_bytes):
        if not bucket_bytes or _alone(bucket, arrays, bucket_bytes):
            out[bucket[0]] = collectives.all_gather(arrays[bucket[0]], axis_name)
            continue
        word = _word_of([arrays[i] for i in bucket])
        flat = pack([_to_words(arrays[i], word) for i in bucket], axis_name, prev)
        gathered = prev = collectives.all_gather(flat, axis_name)  # (n, words)
        parts = [(sizes[i], arrays[i].dtype, arrays[i].shape) for i in bucket]
        for i, x in zip(bucket, _cut(gathered, parts)):
            out[i] = x
    return out
