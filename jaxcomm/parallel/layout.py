"""Where a data-parallel step's state lives: per worker (a leading worker axis) or replicated."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "axis_size",
    "init_state",
    "is_worker_state",
    "per_worker",
    "place",
    "state_mask",
]

# wrappers whose params differ per worker between synchronisations
_PER_WORKER_PARAMS = (
    "LocalSGDState",
    "DiLoCoState",
    "StreamingDiLoCoState",
    "SparseLoCoState",
    "ZeroOneAdamState",  # local steps between synchronisations
)


def is_worker_state(x: Any) -> bool:
    """Whether ``x`` is the state of a jaxcomm transform (kept per worker)."""
    cls = type(x)
    return (
        isinstance(x, tuple)
        and hasattr(cls, "_fields")
        and cls.__module__.split(".")[0] == "jaxcomm"
    )


def axis_size(mesh: Mesh, axis_name: str) -> int:
    if axis_name not in mesh.shape:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})"
        )
    return mesh.shape[axis_name]


def state_mask(tree: Any) -> Any:
    """``tree``'s structure with True on every leaf inside a jaxcomm state, False elsewhere."""

    def mark(node):
        flag = is_worker_state(node)
        if flag and type(node).__name__ in _PER_WORKER_PARAMS:
            raise ValueError(
                f"{type(node).__name__}: local_sgd, diloco and zero_one_adam keep params per "
                "worker between synchronisations, which "
                "data_parallel does not do; write the shard_map step with params, state and "
                "data all P(axis) (see the sync module's docstring)"
            )
        return jax.tree.map(lambda _: flag, node)

    return jax.tree.map(mark, tree, is_leaf=is_worker_state)


def init_state(
    tx: optax.GradientTransformation, params: Any, mesh: Mesh, *, axis_name: str = "data"
) -> Any:
    """``tx.init(params)`` laid out for :func:`data_parallel` on ``mesh``.

    Every leaf of a jaxcomm transform's state gets a leading worker axis of
    the mesh axis' size (each worker starts from the same state) and is
    sharded over it; every other leaf is replicated.

    Args:
      tx: the optimizer, e.g. ``optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1))``.
      params: the model's params (replicated).
      mesh: the device mesh the step runs on.
      axis_name: the mesh axis the workers are on.

    Returns:
      The optimizer state, placed on ``mesh``.
    """
    state = tx.init(params)
    mask = state_mask(state)
    replicated = NamedSharding(mesh, P())

    def place(x, worker):
        return per_worker(x, mesh, axis_name=axis_name) if worker else jax.device_put(x, replicated)

    return jax.tree.map(place, state, mask)


def per_worker(tree: Any, mesh: Mesh, *, axis_name: str = "data") -> Any:
    """``tree`` copied to every worker: a leading worker axis, sharded over ``axis_name``.

    The layout :func:`init_state` gives a jaxcomm state, for other state kept
    per worker (e.g. a linen ``batch_stats`` collection with
    ``data_parallel(..., batch_stats="per_worker")``).
    """
    n = axis_size(mesh, axis_name)
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.tree.map(
        lambda x: jax.device_put(jnp.broadcast_to(x, (n, *jnp.shape(x))), sharding), tree
    )


def place(args, masks, batch, mesh, axis_name):
    """Put each argument on ``mesh``: per-worker leaves and the batch over ``axis_name``."""

    def spec(per_worker, is_batch):
        return P(axis_name) if per_worker or is_batch else P()

    out = []
    for i, (arg, mask) in enumerate(zip(args, masks)):
        out.append(
            jax.tree.map(
                lambda x, m, b=i in batch: jax.device_put(x, NamedSharding(mesh, spec(m, b))),
                arg,
                mask,
            )
        )
    return tuple(out)
