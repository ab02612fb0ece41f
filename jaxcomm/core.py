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
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import buckets, checks, exchange, strategies
from jaxcomm.strategies import Config, Memory, Step, Strategy

_xc = exchange  # the module, where compress's ``exchange=`` option shadows its name

Payload = tuple[jax.Array, ...]


@runtime_checkable
class Compressor(Protocol):
    """What a compressor must provide. It works on one flat vector at a time.

    Attributes:
      kind: how payloads are exchanged: ``"psum"`` (the payload is linear, so
        summing payloads sums the decoded vectors; e.g. casts, random-k with
        shared indices, PowerSGD's factors) or ``"all_gather"`` (every worker
        receives every payload and decodes each; e.g. top-k values+indices).
      needs_key: whether :meth:`encode` uses randomness.
      per_worker_key: whether workers must draw different random numbers (the
        key is then folded with the worker's axis index); otherwise all
        workers share the step's key (e.g. shared random-k indices), made
        identical by one 8-byte all-reduce (``exchange.agree``).
    """

    kind: str
    needs_key: bool
    per_worker_key: bool

    def encode(self, p: jax.Array, key: jax.Array | None) -> tuple[Payload, Any]:
        """Compress flat ``p`` (shape ``(d,)``) into ``(payload, aux)``.

        ``payload`` is what goes on the wire (a tuple of arrays with static
        shapes); ``aux`` is local side information decode may use (never sent),
        e.g. indices every worker can recompute from a shared key.
        """
        ...

    def decode(self, payload: Payload, aux: Any, d: int, dtype: Any) -> jax.Array:
        """Dense ``(d,)`` vector of dtype ``dtype``: the SUM of the contributions.

        For ``kind="psum"`` ``payload`` is the (summed) payload; for
        ``kind="all_gather"`` every payload array has a leading axis of
        workers (size 1 for the worker's own payload).
        """
        ...

    def residual(self, p: jax.Array, payload: Payload, aux: Any) -> jax.Array:
        """``p - decode(own payload)``, the error-feedback memory update."""
        ...

    def residual_checked(
        self,
        p: jax.Array,
        e: jax.Array,
        kept: Callable[[], jax.Array],
        payload: Payload,
        aux: Any,
        ok: jax.Array,
    ) -> jax.Array:
        """:meth:`residual` where the bool scalar ``ok`` holds, else the old residual ``e``
        (``p``'s shape and dtype): the residual is left unchanged on a step where some
        worker's ``g + e`` was not finite. ``kept()`` returns ``where(ok, p, e)`` formed
        from ``g`` and ``e``, so that XLA need not write ``p`` out. Default a select over
        the new residual; sparse codecs subtract what was sent from ``kept()`` (nothing
        where not ``ok``): one pass over ``d`` fewer."""
        ...

    def wire_size(self, d: int, dtype: Any, n_workers: int = 1) -> int:
        """Bytes of the payload one worker contributes for a vector of ``d`` entries of
        ``dtype`` on an axis of ``n_workers``: the one payload size the library uses
        (:func:`jaxcomm.accounting.payload_bytes`, the wire ledger, ``exchange="auto"``).
        :class:`CompressorBase`'s default is the size of the arrays ``encode`` returns."""
        ...

    # Optional hooks: jaxcomm.core.CompressorBase gives each a default (derive from it).
    carries_nonfinite: bool
    auto_two_phase: bool
    agrees: bool

    def decode_mean(self, received: Payload, aux: Any, d: int, dtype: Any, n: int) -> jax.Array:
        """Mean over ``n`` workers; default ``decode(...) / n`` (sparse codecs scale k values)."""
        ...

    def decode_mean_checked(
        self, received: Payload, aux: Any, d: int, dtype: Any, n: int, ok: jax.Array
    ) -> jax.Array:
        """:meth:`decode_mean`, every entry NaN where the bool scalar ``ok`` is False (some
        worker's ``g + e`` was not finite). Default a select over the mean; sparse codecs
        scatter into a fill of 0 or NaN instead (one pass over ``d`` fewer)."""
        ...

    def all_finite(self, p: jax.Array, payload: Payload, aux: Any) -> jax.Array:
        """Bool scalar: no NaN/Inf in ``p``. Default reads all of ``p``; top-k and
        threshold read only what they selected (which holds any non-finite entry)."""
        ...

    def server_codec(self) -> "Compressor":
        """The codec that re-compresses the chunk means in the two-phase exchange's
        second phase (:func:`jaxcomm.exchange.two_phase`); default this one."""
        ...


