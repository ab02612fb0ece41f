"""Candidate selection for the threshold sparsifier, without a sort of the gradient.

The pieces of :class:`jaxcomm.compressors.sparse.Threshold`: the k-th largest
by bisection over bit patterns (:func:`kth_largest`, :func:`kth_patterns`),
each residue class's best entries in one strided fold (:func:`strided_best`),
the class period chosen per ``(k, d)`` (:func:`period`) and the compaction of
the chosen slots (:func:`top_slots`). DGC's sampled threshold uses
:func:`kth_largest` too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "band_fill",
    "is_prime",
    "kth_largest",
    "kth_patterns",
    "period",
    "prime_at_least",
    "prime_at_most",
    "strided_best",
    "top_slots",
]


def kth_patterns(pairs: Sequence[tuple[jax.Array, int]]) -> list[jax.Array]:
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
    :func:`kth_patterns`. Exact, and cheaper than ``lax.top_k``/``sort`` on
    XLA:CPU for the sample sizes used here.
    """
    (lo,) = kth_patterns([(lax.bitcast_convert_type(a, jnp.uint32), k)])
    return lax.bitcast_convert_type(lo, jnp.float32)


def is_prime(n: int) -> bool:
    """Trial division, at trace time."""
    return n > 1 and all(n % f for f in range(2, math.isqrt(n) + 1))


def prime_at_most(n: int) -> int:
    """The largest prime ``<= n`` (1 for ``n < 2``)."""
    for c in range(n, 1, -1):
        if is_prime(c):
            return c
    return 1


def prime_at_least(n: int) -> int:
    """The smallest prime ``>= n`` (1 for ``n <= 1``)."""
    if n <= 1:
        return 1
    c = n
    while not is_prime(c):
        c += 1
    return c


def strided_best(a: jax.Array, m: int, *, second: bool = False):
    """Flat index of the largest entry of each residue class ``j (mod m)`` of ``a``.

    ``a`` is non-negative float32 of shape ``(d,)``, ``m <= d``. Block ``j``
    holds the entries ``j, j+m, j+2m, ...``. Exact up to a relative
    ``2^(R-23)`` of the block maximum, ``R`` the bits of the row count
    ``ceil(d / m)`` (ties, and values equal in all but the low R mantissa
    bits, go to the first row); the value later sent is read from the
    gradient itself, so it is exact. A NaN or Inf entry wins its block;
    zeros and subnormals keep their rows.

    With ``second=True`` it also returns each block's runner-up and whether
    there is one, ``(best, runner_up, has_runner_up)``; a block of one entry
    has no runner-up.
    """
    # The first (d // m)·m entries viewed as a (d // m, m) array are reduced over axis 0
    # (folds of _FOLD slices of contiguous rows, which vectorise and read `a` once, see
    # _fold_level); the last d mod m entries join blocks 0..d mod m - 1. The reduction is
    # an integer max of keys (_keys) that hold each entry's row in their low bits.
    d = a.shape[0]
    rows = d // m
    rem = d - rows * m
    n_rows = rows + (1 if rem else 0)
    bits = max(1, n_rows.bit_length())  # row ids 0..n_rows-1 and an unused all-ones
    low = jnp.uint32((1 << bits) - 1)
    none = jnp.uint32(0)  # below every key: a key holds low - row > 0 in its low bits

    best, lo = _keys(a[: rows * m].reshape(rows, m), 0, low), None
    while best.shape[0] > 1:
        best, lo = _fold_level(best, lo, second)
    if second and lo is None:  # one row: no runner-up
        lo = jnp.full_like(best, none)
    best = best[0]
    if second:
        lo = lo[0]
    if rem:
        tail = _keys(a[rows * m :].reshape(1, rem), rows, low)[0]
        head = best[:rem]
        best = jnp.concatenate([jnp.maximum(head, tail), best[rem:]])
        if second:
            lo = jnp.concatenate([jnp.maximum(lo[:rem], jnp.minimum(head, tail)), lo[rem:]])
    if not second:
        return _rows_of(best, low, m, d)
    return _rows_of(best, low, m, d), _rows_of(lo, low, m, d), lo > none


def _keys(x: jax.Array, row0: int, low: jax.Array) -> jax.Array:
    """uint32 keys of the entries of ``x``, rows numbered from ``row0``: the value's bit
    pattern with its low bits replaced by ``low - row`` (see :func:`strided_best`)."""
    # Non-negative floats order like their bit patterns, so the low R bits of each uint32
    # pattern are replaced by 2^R-1-row and an integer max returns the largest value *and*,
    # in its low bits, its row. NaN and Inf patterns lie above every finite one. On
    # XLA:CPU a variadic argmax reduction is much slower than a plain max, and an integer
    # max is one instruction (a float max propagates NaN: several); zeros and subnormals
    # keep their rows (integers are not flushed).
    pattern = lax.bitcast_convert_type(x, jnp.uint32)
    r = (row0 + jnp.arange(x.shape[0], dtype=jnp.uint32))[:, None]
    return (pattern & ~low) | (low - r)


