"""The fast threshold top-k: a sampled threshold over strided candidates, the exact
top-k among them; no sort of the gradient (the selection in
:mod:`jaxcomm.compressors.selection`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import checks, core
from jaxcomm.compressors import selection
from jaxcomm.compressors.sparse.base import SparseCompressor, decode_mean_checked
from jaxcomm.options import Options, Unpack, take

# The sampled threshold sits at the sample's ceil(1.25·k_s)-th largest (k_s its
# share of the top-ratio): a threshold from >= 32 kept sample entries varies
# by ~18% in the count it passes, and one set at exactly k_s cut into the true
# top-k (recall 0.88 on i.i.d. (3, 3, 32, 64) leaves); the top-k re-selection
# caps what is sent at k either way.
_SAMPLE_SLACK = 1.25


ThresholdState = core.state_type("ThresholdState", __name__)


class Threshold(SparseCompressor):
    """Sampled threshold, strided candidates, exact top-k among them; no sort of d.

    The selection's pieces are in :mod:`jaxcomm.compressors.selection`.
    ``k = max(1, ceil(ratio·d))`` payload slots (top-k's wire). The entries
    fall into ``m`` classes ``j, j+m, j+2m, ...`` (``selection.period``: a prime
    ``>= 2k`` chosen for ``d``, or ``m = d``); one fold of the ``(d // m, m)``
    view, 8 row slices at a time (``selection.strided_best``), gives each class's
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
    sampled threshold (``selection.top_slots``: the k-th largest candidate is found
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
        return selection.period(core.num_kept(self.ratio, d), d)

    def slots(self, d: int) -> int:
        return core.num_kept(self.ratio, d)

    def _stride(self, d: int) -> int:
        """The sample's stride: the smallest prime ``>= round(1/sample_ratio)``, but
        small enough that 32 sample entries reach the threshold (the largest prime
        ``<= k // 32``; 1, every entry, if none). Primes that divide ``d`` are
        skipped: a stride coprime with ``d`` is coprime with every row length
        ``c`` of a ``(d/c, c)`` view, so the sample visits every column alike (a
        stride of 2 on even rows would see only even columns)."""
        s = selection.prime_at_least(max(1, round(1.0 / self.sample_ratio)))
        while s > 1 and d % s == 0:
            s = selection.prime_at_least(s + 1)
        t = selection.prime_at_most(core.num_kept(self.ratio, d) // 32)
        while t > 1 and d % t == 0:
            t = selection.prime_at_most(t - 1)
        return min(s, t)

    def encode(self, p, key):
        d = p.shape[0]
        k, m = self.slots(d), self.period(d)
        a = jnp.abs(p).astype(jnp.float32)
        if m == d:  # every entry is a candidate
            cand = jnp.arange(d, dtype=jnp.int32)
            live = None
        else:
            best, runner, has_runner = selection.strided_best(a, m, second=True)
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
        j, filled = selection.top_slots(keys, k, sample, kept)
        idx = cand[j]
        ok = filled if live is None else filled & live[j]
        vals = jnp.where(ok, raw[j], jnp.zeros((), p.dtype))
        return (vals, idx), raw

    decode_mean_checked = decode_mean_checked

    def slots_used(self, p: jax.Array) -> jax.Array:
        """int32 scalar: slots of flat ``p``'s payload that carry a nonzero entry."""
        (vals, _), _ = self.encode(p, None)
        return jnp.sum(vals != 0, dtype=jnp.int32)

    def all_finite(self, p, payload, aux):
        # A NaN/Inf entry wins its class (selection.strided_best maps it to the largest
        # key): it is among the candidates (aux), sent or not.
        return jnp.all(jnp.isfinite(aux))


def threshold(
    ratio: float, *, sample_ratio: float | None = 0.01, **options: Unpack[Options]
) -> optax.GradientTransformation:
    """Fast sparsification: a sampled threshold and top-k among strided candidates.

    Rule: ``p = g + e``; of ``2m`` strided candidates (each class ``j, j+m, ...``'s
    two largest, ``m`` a prime ``>= 2k``) the ``k = ceil(ratio·d)`` largest that reach
    the sampled threshold are sent; the rest stays in the residual ``e``.
    Wire: top-k's, ``k·(value bytes + 4)`` per worker per leaf (values + int32
    indices, all-gathered). :func:`threshold_usage` counts the slots a step fills.

    Args:
      ratio: fraction of entries kept (payload slots ≈ ratio·d), in (0, 1].
      sample_ratio: fraction of entries sampled for the threshold, in (0, 1],
        or ``None`` for no threshold. Raised where needed so that >= 32
        sampled entries reach the threshold (every entry when ``k < 64``).
      **options: ``axis_name``, ``error_feedback`` (strongly advised:
        without it, true top-k entries crowded out of their class are lost),
        ``min_size``, ``state_dtype``, ``bucket_bytes``: see
        :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = optax.chain(jaxcomm.threshold(0.001, axis_name="data"), optax.sgd(0.1))

    References:
      Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud
      Computing", Interspeech 2015. Lin et al., "Deep Gradient Compression",
      ICLR 2018, arXiv:1712.01887.
    """
    # Implementation. Exact top-k ranks all ``d`` entries (``lax.top_k``); this path folds the
    # gradient once and ranks ``2m >= 4k`` candidates (its cost against top-k and a gradient copy:
    # experiments/results/floor.md). The payload has top-k's ``k = ceil(ratio·d)`` slots. The
    # entries fall into ``m`` classes ``j, j+m, j+2m, ...``, ``m`` a prime ``>= 2k`` (or ``m = d``,
    # every entry a candidate, when no such prime is below ``d``); one fold of the ``(d // m, m)``
    # view, 8 row slices at a time, gives each class's largest and runner-up magnitude, and the
    # ``k`` largest of these ``2m`` candidates that reach the threshold are sent. With
    # ``sample_ratio`` the threshold is estimated from the sample ``p[::s]`` (``s`` the smallest
    # prime ``>= round(1/sample_ratio)``, or a denser one where the sample would keep fewer than 32
    # entries), set at 1.25 times the sample's top-``ratio`` count so that it rarely cuts into the
    # true top-k (Strom 2015; DGC, whose re-selection among the entries above its threshold is the
    # top-k here); with ``sample_ratio=None`` the ``k`` largest candidates are sent.
    # Why strided and prime: with contiguous classes, mass concentrated in a few rows of a matrix
    # leaf falls into a few classes. With a prime period ``>= 2k``, a row (consecutive entries) and
    # a column (entries a row length apart) spread over distinct classes, but a band of adjacent
    # columns is a lattice of the row length modulo ``m`` and some primes crowd it. So ``m`` is
    # chosen when the update is traced, from ``d`` alone (every worker picks the same): for every
    # factorisation ``d = R·c`` a band of adjacent columns holding ~k entries is scored by the
    # entries the candidates hold, and of the 17 smallest primes ``>= 2k`` not dividing ``d`` the
    # one with the best worst case is used (once per ``(k, d)`` and process, in NumPy, within a
    # fixed work budget). The share of the true top-k sent on i.i.d., structured, small and real
    # leaves is in experiments/results/threshold_fill.json (python -m
    # experiments.bench.threshold_fill).
    names = ("axis_name", "error_feedback", "min_size", "state_dtype", "bucket_bytes")
    o = take("threshold", options, names)
    if sample_ratio is not None:
        sample_ratio = checks.check_ratio(sample_ratio, "sample_ratio")
    return core.compress(Threshold(checks.check_ratio(ratio), sample_ratio), **o)


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
