"""Dense exchanges: the fp32 all-reduce baseline and low-precision casts."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import collectives, core, ledger
from jaxcomm.collectives import AxisName
from jaxcomm.options import Options, Unpack, take

DenseState = core.state_type("DenseState", __name__)


class Dense(core.CompressorBase):
    """Identity payload, summed with an all-reduce."""

    state_cls = DenseState

    kind = "psum"
    carries_nonfinite = True  # a NaN/Inf entry is summed into every worker's mean

    def encode(self, p, key):
        return (p,), None

    def decode(self, payload, aux, d, dtype):
        return payload[0].astype(dtype)

    def wire_size(self, d: int, dtype: Any, n_workers: int = 1) -> int:
        return d * collectives.moved_itemsize(dtype)  # bf16 sums move 4 bytes on XLA:CPU


def allreduce(**options: Unpack[Options]) -> optax.GradientTransformation:
    """Dense mean over workers: the uncompressed baseline (one all-reduce per leaf).

    ``axis_name=None`` returns the updates as they are. No error feedback
    (nothing is lost) and no ``min_size``: every leaf is summed.

    Args:
      **options: ``axis_name``, ``bucket_bytes``: see :class:`jaxcomm.options.Options`.

    Returns:
      An ``optax.GradientTransformation``; wire bytes = 4 per fp32 entry.

    Example:
      >>> tx = optax.chain(jaxcomm.allreduce(axis_name="data"), optax.sgd(0.1))
    """
    o = take("allreduce", options, ("axis_name", "bucket_bytes"))
    return core.compress(Dense(), **o, error_feedback=False, min_size=0)


_CAST_DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


CastState = core.state_type("CastState", __name__)


class Cast(core.CompressorBase):
    """Payload cast to a 16-bit float.

    ``accumulate="psum"`` sums the 16-bit payload with an all-reduce in that
    dtype. ``accumulate="all_gather"`` bit-casts the payload to ``uint16``,
    all-gathers it and sums the n payloads in float32.

    fp16 psum on the CPU backend: the fp16-rounded payload is widened to
    float32 for the all-reduce (``widened``). XLA:CPU's gloo communicator
    sums F16 element by element through scalar half<->float conversions, so a
    bare fp16 all-reduce is slower than the fp32 one, while the cast itself is
    cheap (``experiments/results/peers.json``, ``castcost``). XLA already
    widens bf16 all-reduces this way on CPU; the wire report then says 4
    bytes per entry, as the program moves.
    """

    state_cls = CastState

    carries_nonfinite = True  # NaN/Inf survive the cast and the sum: no NaN flag needed
    # exchange="auto": two-phase (uint16 both ways) where fewer bytes, with
    # accumulate="all_gather"; the psum stays the one all-reduce (widened on CPU)
    auto_two_phase = True

    def __init__(self, dtype: Any, accumulate: str = "psum", axis_name: AxisName | None = None):
        self.dtype = jnp.dtype(dtype)
        self.kind = accumulate
        self.per_worker_key = False
        # fp16 summed in fp16 overflows (max 65504; n values near 6e4 sum to inf; summing first and
        # dividing after gave inf at n = 4 for |g| in [2e4, 6e4]): pre-divide by n, as
        # torch's fp16_compress_hook does (same trade: entries below ~6e-8*n underflow).
        # accumulate="all_gather" sums in float32 and needs neither. bf16 has fp32's range.
        self.prediv = accumulate == "psum" and self.dtype == jnp.float16 and axis_name is not None
        self.axis_name = axis_name

    def _n(self) -> int:
        return collectives.axis_size(self.axis_name) if self.prediv else 1

    def widened(self) -> bool:
        """Whether the fp16 psum runs in float32 (on the CPU backend; see the class doc)."""
        return self.prediv and ledger.backend() == "cpu"

    def encode(self, p, key):
        n = self._n()
        q = (p / jnp.asarray(n, p.dtype) if n > 1 else p).astype(self.dtype)
        if self.kind == "all_gather":
            q = lax.bitcast_convert_type(q, jnp.uint16)
        elif self.widened():  # fp16-rounded values, summed exactly in float32
            q = q.astype(jnp.float32)
        return (q,), None

    def decode(self, payload, aux, d, dtype):
        q = payload[0]
        if self.kind == "psum":
            n = self._n()
            return q.astype(dtype) * jnp.asarray(n, dtype) if n > 1 else q.astype(dtype)
        q = lax.bitcast_convert_type(q, self.dtype).astype(jnp.float32)
        return q.sum(axis=0).astype(dtype)

    def decode_mean(self, received, aux, d, dtype, n):
        if self.prediv:  # the sum of the pre-divided payloads is already the mean
            return received[0].astype(dtype)
        return super().decode_mean(received, aux, d, dtype, n)

    def wire_size(self, d: int, dtype: Any, n_workers: int = 1) -> int:
        if self.kind == "all_gather":  # uint16 words on every backend
            return d * 2
        # the psum: fp16 widened by us on CPU, bf16 by XLA:CPU (both 4 bytes there)
        return d * (4 if self.widened() else collectives.moved_itemsize(self.dtype))


def _cast_dtype(dtype: Any) -> Any:
    """``dtype`` as a 16-bit float ``jnp.dtype``, or the TypeError that names the choices."""
    name = getattr(dtype, "__name__", None) or str(dtype)
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in _CAST_DTYPES:
        raise TypeError(
            f"dtype: expected one of {sorted(_CAST_DTYPES)} for jaxcomm.cast, got {name}"
            " (use jaxcomm.int8 / jaxcomm.qsgd for integer quantisation)"
        )
    return resolved


def cast(
    dtype: Any = jnp.bfloat16, *, accumulate: str = "auto", **options: Unpack[Options]
) -> optax.GradientTransformation:
    """Exchange gradients in a 16-bit float (fp16 or bf16): 2 bytes per entry.

    Rule: round to ``dtype`` and average (``"psum"``) or all-gather the 16-bit bits
    and sum in float32 (``"all_gather"``, exact).
    Wire: 2 bytes per entry (XLA:CPU moves a 16-bit all-reduce as 4, and says so).

    Args:
      dtype: ``jnp.bfloat16`` (default) or ``jnp.float16`` (or their names).
      accumulate: ``"psum"``, ``"all_gather"`` or ``"auto"`` (default: psum on GPU/TPU,
        all_gather on CPU); pass it explicitly to move an error-feedback checkpoint
        between CPU and GPU/TPU runs.
      **options: ``axis_name`` (``None`` rounds locally), ``error_feedback``
        (default ``False``; keeps the rounding error), ``min_size``,
        ``state_dtype``, ``bucket_bytes``, ``exchange``: see
        :class:`jaxcomm.options.Options`. With ``accumulate="psum"`` the
        exchange is the one all-reduce (``"auto"`` or ``"gather"``); with
        ``"all_gather"``, ``exchange="auto"`` takes the one that moves fewer
        bytes for the axis size: the uint16 all-gather on 2 workers,
        two-phase (uint16 both ways, summed in float32) on more; force
        ``"gather"`` where compute bounds the step.

    Returns:
      An ``optax.GradientTransformation``; updates keep their input dtype.

    Example:
      >>> tx = optax.chain(jaxcomm.cast(jnp.bfloat16, axis_name="data"), optax.adam(1e-3))

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018, arXiv:1710.03740.
    """
    # Notes. XLA:CPU moves a 16-bit all-reduce as 4 bytes per entry (bf16 promoted by XLA, fp16
    # widened by :class:`Cast`), and the wire report says so; GPU (NCCL) and TPU reduce bf16 and
    # fp16 natively. ``accumulate="psum"``: one all-reduce in the 16-bit dtype (fp16 sends ``g /
    # n``: no overflow when every ``|g|`` fits fp16, entries below ~6e-8·n underflow to zero).
    # ``"all_gather"``: ``uint16`` bits over the wire (see ``exchange``), summed in float32: exact,
    # 2 bytes per entry on every backend. ``"auto"``: ``"psum"`` on GPU/TPU and without an axis,
    # ``"all_gather"`` on CPU (decided at first init or trace, safe before
    # ``jax.distributed.initialize``) and with ``exchange="two_phase"`` or ``"reduce_scatter"``.
    # From 3 workers the CPU choice keeps a server residual (``state.server``) that the psum does
    # not have.
    o = take(
        "cast",
        options,
        ("axis_name", "error_feedback", "min_size", "state_dtype", "bucket_bytes", "exchange"),
        error_feedback=False,
    )
    axis_name, exchange = o["axis_name"], o["exchange"]
    resolved = _cast_dtype(dtype)
    if accumulate not in ("auto", "psum", "all_gather"):
        raise ValueError(f"accumulate: expected 'auto', 'psum' or 'all_gather', got {accumulate!r}")

    def build(acc: str) -> optax.GradientTransformation:
        return core.compress(Cast(resolved, acc, axis_name), **o)

    if accumulate == "auto" and (axis_name is None or exchange not in ("auto", "gather")):
        accumulate = "psum" if axis_name is None else "all_gather"
    if accumulate != "auto":
        return build(accumulate)
    # "auto" reads jax.default_backend() at first init/trace, so building the transform does
    # not start JAX. On CPU a 16-bit psum moves 4 bytes per entry, as dense fp32 does (and
    # accounting.collective_bytes reads the same from HLO): the uint16 words beat the bf16
    # psum and dense fp32 (step times: experiments/results/cast_words.json). GPU and TPU
    # keep the native 16-bit psum.
    # both built (and their arguments checked) now; which one runs is decided later
    return _by_backend(cpu=build("all_gather"), other=build("psum"))


def _by_backend(
    *, cpu: optax.GradientTransformation, other: optax.GradientTransformation
) -> optax.GradientTransformation:
    """``cpu`` on the CPU backend, ``other`` on GPU/TPU (:func:`jaxcomm.ledger.backend`).

    The backend is read each time init or update runs (at trace time), not
    here: a factory that started JAX would break ``jax.distributed.initialize``
    called after it. Both variants share one state class.
    """

    def pick() -> optax.GradientTransformation:
        return cpu if ledger.backend() == "cpu" else other

    def init_fn(params):
        return pick().init(params)

    def update_fn(updates, state, params=None):
        return pick().update(updates, state, params)

    return optax.GradientTransformation(init_fn, update_fn)


__all__ = ["allreduce", "cast", "Dense", "Cast"]