class CompressorBase:
    """Defaults for :class:`Compressor` implementations: derive every compressor from it.

    Attributes:
      carries_nonfinite: True when a NaN/Inf entry of ``p`` reaches every
        worker's decoded mean by itself (casts, dense): no NaN flag is sent.
      auto_two_phase: True when ``exchange="auto"`` may pick the two-phase
        exchange for this (all-gathered) codec where it moves fewer bytes: the
        quantisers and the uint16 cast, whose chunk means re-compress like the
        chunks. False: ``"auto"`` is the all-gather.
      axis_name: the mesh axis, for encoders that read it (its size, an
        agreed value); None otherwise.
      agrees: True when the workers first agree on a value per vector:
        ``to_agree(p, key)`` gives it, the max over workers goes to
        ``encode_agreed(p, key, agreed)`` (TernGrad's shared scale); all
        vectors' values travel in one bucketed all-reduce.

    ``server_codec()`` is the codec of the two-phase exchange's second phase
    (the owner of a chunk re-compresses the workers' mean of it, plus its
    server residual, and all-gathers it): by default the compressor itself;
    a codec whose fixed parameters suit a worker's vector but not a mean of
    n decoded ones returns another (2-bit: a per-chunk scale, see
    :class:`jaxcomm.compressors.sign.TwoBitServer`).
    """

    kind: str = "all_gather"
    needs_key: bool = False
    per_worker_key: bool = True
    auto_two_phase: bool = False
    carries_nonfinite: bool = False
    agrees: bool = False
    axis_name: Any = None  # set by encoders that read the axis (its size, an agreed value)
    state_cls: type | None = None  # the transform's CompressState subclass (state_class)

    def to_agree(self, p: jax.Array, key: jax.Array | None) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__}: agrees=True needs to_agree")

    def encode_agreed(self, p: jax.Array, key: jax.Array | None, agreed: jax.Array):
        raise NotImplementedError(f"{type(self).__name__}: agrees=True needs encode_agreed")

    def residual(self, p: jax.Array, payload: Payload, aux: Any) -> jax.Array:
        own = payload if self.kind == "psum" else tuple(x[None] for x in payload)
        return p - self.decode(own, aux, p.shape[0], p.dtype)

    def residual_checked(
        self,
        p: jax.Array,
        e: jax.Array,
        kept: Callable[[], jax.Array],
        payload: Payload,
        aux: Any,
        ok: jax.Array,
    ) -> jax.Array:
        return jnp.where(ok, self.residual(p, payload, aux), e)

    def decode_mean(self, received: Payload, aux: Any, d: int, dtype: Any, n: int) -> jax.Array:
        total = self.decode(received, aux, d, dtype)
        return total / jnp.asarray(n, total.dtype)

    def decode_mean_checked(
        self, received: Payload, aux: Any, d: int, dtype: Any, n: int, ok: jax.Array
    ) -> jax.Array:
        mean = self.decode_mean(received, aux, d, dtype, n)
        return jnp.where(ok, mean, jnp.asarray(jnp.nan, mean.dtype))

    def all_finite(self, p: jax.Array, payload: Payload, aux: Any) -> jax.Array:
        return jnp.isfinite(jnp.sum(p * 0))

    def server_codec(self) -> "CompressorBase":
        return self

    def wire_size(self, d: int, dtype: Any, n_workers: int = 1) -> int:
        """The arrays ``encode`` returns for a ``(d,)`` vector (traced, nothing computed).

        Codecs whose wire differs from their encoded arrays override it: psum
        words a backend widens (bf16 sums move 4 bytes on XLA:CPU), fields
        sized by the number of workers (TernGrad, majority vote).
        """
        key = jax.ShapeDtypeStruct((2,), jnp.uint32) if self.needs_key else None
        x = jax.ShapeDtypeStruct((d,), dtype)
        out = jax.eval_shape(lambda x, k: tuple(self.encode(x, k)[0]), x, key)
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in out)


