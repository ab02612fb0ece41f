"""Sign and 2-bit compressors: 1-bit SGD, EF-SignSGD, signSGD majority vote, 2-bit.

Signs are bit-packed, 32 to a ``uint32`` word (bit = 1 for a negative
entry; an exact zero is sent as ``+``), and the words go through the
collective. 2-bit codes are packed 16 to a word. Reconstruction values are
sent in float32; updates come out in the gradient's dtype.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from jaxcomm import checks, core
from jaxcomm.collectives import AxisName, check_axis_name
from jaxcomm.compressors import packing
from jaxcomm.compressors.blocks import (
    axis_workers,
    bucket_view,
    buckets,
    sum_over_workers,
    unbucket,
)
from jaxcomm.compressors.twobit import TwoBit, TwoBitServer, twobit
from jaxcomm.compressors.twobit import TwoBitState as TwoBitState
from jaxcomm.options import Options, Unpack, take


def _sign_words(p: jnp.ndarray) -> jnp.ndarray:
    """1 bit per entry (1 = negative), 32 per uint32 word."""
    return packing.pack(p < 0, 1, dtype=jnp.uint32)


def _signs(words: jnp.ndarray, d: int) -> jnp.ndarray:
    """``(..., nw)`` words -> ``(..., d)`` bool, True where the entry was negative."""
    return packing.unpack(words, 1, d) == 1


# the options of jaxcomm.options.Options that onebit and ef_sign take
_SIGN_OPTIONS = (
    "axis_name",
    "error_feedback",
    "min_size",
    "state_dtype",
    "bucket_bytes",
    "exchange",
)


# --- 1-bit SGD ----------------------------------------------------------------------


OneBitState = core.state_type("OneBitState", __name__)


class OneBit(core.CompressorBase):
    """Sign bits + two reconstruction values per bucket (mean of the >= 0 / < 0 entries).

    ``bucket_size=None``: one pair per leaf. The pair minimises the squared
    error of the 1-bit code; error feedback keeps what it misses. Payload:
    ``uint32[ceil(d/32)]`` + ``float32[nb, 2]``, all-gathered.
    """

    state_cls = OneBitState

    kind = "all_gather"
    auto_two_phase = True  # exchange="auto": two-phase where fewer bytes

    def __init__(self, bucket_size: int | None):
        self.bucket_size = bucket_size

    def _b(self, d: int) -> int:
        return d if self.bucket_size is None else min(self.bucket_size, d)

    def encode(self, p, key):
        x = buckets(p, self._b(p.shape[0]))
        neg = x < 0
        n_neg = jnp.sum(neg, axis=1)
        n_pos = x.shape[1] - n_neg  # zero padding counts as >= 0 but adds 0 ...
        pad = x.shape[0] * x.shape[1] - p.shape[0]
        if pad:  # ... so do not count it in the last bucket's mean
            n_pos = n_pos.at[-1].add(-pad)
        s_neg = jnp.sum(jnp.where(neg, x, 0.0), axis=1)
        s_pos = jnp.sum(jnp.where(neg, 0.0, x), axis=1)
        pos = s_pos / jnp.maximum(n_pos, 1)
        negv = s_neg / jnp.maximum(n_neg, 1)
        return (_sign_words(p), jnp.stack([pos, negv], axis=1)), None

    def decode(self, payload, aux, d, dtype):
        # payload: (n, nw) uint32 sign words, (n, nb, 2) float32 reconstruction values

        def one(words, recon):
            neg = bucket_view(_signs(words, d), self._b(d))
            return unbucket(jnp.where(neg, recon[:, 1:2], recon[:, 0:1]), d)

        return sum_over_workers(one, payload).astype(dtype)


def onebit(
    *, bucket_size: int | None = None, **options: Unpack[Options]
) -> optax.GradientTransformation:
    """1-bit SGD: signs with two reconstruction values, error feedback on.

    Rule (Seide et al. 2014): ``p = g + e``; each entry is sent as its sign and
    rebuilt as the mean of its group's entries of that sign; ``e = p − p̂``.
    Wire per worker per leaf: ``4·ceil(d/32) + 8·ceil(d/bucket_size)`` bytes, all-gathered.

    Args:
      bucket_size: entries sharing one pair of values, >= 1; ``None``: the leaf.
      **options: ``axis_name``, ``error_feedback`` (keeps ``p − p̂``: the
        method relies on it; turn off only to study its effect),
        ``min_size``, ``state_dtype``, ``bucket_bytes``, ``exchange``: see
        :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation``; updates keep their dtype.

    Example:
      >>> tx = optax.chain(jaxcomm.onebit(axis_name="data"), optax.sgd(0.1))

    References:
      Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
      Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
    """
    # Notes. The two values (the mean of the non-negative entries and of the negative ones) minimise
    # the squared quantisation error. A group is the leaf (default) or a bucket of ``bucket_size``
    # consecutive entries (e.g. a row of a row-major matrix: ``bucket_size=shape[-1]``; the paper
    # uses one pair per matrix column). Wire: sign bits in uint32 words + two float32 values per
    # group, ~1/32 of fp32.
    o = take("onebit", options, _SIGN_OPTIONS)
    if bucket_size is not None:
        bucket_size = checks.check_int(bucket_size, "bucket_size", 1)
    return core.compress(OneBit(bucket_size), **o)


# --- EF-SignSGD ---------------------------------------------------------------------


ScaledSignState = core.state_type("ScaledSignState", __name__)


class ScaledSign(core.CompressorBase):
    """``(‖p‖₁/d)·sign(p)``: sign bits + one float32 scale per leaf, all-gathered."""

    state_cls = ScaledSignState

    kind = "all_gather"
    auto_two_phase = True  # exchange="auto": two-phase where fewer bytes

    def encode(self, p, key):
        x = p.astype(jnp.float32)
        scale = jnp.mean(jnp.abs(x)).reshape(1)
        return (_sign_words(x), scale), None

    def decode(self, payload, aux, d, dtype):
        # payload: (n, nw) uint32 sign words, (n, 1) float32 scales

        def one(words, scale):
            return jnp.where(_signs(words, d), -scale, scale)

        return sum_over_workers(one, payload).astype(dtype)


def ef_sign(**options: Unpack[Options]) -> optax.GradientTransformation:
    """EF-SignSGD: the scaled sign ``(‖p‖₁/d)·sign(p)`` with error feedback.

    Rule (Karimireddy et al. 2019): ``p = g + e``; ``C(p) = (‖p‖₁/d)·sign(p)``;
    ``e = p − C(p)``; the ``C(p)`` are averaged. An exact zero counts as positive.
    Wire per worker per leaf: ``4·ceil(d/32) + 4`` bytes, all-gathered (~1/32 of fp32).

    Args:
      **options: ``axis_name``, ``error_feedback`` (keeps ``p − C(p)``;
        ``False`` gives plain scaled signSGD, which Karimireddy et al. show
        can fail to converge), ``min_size``, ``state_dtype``,
        ``bucket_bytes``, ``exchange``: see :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation``; updates keep their dtype.

    Example:
      >>> tx = optax.chain(jaxcomm.ef_sign(axis_name="data"), optax.sgd(0.1))

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019, arXiv:1901.09847.
    """
    # Notes. An exact zero counts as positive: 1 bit cannot say 0; the error goes to the residual.
    # Wire: sign bits in uint32 words + one float32 scale.
    return core.compress(ScaledSign(), **take("ef_sign", options, _SIGN_OPTIONS))


# --- signSGD with majority vote -----------------------------------------------------


def vote_field_bits(n_workers: int) -> int:
    """Field width for psum-ing ``n`` votes offset to ``{0, 1, 2}``: ``bit_length(2n)``."""
    return packing.field_bits(2 * n_workers)


MajorityVoteState = core.state_type("MajorityVoteState", __name__)


class MajorityVote(core.CompressorBase):
    """``sign(Σ_w sign(p_w))``; the votes are summed by one all-reduce of packed fields.

    Each worker's vote ``sign(p_i) + 1 ∈ {0, 1, 2}`` goes into a field of
    ``w = bit_length(2n)`` bits, ``⌊32/w⌋`` fields per uint32 word. A field's
    sum over n workers is at most ``2n < 2**w``: no carry into the next field.
    :meth:`decode` returns ``n·sign(Σ)`` so that the generic mean over workers
    is ``sign(Σ)`` itself.
    """

    state_cls = MajorityVoteState

    kind = "psum"

    def __init__(self, axis_name: AxisName | None):
        self.axis_name = axis_name

    def encode(self, p, key):
        n = axis_workers(self.axis_name)
        vote = (jnp.sign(p.astype(jnp.float32)) + 1).astype(jnp.uint32)
        return (packing.pack(vote, vote_field_bits(n), dtype=jnp.uint32, aligned=True),), n

    def decode(self, payload, aux, d, dtype):
        n = aux
        total = packing.unpack(payload[0], vote_field_bits(n), d, aligned=True)
        votes = total.astype(jnp.int32) - n  # Σ_w sign(p_w), in [-n, n]
        return (n * jnp.sign(votes)).astype(dtype)

    def residual(self, p, payload, aux):
        return p - jnp.sign(p)  # a worker's own contribution is its sign

    def wire_size(self, d: int, dtype: Any, n_workers: int = 1) -> int:
        return 4 * packing.packed_size(d, vote_field_bits(n_workers), aligned=True)


def sign_majority(**options: Unpack[Options]) -> optax.GradientTransformation:
    """signSGD with majority vote: every worker gets ``sign(Σ_w sign(g_w))``.

    Rule (Bernstein et al. 2018): each worker votes ``sign(g)``; the update is the
    sign of the votes' sum (0 on a tie), in {−1, 0, +1}: chain plain ``optax.sgd(lr)``
    with a small lr. Signum puts momentum before:
    ``optax.chain(optax.trace(0.9), jaxcomm.sign_majority(...), optax.sgd(lr))``.
    Wire per worker per leaf: ``4·ceil(d/⌊32/w⌋)`` bytes, all-reduced (votes in
    ``w = bit_length(2n)``-bit fields; n=8: 5.3 bits per entry).

    Args:
      **options: ``axis_name`` (the axis to vote over; ``None`` returns
        ``sign(g)``), ``min_size`` (smaller leaves are averaged densely, not
        signed), ``state_dtype``, ``bucket_bytes``: see
        :class:`jaxcomm.options.Options`. No ``error_feedback`` (always off)
        and no ``exchange`` (the one all-reduce).

    Returns:
      An ``optax.GradientTransformation``; updates keep their dtype.

    Example:
      >>> tx = optax.chain(jaxcomm.sign_majority(axis_name="data"), optax.sgd(1e-3))

    References:
      Bernstein et al., "signSGD", ICML 2018, arXiv:1802.04434; "signSGD with
      Majority Vote is Communication Efficient and Fault Tolerant", ICLR 2019, arXiv:1810.05291.
    """
    # Notes. The output has entries in {−1, 0, +1} whatever the gradient's scale: the optimizer's
    # learning rate is the step size per weight (e.g. 1e-3). Momentum after the vote
    # (``optax.sgd(lr, momentum=0.9)``) is not Signum. The votes are summed with one all-reduce of
    # small integers: ``sign + 1`` in a field of ``w = bit_length(2n)`` bits, ``⌊32/w⌋`` fields per
    # uint32 word. A field's sum is at most ``2n < 2**w``, so it cannot overflow for the (static)
    # axis size n: n=8 -> 5-bit fields (6 per word), 64 <= n <= 127 -> 8-bit fields (exactly an int8
    # psum), larger n -> wider fields, up to 32 bits.
    o = take("sign_majority", options, ("axis_name", "min_size", "state_dtype", "bucket_bytes"))
    o["axis_name"] = check_axis_name(o["axis_name"])
    return core.compress(MajorityVote(o["axis_name"]), **o, error_feedback=False)


__all__ = [
    "ef_sign",
    "onebit",
    "sign_majority",
    "twobit",
    "MajorityVote",
    "OneBit",
    "ScaledSign",
    "TwoBit",
    "TwoBitServer",
]
