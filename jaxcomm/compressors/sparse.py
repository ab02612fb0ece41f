"""Sparsifiers: top-k, random-k and the fast strided-block threshold top-k.

With error feedback (the default) the kept values are sent raw and what is
not sent stays in the residual. Without it, random-k rescales what it sends
so that the compressed gradient is unbiased.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import checks, core, exchange
from jaxcomm.buckets import DEFAULT_BUCKET_BYTES
from jaxcomm.exchange import AxisName


def _scatter_add(
    d: int, dtype: Any, idx: jax.Array, vals: jax.Array, fill: jax.Array | None = None
) -> jax.Array:
    """Dense ``(d,)`` zeros (or the scalar ``fill``) with ``vals`` added at ``idx``."""
    base = jnp.zeros((d,), dtype) if fill is None else jnp.full((d,), fill, dtype)
    return base.at[idx.reshape(-1)].add(vals.reshape(-1).astype(dtype))


class _Sparse(core.CompressorBase):
    """Payload ``(values, int32 indices)``, all-gathered and scatter-added."""

    kind = "all_gather"

    def decode(self, payload, aux, d, dtype):
        vals, idx = payload
        return _scatter_add(d, dtype, idx, vals)

    def _sent(self, payload, aux):
        """``(values, indices)`` this worker sent."""
        return payload

    def residual(self, p, payload, aux):
        vals, idx = self._sent(payload, aux)
        # p[idx] - p[idx] is exactly 0: sent entries leave nothing behind.
        return p.at[idx].add(-vals)

    def residual_checked(self, p, e, kept, payload, aux, ok):
        # What was sent, subtracted from kept (one pass over g and e, p not written
        # out). Where not ok the indices point past the end and are dropped: adding
        # -0.0 instead would flush subnormal residual entries on XLA:CPU.
        vals, idx = self._sent(payload, aux)
        idx = jnp.where(ok, idx, p.shape[0])
        return kept().at[idx].add(-vals, mode="drop")

    def decode_mean(self, received, aux, d, dtype, n):
        vals, idx = received
        # scale the n*k received values, not the dense d-vector
        return _scatter_add(d, dtype, idx, vals.astype(dtype) / jnp.asarray(n, dtype))


def _decode_mean_checked(self, received, aux, d, dtype, n, ok):
    """:meth:`_Sparse.decode_mean` with the NaN rule in the fill the values are added to
    (NaN + x is NaN): no select over ``d``. Bit for bit the select's result for top-k and
    threshold (tests/test_golden.py holds it). Random-k keeps the default select (its
    decode rescales after the sum; with this fill its golden digests changed)."""
    vals, idx = received
    fill = jnp.where(ok, jnp.zeros((), dtype), jnp.asarray(jnp.nan, dtype))
    return _scatter_add(d, dtype, idx, vals.astype(dtype) / jnp.asarray(n, dtype), fill)


class TopKState(core.CompressState):
    """State of the TopK transform: the fields of :class:`jaxcomm.core.CompressState`.

    A class of its own, so another transform's state is refused by name.
    """

    __slots__ = ()


class TopK(_Sparse):
    """The ``k = max(1, ceil(ratio*d))`` entries of largest magnitude (exact ``lax.top_k``)."""

    state_cls = TopKState

    def __init__(self, ratio: float):
        self.ratio = ratio

    def slots(self, d: int) -> int:
        return core.num_kept(self.ratio, d)

    def encode(self, p, key):
        _, idx = lax.top_k(jnp.abs(p), self.slots(p.shape[0]))
        return (p[idx], idx.astype(jnp.int32)), None

    decode_mean_checked = _decode_mean_checked

    def all_finite(self, p, payload, aux):
        # lax.top_k ranks NaN and Inf above every finite magnitude: if p has a
        # non-finite entry, the first selected value is one.
        return jnp.all(jnp.isfinite(payload[0]))


def topk(
    ratio: float,
    *,
    axis_name: AxisName | None = None,
    error_feedback: bool = True,
    scope: str = "leaf",
    min_size: int = 1024,
    bucket_bytes: int | str | None = DEFAULT_BUCKET_BYTES,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """Top-k sparsification with error feedback.

    Each worker keeps the ``k = max(1, ceil(ratio·d))`` largest-magnitude
    entries of ``p = g + e`` (``e`` the residual), all-gathers values and int32
    indices, scatter-adds every worker's entries into zeros and divides by n.
    Wire: ``k·(value bytes + 4)`` per worker per leaf, i.e. an all-gather whose
    cost grows with n (see ``jaxcomm.netsim`` for the break-even vs a ring).

    Args:
      ratio: fraction of entries kept, in (0, 1].
      axis_name: mesh axis to average over; ``None`` sparsifies locally.
      error_feedback: keep unsent entries in a residual (one model copy).
      scope: ``"leaf"`` (k per leaf) or ``"global"`` (k of the whole
        flattened tree of compressible leaves).
      min_size: leaves with fewer entries are averaged densely.
      state_dtype: dtype of the error-feedback residual (see :func:`jaxcomm.compress`).
      bucket_bytes: tensor fusion, default ``"auto"`` (see :func:`jaxcomm.compress`).

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1))

    References:
      Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
      EMNLP 2017, arXiv:1704.05021. Stich et al., "Sparsified SGD with Memory",
      NeurIPS 2018, arXiv:1809.07599.
    """
    return core.compress(
        TopK(checks.check_ratio(ratio)),
        axis_name=axis_name,
        error_feedback=error_feedback,
        min_size=min_size,
        scope=scope,
        bucket_bytes=bucket_bytes,
        state_dtype=state_dtype,
    )


class RandomKState(core.CompressState):
    """State of the RandomK transform: the fields of :class:`jaxcomm.core.CompressState`.

    A class of its own, so another transform's state is refused by name.
    """

    __slots__ = ()


class RandomK(_Sparse):
    """``k`` random entries; uniform without replacement or one per stratum.

    ``sampling="uniform"``: k indices uniform without replacement (every
    entry kept with probability k/d; rescale d/k). ``sampling="stratified"``:
    the vector is cut into k contiguous strata of sizes floor/ceil(d/k) and one
    index is drawn uniformly in each (entry in stratum j kept with probability
    1/size_j; rescale size_j). Both keep each entry with the marginal
    probability that makes the rescaled estimate unbiased; stratified costs k
    random numbers instead of a permutation of d.
    """

    state_cls = RandomKState

    needs_key = True

    def __init__(self, ratio: float, *, shared: bool, rescale: bool, sampling: str):
        self.ratio = ratio
        self.kind = "psum" if shared else "all_gather"
        self.per_worker_key = not shared
        self.rescale = rescale
        self.sampling = sampling

    def slots(self, d: int) -> int:
        return core.num_kept(self.ratio, d)

    def _strata(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        k = self.slots(d)
        bounds = (np.arange(k + 1, dtype=np.int64) * d) // k
        return bounds[:-1], np.diff(bounds)

    def _indices(self, key, d: int) -> jax.Array:
        k = self.slots(d)
        if self.sampling == "uniform":
            # The k least of d random 32-bit words, as float32 (XLA's top-k is fast on
            # float32 only; a float holds the word exactly below 2^24, i.e. for ratios up
            # to 1/256, and rounds it above), rotated by a random shift: a uniform k-subset
            # up to ties at the boundary (equal words, or words a float does not tell
            # apart), which top-k gives to the lower index; the shift makes every index's
            # chance exactly k/d all the same. jax.random.choice(replace=False) shuffled all
            # d entries (several sorts): 52x slower at d = 2.4M on one CPU device.
            k_words, k_shift = jax.random.split(key)
            words = jax.random.bits(k_words, (d,), jnp.uint32)
            idx = jax.lax.top_k(-words.astype(jnp.float32), k)[1].astype(jnp.int32)
            shift = jax.random.randint(k_shift, (), 0, d, dtype=jnp.int32)
            return jnp.where(idx >= d - shift, idx - (d - shift), idx + shift)
        lo, size = self._strata(d)
        offs = jnp.floor(jax.random.uniform(key, (k,)) * size).astype(jnp.int32)
        return jnp.asarray(lo, jnp.int32) + jnp.minimum(offs, jnp.asarray(size - 1, jnp.int32))

    def _scale(self, d: int, dtype: Any):
        if not self.rescale:
            return None
        if self.sampling == "uniform":
            return jnp.asarray(d / self.slots(d), dtype)
        return jnp.asarray(self._strata(d)[1], dtype)

    def encode(self, p, key):
        idx = self._indices(key, p.shape[0])
        if self.kind == "psum":
            return (p[idx],), idx
        return (p[idx], idx), None

    def decode(self, payload, aux, d, dtype):
        if self.kind == "psum":
            vals, idx = payload[0], aux
        else:
            vals, idx = payload
        scale = self._scale(d, dtype)
        if scale is not None:
            vals = vals.astype(dtype) * scale
        return _scatter_add(d, dtype, idx, vals)

    decode_mean = core.CompressorBase.decode_mean  # payload layouts differ from _Sparse's

    def _sent(self, payload, aux):
        return (payload[0], aux) if self.kind == "psum" else payload

    def residual(self, p, payload, aux):
        if self.rescale:
            return core.CompressorBase.residual(self, p, payload, aux)
        return super().residual(p, payload, aux)

    def residual_checked(self, p, e, kept, payload, aux, ok):
        if self.rescale:
            return core.CompressorBase.residual_checked(self, p, e, kept, payload, aux, ok)
        return super().residual_checked(p, e, kept, payload, aux, ok)

    def wire_size(self, d: int, dtype: Any, n_workers: int = 1) -> int:
        # Payload only; the 8-byte key agreement is once per step, not per leaf.
        if self.kind == "psum":  # bf16 sums move 4 bytes on XLA:CPU
            per_entry = exchange.moved_itemsize(dtype)
        else:
            per_entry = jnp.dtype(dtype).itemsize + 4
        return self.slots(d) * per_entry


def randomk(
    ratio: float,
    *,
    key: jax.Array,
    axis_name: AxisName | None = None,
    error_feedback: bool = True,
    shared_indices: bool = True,
    sampling: str = "uniform",
    min_size: int = 1024,
    bucket_bytes: int | str | None = DEFAULT_BUCKET_BYTES,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """Random-k sparsification.

    Keeps ``k = max(1, ceil(ratio·d))`` random entries per leaf. With
    ``shared_indices`` (default) every worker draws the same indices from the
    shared key, so only the values go on the wire and they are summed with a
    ``psum`` (``k·value bytes``). Otherwise each worker draws its own (key
    folded with the axis index) and values + int32 indices are all-gathered.
    Without error feedback the values are rescaled (by d/k for uniform
    sampling) so that the average is an unbiased estimate of the gradient.

    Args:
      ratio: fraction of entries kept, in (0, 1].
      key: PRNG key (``jax.random.key(0)``); stored in the state, split each step.
      axis_name: mesh axis to average over; ``None`` sparsifies locally.
      error_feedback: keep unsent entries in a residual; if False, rescale.
      shared_indices: same indices on every worker (psum of values only).
      sampling: ``"uniform"`` (k without replacement; costs a permutation of
        d) or ``"stratified"`` (one uniform index in each of k equal strata;
        costs k random numbers). See :class:`RandomK`.
      min_size: leaves with fewer entries are averaged densely.
      state_dtype: dtype of the error-feedback residual (see :func:`jaxcomm.compress`).
      bucket_bytes: tensor fusion, default ``"auto"`` (see :func:`jaxcomm.compress`).

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = optax.chain(jaxcomm.randomk(0.01, key=jax.random.key(0), axis_name="data"),
      ...                  optax.sgd(0.1))

    References:
      Stich et al., "Sparsified SGD with Memory", NeurIPS 2018, arXiv:1809.07599.
      Wangni et al., "Gradient Sparsification for Communication-Efficient
      Distributed Optimization", NeurIPS 2018, arXiv:1710.09854.
    """
    if sampling not in ("uniform", "stratified"):
        raise ValueError(f"sampling: expected 'uniform' or 'stratified', got {sampling!r}")
    comp = RandomK(
        checks.check_ratio(ratio),
        shared=bool(shared_indices),
        rescale=not error_feedback,
        sampling=sampling,
    )
    return core.compress(
        comp,
        axis_name=axis_name,
        error_feedback=error_feedback,
        min_size=min_size,
        key=key,
        bucket_bytes=bucket_bytes,
        state_dtype=state_dtype,
    )


def _kth_patterns(pairs: Sequence[tuple[jax.Array, int]]) -> list[jax.Array]:
    """For each ``(bits, k)``: the k-th largest of the uint32 array ``bits`` (1-D).

    Bisection over the patterns: 32 rounds of "how many entries reach t?", each
    one compare-and-count pass over every array, all arrays in one loop.
    """

    def halve(_, lohi):
        out = []
        # invariant: count(bits >= lo) >= k > count(bits >= hi)
        for (bits, k), (lo, hi) in zip(pairs, lohi):
            mid = lo + (hi - lo) // 2
            enough = jnp.sum(bits >= mid, dtype=jnp.int32) >= k
            out.append((jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)))
        return out

    # A loop, not 32 unrolled rounds: unrolled, XLA:CPU's fusion under vmap
    # took minutes to compile. The carry starts from the data so that it has
    # the data's shard_map type (varying or not).
    start = []
    for bits, _ in pairs:
        zero = bits[0] & jnp.uint32(0)
        start.append((zero, zero | jnp.uint32(0xFFFFFFFF)))
    return [lo for lo, _ in lax.fori_loop(0, 32, halve, start)]


def kth_largest(a: jax.Array, k: int) -> jax.Array:
    """The k-th largest entry of non-negative float32 ``a`` (1-D), without sorting.

    Bisection over the uint32 bit patterns (which order like the floats):
    :func:`_kth_patterns`. Exact, and cheaper than ``lax.top_k``/``sort`` on
    XLA:CPU for the sample sizes used here.
    """
    (lo,) = _kth_patterns([(lax.bitcast_convert_type(a, jnp.uint32), k)])
    return lax.bitcast_convert_type(lo, jnp.float32)


def _is_prime(n: int) -> bool:
    """Trial division, at trace time."""
    return n > 1 and all(n % f for f in range(2, math.isqrt(n) + 1))


def _prime_at_most(n: int) -> int:
    """The largest prime ``<= n`` (1 for ``n < 2``)."""
    for c in range(n, 1, -1):
        if _is_prime(c):
            return c
    return 1


def _prime_at_least(n: int) -> int:
    """The smallest prime ``>= n`` (1 for ``n <= 1``)."""
    if n <= 1:
        return 1
    c = n
    while not _is_prime(c):
        c += 1
    return c


def _strided_best(a: jax.Array, m: int, *, second: bool = False):
    """Flat index of the largest entry of each residue class ``j (mod m)`` of ``a``.

    ``a`` is non-negative float32 of shape ``(d,)``, ``m <= d``. Block ``j``
    holds the entries ``j, j+m, j+2m, ...``: the first ``(d // m)·m`` entries
    viewed as a ``(d // m, m)`` array are reduced over axis 0 (folds of 8
    slices of contiguous rows, which vectorise and read ``a`` once), the last
    ``d mod m`` entries join blocks ``0..d mod m - 1``.

    Non-negative floats order like their bit patterns, so the low ``R`` bits
    of each uint32 pattern (``R`` = bits of the row count) are replaced by
    ``2^R-1-row`` and an integer max returns the largest value *and*, in
    its low bits, its row (ties, and values equal in all but the low R
    mantissa bits, go to the first row): exact up to a relative ``2^(R-23)``
    of the block maximum; the value later sent is read from the gradient
    itself, so it is exact. (On XLA:CPU a variadic argmax reduction is much
    slower than a plain max, and an integer max is cheaper than a float max,
    which propagates NaN.) NaN and Inf patterns lie above every finite one,
    so a non-finite entry wins its block; zeros and subnormals keep their
    rows (integers are not flushed).

    With ``second=True`` the fold also carries each block's runner-up key
    (``lo ← max(min(hi_a, hi_b), lo_a, lo_b)``) and returns ``(best, runner_up,
    has_runner_up)``; a block of one entry has no runner-up.
    """
    d = a.shape[0]
    rows = d // m
    rem = d - rows * m
    n_rows = rows + (1 if rem else 0)
    bits = max(1, n_rows.bit_length())  # row ids 0..n_rows-1 and an unused all-ones
    low = jnp.uint32((1 << bits) - 1)

    def keys(x, row0):
        # uint32 keys: non-negative floats order like their bit patterns, NaN and Inf
        # above every finite value; an integer max is one instruction (a float max
        # propagates NaN: several), and subnormals are not flushed
        pattern = lax.bitcast_convert_type(x, jnp.uint32)
        r = (row0 + jnp.arange(x.shape[0], dtype=jnp.uint32))[:, None]
        return (pattern & ~low) | (low - r)

    # Fold the rows _FOLD ways at a time (the elementwise max of _FOLD slices of
    # ceil(r/_FOLD) contiguous rows), log_FOLD(rows) times: every level reads its
    # input once, is elementwise over contiguous rows and fuses with the key
    # computation, and writes 1/_FOLD of it (folding in halves wrote half the
    # input at every level: a gradient's worth of writes over all levels). On
    # XLA:CPU a reduction over axis 0 (strided or transposed) was slower, and a
    # concatenate in the folds breaks their fusion (cost against a gradient copy:
    # python -m experiments.bench.floor). The last slice starts at r - c so that
    # every slice has c rows; its rows that an earlier slice holds too are masked
    # out for the runner-up (harmless for the maximum).
    none = jnp.uint32(0)  # below every key: a key holds low - row > 0 in its low bits

    def combine(x, y):
        (h1, l1), (h2, l2) = x, y
        if not second:
            return jnp.maximum(h1, h2), None
        lo = jnp.minimum(h1, h2)
        for extra in (l1, l2):
            lo = lo if extra is None else jnp.maximum(lo, extra)
        return jnp.maximum(h1, h2), lo

    best, lo = keys(a[: rows * m].reshape(rows, m), 0), None
    while best.shape[0] > 1:
        r = best.shape[0]
        f = min(_FOLD, r)
        c = -(-r // f)
        parts = []
        for i in range(f):
            start = min(i * c, r - c)
            h = best[start : start + c]
            low_part = None if lo is None else lo[start : start + c]
            if second and i * c > start:  # leading rows an earlier slice holds
                seen = (jnp.arange(c) < i * c - start)[:, None]
                h = jnp.where(seen, none, h)
                low_part = None if low_part is None else jnp.where(seen, none, low_part)
            parts.append((h, low_part))
        while len(parts) > 1:
            paired = [combine(x, y) for x, y in zip(parts[::2], parts[1::2])]
            parts = paired + parts[len(parts) - len(parts) % 2 :]
        best, lo = parts[0]
        if second:
            # Both keys travel to the next level as the bits of one complex64 array
            # behind a barrier (moved, not computed on: nothing is flushed): as two
            # arrays XLA:CPU computed each level's input twice, stacked it was slower.
            f32 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.float32)
            u32 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.uint32)
            z = lax.optimization_barrier(lax.complex(f32(best), f32(lo)))
            best, lo = u32(jnp.real(z)), u32(jnp.imag(z))
    if second and lo is None:  # one row: no runner-up
        lo = jnp.full_like(best, none)
    best = best[0]
    if second:
        lo = lo[0]
    if rem:
        tail = keys(a[rows * m :].reshape(1, rem), rows)[0]
        head = best[:rem]
        best = jnp.concatenate([jnp.maximum(head, tail), best[rem:]])
        if second:
            lo = jnp.concatenate([jnp.maximum(lo[:rem], jnp.minimum(head, tail)), lo[rem:]])

    def rows_of(k):
        row = low - (k & low)
        row = row.astype(jnp.int32)
        idx = row * m + jnp.arange(m, dtype=jnp.int32)
        return jnp.where(idx < d, idx, idx - m)

    if not second:
        return rows_of(best)
    return rows_of(best), rows_of(lo), lo > none


# Rows :func:`_strided_best` folds into one per level.
_FOLD = 8
# How much work the choice of the period may do, per (k, d) and once per process:
# band entries scored (in NumPy), and primes tried.
_PERIOD_BUDGET = 50_000_000
_PERIOD_CANDIDATES = 16
# Candidate classes per kept entry: m >= 2k classes offer their best and
# runner-up, 4k candidates for k slots (on i.i.d. entries a class holds
# Poisson(1/2) of the true top-k and loses ~1.6% of them beyond its two).
_CLASSES_PER_SLOT = 2
# The sampled threshold sits at the sample's ceil(1.25·k_s)-th largest (k_s its
# share of the top-ratio): a threshold from >= 32 kept sample entries varies
# by ~18% in the count it passes, and one set at exactly k_s cut into the true
# top-k (recall 0.88 on i.i.d. (3, 3, 32, 64) leaves); the top-k re-selection
# caps what is sent at k either way.
_SAMPLE_SLACK = 1.25


def _band_fill(idx: np.ndarray, m: int) -> int:
    """Entries of ``idx`` (heavier than every other entry) among the candidates mod ``m``.

    Each class ``j (mod m)`` offers its two largest entries, so a class holding
    ``c`` of the heavy entries offers ``min(c, 2)`` of them.
    """
    return int(np.minimum(np.bincount(idx % m, minlength=m), 2).sum())


@functools.lru_cache(maxsize=1024)
def _period(k: int, d: int) -> int:
    """The class period ``m`` of :class:`Threshold`'s candidates for ``k`` slots of ``(d,)``.

    ``d`` itself (every entry a candidate: exact top-k) when ``2k >= d`` or no
    prime fits; else a prime in ``[2k, d)`` not dividing ``d``. A band of
    adjacent columns of a matrix with row length ``c`` is a lattice of ``c``
    modulo ``m``, and some primes crowd it into few classes (on a
    ``(3072, 768)`` leaf at 1%, the smallest prime kept 0.85 of an 8-column
    band's top entries). For every factorisation ``d = R·c`` the band of
    ``round(k/R)`` adjacent columns is scored by :func:`_band_fill`, and of
    the first ``_PERIOD_CANDIDATES + 1`` primes the one with the best worst
    case wins (the smallest on ties), within ``_PERIOD_BUDGET`` scored
    entries. Deterministic (every worker picks the same; workers that did not
    would still be averaged right, since the payload carries absolute
    indices), computed once per ``(k, d)`` at trace time.
    """
    lo = _CLASSES_PER_SLOT * k
    if lo >= d:
        return d
    cands = []
    m = lo
    while len(cands) <= _PERIOD_CANDIDATES:
        m = _prime_at_least(m)
        if m >= d:
            break
        if d % m:
            cands.append(m)
        m += 1
    if not cands:
        return d
    # A band one column wide (w = 1) is scored 1 by every candidate: its entries are a
    # row length c apart, c is coprime with the prime m (m does not divide d), so they
    # fill distinct classes until every class has one, and a class offers two: the
    # candidates hold min(R, 2m) >= min(k, R) of them. Only wider bands are scored.
    bands = []
    for f in range(1, math.isqrt(d) + 1):
        if d % f:
            continue
        for c in {f, d // f}:
            r = d // c
            w = min(c, round(k / r))
            if 2 <= c < d and w >= 2:
                bands.append((r * w, c, r, w))
    bands.sort()

    def band(c: int, r: int, w: int) -> np.ndarray:
        return (np.arange(r, dtype=np.int64)[:, None] * c + np.arange(w)).reshape(-1)

    best, best_worst, spent = cands[0], -1.0, 0
    for m in cands:
        worst = 1.0
        for size, c, r, w in bands:
            if spent >= _PERIOD_BUDGET:
                break
            worst = min(worst, _band_fill(band(c, r, w), m) / min(k, size))
            spent += size
            if worst <= best_worst:  # cannot win
                break
        else:  # every band scored (within the budget)
            if worst > best_worst:
                best, best_worst = m, worst
        if best_worst >= 1.0 or spent >= _PERIOD_BUDGET:
            break
    return best


def _top_slots(keys: jax.Array, k: int, sample: jax.Array | None = None, kept: int = 1):
    """``(positions, filled)``: the positions of the ``k`` largest of the uint32 ``keys``
    (bit patterns of magnitudes) that reach the ``kept``-th largest of ``sample`` (if
    given), ties at the boundary to the first positions (as ``lax.top_k`` breaks them):
    those above the boundary first, then the ties, each in position order; and which of
    the ``k`` slots hold one (an empty slot says position 0). One bisection loop finds
    both thresholds (:func:`_kth_patterns`); two cumulative sums and one scatter compact
    the chosen."""
    n = keys.shape[0]
    t, *ts = _kth_patterns([(keys, k)] + ([] if sample is None else [(sample, kept)]))
    if ts:
        t = jnp.maximum(t, ts[0])
    above, tie = keys > t, keys == t
    n_above = jnp.cumsum(above, dtype=jnp.int32)
    n_tie = jnp.cumsum(tie, dtype=jnp.int32)
    pos = jnp.where(above, n_above - 1, jnp.where(tie, n_above[-1] + n_tie - 1, k))
    pos = jnp.minimum(pos, k)
    slot = jnp.full((k + 1,), n, jnp.int32).at[pos].set(jnp.arange(n, dtype=jnp.int32))[:k]
    filled = slot < n
    return jnp.where(filled, slot, 0), filled


class ThresholdState(core.CompressState):
    """State of the Threshold transform: the fields of :class:`jaxcomm.core.CompressState`.

    A class of its own, so another transform's state is refused by name.
    """

    __slots__ = ()


class Threshold(_Sparse):
    """Sampled threshold, strided candidates, exact top-k among them; no sort of d.

    ``k = max(1, ceil(ratio·d))`` payload slots (top-k's wire). The entries
    fall into ``m`` classes ``j, j+m, j+2m, ...`` (:func:`_period`: a prime
    ``>= 2k`` chosen for ``d``, or ``m = d``); one fold of the ``(d // m, m)``
    view, 8 row slices at a time (:func:`_strided_best`), gives each class's
    largest and runner-up magnitude, ``2m`` candidates. Because ``m`` is prime and
    ``>= 2k``, a run of consecutive entries (a row of a matrix leaf) falls in
    distinct classes, and so does a column (entries a row length apart); a
    class loses only its third and later entries of the true top-k.

    If ``sample_ratio`` is set, a threshold is computed (exactly, without a
    sort: a bisection over the bit patterns) as the ``ceil(1.25·ratio·n)``-th largest
    magnitude of the sample ``|p[::s]|`` of ``n`` entries, ``s`` the smallest
    prime ``>= round(1/sample_ratio)`` (a prime stride does not alias with
    common row lengths), lowered to the largest prime ``<= k // 32`` (1 if
    none) when the sample would otherwise keep fewer than 32 entries, primes
    dividing ``d`` skipped (then the stride is coprime with every row
    length); candidates below it are not sent. The ``k`` largest candidates
    that remain fill the slots, as DGC re-selects among the entries above its
    sampled threshold (:func:`_top_slots`: the k-th largest candidate is found
    in the same bisection loop as the threshold, and the candidates at or
    above both are compacted, ties at the boundary to the first; on XLA:CPU
    cheaper than ``lax.top_k`` over the ``2m`` candidates);
    a slot left over carries value 0. What is not sent stays in the residual.
    :meth:`slots_used` counts the slots that carry an entry.
    """

    state_cls = ThresholdState

    def __init__(self, ratio: float, sample_ratio: float | None):
        self.ratio = ratio
        self.sample_ratio = sample_ratio

    def period(self, d: int) -> int:
        return _period(core.num_kept(self.ratio, d), d)

    def slots(self, d: int) -> int:
        return core.num_kept(self.ratio, d)

    def _stride(self, d: int) -> int:
        """The sample's stride: the smallest prime ``>= round(1/sample_ratio)``, but
        small enough that 32 sample entries reach the threshold (the largest prime
        ``<= k // 32``; 1, every entry, if none). Primes that divide ``d`` are
        skipped: a stride coprime with ``d`` is coprime with every row length
        ``c`` of a ``(d/c, c)`` view, so the sample visits every column alike (a
        stride of 2 on even rows would see only even columns)."""
        s = _prime_at_least(max(1, round(1.0 / self.sample_ratio)))
        while s > 1 and d % s == 0:
            s = _prime_at_least(s + 1)
        t = _prime_at_most(core.num_kept(self.ratio, d) // 32)
        while t > 1 and d % t == 0:
            t = _prime_at_most(t - 1)
        return min(s, t)

    def encode(self, p, key):
        d = p.shape[0]
        k, m = self.slots(d), self.period(d)
        a = jnp.abs(p).astype(jnp.float32)
        if m == d:  # every entry is a candidate
            cand = jnp.arange(d, dtype=jnp.int32)
            live = None
        else:
            best, runner, has_runner = _strided_best(a, m, second=True)
            cand = jnp.concatenate([best, runner])
            live = jnp.concatenate([jnp.ones((m,), bool), has_runner])
        raw = p[cand]
        mag = jnp.abs(raw).astype(jnp.float32)
        keys = lax.bitcast_convert_type(mag, jnp.uint32)
        if live is not None:
            keys = jnp.where(live, keys, jnp.uint32(0))
        sample, kept = None, 1
        if self.sample_ratio is not None:
            sample = lax.bitcast_convert_type(a[:: self._stride(d)], jnp.uint32)
            kept = min(
                sample.shape[0],
                math.ceil(_SAMPLE_SLACK * core.num_kept(self.ratio, sample.shape[0])),
            )
        j, filled = _top_slots(keys, k, sample, kept)
        idx = cand[j]
        ok = filled if live is None else filled & live[j]
        vals = jnp.where(ok, raw[j], jnp.zeros((), p.dtype))
        return (vals, idx), raw

    decode_mean_checked = _decode_mean_checked

    def slots_used(self, p: jax.Array) -> jax.Array:
        """int32 scalar: slots of flat ``p``'s payload that carry a nonzero entry."""
        (vals, _), _ = self.encode(p, None)
        return jnp.sum(vals != 0, dtype=jnp.int32)

    def all_finite(self, p, payload, aux):
        # A NaN/Inf entry wins its class (_strided_best maps it to the largest
        # key): it is among the candidates (aux), sent or not.
        return jnp.all(jnp.isfinite(aux))


def threshold(
    ratio: float,
    *,
    axis_name: AxisName | None = None,
    sample_ratio: float | None = 0.01,
    error_feedback: bool = True,
    min_size: int = 1024,
    bucket_bytes: int | str | None = DEFAULT_BUCKET_BYTES,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """Fast sparsification: a sampled threshold and top-k among strided candidates.

    Exact top-k ranks all ``d`` entries (``lax.top_k``); this path folds the
    gradient once and ranks ``2m >= 4k`` candidates (its cost against top-k and a
    gradient copy: ``experiments/results/floor.md``). The payload
    has top-k's ``k = ceil(ratio·d)`` slots. The entries fall into ``m``
    classes ``j, j+m, j+2m, ...``, ``m`` a prime ``>= 2k`` (or ``m = d``,
    every entry a candidate, when no such prime is below ``d``); one fold
    of the ``(d // m, m)`` view, 8 row slices at a time, gives each class's
    largest and runner-up magnitude, and the ``k`` largest of these ``2m`` candidates
    that reach the threshold are sent. With
    ``sample_ratio`` the threshold is estimated from the sample ``p[::s]``
    (``s`` the smallest prime ``>= round(1/sample_ratio)``, or a denser one
    where the sample would keep fewer than 32 entries), set at 1.25 times the
    sample's top-``ratio`` count so that it rarely cuts into the true top-k
    (Strom 2015; DGC, whose re-selection among the entries above its
    threshold is the top-k here); with ``sample_ratio=None`` the ``k``
    largest candidates are sent. What is not sent stays in the residual. The
    payload is values + int32 indices, all-gathered like top-k.

    Why strided and prime: with contiguous classes, mass concentrated in a
    few rows of a matrix leaf falls into a few classes. With a prime period
    ``>= 2k``, a row (consecutive entries) and a column (entries a row length
    apart) spread over distinct classes, but a band of adjacent columns is a
    lattice of the row length modulo ``m`` and some primes crowd it. So ``m``
    is chosen when the update is traced, from ``d`` alone (every worker picks
    the same): for every factorisation ``d = R·c`` (any view of the leaf as
    ``R`` rows of length ``c``), a band of adjacent columns holding ~k entries
    is scored by the entries the candidates hold, and of the 17 smallest
    primes ``>= 2k`` not dividing ``d`` the one with the best worst case is
    used (once per ``(k, d)`` and process, in NumPy, within a fixed work
    budget). The share of the true top-k sent on i.i.d., structured, small
    and real leaves, beside the earlier two-period selection, is in
    ``experiments/results/threshold_fill.json``
    (``python -m experiments.bench.threshold_fill``). To see how many slots
    a step fills, call :func:`threshold_usage` with the gradient and
    ``state.residual``.

    Args:
      ratio: fraction of entries kept (payload slots ≈ ratio·d), in (0, 1].
      axis_name: mesh axis to average over; ``None`` sparsifies locally.
      sample_ratio: fraction of entries sampled for the threshold, in (0, 1],
        or ``None`` for no threshold. Raised where needed so that >= 32
        sampled entries reach the threshold (every entry when ``k < 64``).
      error_feedback: keep unsent entries in a residual. Strongly advised:
        without it, true top-k entries crowded out of their class are lost.
      min_size: leaves with fewer entries are averaged densely.
      state_dtype: dtype of the error-feedback residual (see :func:`jaxcomm.compress`).
      bucket_bytes: tensor fusion, default ``"auto"`` (see :func:`jaxcomm.compress`).

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = optax.chain(jaxcomm.threshold(0.001, axis_name="data"), optax.sgd(0.1))

    References:
      Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud
      Computing", Interspeech 2015. Lin et al., "Deep Gradient Compression",
      ICLR 2018, arXiv:1712.01887.
    """
    if sample_ratio is not None:
        sample_ratio = checks.check_ratio(sample_ratio, "sample_ratio")
    return core.compress(
        Threshold(checks.check_ratio(ratio), sample_ratio),
        axis_name=axis_name,
        error_feedback=error_feedback,
        min_size=min_size,
        bucket_bytes=bucket_bytes,
        state_dtype=state_dtype,
    )


def threshold_usage(
    updates: Any,
    residual: Any = None,
    *,
    ratio: float,
    sample_ratio: float | None = 0.01,
    min_size: int = 1024,
) -> dict[str, tuple[jax.Array, int]]:
    """Slots that :func:`threshold` fills in a step: ``{leaf path: (used, slots)}``.

    Recomputes the (deterministic) selection of ``threshold(ratio,
    sample_ratio=sample_ratio, min_size=min_size)`` for one worker's
    gradient ``updates`` plus its error-feedback ``residual`` (the transform's
    ``state.residual``; ``None`` for a zero residual) and returns, for every
    leaf that is compressed (``scope="leaf"``), the int32 count of payload
    slots carrying a nonzero entry and the static number of slots the wire
    is billed for. Runs under ``jit``; costs about one encode.

    Example:
      >>> used = jaxcomm.compressors.sparse.threshold_usage(grads, state.residual, ratio=0.01)
    """
    comp = Threshold(
        checks.check_ratio(ratio),
        None if sample_ratio is None else checks.check_ratio(sample_ratio, "sample_ratio"),
    )
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size: expected an int >= 0, got {min_size!r}")
    leaves = jax.tree_util.tree_leaves_with_path(updates)
    res = [None] * len(leaves)
    if residual is not None:
        res = jax.tree_util.tree_structure(updates).flatten_up_to(residual)
    out = {}
    for (path, g), e in zip(leaves, res):
        if g.size < max(min_size, 1):
            continue
        p = g.reshape(-1)
        if e is not None:
            p = p + e.reshape(-1).astype(g.dtype)
        out[jax.tree_util.keystr(path)] = (comp.slots_used(p), comp.slots(p.shape[0]))
    return out


__all__ = ["topk", "randomk", "threshold", "threshold_usage", "TopK", "RandomK", "Threshold"]
