"""Flax nnx: the data-parallel step for an ``nnx.Optimizer`` loop (imports flax; optional).

A plain optax loop and a linen ``TrainState`` loop use
:func:`jaxcomm.data_parallel` directly (a ``TrainState`` is a pytree). An nnx
loop mutates its model, optimizer and metrics in place; this module makes
such a step data-parallel. The change to the official Flax nnx MNIST
example is four lines:

    mesh = jax.make_mesh((8,), ("data",))                                  # + the workers
    tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.adamw(lr, momentum))  # ~
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    jaxcomm.flax.init_optimizer(optimizer, mesh)                           # + worker axis

    @jaxcomm.flax.data_parallel(mesh)                                      # ~ was @nnx.jit
    def train_step(model, optimizer, metrics, batch):  # unchanged
        ...

The rules are :mod:`jaxcomm.parallel`'s, for the state of the nnx objects
among the step's arguments: the jaxcomm part of an optimizer's state is per
worker (a leading worker axis, added by :func:`init_optimizer`), the batch
(the last argument by default) is split over workers, everything else is
replicated. The floating-point state of ``nnx.Metric`` objects (sums,
averages) is averaged over workers after the step, so metrics describe the
global batch (integer counters, equal on every worker, are kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import graph
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import parallel

__all__ = ["data_parallel", "init_optimizer"]


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _worker_variables(nodes) -> set[int]:
    """ids of the Variables inside a jaxcomm state of an optimizer reachable from ``nodes``."""
    ids = set()
    for _, node in nnx.iter_graph(nodes):
        state = getattr(node, "opt_state", None) if isinstance(node, nnx.Optimizer) else None
        for sub in jax.tree.leaves(state, is_leaf=parallel.is_worker_state):
            if parallel.is_worker_state(sub):
                ids |= {id(v) for v in jax.tree.leaves(sub, is_leaf=_is_var) if _is_var(v)}
    return ids


def init_optimizer(optimizer: nnx.Optimizer, mesh: Mesh, *, axis_name: str = "data") -> None:
    """Give the jaxcomm part of ``optimizer``'s state a leading worker axis, in place.

    Call once after building ``nnx.Optimizer(model, tx, ...)``; a checkpoint
    restored into an optimizer laid out this way keeps the layout.
    """
    n = parallel.axis_size(mesh, axis_name)
    parallel.state_mask(optimizer.opt_state)  # raises for local_sgd / diloco
    for var in (v for v in jax.tree.leaves(optimizer.opt_state, is_leaf=_is_var) if _is_var(v)):
        if id(var) in _worker_variables(optimizer):
            x = var.get_value()
            x = jnp.broadcast_to(x, (n, *jnp.shape(x)))
            var.set_value(jax.device_put(x, NamedSharding(mesh, P(axis_name))))


def _metric_mean(nodes, axis_name) -> None:
    for _, node in nnx.iter_graph(nodes):
        if isinstance(node, nnx.Metric):
            for v in jax.tree.leaves(nnx.state(node), is_leaf=_is_var):
                if _is_var(v) and jnp.issubdtype(jnp.result_type(v.get_value()), jnp.inexact):
                    v.set_value(jax.lax.pmean(v.get_value(), axis_name))


def data_parallel(
    fn: Callable | None = None,
    mesh: Mesh | None = None,
    *,
    axis_name: str = "data",
    batch_argnums: Sequence[int] = (-1,),
) -> Callable:
    """Make an nnx training step (mutating its nnx arguments) data-parallel over ``mesh``.

    Args:
      fn: ``fn(model, optimizer, ..., batch) -> aux``, one worker's step as
        written for ``nnx.jit``; it updates its nnx arguments in place. Call
        as ``data_parallel(fn, mesh)`` or decorate with ``@data_parallel(mesh)``.
      mesh: the device mesh.
      axis_name: the mesh axis of the workers.
      batch_argnums: positions of the arguments split over workers.

    Returns:
      ``step(*args) -> aux``: updates the nnx arguments like ``fn`` and
      returns ``fn``'s output (floating leaves averaged over workers).
    """
    if isinstance(fn, Mesh):
        fn, mesh = None, fn
    if fn is None:
        return lambda f: data_parallel(f, mesh, axis_name=axis_name, batch_argnums=batch_argnums)
    if mesh is None:
        raise ValueError("data_parallel: mesh is required, e.g. jax.make_mesh((8,), ('data',))")
    compiled: dict[Any, Callable] = {}

    def step(*args):
        pos = [i for i, a in enumerate(args) if graph.is_graph_node(a)]
        nodes = tuple(args[i] for i in pos)
        others = tuple(a for i, a in enumerate(args) if i not in pos)
        graphdef, state = nnx.split(nodes)
        ids = _worker_variables(nodes)
        flags = jax.tree.map(lambda v: jax.tree.map(lambda _: id(v) in ids, v), state,
                             is_leaf=_is_var)  # fmt: skip
        paths = {p for p, f in jax.tree_util.tree_leaves_with_path(flags) if f}
        structure = jax.tree.structure(state)

        def mask(tree):
            if jax.tree.structure(tree) != structure:
                return jax.tree.map(lambda _: False, tree)
            return jax.tree_util.tree_map_with_path(lambda p, _: p in paths, tree)

        n_args = len(args)
        rest_pos = [i for i in range(n_args) if i not in pos]
        batch = tuple(
            1 + rest_pos.index(k % n_args) for k in batch_argnums if k % n_args in rest_pos
        )
        key = (graphdef, batch)
        if key not in compiled:

            def pure(state, *rest):
                objs = iter(nnx.merge(graphdef, state))
                rest_it = iter(rest)
                full = [next(objs) if i in pos else next(rest_it) for i in range(n_args)]
                out = fn(*full)
                merged = tuple(full[i] for i in pos)
                _metric_mean(merged, axis_name)
                return nnx.state(merged), out

            compiled[key] = parallel.data_parallel(
                pure, mesh, axis_name=axis_name, batch_argnums=batch,
                mean_outputs=(1,), worker_mask=mask,
            )  # fmt: skip
        new_state, out = compiled[key](state, *others)
        nnx.update(nodes, new_state)
        return out

    return step
