"""Payload exchange over a named mesh axis: the only place jaxcomm communicates.

Every collective jaxcomm issues goes through :func:`psum` or :func:`all_gather`
here. That gives one place to

* check that the axis is bound (a clear error instead of JAX's
  ``unbound axis name``),
* work under ``jax.shard_map`` (where an all-gathered value must be marked
  invariant across the axis), ``jax.pmap`` and ``jax.vmap(axis_name=...)``,
* record what is sent. :func:`jaxcomm.accounting.wire_report` traces a
  transform's ``update`` abstractly with a *ledger* open: the functions below
  then note the operand of each collective (bytes a worker contributes) and
  stand in for the collective by shape alone, so no devices or mesh are needed.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

AxisName = str | tuple[str, ...]


class Collective(NamedTuple):
    """One collective a worker takes part in during one step.

    Attributes:
      kind: ``"all_reduce"``, ``"all_gather"``, ``"collective_permute"`` or
        ``"reduce_scatter"``.
      axis: the mesh axis name (or tuple of names) it runs over.
      nbytes: bytes this worker contributes: the operand size (for an
        all-reduce the whole payload S, for an all-gather the worker's piece).
      dtype: dtype name of the operand as the algorithm sends it.
      shape: operand shape.
    """

    kind: str
    axis: Any
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class _Ledger:
    def __init__(self, sizes: int | Mapping[str, int]):
        self.sizes = sizes
        self.collectives: list[Collective] = []

    def size(self, axis_name: AxisName) -> int:
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        if isinstance(self.sizes, int):
            return self.sizes ** len(names)
        missing = [a for a in names if a not in self.sizes]
        if missing:
            raise ValueError(
                f"n_workers: no size given for mesh axis {missing[0]!r}; pass an int or a "
                f"dict with every axis the transform uses, e.g. {{{missing[0]!r}: 8}}"
            )
        return math.prod(self.sizes[a] for a in names)


_local = threading.local()


def _ledger() -> _Ledger | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def recording(sizes: int | Mapping[str, int]) -> Iterator[_Ledger]:
    """Open a ledger: collectives traced inside are recorded, not run.

    Use through :func:`jaxcomm.accounting.wire_report`; only meant for abstract
    tracing (``jax.make_jaxpr``), since the stand-ins compute nothing useful.
    """
    if isinstance(sizes, int) and sizes < 1:
        raise ValueError(f"n_workers: must be >= 1, got {sizes}")
    ledger = _Ledger(sizes)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ledger)
    try:
        yield ledger
    finally:
        stack.pop()


MARKER = "jaxcomm_wire_"


def _record(kind: str, axis_name: AxisName, x: jax.Array) -> jax.Array:
    """Note ``x`` as the operand of a collective; return ``x`` tagged for the jaxpr.

    The tag (an ``optimization_barrier`` under a named scope carrying the
    entry's number) lets :func:`jaxcomm.accounting.wire_report` keep only the
    collectives that end up in the traced program: a transform may trace an
    update more than once (``optax.MultiSteps`` calls ``jax.eval_shape`` on
    the inner update) and only the copy in the program counts.
    """
    ledger = _ledger()
    x = jnp.asarray(x)
    ledger.collectives.append(
        Collective(kind, axis_name, int(x.size * x.dtype.itemsize), x.dtype.name, tuple(x.shape))
    )
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


def axis_size(axis_name: AxisName) -> int:
    """Number of workers on ``axis_name``; a clear error if the axis is not bound."""
    ledger = _ledger()
    if ledger is not None:
        return ledger.size(axis_name)
    try:
        return lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here. Call the update inside "
            f"jax.shard_map(..., mesh=mesh) whose mesh has axis {axis_name!r}, or inside "
            f"jax.pmap(..., axis_name={axis_name!r}) / jax.vmap(..., axis_name={axis_name!r}); "
            f"or build the transform with axis_name=None to compress locally without "
            f"communicating. ({e})"
        ) from None


def axis_index(axis_name: AxisName) -> jax.Array:
    """This worker's index along ``axis_name`` (0 while recording)."""
    if _ledger() is not None:
        return jnp.zeros((), jnp.int32)
    axis_size(axis_name)  # for the clear error
    return lax.axis_index(axis_name)


def _manual(axis_name: AxisName) -> bool:
    """Whether ``axis_name`` is a manual axis of an enclosing shard_map/pmap."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    return all(a in manual for a in names)


def _as_varying(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Mark ``x`` as varying over the axis before a collective, under shard_map.

    A worker's payload differs per worker, but shard_map's type tracking can
    see it as invariant (e.g. indices drawn by ``jax.random.choice`` from a
    per-worker key are typed invariant in JAX 0.10). A collective over an
    "invariant" value would be typed wrongly; ``pcast`` fixes the type and
    moves no data.
    """
    if not _manual(axis_name):
        return x
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    varying = getattr(mat, "varying", frozenset()) if mat is not None else frozenset()
    missing = tuple(a for a in names if a not in varying)
    if missing:
        x = lax.pcast(x, missing if len(missing) > 1 else missing[0], to="varying")
    return x


def psum(tree: Any, axis_name: AxisName) -> Any:
    """Sum every leaf of ``tree`` over ``axis_name`` (one all-reduce per leaf)."""
    ledger = _ledger()
    if ledger is not None:
        n = ledger.size(axis_name)
        return jax.tree.map(lambda x: _record("all_reduce", axis_name, x) * n, tree)
    axis_size(axis_name)
    return lax.psum(jax.tree.map(lambda x: _as_varying(x, axis_name), tree), axis_name)


def agree(tree: Any, axis_name: AxisName) -> Any:
    """Make every worker hold the same value (the elementwise max over workers).

    Used for randomness that workers must share (e.g. random-k's shared
    indices): one tiny all-reduce makes the key identical *and* typed
    invariant under ``jax.shard_map``, even though it lives in per-worker
    state.
    """
    ledger = _ledger()
    if ledger is not None:
        return jax.tree.map(lambda x: _record("all_reduce", axis_name, x), tree)
    axis_size(axis_name)
    return lax.pmax(jax.tree.map(lambda x: _as_varying(x, axis_name), tree), axis_name)


def pmean(tree: Any, axis_name: AxisName) -> Any:
    """Mean of every leaf over ``axis_name``, in the leaf's dtype."""
    n = axis_size(axis_name)
    return jax.tree.map(lambda x: x / jnp.asarray(n, x.dtype), psum(tree, axis_name))


def all_gather(tree: Any, axis_name: AxisName) -> Any:
    """Stack every worker's copy of each leaf along a new leading axis of size n.

    Under ``jax.shard_map`` the result is marked invariant over the axis (every
    worker holds the same stacked array), so a transform's output can use
    ``out_specs=P()``.
    """
    ledger = _ledger()
    if ledger is not None:
        n = ledger.size(axis_name)
        return jax.tree.map(
            lambda x: jnp.broadcast_to(_record("all_gather", axis_name, x)[None], (n,) + x.shape),
            tree,
        )
    axis_size(axis_name)

    def gather(x):
        if _manual(axis_name):
            return lax.all_gather(_as_varying(x, axis_name), axis_name, to="invarying")
        return lax.all_gather(x, axis_name)

    return jax.tree.map(gather, tree)
