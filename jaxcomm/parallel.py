"""The data-parallel step in one call: per-worker state, specs and placement done for you.

A jaxcomm transform keeps **per-worker** state (an error-feedback residual is
what *this* worker did not send), while params and the state of optax
transforms after it (momentum, Adam's moments) are the same on every worker.
Writing that split by hand under ``jax.shard_map`` takes a page of specs and
slicing; :func:`init_state` and :func:`data_parallel` do it:

    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.adam(1e-3))
    opt_state = jaxcomm.init_state(tx, params, mesh)

    @jaxcomm.data_parallel(mesh)
    def train_step(params, opt_state, batch):  # one worker's step, plain optax
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, loss = train_step(params, opt_state, batch)  # batch: the global batch

The layout rule, applied to every argument and every output of the step:

* a **jaxcomm state** (any state class defined in ``jaxcomm``, found
  anywhere in the tree, e.g. inside a chain's tuple or a flax ``TrainState``)
  carries a leading worker axis of size ``n`` and is sharded over it;
* the **batch** arguments (``batch_argnums``, default the last) are split
  over workers along their leading axis (the global batch);
* **everything else** (params, the other optimizer state, step counters) is
  replicated.

Inside the step each worker sees its own slice without the worker axis, and
gradients are per worker: the step runs under ``shard_map(check_vma=False)``
(pmap's semantics), so ``jax.grad`` of a replicated param does not insert
the dense all-reduce JAX adds under type checking, and the jaxcomm
transform does the only exchange. Outputs named in ``mean_outputs`` (e.g.
the loss) have their floating leaves averaged over workers.

Checks made before anything is compiled, each naming the leaf and the fix:
a jaxcomm state leaf without the worker axis (state not built with
:func:`init_state`), a batch whose leading axis does not divide over the
workers, a step with no jaxcomm state among its arguments (gradients would
not be exchanged), and the parameter-averaging wrappers (``local_sgd``,
``diloco``), whose params are per worker and need a hand-written step.

Arrays are placed on the mesh on every call (a no-op for arrays already
there), so a NumPy batch, an orbax restore onto one device, or a mesh with
Explicit axes all work. On XLA:CPU with several devices in one process, the
helper waits for the previous step before dispatching the next: with many
collective programs in flight the in-process communicator can stall (only
some devices reach a rendezvous while the others' threads wait on a later
step). One step in flight keeps the host ahead of nothing but avoids it;
GPU/TPU keep JAX's asynchronous dispatch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["axis_size", "data_parallel", "init_state", "is_worker_state", "state_mask"]

# wrappers whose params differ per worker between synchronisations
_PER_WORKER_PARAMS = ("LocalSGDState", "DiLoCoState", "StreamingDiLoCoState", "SparseLoCoState")


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
                f"{type(node).__name__}: local_sgd and diloco keep params per worker, which "
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
    n = axis_size(mesh, axis_name)
    state = tx.init(params)
    mask = state_mask(state)

    def place(x, per_worker):
        if per_worker:
            x = jnp.broadcast_to(x, (n, *jnp.shape(x)))
            return jax.device_put(x, NamedSharding(mesh, P(axis_name)))
        return jax.device_put(x, NamedSharding(mesh, P()))

    return jax.tree.map(place, state, mask)


def _path(prefix: str, path) -> str:
    return prefix + jax.tree_util.keystr(path)


def _check_inputs(args, masks, batch, n, axis_name):
    for i, (arg, mask) in enumerate(zip(args, masks)):
        leaves = jax.tree_util.tree_leaves_with_path(arg)
        flags = jax.tree.leaves(mask)
        for (path, x), per_worker in zip(leaves, flags):
            shape = jnp.shape(x)
            where = _path(f"argument {i}", path)
            if i in batch and (not shape or shape[0] % n):
                raise ValueError(
                    f"{where}: a batch argument needs a leading axis divisible by the {n} "
                    f"workers of axis {axis_name!r}; got shape {shape}"
                )
            if per_worker and (not shape or shape[0] != n):
                raise ValueError(
                    f"{where}: jaxcomm state needs a leading worker axis of size {n}; got shape "
                    f"{shape}. Build the optimizer state with jaxcomm.init_state(tx, params, "
                    "mesh), and return the state the step gave back unchanged in layout"
                )


def _place(args, masks, batch, mesh, axis_name):
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


def _specs(masks, batch, axis_name):
    return tuple(
        jax.tree.map(lambda m, b=i in batch: P(axis_name) if m or b else P(), mask)
        for i, mask in enumerate(masks)
    )


def data_parallel(
    fn: Callable | None = None,
    mesh: Mesh | None = None,
    *,
    axis_name: str = "data",
    batch_argnums: Sequence[int] = (-1,),
    mean_outputs: Sequence[int] = (),
    donate_argnums: Sequence[int] = (),
    worker_mask: Callable[[Any], Any] | None = None,
    wait_previous: bool | None = None,
) -> Callable:
    """Make one worker's training step a jitted data-parallel step over ``mesh``.

    Args:
      fn: the step of one worker, ``fn(*args) -> outputs``, written as for a
        single device (params, optimizer state, batch, ...). Call as
        ``data_parallel(fn, mesh)`` or decorate with ``@data_parallel(mesh)``.
      mesh: the device mesh (``jax.make_mesh``; Auto or Explicit axes).
      axis_name: the mesh axis of the workers (the jaxcomm transforms' axis).
      batch_argnums: positions of the arguments split over workers along
        their leading axis (default: the last argument).
      mean_outputs: positions in the output tuple (or ``-1`` for a single
        output) whose floating leaves are averaged over workers, e.g. the
        loss; other outputs that are not jaxcomm state must already be equal
        on every worker (what a jaxcomm transform's update makes them).
      donate_argnums: arguments whose buffers may be reused (``jax.jit``'s).
      worker_mask: ``tree -> tree of bools`` marking the per-worker leaves of
        an argument or output; default: the leaves inside a jaxcomm state
        (:func:`state_mask`). :mod:`jaxcomm.flax` passes one for nnx.
      wait_previous: wait for the previous step before dispatching the next
        (see the module docstring); ``None``: exactly on XLA:CPU with several
        devices in this process.

    Returns:
      ``step(*args) -> outputs`` on global arrays: jaxcomm state with its
      worker axis, the batch whole, the rest replicated (see the module
      docstring for the layout and the checks).
    """
    if isinstance(fn, Mesh):  # @data_parallel(mesh)
        fn, mesh = None, fn
    if mesh is None:
        raise ValueError("data_parallel: mesh is required, e.g. jax.make_mesh((8,), ('data',))")
    if fn is None:
        return functools.partial(
            data_parallel,
            mesh=mesh,
            axis_name=axis_name,
            batch_argnums=batch_argnums,
            mean_outputs=mean_outputs,
            donate_argnums=donate_argnums,
            worker_mask=worker_mask,
            wait_previous=wait_previous,
        )
    mask_of = worker_mask or state_mask
    n = axis_size(mesh, axis_name)
    one_in_flight = wait_previous
    if one_in_flight is None:
        one_in_flight = mesh.devices.flat[0].platform == "cpu" and len(mesh.local_devices) > 1
    compiled: dict[Any, Callable] = {}
    last: list[Any] = [None]

    def build(args, masks, batch):
        in_specs = _specs(masks, batch, axis_name)

        def local(*local_args):
            local_args = tuple(
                jax.tree.map(lambda x, m: x[0] if m else x, a, mk)
                for a, mk in zip(local_args, masks)
            )
            out = fn(*local_args)
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            means = {k % len(outs) for k in mean_outputs}
            outs = tuple(
                jax.tree.map(
                    lambda x, m, avg=k in means: (
                        x[None]
                        if m
                        else (jax.lax.pmean(x, axis_name) if avg and _floating(x) else x)
                    ),
                    o,
                    mask_of(o),
                )
                for k, o in enumerate(outs)
            )
            return outs[0] if single else outs

        def out_specs_of(shapes):
            shapes = shapes if isinstance(shapes, tuple) else (shapes,)
            return tuple(jax.tree.map(lambda m: P(axis_name) if m else P(), mask_of(o))
                         for o in shapes)  # fmt: skip

        # the output layout follows from the step's output tree: trace it once
        probe = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(),
                              check_vma=False)  # fmt: skip
        shapes = jax.eval_shape(probe, *args)
        specs = out_specs_of(shapes)
        specs = specs if isinstance(shapes, tuple) else specs[0]
        mapped = jax.shard_map(
            local, mesh=mesh, in_specs=in_specs, out_specs=specs, check_vma=False
        )
        return jax.jit(mapped, donate_argnums=tuple(donate_argnums))

    def step(*args):
        batch = {k % len(args) for k in batch_argnums}
        masks = tuple(mask_of(a) for a in args)
        if not any(any(jax.tree.leaves(m)) for m in masks):
            raise ValueError(
                "data_parallel: no jaxcomm transform's state among the step's arguments, so "
                "nothing would exchange the gradients and the workers would drift apart; "
                f"put a jaxcomm transform with axis_name={axis_name!r} first in the optimizer "
                "chain and pass its state (jaxcomm.init_state)"
            )
        _check_inputs(args, masks, batch, n, axis_name)
        args = _place(args, masks, batch, mesh, axis_name)
        leaves = jax.tree.leaves(args)
        shapes = tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)
        key = (jax.tree.structure(args), tuple(sorted(batch)), shapes)
        if key not in compiled:
            compiled[key] = build(args, masks, batch)
        if one_in_flight and last[0] is not None:
            jax.block_until_ready(last[0])
        out = compiled[key](*args)
        last[0] = out if one_in_flight else None
        return out

    return step


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)