class CompressState(NamedTuple):
    """State of :func:`compress` (and of every compressor factory built on it).

    Attributes:
      count: int32 ``[]``, number of updates made.
      key: uint32 ``[2]`` raw PRNG key, split every step; ``None`` for
        deterministic compressors.
      residual: error-feedback memory, same tree/shapes/dtypes as the params
        (one extra copy of the model); ``None`` without error feedback.
      nonfinite: int32 ``[]``, number of steps in which some worker's gradient
        (``g + e``) held NaN or Inf; on those steps the residual was left
        unchanged and the update was NaN on every worker.
      server: with error feedback over an axis, where the two-phase exchange
        can run, its server residual (the params' tree and shapes, in the
        residual's dtype; each worker uses the chunk it averages: see
        :func:`jaxcomm.exchange.two_phase`); ``None`` otherwise. With
        ``exchange="two_phase"`` always; with ``"auto"`` exactly when it picks
        two-phase for the axis size, if ``init`` sees the axis (called under
        ``shard_map``/``pmap``, or by :func:`jaxcomm.wire_bytes`); an ``init``
        outside the axis cannot know n and allocates it when ``"auto"`` picks
        two-phase on some axis size for this tree (a gather step then keeps
        it as it is, zeros).
    """

    count: jax.Array
    key: jax.Array | None
    residual: Any
    nonfinite: jax.Array
    server: Any = None


def check_residual(residual: Any, updates: Any, name: str = "state.residual") -> None:
    """The residual tree must match the updates leaf for leaf (structure and shapes)."""
    s_res, s_upd = jax.tree.structure(residual), jax.tree.structure(updates)
    if s_res != s_upd:
        raise ValueError(
            f"{name}: its tree structure {s_res} does not match the updates' "
            f"{s_upd}; was the state initialised with other params?"
        )
    for r, u in zip(jax.tree.leaves(residual), jax.tree.leaves(updates)):
        if jnp.shape(r) != jnp.shape(u):
            raise ValueError(
                f"{name}: leaf shape {jnp.shape(r)} does not match the update's "
                f"{jnp.shape(u)}; was the state initialised with other params?"
            )


def resolve_state_dtype(leaf_dtype: Any, state_dtype: Any = None) -> Any:
    """dtype of the optimizer-side state (residual, momentum, velocity) of one leaf.

    ``state_dtype=None`` (the default) keeps state in float32 for 16-bit float
    leaves (bf16/fp16), so that ``residual + g`` does not round small gradients
    away, and in the leaf's own dtype otherwise; an explicit floating dtype is
    used for every floating leaf (to save memory, at that cost).
    """
    leaf_dtype = jnp.dtype(leaf_dtype)
    if not jnp.issubdtype(leaf_dtype, jnp.floating):
        return leaf_dtype
    if state_dtype is not None:
        return jnp.dtype(state_dtype)
    return jnp.dtype(jnp.float32) if leaf_dtype.itemsize < 4 else leaf_dtype


def num_kept(ratio: float, d: int) -> int:
    """Entries a sparsifier keeps of ``d``: ``max(1, ceil(ratio * d))``, at most d."""
    return min(d, max(1, math.ceil(ratio * d - 1e-9)))


def key_bits(key: Any, name: str = "key") -> jax.Array:
    if key is None:
        raise TypeError(f"{name}: a PRNG key is required, e.g. {name}=jax.random.key(0)")
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    if key.dtype != jnp.uint32 or key.shape != (2,):
        raise TypeError(
            f"{name}: expected a PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), "
            f"got an array of dtype {key.dtype} and shape {key.shape}"
        )
    return key


def _path_str(path: Sequence[Any]) -> str:
    return jax.tree_util.keystr(tuple(path)) or "<root>"


def check_float_leaves(leaves_with_path: Sequence[tuple[Any, Any]], what: str) -> None:
    for path, leaf in leaves_with_path:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{what}: leaf {_path_str(path)} has dtype {dtype}; jaxcomm compresses "
                f"floating-point gradients only. Remove integer/bool leaves from the tree "
                f"(e.g. with optax.partition / optax.masked) before this transform."
            )


def state_class(compressor: Any) -> type:
    """The state class of a compressor's transform: its ``state_cls``, e.g. ``TopKState``.

    Every transform built on :func:`compress` has the same fields, so without
    a class of its own one transform's state would pass for another's (top-k
    given random-k's state ran silently). Each jaxcomm compressor declares a
    :class:`CompressState` subclass beside it; a compressor that declares none
    gets :class:`CompressState`.
    """
    return type(compressor).state_cls or CompressState


