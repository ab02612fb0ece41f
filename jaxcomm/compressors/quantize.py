"""Quantisers: per-bucket int8, QSGD and TernGrad, with real bit packing.

Every payload is what goes through the collective: ``int8`` codes, or
``uint32`` words of packed codes (see :mod:`jaxcomm.compressors.packing`),
plus one float32 scale per bucket. Scales are sent in float32 whatever the
gradient dtype; the arithmetic is done in float32 and the update comes out in
the gradient's dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm import checks, collectives, core
from jaxcomm.collectives import AxisName, check_axis_name
from jaxcomm.compressors import packing
from jaxcomm.compressors.blocks import UNROLL as UNROLL  # where tests and benchmarks read it
from jaxcomm.compressors.blocks import (
    axis_workers,
    bucket_view,
    buckets,
    require_key,
    sum_over_workers,
    unbucket,
)
from jaxcomm.options import Options, Unpack, take

MAX_LEVELS = 65535  # QSGD levels: at most 16 level bits + 1 sign bit per entry

# the options of jaxcomm.options.Options that int8, qsgd and terngrad take
_QUANTISER_OPTIONS = (
    "axis_name",
    "key",
    "error_feedback",
    "min_size",
    "state_dtype",
    "bucket_bytes",
    "exchange",
)


# --- int8 ---------------------------------------------------------------------------


Int8State = core.state_type("Int8State", __name__)


class Int8(core.CompressorBase):
    """Per-bucket max-abs scale, int8 codes in [-127, 127]; all-gathered.

    ``scale_j = max_{i in bucket j} |p_i| / 127``, ``q_i = R(p_i / scale_j)``
    with ``R`` = round-to-nearest, or stochastic rounding ``floor(x + u)``,
    ``u ~ U[0, 1)`` (unbiased). Payload: ``int8[d]`` codes + ``float32[nb]``.
    """

    state_cls = Int8State

    kind = "all_gather"
    auto_two_phase = True  # exchange="auto": two-phase where fewer bytes

    def __init__(self, bucket_size: int, stochastic: bool):
        self.bucket_size = bucket_size
        self.stochastic = stochastic
        self.needs_key = stochastic

    def encode(self, p, key):
        d = p.shape[0]
        x = buckets(p, self.bucket_size)
        scale = jnp.max(jnp.abs(x), axis=1) / 127.0
        safe = jnp.where(scale > 0, scale, 1.0)
        y = x / safe[:, None]
        if self.stochastic:
            y = jnp.floor(y + jax.random.uniform(key, y.shape, jnp.float32))
        else:
            y = jnp.round(y)
        q = jnp.clip(y, -127, 127).astype(jnp.int8)
        return (unbucket(q, d), scale), None

    def _decode_one(self, q, scale):
        x = bucket_view(q.astype(jnp.float32), self.bucket_size) * scale[:, None]
        return unbucket(x, q.shape[0])

    def decode(self, payload, aux, d, dtype):
        # payload: (n, d) int8 codes, (n, nb) float32 scales
        return sum_over_workers(self._decode_one, payload).astype(dtype)


def int8(
    *, bucket_size: int = 512, stochastic: bool = True, **options: Unpack[Options]
) -> optax.GradientTransformation:
    """Int8 quantisation with one max-abs scale per bucket (1 byte per entry).

    Rule: per bucket, ``q_i = round(p_i/scale)``, ``scale = max|p|/127`` (stochastic: unbiased).
    Wire per worker per leaf: ``d + 4·ceil(d/bucket_size)`` bytes, all-gathered.

    Args:
      bucket_size: entries sharing one scale, >= 1.
      stochastic: stochastic rounding; ``False`` rounds to nearest (no key needed).
      **options: ``axis_name``, ``key`` (required when ``stochastic``; workers
        draw independent rounding noise), ``error_feedback`` (default
        ``False``), ``min_size``, ``state_dtype``, ``bucket_bytes``,
        ``exchange``: see :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation``; updates keep their dtype.

    Example:
      >>> tx = optax.chain(jaxcomm.int8(key=jax.random.key(0), axis_name="data"), optax.sgd(0.1))

    References:
      Dettmers, "8-Bit Approximations for Parallelism in Deep Learning", ICLR 2016,
      arXiv:1511.04561. Gupta et al. (stochastic rounding), ICML 2015, arXiv:1502.02551.
    """
    # Notes. Stochastic rounding is ``floor(p_i/scale_j + u)``, ``u ~ U[0,1)``, so ``E[scale_j·q_i]
    # = p_i``; round-to-nearest is deterministic and biased. Workers all-gather their int8 codes and
    # float32 scales and each decodes and sums them (exact float32 accumulation); a worker receives
    # ``(n-1)`` times its bytes. References: Dettmers, arXiv:1511.04561; Gupta et al., "Deep
    # Learning with Limited Numerical Precision" (stochastic rounding), ICML 2015, arXiv:1502.02551.
    o = take("int8", options, _QUANTISER_OPTIONS, error_feedback=False)
    bucket_size = checks.check_int(bucket_size, "bucket_size", 1)
    if stochastic:
        require_key(o["key"], "when stochastic=True (or pass stochastic=False)")
    return core.compress(Int8(bucket_size, bool(stochastic)), **o)


# --- QSGD ---------------------------------------------------------------------------


QSGDState = core.state_type("QSGDState", __name__)


class QSGD(core.CompressorBase):
    """QSGD: stochastic levels of ``‖v‖₂/s`` per bucket, sign + level bits packed.

    Code per entry: ``(ξ << 1) | sign`` with ``ξ`` in ``[0, s]``, i.e.
    ``1 + bit_length(s)`` bits (= ``1 + ceil(log2(s+1))``), packed into a
    dense ``uint32`` bit stream; one float32 norm per bucket.
    """

    state_cls = QSGDState

    kind = "all_gather"
    auto_two_phase = True  # exchange="auto": two-phase where fewer bytes
    needs_key = True

    def __init__(self, levels: int, bucket_size: int):
        self.levels = levels
        self.bucket_size = bucket_size
        self.bits = 1 + levels.bit_length()

    def encode(self, p, key):
        d, s = p.shape[0], self.levels
        x = buckets(p, self.bucket_size)
        norm = jnp.sqrt(jnp.sum(x * x, axis=1))
        r = jnp.abs(x) * (s / jnp.where(norm > 0, norm, 1.0))[:, None]  # in [0, s]
        low = jnp.floor(r)
        u = jax.random.uniform(key, r.shape, jnp.float32)
        xi = jnp.minimum(low + (u < r - low), s).astype(jnp.uint32)
        code = (xi << 1) | (x < 0).astype(jnp.uint32)
        words = packing.pack(unbucket(code, d), self.bits, dtype=jnp.uint32)
        return (words, norm), None

    def _decode_one(self, words, norm, d):
        code = packing.unpack(words, self.bits, d)
        mag = (code >> 1).astype(jnp.float32)
        val = jnp.where((code & 1) == 1, -mag, mag)
        return unbucket(bucket_view(val, self.bucket_size) * (norm / self.levels)[:, None], d)

    def decode(self, payload, aux, d, dtype):
        # payload: (n, nw) uint32 words, (n, nb) float32 norms
        one = functools.partial(self._decode_one, d=d)
        return sum_over_workers(one, payload).astype(dtype)


def qsgd(
    levels: int = 16, *, bucket_size: int = 512, **options: Unpack[Options]
) -> optax.GradientTransformation:
    """QSGD: unbiased stochastic quantisation to ``levels`` levels per bucket.

    Rule: per bucket ``v``, ``Q(v_i) = ‖v‖₂·sign(v_i)·ξ_i/s``, ``ξ_i`` ~ ``s|v_i|/‖v‖₂`` rounded.
    Wire per worker per leaf: ``4·ceil(d·(1+ceil(log2(s+1)))/32) + 4·ceil(d/bucket_size)``
    bytes, all-gathered (s=16: ~0.19 of fp32).

    Args:
      levels: number of levels s, in [1, 65535] (s=1: ternary, ~2 bits).
      bucket_size: entries sharing one norm, >= 1 (512 as in the paper).
      **options: ``axis_name``, ``key`` (required; workers draw independent
        noise), ``error_feedback`` (default ``False``: the plain method,
        unbiased, has none), ``min_size``, ``state_dtype``, ``bucket_bytes``,
        ``exchange``: see :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation``; updates keep their dtype.

    Example:
      >>> tx = optax.chain(jaxcomm.qsgd(16, key=jax.random.key(0)), optax.sgd(0.1))

    References:
      Alistarh et al., "QSGD", NeurIPS 2017, arXiv:1610.02132.
    """
    # Rule in full (Alistarh et al. 2017): ``l_i = floor(s|v_i|/‖v‖₂)``; ``ξ_i = l_i + 1`` with
    # probability ``s|v_i|/‖v‖₂ − l_i``, else ``l_i``; ``E‖Q(v) − v‖² <= min(b/s², √b/s)·‖v‖²`` per
    # bucket of b entries. Wire: a sign bit and ``ceil(log2(s+1))`` level bits per entry, bit-packed
    # into uint32 words, plus one float32 norm per bucket (s=16: 6 bits per entry).
    o = take("qsgd", options, _QUANTISER_OPTIONS, error_feedback=False)
    levels = checks.check_int(levels, "levels", 1, MAX_LEVELS)
    bucket_size = checks.check_int(bucket_size, "bucket_size", 1)
    require_key(o["key"], "for qsgd")
    return core.compress(QSGD(levels, bucket_size), **o)


# --- TernGrad -----------------------------------------------------------------------


def ternary_field_bits(n_workers: int) -> int:
    """Field width for psum-ing ``n`` ternary codes offset to ``{0, 1, 2}``.

    The sum of a field over n workers is at most ``2n``, so a field of
    ``bit_length(2n)`` bits never carries into its neighbour: n=8 -> 5 bits
    (6 fields per uint32 word), n <= 31 -> <= 6 bits, n <= 127 -> 8 bits (4 per
    word, the size of an int8 psum), up to n = 2**31 - 1 -> 32 bits.
    """
    return packing.field_bits(2 * n_workers)


TernGradState = core.state_type("TernGradState", __name__)


class TernGrad(core.CompressorBase):
    """TernGrad: ``s·sign(g)·Bernoulli(|g|/s)``, ternary codes bit-packed.

    ``share_scale=True`` (kind ``"psum"``): ``s`` is max-reduced over workers
    first (4 bytes), then the codes ``t+1`` in ``{0,1,2}`` are packed into
    ``w = bit_length(2n)``-bit fields of uint32 words (``⌊32/w⌋`` per word)
    and the words are summed with one all-reduce. A field's sum is at most
    ``2n < 2**w``, so nothing overflows into the next field (and the uint32
    word never wraps); decoding subtracts ``n``. ``share_scale=False`` (kind
    ``"all_gather"``): 2-bit codes, 16 per uint32 word, and each worker's own
    float32 scale are all-gathered.
    """

    state_cls = TernGradState

    needs_key = True

    def __init__(self, clip_sigma: float | None, share_scale: bool, axis_name: AxisName | None):
        self.clip_sigma = clip_sigma
        self.share_scale = share_scale
        self.axis_name = axis_name
        self.kind = "psum" if share_scale else "all_gather"
        self.auto_two_phase = True  # with share_scale=False (all-gathered codes)
        # core.compress agrees every leaf's scale in one bucketed all-reduce
        self.agrees = share_scale

    def _clipped(self, p):
        x = p.astype(jnp.float32)
        if self.clip_sigma is not None:
            c = self.clip_sigma * jnp.std(x)
            x = jnp.clip(x, -c, c)
        return x

    def _ternarise(self, p, key, agreed=None):
        x = self._clipped(p)
        s = jnp.max(jnp.abs(x)) if agreed is None else agreed
        if agreed is None and self.share_scale and self.axis_name is not None:
            s = collectives.agree(s, self.axis_name)
        prob = jnp.abs(x) / jnp.where(s > 0, s, 1.0)
        keep = jax.random.uniform(key, x.shape, jnp.float32) < prob
        t = jnp.where(keep, jnp.sign(x), 0.0).astype(jnp.int32)
        return t, s

    def to_agree(self, p, key):
        """The scale the workers agree on (max over workers) before :meth:`encode_agreed`."""
        return jnp.max(jnp.abs(self._clipped(p)))

    def encode_agreed(self, p, key, agreed):
        return self._encode(p, key, agreed)

    def encode(self, p, key):
        return self._encode(p, key, None)

    def _encode(self, p, key, agreed):
        t, s = self._ternarise(p, key, agreed)
        code = (t + 1).astype(jnp.uint32)
        if not self.share_scale:
            return (packing.pack(code, 2, dtype=jnp.uint32), s.reshape(1)), None
        n = axis_workers(self.axis_name)
        words = packing.pack(code, ternary_field_bits(n), dtype=jnp.uint32, aligned=True)
        return (words,), (t, s, n)

    def decode(self, payload, aux, d, dtype):
        if not self.share_scale:  # (n, nw) uint32 words, (n, 1) float32 scales

            def one(words, s):
                return s * (packing.unpack(words, 2, d).astype(jnp.float32) - 1.0)

            return sum_over_workers(one, payload).astype(dtype)
        _, s, n = aux
        total = packing.unpack(payload[0], ternary_field_bits(n), d, aligned=True)
        return (s * (total.astype(jnp.float32) - n)).astype(dtype)

    def residual(self, p, payload, aux):
        if not self.share_scale:
            return super().residual(p, payload, aux)
        t, s, _ = aux
        return p - (s * t.astype(jnp.float32)).astype(p.dtype)

    def wire_size(self, d: int, dtype: Any, n_workers: int = 1) -> int:
        if not self.share_scale:
            return 4 * packing.packed_size(d, 2) + 4
        w = ternary_field_bits(n_workers)
        agree = 4 if n_workers > 1 else 0
        return 4 * packing.packed_size(d, w, aligned=True) + agree


def terngrad(
    *, clip_sigma: float | None = 2.5, share_scale: bool = True, **options: Unpack[Options]
) -> optax.GradientTransformation:
    """TernGrad: unbiased ternary gradients ``s·sign(g)·b``, ``b ~ Bernoulli(|g|/s)``.

    Rule per leaf: optionally clip ``g`` to ``[-c·σ, c·σ]``; ``s = max|g|``;
    ``g̃ = s·sign(g)·b``, unbiased for the (clipped) gradient. With ``share_scale``
    the workers agree on ``s`` (a 4-byte ``pmax``) and sum the codes in packed
    ``w = bit_length(2n)``-bit fields; else 2-bit codes and a scale are all-gathered.
    Wire per worker per leaf: ``4·ceil(d/⌊32/w⌋) + 4`` bytes (share_scale,
    all-reduce), else ``4·ceil(d/16) + 4`` bytes (all-gather).

    Args:
      clip_sigma: clip at this many standard deviations (2.5 in the paper), > 0; ``None``: no clip.
      share_scale: agree on one scale across workers and psum the codes.
      **options: ``axis_name``, ``key`` (required; workers draw independent
        Bernoulli noise), ``error_feedback`` (default ``False``; keeps
        ``p − g̃``, clipping loss included), ``min_size``, ``state_dtype``,
        ``bucket_bytes``, ``exchange`` (with ``share_scale`` the codes are
        summed: ``"auto"`` is that one all-reduce, and only
        ``"gather"``/``"auto"`` are accepted): see
        :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation``; updates keep their dtype.

    Example:
      >>> tx = optax.chain(jaxcomm.terngrad(key=jax.random.key(0), axis_name="data"),
      ...                  optax.sgd(0.1))

    References:
      Wen et al., "TernGrad", NeurIPS 2017, arXiv:1705.07878.
    """
    # Notes. σ is the standard deviation of the leaf's entries; scaler sharing is the paper's
    # default. With ``share_scale`` the codes ``t+1 ∈ {0,1,2}`` go in fields of ``w =
    # bit_length(2n)`` bits packed ``⌊32/w⌋`` to a uint32 word. The sum of a field over n workers is
    # at most ``2n < 2**w``, so no field overflows into the next, for any static axis size n (n=8:
    # 5-bit fields, 6 per word; n <= 127: at most the size of an int8 psum). Without ``share_scale``
    # each worker's 2-bit codes (16 per uint32 word) and float32 scale are all-gathered.
    o = take("terngrad", options, _QUANTISER_OPTIONS, error_feedback=False)
    require_key(o["key"], "for terngrad")
    if clip_sigma is not None:
        clip_sigma = checks.check_positive(clip_sigma, "clip_sigma")
    codec = TernGrad(clip_sigma, bool(share_scale), check_axis_name(o["axis_name"]))
    return core.compress(codec, **o)


__all__ = ["int8", "qsgd", "terngrad", "Int8", "QSGD", "TernGrad"]
