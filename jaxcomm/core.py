"""The one path every jaxcomm compressor runs on.

    grads (pytree, per worker)
      -> memory.add        p = g + e            (error feedback)
      -> compressor.encode payload = C(p)       (pure, static shapes)
      -> exchange          psum | all_gather over axis_name
      -> compressor.decode mean of decoded payloads
      -> memory.update     e = p - decode(own payload)

:func:`compress` builds that path as an ``optax.GradientTransformation`` for
any object following the :class:`Compressor` protocol. The named methods
(:func:`jaxcomm.topk`, :func:`jaxcomm.cast`, ...) are thin factories over it.

Small leaves: leaves under ``min_size`` entries go dense (a plain mean in
their own dtype, no residual). They ride in the payload's collective (one
collective per bucket) unless gathering them costs more bytes than a
collective's latency (:func:`jaxcomm.strategies.dense_rides`).

Tensor fusion (``bucket_bytes``, see :mod:`jaxcomm.buckets`): the payloads of
all leaves that go through the same collective are packed into flat buffers
of at most this many bytes, filled from the last leaf to the first (backprop
order), and each buffer is exchanged with one collective: psum buckets per
dtype, all-gather buckets as raw words. ``"auto"``: 25 MiB (PyTorch DDP's) on
GPU/TPU; on CPU 1 MiB for the sums, 25 MiB for the gathers
(:func:`jaxcomm.buckets.default_bucket_bytes`). ``None`` or 0: one
collective per payload array. Results are bit-identical either way.

Residual dtype (``state_dtype``, :func:`resolve_state_dtype`): a bf16
residual rounds ``e + g`` to a bf16 neighbour of ``e`` when ``g`` is small
next to it, so the mass of small gradients beside large ones is lost or
inflated. With a float32 residual (the default for bf16/fp16 leaves),
``g + e`` is formed in float32, rounded to the gradient's dtype only to be
encoded, and the residual keeps what was not sent, rounding included.

Exchanges (``exchange``) for all-gathered payloads (``kind="all_gather"``):
``"gather"``: every worker receives every payload, ``(n-1)·s`` bytes, and
decodes n of them. ``"two_phase"``: compressed chunks are reduce-scattered
with an all-to-all, each chunk averaged once, re-compressed with a server
residual (error feedback on both sides) and all-gathered, ``2(n-1)/n·s`` per
worker (:func:`jaxcomm.exchange.two_phase`; with error feedback the state
holds a second residual, ``state.server``). ``"auto"``: decided when the
update is traced and the axis size n is known, the one that moves fewer
bytes per worker for this codec, tree and n
(:meth:`jaxcomm.strategies.Auto.choose`,
:func:`jaxcomm.strategies.exchange_traffic`); ``"gather"`` on a tie (every
n <= 2) and for codecs without ``auto_two_phase`` (sparse ones), the one
all-reduce for summed payloads. Two-phase encodes and decodes twice: where
compute, not the link, bounds the step (a fast link, workers sharing cores)
force ``"gather"``. ``"reduce_scatter"``: phase one only, for sharded
(ZeRO/FSDP-style) training: the update of a leaf is this worker's shard of
the worker mean along the leaf's first dimension (which must be a multiple
of n): shape ``(shape[0] // n, *shape[1:])``, worker j's rows; error
feedback on the sender (:func:`jaxcomm.exchange.reduce_scatter`). Each name
is a :class:`jaxcomm.strategies.Strategy` of
:data:`jaxcomm.strategies.STRATEGIES`; an instance of one (e.g. a new
strategy, see that module) is taken as it is.

Non-finite gradients (the NaN rule): if any compressible leaf of any
worker's ``g + e`` holds NaN/Inf, the compressed leaves' update is NaN on
every worker (a compressor may not send the bad entry, e.g. random-k, so
each worker adds a flag to the exchange: 1 byte in the all-gather, or one
entry of the payload's dtype in the psum, in the first bucket; no extra
collective; casts and dense means carry NaN/Inf by themselves and send
none), and every worker's residual is left unchanged for the step (casts:
the residual of the worker whose gradient was not finite)
(``state.nonfinite`` counts such steps): state is never poisoned. Dense
(small) leaves are plain means, so a NaN there reaches every worker too. To
skip such steps, wrap the chain in :func:`jaxcomm.skip_nonfinite`, which
decides from the (agreed) update, after the exchange.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm import buckets, checks, collectives, strategies, trees
from jaxcomm.protocol import (
    Compressor,
    CompressorBase,
    CompressState,
    check_float_leaves,
    check_residual,
    check_state,
    key_bits,
    nan_flag_bytes,
    num_kept,
    resolve_state_dtype,
    state_class,
    state_type,
)
from jaxcomm.stages import Config, Memory, Step

# the protocol's names, re-exported: jaxcomm.core is where compressors find them
__all__ = [
    "Compressor",
    "CompressorBase",
    "CompressState",
    "check_float_leaves",
    "check_residual",
    "compress",
    "key_bits",
    "nan_flag_bytes",
    "num_kept",
    "resolve_state_dtype",
    "state_class",
    "state_type",
]

# --- the update pipeline: compress's update_fn runs these stages in order --------------


def _start(compressor: Compressor, updates: Any, state: Any, config: Config) -> Step:
    """Check the state and the updates; the updates' (and residuals') leaves."""
    check_state(
        state,
        updates,
        error_feedback=config.error_feedback,
        needs_key=compressor.needs_key,
        cls=config.state_cls,
    )
    with_path, treedef, grads = trees.leaves(updates, config.axis_name)
    residuals = treedef.flatten_up_to(state.residual) if config.error_feedback else None
    return Step(treedef, with_path, grads, residuals)


def _step_key(compressor: Compressor, step: Step, state: Any, config: Config) -> Step:
    """The state's next key and this step's (per worker, or agreed over the axis)."""
    new_key, step_key = (None, None)
    if compressor.needs_key:
        new_key, step_key = jax.random.split(state.key)
        if config.axis_name is not None:
            if compressor.per_worker_key:
                step_key = jax.random.fold_in(step_key, collectives.axis_index(config.axis_name))
            else:  # one 8-byte all-reduce: identical (and invariant-typed) everywhere
                step_key = collectives.agree(step_key, config.axis_name)
    return step._replace(new_key=new_key, step_key=step_key)


def _add_memory(step: Step, config: Config) -> Step:
    """``p = g + e`` of every compressible leaf, flat; the other leaves go dense.

    ``ps``: in the gradient's dtype (what is encoded); ``ps_state``: formed in
    the residual's dtype, where that differs (and rounded to the gradient's
    for ``ps``).
    """
    grads, residuals = step.grads, step.residuals
    compressible = [i for i, g in enumerate(grads) if g.size >= max(config.min_size, 1)]
    dense = set(range(len(grads))) - set(compressible)
    ps, ps_state = {}, {}
    for i in compressible:
        g = grads[i]
        p = g.reshape(-1)
        if config.error_feedback:
            r = residuals[i].reshape(-1)
            if r.dtype == p.dtype:
                p = p + r
            else:
                ps_state[i] = p.astype(r.dtype) + r
                p = ps_state[i].astype(g.dtype)
        ps[i] = p
    return step._replace(compressible=compressible, dense=dense, ps=ps, ps_state=ps_state)


def _group(step: Step, config: Config) -> Step:
    """Groups of leaves compressed as one vector (``scope``), their vectors and keys."""
    compressible, ps = step.compressible, step.ps
    if config.scope == "leaf":
        groups = [[i] for i in compressible]
    else:
        groups = [compressible] if compressible else []
    vecs, keys = [], []
    for gi, group in enumerate(groups):
        if len(group) == 1:
            vec = ps[group[0]]
        else:
            dtype = jnp.result_type(*[ps[i].dtype for i in group])
            vec = jnp.concatenate([ps[i].astype(dtype) for i in group])
        vecs.append(vec)
        keys.append(None if step.step_key is None else jax.random.fold_in(step.step_key, gi))
    return step._replace(groups=groups, vecs=vecs, keys=keys)


def _new_state(step: Step, state: Any, memory: Memory, config: Config) -> Any:
    """The state after the step: count, key, the strategy's memory (residuals, non-finite steps)."""
    return config.state_cls(
        count=optax.safe_int32_increment(state.count),
        key=step.new_key,
        residual=memory.residual,
        nonfinite=memory.nonfinite,
        # with "auto", a gather step keeps the server residual as it is (init could not see n)
        server=memory.server,
    )