def _check_state(
    state: Any, updates: Any, *, error_feedback: bool, needs_key: bool, cls: type = CompressState
) -> None:
    if type(state) is not cls:
        raise TypeError(
            f"state: expected the {cls.__name__} made by this transform's init, got "
            f"{type(state).__name__}. Pass the state returned by tx.init(params) of the same "
            f"transform."
        )
    checks.check_scalar_count(state, cls.__name__)
    if needs_key and state.key is None:
        raise ValueError(
            "state: this transform needs a PRNG key in its state but state.key is None; the "
            "state comes from a different transform."
        )
    if error_feedback:
        if state.residual is None:
            raise ValueError(
                "state: this transform uses error feedback but state.residual is None; the "
                "state comes from a transform built with error_feedback=False."
            )
        check_residual(state.residual, updates)


def nan_flag_bytes(
    compressor: Compressor, d: int = 1024, dtype: Any = jnp.float32, n_workers: int = 8
) -> int:
    """Bytes a worker adds per step for the NaN rule's flag (see :func:`compress`).

    0 for compressors that carry NaN/Inf in their payload (dense, casts); 1
    for all-gathered payloads; else one entry of the psum payload's dtype
    (for a vector of ``d`` entries of ``dtype`` over ``n_workers``).
    Counted once per transform and step, not per leaf.
    """
    if compressor.carries_nonfinite:
        return 0
    if compressor.kind != "psum":
        return 1
    key = jax.random.key_data(jax.random.key(0)) if compressor.needs_key else None
    axis = compressor.axis_name
    enc = lambda p: compressor.encode(p, key)[0]  # noqa: E731
    if axis is not None:  # encoders that read the axis size: trace under a bound axis
        enc = jax.vmap(enc, axis_name=axis, axis_size=n_workers)
        shape: tuple[int, ...] = (n_workers, d)
    else:
        shape = (d,)
    payload = jax.eval_shape(enc, jax.ShapeDtypeStruct(shape, dtype))
    return jnp.dtype(payload[-1].dtype).itemsize


# --- the update pipeline: compress's update_fn runs these stages in order --------------


def _start(compressor: Compressor, updates: Any, state: Any, config: Config) -> Step:
    """Check the state and the updates; the updates' (and residuals') leaves."""
    _check_state(
        state,
        updates,
        error_feedback=config.error_feedback,
        needs_key=compressor.needs_key,
        cls=config.state_cls,
    )
    with_path, treedef = jax.tree_util.tree_flatten_with_path(updates)
    check_float_leaves(with_path, "updates")
    _xc.check_per_worker(updates, config.axis_name)
    grads = [g for _, g in with_path]
    residuals = treedef.flatten_up_to(state.residual) if config.error_feedback else None
    return Step(treedef, with_path, grads, residuals)


def _step_key(compressor: Compressor, step: Step, state: Any, config: Config) -> Step:
    """The state's next key and this step's (per worker, or agreed over the axis)."""
    new_key, step_key = (None, None)
    if compressor.needs_key:
        new_key, step_key = jax.random.split(state.key)
        if config.axis_name is not None:
            if compressor.per_worker_key:
                step_key = jax.random.fold_in(step_key, _xc.axis_index(config.axis_name))
            else:  # one 8-byte all-reduce: identical (and invariant-typed) everywhere
                step_key = _xc.agree(step_key, config.axis_name)
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


