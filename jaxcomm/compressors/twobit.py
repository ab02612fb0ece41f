"""2-bit threshold compression (MXNet's ``2bit``): codes +t, −t or 0, 16 to a uint32 word,
with error feedback; a worker-summed variant with a server's second residual
(:class:`TwoBitServer`)."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from jaxcomm import checks, core
from jaxcomm.compressors import packing
from jaxcomm.compressors.blocks import sum_over_workers
from jaxcomm.options import Options, Unpack, take

TwoBitState = core.state_type("TwoBitState", __name__)


def _ternary(words: jnp.ndarray, d: int) -> jnp.ndarray:
    """``(nw,)`` words of 2-bit codes -> ``(d,)`` float32: code 1 -> +1, 2 -> −1, 0 -> 0."""
    code = packing.unpack(words, 2, d).astype(jnp.int32)
    return ((code & 1) - (code >> 1)).astype(jnp.float32)


class TwoBit(core.CompressorBase):
    """Codes 0 (zero), 1 (+τ), 2 (−τ), 16 per uint32 word, all-gathered.

    On the two-phase exchange the chunk means are re-quantised by
    :class:`TwoBitServer` (:meth:`server_codec`), not with τ.
    """

    state_cls = TwoBitState

    kind = "all_gather"
    auto_two_phase = True  # exchange="auto": two-phase where fewer bytes

    def __init__(self, threshold: float):
        self.threshold = threshold
        self._server = TwoBitServer()

    def encode(self, p, key):
        code = jnp.where(p >= self.threshold, 1, jnp.where(p <= -self.threshold, 2, 0))
        return (packing.pack(code, 2, dtype=jnp.uint32),), None

    def decode(self, payload, aux, d, dtype):
        # payload: (n, nw) uint32 words of 2-bit codes
        tau = jnp.asarray(self.threshold, dtype).astype(jnp.float32)  # τ as the residual sees it

        def one(words):
            return tau * _ternary(words, d)  # 1: +τ, 2: −τ, 0: 0

        return sum_over_workers(one, payload).astype(dtype)

    def residual(self, p, payload, aux):
        tau = jnp.asarray(self.threshold, p.dtype)
        q = jnp.where(p >= tau, tau, jnp.where(p <= -tau, -tau, jnp.zeros((), p.dtype)))
        return p - q

    def server_codec(self) -> TwoBitServer:
        return self._server


class TwoBitServer(core.CompressorBase):
    """2-bit codes with a per-chunk scale: twobit's codec for the two-phase chunk means.

    Rule, on a chunk ``s`` of c entries (the workers' mean of the chunk plus
    the server residual; the last chunk's zero padding counted in c):
    ``a = mean_i |s_i|`` (float32), ``q_i = +a if s_i >= a/2, −a if
    s_i <= −a/2, else 0`` (the nearest of ``{−a, 0, +a}``); the server
    residual keeps ``s − q``. Payload: the codes, 16 per uint32 word, and
    ``a`` as one float32: ``4·ceil(c/16) + 4`` bytes.

    Why not τ: a chunk mean is the average of n workers' ``{−τ, 0, +τ}``, in
    steps of ``τ/n``; re-quantised with τ, only entries where every worker
    sent the same ``±τ`` (or where the server residual has grown to τ) move,
    so one step's update has almost no component along the worker mean. The
    scale follows the means: every entry above half the chunk's mean
    magnitude moves at once.
    """

    kind = "all_gather"

    def encode(self, p, key):
        x = p.astype(jnp.float32)
        a = jnp.mean(jnp.abs(x))
        half = a / 2
        code = jnp.where(x >= half, 1, jnp.where(x <= -half, 2, 0))  # a = 0: q = 0 either way
        return (packing.pack(code, 2, dtype=jnp.uint32), a.reshape(1)), None

    def decode(self, payload, aux, d, dtype):
        # payload: (n, nw) uint32 words of 2-bit codes, (n, 1) float32 scales

        def one(words, scale):
            return scale * _ternary(words, d)

        return sum_over_workers(one, payload).astype(dtype)


def twobit(threshold: float = 0.5, **options: Unpack[Options]) -> optax.GradientTransformation:
    """MXNet's 2-bit gradient compression with a residual.

    Rule (MXNet kvstore ``type='2bit'``), per entry with threshold τ: ``r += g``;
    ``q = ±τ if ±r >= τ, else 0``; ``r −= q``. Pick τ near a gradient entry's size.
    Wire per worker per leaf: ``4·ceil(d/16)`` bytes (2-bit codes), all-gathered; on
    the two-phase exchange ``(n-1)·(2·4·ceil(c/16) + 4)``, ``c = ceil(d/n)``.

    Args:
      threshold: τ > 0 (the default 0.5 is MXNet's, tuned for its models).
      **options: ``axis_name``, ``min_size``, ``state_dtype``,
        ``bucket_bytes``, ``exchange``: see :class:`jaxcomm.options.Options`.
        No ``error_feedback``: the residual is the method (always on).

    Returns:
      An ``optax.GradientTransformation``; updates keep their dtype.

    Example:
      >>> tx = optax.chain(jaxcomm.twobit(0.5, axis_name="data"), optax.sgd(0.1))

    References:
      MXNet, "Gradient Compression" (type '2bit'), 2017. Strom, "Scalable Distributed
      DNN Training Using Commodity GPU Cloud Computing", Interspeech 2015.
    """
    # At most τ leaves the residual per step. Two-phase exchange (``exchange="auto"`` picks it on
    # more than two workers where it moves fewer bytes): the workers send their chunks with this
    # rule; the owner of chunk j averages them, adds its server residual, ``s = mean + r_s``, and
    # re-quantises with a scale of its own, not τ (:class:`TwoBitServer`): ``a = mean |s|`` over the
    # chunk, ``q = +a if s >= a/2, −a if s <= −a/2, else 0``, ``r_s = s − q``; it all-gathers the
    # 2-bit codes and ``a`` (one float32 per chunk). (With τ on the server, a mean, in steps of τ/n,
    # moved only where all n workers agreed: the first step's update was nearly orthogonal to the
    # worker mean.)
    names = ("axis_name", "min_size", "state_dtype", "bucket_bytes", "exchange")
    o = take("twobit", options, names)
    threshold = checks.check_positive(threshold, "threshold")
    return core.compress(TwoBit(threshold), **o, error_feedback=True)
