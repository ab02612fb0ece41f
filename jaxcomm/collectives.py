"""Thin wrappers over JAX's collectives: every collective jaxcomm issues goes through here.

The functions below (:func:`psum`, :func:`all_gather`, :func:`psum_scatter`,
:func:`all_to_all`, :func:`ppermute`, :func:`agree`) give one place to

* check that the axis is bound (a clear error instead of JAX's
  ``unbound axis name``),
* work under ``jax.shard_map`` (where an all-gathered value must be marked
  invariant across the axis, and a per-worker payload varying:
  :func:`as_varying`), ``jax.pmap`` and ``jax.vmap(axis_name=...)``,
* record what is sent. :func:`jaxcomm.accounting.wire_report` traces a
  transform's ``update`` abstractly with a *ledger* open
  (:func:`jaxcomm.ledger.recording`): the functions below then note the
  operand of each collective (bytes a worker contributes) and stand in for the
  collective by shape alone, so no devices or mesh are needed.

Tensor fusion (one collective per bucket) is built on these in
:mod:`jaxcomm.buckets`; the exchange algorithms in :mod:`jaxcomm.exchange`.
This module imports nothing else of jaxcomm but :mod:`jaxcomm.ledger`.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.ledger import MARKER, AxisName, Collective, backend, current_ledger

_REDUCING = ("all_reduce", "reduce_scatter")


def moved_itemsize(dtype: Any, kind: str = "all_reduce") -> int:
    """Bytes per entry a collective of ``kind`` moves for operands of ``dtype``.

    The dtype's own size, except for a bf16 reduction on the CPU backend:
    XLA:CPU promotes bf16 collectives to float32 in the compiled program
    (4 bytes per entry). Collectives that only move data (all-gather,
    all-to-all, collective-permute) send 16-bit floats as their ``uint16``
    bits (:func:`_words`), so those stay at 2 bytes on every backend. GPU
    (NCCL) and TPU reduce bf16 natively. Decided by :func:`jaxcomm.ledger.backend`.
    """
    dtype = jnp.dtype(dtype)
    if kind in _REDUCING and dtype == jnp.bfloat16 and backend() == "cpu":
        return 4
    return dtype.itemsize


def _words(x: jax.Array) -> jax.Array:
    """A 16-bit float as its ``uint16`` bits, for collectives that only move data.

    XLA:CPU promotes every bf16 collective to float32, all-gathers included
    (twice the bytes, for nothing: no arithmetic happens in them). The bits
    travel unchanged, so the result is bit-identical on every backend.
    """
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _unwords(y: jax.Array, dtype: Any) -> jax.Array:
    return lax.bitcast_convert_type(y, dtype) if y.dtype != dtype else y


def _record(kind: str, axis_name: AxisName, x: jax.Array) -> jax.Array:
    """Note ``x`` as the operand of a collective; return ``x`` tagged for the jaxpr.

    The tag (an ``optimization_barrier`` under a named scope carrying the
    entry's number) lets :func:`jaxcomm.accounting.wire_report` keep only the
    collectives that end up in the traced program: a transform may trace an
    update more than once (``optax.MultiSteps`` calls ``jax.eval_shape`` on
    the inner update) and only the copy in the program counts.
    """
    ledger = current_ledger()
    x = jnp.asarray(x)
    nbytes = int(x.size * moved_itemsize(x.dtype, kind))  # what the program moves
    ledger.collectives.append(Collective(kind, axis_name, nbytes, x.dtype.name, tuple(x.shape)))
    with jax.named_scope(f"{MARKER}{len(ledger.collectives) - 1}"):
        return lax.optimization_barrier(x)


def check_axis_name(axis_name: Any) -> AxisName | None:
    """Validate the type of an ``axis_name`` argument (a str, tuple of str or None)."""
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if (
        isinstance(axis_name, (tuple, list))
        and axis_name
        and all(isinstance(a, str) for a in axis_name)
    ):
        return tuple(axis_name)
    raise TypeError(
        f"axis_name: expected None, a mesh axis name (str) or a non-empty tuple of names, "
        f"got {axis_name!r}"
    )


class UnboundAxisError(ValueError):
    """A transform's ``axis_name`` is not an axis bound where its update runs."""

    def __init__(self, message: str, axis_name: AxisName):
        super().__init__(message)
        self.axis_name = axis_name


def axis_size(axis_name: AxisName) -> int:
    """Number of workers on ``axis_name``; a clear error if the axis is not bound."""
    ledger = current_ledger()
    if ledger is not None:
        return ledger.size(axis_name)
    try:
        return lax.axis_size(axis_name)
    except NameError as e:
        raise UnboundAxisError(
            f"axis_name={axis_name!r} is not bound here. Call the update inside "
            f"jax.shard_map(..., mesh=mesh) whose mesh has axis {axis_name!r}, or inside "
            f"jax.pmap(..., axis_name={axis_name!r}) / jax.vmap(..., axis_name={axis_name!r}); "
            f"or build the transform with axis_name=None to compress locally without "
            f"communicating. ({e})",
            axis_name,
        ) from None


def axis_index(axis_name: AxisName) -> jax.Array:
    """This worker's index along ``axis_name`` (0 while recording)."""
    if current_ledger() is not None:
        return jnp.zeros((), jnp.int32)
    axis_size(axis_name)  # for the clear error
    return lax.axis_index(axis_name)


def is_manual_axis(axis_name: AxisName) -> bool:
    """Whether ``axis_name`` is a manual axis of an enclosing shard_map/pmap."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    return all(a in manual for a in names)


def varying_names(x: Any) -> frozenset:
    """Mesh axes over which shard_map's type system says ``x`` varies.

    ``x``: an array, a tracer, or a ``ShapeDtypeStruct`` (which carries its type).
    """
    mat = getattr(x, "manual_axis_type", None)
    if mat is None:
        mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def as_varying(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Mark ``x`` as varying over the axis before a collective, under shard_map.

    A worker's payload differs per worker, but shard_map's type tracking can
    see it as invariant (e.g. indices drawn by ``jax.random.choice`` from a
    per-worker key are typed invariant in JAX 0.10). A collective over an
    "invariant" value would be typed wrongly; ``pcast`` fixes the type and
    moves no data.
    """
    if not is_manual_axis(axis_name):
        return x
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    varying = varying_names(x)
    missing = tuple(a for a in names if a not in varying)
    if missing:
        x = lax.pcast(x, missing if len(missing) > 1 else missing[0], to="varying")
    return x


def check_per_worker(tree: Any, axis_name: AxisName | None, what: str = "updates") -> None:
    """Raise if, under ``jax.shard_map``, ``tree`` is already identical on every worker.

    Inside ``shard_map`` the gradient of a *replicated* parameter (``in_specs
    P()``) is summed over the axis by JAX's autodiff itself: it arrives
    invariant, already all-reduced densely, so compressing it saves nothing
    and averaging it again would scale it by n. Per-worker gradients come from
    differentiating per-worker params: ``jax.lax.pcast(params, axis, to="varying")``
    before ``jax.grad`` (no data moves). Under ``pmap``/``vmap`` there is no
    such tracking and nothing is checked.
    """
    if axis_name is None or current_ledger() is not None or not is_manual_axis(axis_name):
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    # pmap and shard_map(check_vma=False) do not track varying values: the
    # worker index itself is then untyped, and there is nothing to check.
    if not varying_names(lax.axis_index(names[0])):
        return
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        varying = varying_names(x)
        missing = [a for a in names if a not in varying]
        if missing:
            where = jax.tree_util.keystr(path) or "<root>"
            raise ValueError(
                f"{what}: leaf {where} is the same on every worker of axis {missing[0]!r} "
                f"(invariant under jax.shard_map): these gradients were already summed over "
                f"the axis by JAX, because they are gradients of replicated params (in_specs "
                f"P()). Differentiate per-worker params instead: grads = jax.grad(loss)("
                f"jax.lax.pcast(params, {missing[0]!r}, to='varying'), batch); no data moves "
                f"and jaxcomm then does the (compressed) exchange."
            )


def psum(tree: Any, axis_name: AxisName) -> Any:
    """Sum every leaf of ``tree`` over ``axis_name`` (one all-reduce per leaf)."""
    ledger = current_ledger()
    if ledger is not None:
        n = ledger.size(axis_name)
        return jax.tree.map(lambda x: _record("all_reduce", axis_name, x) * n, tree)
    axis_size(axis_name)
    return lax.psum(jax.tree.map(lambda x: as_varying(x, axis_name), tree), axis_name)


def agree(tree: Any, axis_name: AxisName) -> Any:
    """Make every worker hold the same value (the elementwise max over workers).

    Used for randomness that workers must share (e.g. random-k's shared
    indices): one tiny all-reduce makes the key identical *and* typed
    invariant under ``jax.shard_map``, even though it lives in per-worker
    state.
    """
    ledger = current_ledger()
    if ledger is not None:
        return jax.tree.map(lambda x: _record("all_reduce", axis_name, x), tree)
    axis_size(axis_name)
    return lax.pmax(jax.tree.map(lambda x: as_varying(x, axis_name), tree), axis_name)


def pmean(tree: Any, axis_name: AxisName) -> Any:
    """Mean of every leaf over ``axis_name``, in the leaf's dtype."""
    n = axis_size(axis_name)
    return jax.tree.map(lambda x: x / jnp.asarray(n, x.dtype), psum(tree, axis_name))


def all_gather(tree: Any, axis_name: AxisName, *, tiled: bool = False) -> Any:
    """Every worker's copy of each leaf: stacked on a new leading axis of size n,
    or concatenated along axis 0 with ``tiled=True``.

    Under ``jax.shard_map`` the result is marked invariant over the axis (every
    worker holds the same gathered array), so a transform's output can use
    ``out_specs=P()``.
    """
    ledger = current_ledger()
    if ledger is not None:
        n = ledger.size(axis_name)

        def stand_in(x):
            x = jnp.broadcast_to(_record("all_gather", axis_name, x)[None], (n,) + x.shape)
            return x.reshape((-1,) + x.shape[2:]) if tiled else x

        return jax.tree.map(stand_in, tree)
    axis_size(axis_name)

    def gather(x):
        w = _words(x)
        if is_manual_axis(axis_name):
            w = as_varying(w, axis_name)
            return _unwords(lax.all_gather(w, axis_name, tiled=tiled, to="invarying"), x.dtype)
        return _unwords(lax.all_gather(w, axis_name, tiled=tiled), x.dtype)

    return jax.tree.map(gather, tree)


def psum_scatter(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Reduce-scatter of a ``(n * c,)`` vector: worker i gets the sum of chunk i.

    The operand (what a worker contributes) is the whole vector; each worker
    receives ``c`` entries. ``x.shape[0]`` must be a multiple of n.
    """
    ledger = current_ledger()
    if ledger is not None:
        n = ledger.size(axis_name)
        return _record("reduce_scatter", axis_name, x)[: x.shape[0] // n] * n
    axis_size(axis_name)
    return lax.psum_scatter(as_varying(x, axis_name), axis_name, tiled=True)


def all_to_all(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Row exchange of an ``(n, ...)`` array: row j goes to worker j; row i of the result
    came from worker i.

    The operand (what a worker contributes) is the whole array; a worker sends
    ``(n-1)/n`` of it and keeps its own row. Used by the two-phase exchange:
    worker j receives every worker's compressed chunk j.
    """
    ledger = current_ledger()
    if ledger is not None:
        return _record("all_to_all", axis_name, x)
    axis_size(axis_name)
    w = lax.all_to_all(as_varying(_words(x), axis_name), axis_name, 0, 0, tiled=True)
    return _unwords(w, x.dtype)


def ppermute(x: jax.Array, axis_name: str, perm: list[tuple[int, int]]) -> jax.Array:
    """Send ``x`` from worker ``src`` to worker ``dst`` for each pair in ``perm``."""
    if current_ledger() is not None:
        return _record("collective_permute", axis_name, x)
    axis_size(axis_name)
    return _unwords(lax.ppermute(as_varying(_words(x), axis_name), axis_name, perm), x.dtype)


def bound_axis_size(axis_name: AxisName) -> int | None:
    """Workers on ``axis_name`` where it is bound (or recorded), else ``None``."""
    ledger = current_ledger()
    if ledger is not None:
        return ledger.size(axis_name)
    try:
        return lax.axis_size(axis_name)
    except NameError:
        return None