def _configure(
    compressor, axis_name, error_feedback, min_size, key, scope, bucket_bytes, state_dtype, exchange
) -> tuple[Config, Any, Any]:
    """:func:`compress`'s arguments checked: the :class:`Config`, the key's raw bits (``None``
    for deterministic compressors) and the residual dtype."""
    axis_name = collectives.check_axis_name(axis_name)
    _check_compress_args(compressor, min_size, scope)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    state_dtype = checks.check_state_dtype(state_dtype)
    strategy = strategies.get(exchange)
    strategy.check(compressor, scope=scope)
    raw_key = key_bits(key) if compressor.needs_key else None
    state_cls = state_class(compressor)
    config = Config(axis_name, error_feedback, min_size, scope, bucket_bytes, strategy, state_cls)
    return config, raw_key, state_dtype


def _exchange_for(compressor: Compressor, step: Step, state: Any, config: Config) -> Any:
    """The exchange this trace runs (:mod:`jaxcomm.strategies`), chosen and checked once per
    trace; the local one without an axis."""
    if config.axis_name is None:
        return strategies.LOCAL
    return config.strategy.resolve(compressor, step, state, config)


def _check_compress_args(compressor: Any, min_size: Any, scope: Any) -> None:
    """:func:`compress`'s checks of ``compressor``, ``min_size`` and ``scope``."""
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"compressor: expected a jaxcomm Compressor, got {type(compressor).__name__}; "
            "derive it from jaxcomm.core.CompressorBase, which gives the optional hooks "
            "their defaults"
        )
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size: expected an int >= 0, got {min_size!r}")
    if scope not in ("leaf", "global"):
        raise ValueError(f"scope: expected 'leaf' or 'global', got {scope!r}")
    if compressor.kind not in ("psum", "all_gather"):
        raise ValueError(
            f"compressor.kind: expected 'psum' or 'all_gather', got {compressor.kind!r}"
        )