def _strategy(compressor: Compressor, step: Step, state: Any, config: Config) -> Strategy:
    """The exchange this trace runs (:mod:`jaxcomm.strategies`), checked it can run."""
    axis_name, mode = config.axis_name, config.mode
    if axis_name is None:
        return strategies.local
    if mode == "reduce_scatter":
        n = _xc.axis_size(axis_name)
        for path, g in step.with_path:
            if g.ndim == 0 or g.shape[0] % n:
                raise ValueError(
                    f"exchange='reduce_scatter': leaf {_path_str(path)} has shape {g.shape}; its "
                    f"first dimension must be a multiple of the {n} workers (the shard axis)"
                )
        return strategies.reduce_scatter
    specs = [(v.shape[0], v.dtype) for v in step.vecs]
    if _xc.choose_exchange(mode, compressor, specs, _xc.axis_size(axis_name)) != "two_phase":
        return strategies.gather
    if config.error_feedback and state.server is None:
        raise ValueError(
            f"state.server is None, but exchange={mode!r} runs the two-phase exchange on "
            f"{_xc.axis_size(axis_name)} workers for these updates and needs its server "
            "residual: the state was made by init on an axis size where 'auto' picks "
            "'gather' (or saved by a transform with exchange='gather'). Make the state with "
            "tx.init(params) outside shard_map, or build the transform with "
            "exchange='gather' to keep using this state."
        )
    return strategies.two_phase


def _new_state(step: Step, state: Any, memory: Memory, config: Config) -> Any:
    """The state after the step: count, key, the strategy's memory, non-finite steps."""
    count = optax.safe_int32_increment(state.count)
    nonfinite = memory.nonfinite
    if memory.ok is not None:  # two-phase, reduce-scatter: counted after the step count
        nonfinite = state.nonfinite + (~memory.ok).astype(jnp.int32)
    return config.state_cls(
        count=count,
        key=step.new_key,
        residual=memory.residual,
        nonfinite=nonfinite,
        # with "auto", a gather step keeps the server residual as it is (init could not see n)
        server=memory.server,
    )


