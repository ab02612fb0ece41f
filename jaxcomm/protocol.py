"""The :class:`Compressor` protocol, its base class and the state of :func:`jaxcomm.compress`.

What a compressor is (encode, decode, how its payload is exchanged, its wire
size; optional hooks with defaults on :class:`CompressorBase`), the state its
transform carries (:class:`CompressState`) and the checks of that state.
:mod:`jaxcomm.core` runs a compressor on the one path, and re-exports every
name here.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jaxcomm import checks

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
        identical by one 8-byte all-reduce (``collectives.agree``).
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


def path_str(path: Sequence[Any]) -> str:
    return jax.tree_util.keystr(tuple(path)) or "<root>"


def check_float_leaves(leaves_with_path: Sequence[tuple[Any, Any]], what: str) -> None:
    for path, leaf in leaves_with_path:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{what}: leaf {path_str(path)} has dtype {dtype}; jaxcomm compresses "
                f"floating-point gradients only. Remove integer/bool leaves from the tree "
                f"(e.g. with optax.partition / optax.masked) before this transform."
            )


def state_type(name: str, module: str) -> type:
    """A :class:`CompressState` subclass named ``name`` (e.g. ``"TopKState"``) in ``module``:
    the same fields, a class of its own, so another transform's state is refused by name.

    Example:
      >>> TopKState = state_type("TopKState", __name__)
    """
    doc = (
        f"State of the {name.removesuffix('State')} transform: the fields of "
        ":class:`jaxcomm.core.CompressState`, in a class of its own (another transform's "
        "state is refused by name)."
    )
    return type(name, (CompressState,), {"__slots__": (), "__module__": module, "__doc__": doc})


def state_class(compressor: Any) -> type:
    """The state class of a compressor's transform: its ``state_cls``, e.g. ``TopKState``.

    Every transform built on :func:`compress` has the same fields, so without
    a class of its own one transform's state would pass for another's (top-k
    given random-k's state ran silently). Each jaxcomm compressor declares a
    :class:`CompressState` subclass beside it; a compressor that declares none
    gets :class:`CompressState`.
    """
    return type(compressor).state_cls or CompressState


def check_state(
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
