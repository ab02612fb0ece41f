"""Sparsifiers: top-k, random-k and the fast strided-block threshold top-k.

With error feedback (the default) the kept values are sent raw and what is
not sent stays in the residual. Without it, random-k rescales what it sends
so that the compressed gradient is unbiased.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import checks, core, exchange
from jaxcomm.buckets import DEFAULT_BUCKET_BYTES
from jaxcomm.exchange import AxisName


def _scatter_add(d: int, dtype: Any, idx: jax.Array, vals: jax.Array) -> jax.Array:
    """Dense ``(d,)`` zeros with ``vals`` added at ``idx`` (any matching shapes)."""
    return jnp.zeros((d,), dtype).at[idx.reshape(-1)].add(vals.reshape(-1).astype(dtype))


class _Sparse(core.CompressorBase):
    """Payload ``(values, int32 indices)``, all-gathered and scatter-added."""

    kind = "all_gather"

    def decode(self, payload, aux, d, dtype):
        vals, idx = payload
        return _scatter_add(d, dtype, idx, vals)

    def residual(self, p, payload, aux):
        vals, idx = payload
        # p[idx] - p[idx] is exactly 0: sent entries leave nothing behind.
        return p.at[idx].add(-vals)

    def decode_mean(self, received, aux, d, dtype, n):
        vals, idx = received
        # scale the n*k received values, not the dense d-vector
        return _scatter_add(d, dtype, idx, vals.astype(dtype) / jnp.asarray(n, dtype))


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
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
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
      bucket_bytes: tensor fusion, default 25 MiB (see :func:`jaxcomm.compress`).

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
            return jax.random.choice(key, d, (k,), replace=False).astype(jnp.int32)
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

    def residual(self, p, payload, aux):
        if self.rescale:
            return core.CompressorBase.residual(self, p, payload, aux)
        vals, idx = (payload[0], aux) if self.kind == "psum" else payload
        return p.at[idx].add(-vals)

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
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
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
      bucket_bytes: tensor fusion, default 25 MiB (see :func:`jaxcomm.compress`).

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


def kth_largest(a: jax.Array, k: int) -> jax.Array:
    """The k-th largest entry of non-negative float32 ``a`` (1-D), without sorting.

    Bisection over the uint32 bit patterns (which order like the floats):
    32 rounds of "how many entries reach t?", each one compare-and-count
    pass over ``a``. Exact, and cheaper than ``lax.top_k``/``sort`` on
    XLA:CPU for the sample sizes used here.
    """
    bits = lax.bitcast_convert_type(a, jnp.uint32)

    def halve(_, lohi):
        lo, hi = lohi  # invariant: count(bits >= lo) >= k > count(bits >= hi)
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(bits >= mid, dtype=jnp.int32) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    # A loop, not 32 unrolled rounds: unrolled, XLA:CPU's fusion under vmap
    # took minutes to compile. The carry starts from the data so that it has
    # the data's shard_map type (varying or not).
    zero = bits[0] & jnp.uint32(0)
    lo, _ = lax.fori_loop(0, 32, halve, (zero, zero | jnp.uint32(0xFFFFFFFF)))
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
    viewed as a ``(d // m, m)`` array are reduced over axis 0 (pairwise folds
    of contiguous rows, which vectorise and read ``a`` once), the last
    ``d mod m`` entries join blocks ``0..d mod m - 1``.

    Non-negative floats order like their bit patterns, so the low ``R`` bits
    of each pattern (``R`` = bits of the row count) are replaced by
    ``2^R-1-row`` and a plain float max returns the largest value *and*, in
    its low bits, its row (ties, and values equal in all but the low R
    mantissa bits, go to the first row): exact up to a relative ``2^(R-23)``
    of the block maximum; the value later sent is read from the gradient
    itself, so it is exact. (On XLA:CPU a variadic argmax reduction is much
    slower than a plain max.) NaN and Inf are mapped to the largest finite float
    first, so that a non-finite entry wins its block. A block whose maximum
    is zero or subnormal may report any row (flushed subnormals have no low
    bits); it is clamped into the array, and the value there is ~0.

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
    big = jnp.finfo(jnp.float32).max
    a = jnp.where(a <= big, a, big)  # NaN, Inf -> largest finite

    def keys(x, row0):
        pattern = lax.bitcast_convert_type(x, jnp.uint32)
        r = (row0 + jnp.arange(x.shape[0], dtype=jnp.uint32))[:, None]
        return lax.bitcast_convert_type((pattern & ~low) | (low - r), jnp.float32)

    # Fold the rows in halves (max of the first and last ceil(r/2) rows), log2(rows)
    # times: every step is elementwise over contiguous rows and fuses with the key
    # computation. On XLA:CPU a reduction over axis 0 (strided or transposed) was
    # slower, and a concatenate in the folds breaks their fusion (cost against a
    # gradient copy: python -m experiments.bench.compressors). With an odd row
    # count the middle row is in both halves: harmless for the maximum, and masked
    # out of the second operand (row 0 of the last half) for the runner-up.
    best = keys(a[: rows * m].reshape(rows, m), 0)
    none = jnp.float32(-jnp.inf)
    lo = jnp.full_like(best, none) if second else None
    while best.shape[0] > 1:
        r = best.shape[0]
        c = (r + 1) // 2
        h1, h2 = best[:c], best[r - c :]
        if second:
            lo2 = lo[r - c :]
            if r % 2:
                middle = (jnp.arange(c) == 0)[:, None]
                h2, lo2 = jnp.where(middle, none, h2), jnp.where(middle, none, lo2)
            lo = jnp.maximum(jnp.minimum(h1, h2), jnp.maximum(lo[:c], lo2))
            # Both keys travel to the next level as one complex64 array behind a
            # barrier: as two arrays XLA:CPU computed each level's input twice.
            z = lax.optimization_barrier(lax.complex(jnp.maximum(h1, h2), lo))
            best, lo = jnp.real(z), jnp.imag(z)
        else:
            best = jnp.maximum(h1, h2)
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
        row = low - (lax.bitcast_convert_type(k, jnp.uint32) & low)
        # A zero/subnormal maximum has no low bits: any row may come out; clamp it in.
        row = jnp.minimum(row, jnp.uint32(n_rows - 1)).astype(jnp.int32)
        idx = row * m + jnp.arange(m, dtype=jnp.int32)
        return jnp.where(idx < d, idx, idx - m)

    if not second:
        return rows_of(best)
    return rows_of(best), rows_of(lo), lo > none


def _default_periods(k: int) -> tuple[int, int]:
    """``m1`` the largest prime ``<= ceil(0.6·k)``, ``m2`` the largest other prime ``<= k - m1``."""
    m1 = _prime_at_most(max(1, math.ceil(0.6 * k)))
    m2 = _prime_at_most(k - m1) if k - m1 >= 2 else 0
    if m2 == m1:
        m2 = _prime_at_most(m1 - 1) if m1 > 2 else 0
    return m1, m2


# How much work the choice of periods may do, per (k, d) and once per process:
# band entries scored (in NumPy), and pairs tried.
_PERIODS_BUDGET = 50_000_000
_PERIODS_CANDIDATES = 16


def _band_fill(idx: np.ndarray, rank: np.ndarray, m1: int, m2: int) -> int:
    """Entries of ``idx`` (ranked by ``rank``, above every other entry) the two passes send.

    Pass 1 sends the top entry of every class mod ``m1`` that holds one; pass 2,
    per class mod ``m2``, the top entry if pass 1 did not take it, else the
    runner-up if that is free: :class:`Threshold`'s selection, on the heavy
    entries alone.
    """
    c1 = idx % m1
    top1 = np.full(m1, -1, rank.dtype)
    np.maximum.at(top1, c1, rank)
    taken = top1[c1] == rank
    c2 = idx % m2
    top = np.full(m2, -1, rank.dtype)
    np.maximum.at(top, c2, rank)
    first = top[c2] == rank
    runner = np.full(m2, -1, rank.dtype)
    np.maximum.at(runner, c2[~first], rank[~first])
    second = (runner[c2] == rank) & ~first
    free_first = np.zeros(m2, bool)
    free_first[c2[first & ~taken]] = True
    free_second = np.zeros(m2, bool)
    free_second[c2[second & ~taken]] = True
    return int(taken.sum() + free_first.sum() + (free_second & ~free_first).sum())


@functools.lru_cache(maxsize=1024)
def _periods(k: int, d: int | None = None) -> tuple[int, int]:
    """The two slot periods of ``k`` threshold slots of a ``(d,)`` vector: ``(m1, m2)``.

    Distinct primes (so coprime) with ``m1 + m2 = S``, ``S`` the sum of
    :func:`_default_periods` (``m1`` near ``0.6·k``; ``S <= k``, ``k - S`` below
    1% for ``k >= 1000``): the wire size depends on ``k`` alone. Which pair of
    primes summing to ``S`` depends on ``d``: a band of adjacent columns of a
    matrix with row length ``c`` is a lattice of ``c`` modulo the period, and
    some pairs crowd it into few classes (measured in
    ``experiments/results/threshold_fill.json``). For every factorisation
    ``d = R·c`` whose columns are shorter than ``S``, the band of
    ``round(k/R)`` adjacent columns is scored by the entries the two passes
    send of it (:func:`_band_fill`), and the pair with the best worst case
    wins, among the default and up to ``_PERIODS_CANDIDATES`` pairs with
    ``m1`` nearest ``0.6·S`` (neither dividing ``d``), within
    ``_PERIODS_BUDGET`` scored entries. Deterministic (every worker picks the
    same pair; workers that did not would still be averaged right, since
    the payload carries absolute indices), computed once per ``(k, d)`` at
    trace time. ``d=None``: the default pair.
    """
    m1, m2 = _default_periods(k)
    if d is None or m2 < 3:
        return m1, m2
    s = m1 + m2
    rows = [
        c
        for f in range(1, math.isqrt(d) + 1)
        if d % f == 0
        for c in {f, d // f}
        if 2 <= c and 2 * c <= d and d // c < s
    ]
    if not rows:
        return m1, m2
    near = sorted(range(s // 2 + 1, (7 * s) // 10 + 1), key=lambda p: (abs(10 * p - 6 * s), p))
    others = (
        (p, s - p)
        for p in near
        if p != m1 and d % p and d % (s - p) and _is_prime(p) and _is_prime(s - p)
    )
    cands = [(m1, m2), *itertools.islice(others, _PERIODS_CANDIDATES)]
    bands = []
    for c in sorted(rows):
        r = d // c
        w = max(1, min(c, round(k / r)))
        bands.append((c, r, w))
    perm = np.random.default_rng(0).permutation(max(r * w for _, r, w in bands)).astype(np.int32)
    best, best_worst, spent = (m1, m2), -1.0, 0
    order = list(range(len(bands)))
    for pair in cands:
        if spent >= _PERIODS_BUDGET:
            break
        worst, hardest = 1.0, None
        for j in order:
            c, r, w = bands[j]
            idx = (
                np.arange(r, dtype=np.int32)[:, None] * c + np.arange(w, dtype=np.int32)
            ).reshape(-1)
            frac = _band_fill(idx, perm[: idx.size], *pair) / min(k, idx.size)
            spent += idx.size
            if frac < worst:
                worst, hardest = frac, j
            if worst <= best_worst:  # cannot win: the hardest band first next time
                break
        if worst > best_worst:
            best, best_worst = pair, worst
        if hardest is not None:
            order.remove(hardest)
            order.insert(0, hardest)
    return best


class ThresholdState(core.CompressState):
    """State of the Threshold transform: the fields of :class:`jaxcomm.core.CompressState`.

    A class of its own, so another transform's state is refused by name.
    """

    __slots__ = ()


class Threshold(_Sparse):
    """Two-pass strided-block top-k with a sampled magnitude threshold; no sort of d.

    ``m1 + m2`` payload slots from two coprime periods (:func:`_periods`:
    ``k = max(1, ceil(ratio·d))`` bounds the sum, ``k - m1 - m2`` is below 1%
    for ``k >= 1000``; the sum depends on ``k`` alone, the pair is chosen for
    ``d``). First pass: slot ``j < m1`` offers the entry of largest
    magnitude among ``p[j], p[j+m1], p[j+2·m1], ...``. Second pass: slot
    ``m1 + j`` offers the largest entry of ``p[j], p[j+m2], ...`` that the
    first pass did not take (the class's runner-up when its maximum was
    taken; nothing when both were). Both are folds of a ``(d // m, m)`` view
    (:func:`_strided_best`). Because the periods are prime, a row of a matrix
    leaf (consecutive entries) spreads over distinct slots, and so does a
    column (entries a row length apart), and a layout that crowds into few
    classes of one period (a lattice of the row length mod ``m``) rarely does
    so for the other; the pair is chosen so that it does not for any row
    length that divides ``d``.

    If ``sample_ratio`` is set, a threshold is computed (exactly, without a
    sort: :func:`kth_largest`) as the top-``ratio`` magnitude of the sample
    ``|p[::s]|``, ``s`` the smallest prime ``>= round(1/sample_ratio)`` (a
    prime stride does not alias with common row lengths), lowered to the
    largest prime ``<= k // 32`` (1 if none) when the sample would otherwise
    keep fewer than 32 entries, primes dividing ``d`` skipped (then the
    stride is coprime with every row length), and a slot's entry
    is sent only if it reaches the threshold (the slot carries value 0
    otherwise). Entries above the threshold that found no slot stay in the
    residual. :meth:`slots_used` counts the slots that carry an entry.

    For ablations (``experiments/bench/threshold_fill.py``): ``choose_periods=False``
    uses the default pair for every ``d``, ``sample_kept=0`` the plain
    ``1/sample_ratio`` stride (the rules before these were found lacking).
    """

    state_cls = ThresholdState

    def __init__(
        self,
        ratio: float,
        sample_ratio: float | None,
        *,
        choose_periods: bool = True,
        sample_kept: int = 32,
    ):
        self.ratio = ratio
        self.sample_ratio = sample_ratio
        self.choose_periods = bool(choose_periods)
        self.sample_kept = checks.check_int(sample_kept, "sample_kept", 0)

    def periods(self, d: int) -> tuple[int, int]:
        return _periods(core.num_kept(self.ratio, d), d if self.choose_periods else None)

    def slots(self, d: int) -> int:
        # the chosen pair has the default pair's sum: no search for the wire size
        return sum(_default_periods(core.num_kept(self.ratio, d)))

    def _stride(self, d: int) -> int:
        """The sample's stride: the smallest prime ``>= round(1/sample_ratio)``, but
        small enough that ``sample_kept`` sample entries reach the threshold (the
        largest prime ``<= k // sample_kept``; 1, every entry, if none). Primes
        that divide ``d`` are skipped: a stride coprime with ``d`` is coprime with
        every row length ``c`` of a ``(d/c, c)`` view, so the sample visits every
        column alike (a stride of 2 on even rows would see only even columns)."""
        s = _prime_at_least(max(1, round(1.0 / self.sample_ratio)))
        while s > 1 and d % s == 0:
            s = _prime_at_least(s + 1)
        if self.sample_kept:
            t = _prime_at_most(core.num_kept(self.ratio, d) // self.sample_kept)
            while t > 1 and d % t == 0:
                t = _prime_at_most(t - 1)
            s = min(s, t)
        return s

    def encode(self, p, key):
        m1, m2 = self.periods(p.shape[0])
        a = jnp.abs(p).astype(jnp.float32)
        idx = _strided_best(a, m1)
        live = None
        if m2:
            best, runner, has_runner = _strided_best(a, m2, second=True)
            taken = lambda i: idx[i % m1] == i  # noqa: E731  (i won its first-pass class)
            best_free = ~taken(best)
            idx = jnp.concatenate([idx, jnp.where(best_free, best, runner)])
            live = jnp.concatenate(
                [jnp.ones((m1,), bool), best_free | (has_runner & ~taken(runner))]
            )
        vals = raw = p[idx]
        if self.sample_ratio is not None:
            sample = jnp.abs(p[:: self._stride(p.shape[0])]).astype(jnp.float32)
            thr = kth_largest(sample, core.num_kept(self.ratio, sample.shape[0]))
            # "not below" rather than ">=": a NaN threshold or value is sent, not hidden
            keep = ~(jnp.abs(vals).astype(jnp.float32) < thr)
            live = keep if live is None else live & keep
        if live is not None:
            # a dead slot sends 0 at an index another slot may hold: adding 0 is harmless
            vals = jnp.where(live, vals, jnp.zeros_like(vals))
        return (vals, idx), raw

    def slots_used(self, p: jax.Array) -> jax.Array:
        """int32 scalar: slots of flat ``p``'s payload that carry a nonzero entry."""
        (vals, _), _ = self.encode(p, None)
        return jnp.sum(vals != 0, dtype=jnp.int32)

    def all_finite(self, p, payload, aux):
        # NaN/Inf bit patterns exceed every finite one, so a non-finite entry
        # wins its block: it is among the block maxima (aux), sent or not.
        return jnp.all(jnp.isfinite(aux))


def threshold(
    ratio: float,
    *,
    axis_name: AxisName | None = None,
    sample_ratio: float | None = 0.01,
    error_feedback: bool = True,
    min_size: int = 1024,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """Fast sparsification: two-pass strided-block top-k with a sampled threshold.

    Exact top-k sorts (``lax.top_k``); this path uses only reductions and
    elementwise ops (its cost against top-k and a gradient copy:
    ``python -m experiments.bench.compressors``). The payload
    has ``S = m1 + m2 <= k = ceil(ratio·d)`` slots: ``S`` is the sum of the
    largest prime ``<= ceil(0.6·k)`` and the largest other prime ``<= k``
    minus it, and ``(m1, m2)`` the pair of distinct primes summing to ``S``
    (``m1`` near ``0.6·S``) chosen for ``d`` (see below). Slot
    ``j < m1`` offers the largest-magnitude entry among ``p[j], p[j+m1],
    p[j+2·m1], ...``; slot ``m1 + j`` offers the largest entry among ``p[j],
    p[j+m2], ...`` that the first pass did not take (its class's runner-up
    if the maximum was taken). Both are folds of a ``(d // m, m)`` view in
    halves. With ``sample_ratio`` a slot is filled only if its entry reaches
    the top-``ratio`` threshold estimated from the sample ``p[::s]`` (``s``
    the smallest prime ``>= round(1/sample_ratio)``; Strom 2015; DGC), or a
    denser one where the sample would keep fewer than 32 entries (on small
    leaves a threshold from one kept sample entry, the sample's maximum,
    sent far less than the top-k; the denser sample costs time there); with
    ``sample_ratio=None`` every slot's entry is sent. What is not sent stays
    in the residual. The payload is values + int32 indices, all-gathered
    like top-k; the wire is billed for all ``m1 + m2`` slots.

    Why strided, prime, and two periods: with contiguous blocks of
    ``1/ratio`` entries, mass concentrated in a few rows of a matrix leaf
    falls into a few blocks. Interleaved blocks with a prime period spread a
    row (consecutive entries) and a column (entries a row length apart) over
    distinct slots, but with one period some layouts crowd into few classes
    (adjacent columns whose row length is a lattice modulo the period). A
    second, coprime period rarely crowds the same entries, but a fixed pair
    still did for some shapes. So the pair is chosen when the update is
    traced, from ``d`` alone (every worker picks the same): for every
    factorisation ``d = R·c`` (any view of the leaf as ``R`` rows of length
    ``c``, e.g. a Flax kernel's output features or an HWIO kernel's
    ``Cin·Cout``), a band of adjacent columns holding ~k entries is scored
    by the entries the two passes would send, and of the default pair and 16
    others summing to ``S`` the one with the best worst case is used (this
    scoring runs once per ``(k, d)`` and process, in NumPy, within a fixed
    work budget). The share of the true top-k sent on structured, small and
    real leaves, before and after these rules, is in
    ``experiments/results/threshold_fill.json``
    (``python -m experiments.bench.threshold_fill``).
    Entries that share a slot wait in the residual for a later step. To see
    how many slots a step actually fills, call :func:`threshold_usage` with
    the gradient and ``state.residual``.

    Args:
      ratio: fraction of entries kept (payload slots ≈ ratio·d), in (0, 1].
      axis_name: mesh axis to average over; ``None`` sparsifies locally.
      sample_ratio: fraction of entries sampled for the threshold, in (0, 1],
        or ``None`` for no threshold. Raised where needed so that >= 32
        sampled entries reach the threshold (every entry when ``k < 64``).
      error_feedback: keep unsent entries in a residual. Strongly advised:
        without it, entries beyond one per slot are lost.
      min_size: leaves with fewer entries are averaged densely.
      state_dtype: dtype of the error-feedback residual (see :func:`jaxcomm.compress`).
      bucket_bytes: tensor fusion, default 25 MiB (see :func:`jaxcomm.compress`).

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
    is billed for. Runs under ``jit``; costs about one encode (the two passes).

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