def compress(
    compressor: Compressor,
    *,
    axis_name: exchange.AxisName | None = None,
    error_feedback: bool = True,
    min_size: int = 1024,
    key: jax.Array | None = None,
    scope: str = "leaf",
    bucket_bytes: int | str | None = buckets.DEFAULT_BUCKET_BYTES,
    state_dtype: Any = None,
    exchange: str = "auto",
) -> optax.GradientTransformation:
    """The generic compressed exchange: EF memory, encode, exchange, decode.

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
        dtype, no residual), as torch's PowerSGD hook does for biases. They
        ride in the payload's collective (one collective per bucket) unless
        gathering them costs more bytes than a collective's latency
        (:func:`jaxcomm.exchange.dense_rides`).
      key: PRNG key, required when ``compressor.needs_key``.
      scope: ``"leaf"`` compresses each leaf on its own; ``"global"``
        concatenates all compressible leaves into one vector first (e.g.
        global top-k: the k largest entries of the whole model).
      bucket_bytes: tensor fusion (see :mod:`jaxcomm.buckets`): the payloads
        of all leaves that go through the same collective are packed into
        flat buffers of at most this many bytes, filled from the last leaf
        to the first (backprop order), and each buffer is exchanged with one
        collective: psum buckets per dtype, all-gather buckets as raw bytes.
        Default ``"auto"``: 25 MiB (PyTorch DDP's) on GPU/TPU; on CPU 1 MiB
        for the sums, 25 MiB for the gathers
        (:func:`jaxcomm.buckets.default_bucket_bytes`). ``None`` or 0: one
        collective per payload array. Results are bit-identical either way.
      state_dtype: dtype of the residual (:func:`resolve_state_dtype`).
        ``None``: float32 for bf16/fp16 leaves, the leaf's dtype otherwise.
        A bf16 residual rounds ``e + g`` to a bf16 neighbour of ``e`` when
        ``g`` is small next to it, so the mass of small gradients beside
        large ones is lost or inflated. With a float32 residual, ``g + e``
        is formed in float32, rounded to the gradient's dtype only to be
        encoded, and the residual keeps what was not sent, rounding
        included. Pass ``jnp.bfloat16`` to save the memory.
      exchange: how all-gathered payloads (``kind="all_gather"``) travel.
        ``"gather"``: every worker receives every payload, ``(n-1)·s`` bytes,
        and decodes n of them. ``"two_phase"``: compressed chunks are
        reduce-scattered with an all-to-all, each chunk averaged once,
        re-compressed with a server residual (error feedback on both sides)
        and all-gathered, ``2(n-1)/n·s`` per worker
        (:func:`jaxcomm.exchange.two_phase`; with error feedback the state
        holds a second residual, ``state.server``). ``"auto"`` (default):
        decided when the update is traced and the axis size n is known, the
        one that moves fewer bytes per worker for this codec, tree and n
        (:func:`jaxcomm.exchange.choose_exchange`,
        :func:`jaxcomm.accounting.exchange_traffic`); ``"gather"`` on a tie
        (every n <= 2) and for codecs without ``auto_two_phase`` (sparse
        ones), the one all-reduce for summed payloads. Two-phase encodes and
        decodes twice: where compute, not the link, bounds the step (a fast
        link, workers sharing cores) force ``"gather"``.
        ``"reduce_scatter"``: phase one only, for sharded (ZeRO/FSDP-style)
        training: the update of a leaf is this worker's shard of the worker
        mean along the leaf's first dimension (which must be a multiple of
        n): shape ``(shape[0] // n, *shape[1:])``, worker j's rows; error
        feedback on the sender (:func:`jaxcomm.exchange.reduce_scatter`).

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      :class:`CompressState`. Updates come out in the dtype they came in;
      the payload is encoded from the gradient's dtype (same bytes).

    Non-finite gradients (the NaN rule): if any compressible leaf of any
    worker's ``g + e`` holds NaN/Inf, the compressed leaves' update is NaN on
    every worker (a compressor may not send the bad entry, e.g. random-k, so
    each worker adds a flag to the exchange: 1 byte in the all-gather, or one
    entry of the payload's dtype in the psum, in the first bucket; no extra
    collective; casts and dense means carry NaN/Inf by themselves and send
    none), and every worker's residual is left unchanged for the step (casts:
    the residual of the worker whose gradient was not finite)
    (``state.nonfinite`` counts such steps): state is never poisoned. Dense
    (small) leaves are plain means, so a NaN there reaches every worker too.
    To skip such steps, wrap the chain in :func:`jaxcomm.skip_nonfinite`,
    which decides from the (agreed) update, after the exchange.

    Integer or bool leaves raise ``TypeError``: filter them out first.
    """
    axis_name = _xc.check_axis_name(axis_name)
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
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    state_dtype = checks.check_state_dtype(state_dtype)
    mode = _xc.check_exchange(exchange, compressor.kind)
    if mode not in ("gather", "auto") and compressor.agrees:
        raise ValueError("exchange: this compressor agrees on values per vector; use 'gather'")
    if mode == "reduce_scatter" and scope != "leaf":
        raise ValueError("exchange: 'reduce_scatter' shards each leaf; it needs scope='leaf'")
    raw_key = key_bits(key) if compressor.needs_key else None
    state_cls = state_class(compressor)

    def vector_specs(leaves):  # (d, dtype) of each vector compressed on its own
        big = [x for x in leaves if np.size(x) >= max(min_size, 1)]
        if scope == "global" and big:
            return [(sum(int(np.size(x)) for x in big), jnp.result_type(*big))]
        return [(int(np.size(x)), jnp.result_type(x)) for x in big]

    def init_fn(params):
        leaves = jax.tree_util.tree_leaves_with_path(params)
        check_float_leaves(leaves, "params")
        server = error_feedback and axis_name is not None and mode in ("two_phase", "auto")
        if server and mode == "auto":  # n where init sees the axis, else "on some n"
            n = _xc.bound_axis_size(axis_name)
            specs = vector_specs([x for _, x in leaves])
            server = _xc.choose_exchange(mode, compressor, specs, n) == "two_phase"
        residual = (
            jax.tree.map(
                lambda p: jnp.zeros(
                    jnp.shape(p), resolve_state_dtype(jnp.result_type(p), state_dtype)
                ),
                params,
            )
            if error_feedback
            else None
        )
        return state_cls(
            count=jnp.zeros((), jnp.int32),
            key=raw_key,
            residual=residual,
            nonfinite=jnp.zeros((), jnp.int32),
            server=residual if server else None,
        )

    config = Config(axis_name, error_feedback, min_size, scope, bucket_bytes, mode, state_cls)

    def update_fn(updates, state, params=None):
        del params
        step = _start(compressor, updates, state, config)
        step = _step_key(compressor, step, state, config)
        step = _add_memory(step, config)
        step = _group(step, config)
        strategy = _strategy(compressor, step, state, config)  # chosen once per trace
        outputs, memory = strategy(compressor, step, state, config)
        return step.treedef.unflatten(outputs), _new_state(step, state, memory, config)

    return optax.GradientTransformation(init_fn, update_fn)