def _init_state(compressor: Compressor, params: Any, raw_key: Any, state_dtype: Any, config):
    """:func:`compress`'s initial state: zero counters and residuals (floating params only);
    a server residual where the strategy keeps one."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    check_float_leaves(leaves, "params")
    error_feedback, axis_name, strategy = config.error_feedback, config.axis_name, config.strategy
    server = (
        error_feedback
        and axis_name is not None
        and strategy.needs_server(compressor, [x for _, x in leaves], config)
    )
    residual = trees.zero_state(params, state_dtype) if error_feedback else None
    return config.state_cls(
        count=jnp.zeros((), jnp.int32),
        key=raw_key,
        residual=residual,
        nonfinite=jnp.zeros((), jnp.int32),
        server=residual if server else None,
    )


def compress(
    compressor: Compressor,
    *,
    axis_name: collectives.AxisName | None = None,
    error_feedback: bool = True,
    min_size: int = 1024,
    key: jax.Array | None = None,
    scope: str = "leaf",
    bucket_bytes: int | str | None = buckets.DEFAULT_BUCKET_BYTES,
    state_dtype: Any = None,
    exchange: str | strategies.Strategy = "auto",
) -> optax.GradientTransformation:
    """The generic compressed exchange: EF memory, encode, exchange, decode.

    Each worker adds its residual to the gradient (``p = g + e``), encodes
    ``p``, exchanges the payloads over ``axis_name`` and returns the mean of
    the decoded payloads; the residual keeps ``e = p - decode(own payload)``.
    Bytes: the codec's payload (``compressor.wire_size``) through the
    exchange. Small leaves, tensor fusion, the residual's dtype, the
    exchanges and the NaN rule in detail: :mod:`jaxcomm.core`.

    Args:
      compressor: a :class:`Compressor`.
      axis_name: mesh axis to average over. ``None``: no collective, the
        update is compressed and decompressed locally (single-worker research).
        Set: the update must run under ``jax.shard_map``/``jax.pmap``/
        ``jax.vmap`` binding that axis, and returns the worker mean.
      error_feedback: keep what was not sent in a residual and add it to the
        next gradient (Seide et al. 2014; Karimireddy et al. 2019). The
        residual has the params' shapes and dtypes: one extra model copy.
      min_size: leaves with fewer entries go dense (a plain mean in their own
        dtype, no residual), as torch's PowerSGD hook does for biases.
      key: PRNG key, required when ``compressor.needs_key``.
      scope: ``"leaf"`` compresses each leaf on its own; ``"global"``
        concatenates all compressible leaves into one vector first (e.g.
        global top-k: the k largest entries of the whole model).
      bucket_bytes: tensor fusion: payloads packed into buffers of at most
        this many bytes, one collective each. Default ``"auto"`` (25 MiB on
        GPU/TPU; on CPU 1 MiB for sums, 25 MiB for gathers); ``None`` or 0:
        one collective per payload array. Results are bit-identical either way.
      state_dtype: dtype of the residual. ``None``: float32 for bf16/fp16
        leaves, the leaf's dtype otherwise; ``jnp.bfloat16`` saves the
        memory but loses or inflates small gradients beside large ones.
      exchange: how all-gathered payloads travel: ``"gather"`` (``(n-1)·s``
        bytes), ``"two_phase"`` (``2(n-1)/n·s``, a server residual in
        ``state.server``), ``"reduce_scatter"`` (phase one only: this worker's
        shard of the mean along each leaf's first dimension, for ZeRO/FSDP),
        ``"auto"`` (default: the fewer bytes for this codec, tree and n, when
        traced), or a :class:`jaxcomm.strategies.Strategy` instance.

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      :class:`CompressState`. Updates come out in the dtype they came in;
      the payload is encoded from the gradient's dtype (same bytes).

    A NaN/Inf in any worker's ``g + e`` makes the update NaN on every worker
    and leaves the residuals unchanged (``state.nonfinite`` counts such
    steps); wrap the chain in :func:`jaxcomm.skip_nonfinite` to skip them.
    Integer or bool leaves raise ``TypeError``: filter them out first.
    """
    options = (error_feedback, min_size, key, scope, bucket_bytes, state_dtype, exchange)
    config, raw_key, state_dtype = _configure(compressor, axis_name, *options)

    def init_fn(params):
        return _init_state(compressor, params, raw_key, state_dtype, config)

    def update_fn(updates, state, params=None):
        del params
        step = _start(compressor, updates, state, config)
        step = _step_key(compressor, step, state, config)
        step = _add_memory(step, config)
        step = _group(step, config)
        chosen = _exchange_for(compressor, step, state, config)
        outputs, memory = chosen.run(compressor, step, state, config)
        return step.treedef.unflatten(outputs), _new_state(step, state, memory, config)

    return optax.GradientTransformation(init_fn, update_fn)