def _combine(x, y, second: bool):
    """The elementwise best (and, with ``second``, runner-up) of two ``(hi, lo)`` key pairs:
    ``lo ← max(min(hi_a, hi_b), lo_a, lo_b)``."""
    (h1, l1), (h2, l2) = x, y
    if not second:
        return jnp.maximum(h1, h2), None
    lo = jnp.minimum(h1, h2)
    for extra in (l1, l2):
        lo = lo if extra is None else jnp.maximum(lo, extra)
    return jnp.maximum(h1, h2), lo


def _fold_level(best: jax.Array, lo: jax.Array | None, second: bool):
    """One level of :func:`strided_best`'s fold: ``r`` rows of keys to ``ceil(r/_FOLD)``."""
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
    none = jnp.uint32(0)
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
        paired = [_combine(x, y, second) for x, y in zip(parts[::2], parts[1::2])]
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
    return best, lo


def _rows_of(k: jax.Array, low: jax.Array, m: int, d: int) -> jax.Array:
    """The flat indices the keys ``k`` (one per block of ``m``) point at."""
    row = low - (k & low)
    row = row.astype(jnp.int32)
    idx = row * m + jnp.arange(m, dtype=jnp.int32)
    return jnp.where(idx < d, idx, idx - m)


# Rows :func:`strided_best` folds into one per level.
_FOLD = 8
# How much work the choice of the period may do, per (k, d) and once per process:
# band entries scored (in NumPy), and primes tried.
_PERIOD_BUDGET = 50_000_000
_PERIOD_CANDIDATES = 16
# Candidate classes per kept entry: m >= 2k classes offer their best and
# runner-up, 4k candidates for k slots (on i.i.d. entries a class holds
# Poisson(1/2) of the true top-k and loses ~1.6% of them beyond its two).
_CLASSES_PER_SLOT = 2


def band_fill(idx: np.ndarray, m: int) -> int:
    """Entries of ``idx`` (heavier than every other entry) among the candidates mod ``m``.

    Each class ``j (mod m)`` offers its two largest entries, so a class holding
    ``c`` of the heavy entries offers ``min(c, 2)`` of them.
    """
    return int(np.minimum(np.bincount(idx % m, minlength=m), 2).sum())


@functools.lru_cache(maxsize=1024)
def period(k: int, d: int) -> int:
    """The class period ``m`` of :class:`Threshold`'s candidates for ``k`` slots of ``(d,)``.

    ``d`` itself (every entry a candidate: exact top-k) when ``2k >= d`` or no
    prime fits; else a prime in ``[2k, d)`` not dividing ``d``. A band of
    adjacent columns of a matrix with row length ``c`` is a lattice of ``c``
    modulo ``m``, and some primes crowd it into few classes (on a
    ``(3072, 768)`` leaf at 1%, the smallest prime kept 0.85 of an 8-column
    band's top entries). For every factorisation ``d = R·c`` the band of
    ``round(k/R)`` adjacent columns is scored by :func:`band_fill`, and of
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
        m = prime_at_least(m)
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
            worst = min(worst, band_fill(band(c, r, w), m) / min(k, size))
            spent += size
            if worst <= best_worst:  # cannot win
                break
        else:  # every band scored (within the budget)
            if worst > best_worst:
                best, best_worst = m, worst
        if best_worst >= 1.0 or spent >= _PERIOD_BUDGET:
            break
    return best


def top_slots(keys: jax.Array, k: int, sample: jax.Array | None = None, kept: int = 1):
    """``(positions, filled)``: the positions of the ``k`` largest of the uint32 ``keys``
    (bit patterns of magnitudes) that reach the ``kept``-th largest of ``sample`` (if
    given), ties at the boundary to the first positions (as ``lax.top_k`` breaks them):
    those above the boundary first, then the ties, each in position order; and which of
    the ``k`` slots hold one (an empty slot says position 0). One bisection loop finds
    both thresholds (:func:`kth_patterns`); two cumulative sums and one scatter compact
    the chosen."""
    n = keys.shape[0]
    t, *ts = kth_patterns([(keys, k)] + ([] if sample is None else [(sample, kept)]))
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
