"""DGC's selection: the entries of the velocity that reach a sampled threshold, packed as
bits and sent from a rotating start (no sort of the gradient)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import core
from jaxcomm.compressors.selection import kth_largest

# The official code's bounded threshold correction: while fewer than LOWER·k
# or more than UPPER·k entries reach the threshold, scale it by LOWER / UPPER
# (bisect once bracketed), at most ADAPT_ITERS times.
LOWER, UPPER, ADAPT_ITERS = 0.8, 1.3, 10


# --- selection ----------------------------------------------------------------------


def pack_bits(sel: jax.Array) -> jax.Array:
    """Bool ``(d,)`` -> uint32 ``(ceil(d/32),)`` words; entry i is bit i % 32 of word i // 32."""
    d = sel.shape[0]
    m = -(-d // 32)
    s = jnp.pad(sel, (0, m * 32 - d)).reshape(m, 32).astype(jnp.uint32)
    return jnp.sum(s << jnp.arange(32, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def first_set(words: jax.Array, cap: int, d: int) -> jax.Array:
    """int32 ``(cap,)``: positions of the first ``cap`` set bits of ``words``, padded with d."""
    return nth_set(words, jnp.arange(cap, dtype=jnp.int32), d)


def nth_set(words: jax.Array, ranks: jax.Array, d: int) -> jax.Array:
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


class Plan(NamedTuple):
    cap: int  # payload slots (k)
    stride: int  # sample stride (1: every entry, exact threshold)
    n_samples: int
    k_samples: int


def make_plan(density: float, d: int, sample_ratio: float) -> Plan:
    """Payload cap and threshold sample for one leaf, as the official code sizes them."""
    cap = core.num_kept(density, d)
    target = max(math.ceil(sample_ratio * d), math.ceil(2 / density))
    stride = 1 if target >= d else d // target
    n_samples = d // stride
    return Plan(cap, stride, n_samples, core.num_kept(density, n_samples))


def rotation(step: jax.Array, total: jax.Array) -> jax.Array:
    """A start rank in ``[0, total)`` that moves with the step (Knuth's multiplicative hash)."""
    h = (step.astype(jnp.uint32) + jnp.uint32(1)) * jnp.uint32(2654435761)
    return (h % jnp.maximum(total, 1).astype(jnp.uint32)).astype(jnp.int32)


def keep_selected(words: jax.Array, count: jax.Array, a: jax.Array, cap: int, step: jax.Array):
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
    start = jnp.where(count > window, rotation(step, count), 0)
    ranks = (start + j) % jnp.maximum(count, 1)
    idx = jnp.where(j < count, nth_set(words, ranks, d), d)
    if window == cap:
        return idx
    mags = jnp.where(idx < d, a[jnp.minimum(idx, d - 1)], -1.0)  # NaN ranks first in top_k
    return idx[lax.top_k(mags, cap)[1]]


def select(v: jax.Array, plan: Plan, offset: jax.Array, step: jax.Array) -> jax.Array:
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
    that threshold is used. Which of the selected are sent: :func:`keep_selected`.
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
        words = pack_bits(~(a < t))  # "not below": NaN entries (or a NaN t) select
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
    return keep_selected(words, count, a, plan.cap, step)
