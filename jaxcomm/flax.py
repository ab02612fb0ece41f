"""Flax nnx: the data-parallel step for an ``nnx.Optimizer`` loop (imports flax; optional).

A plain optax loop and a linen ``TrainState`` loop use
:func:`jaxcomm.data_parallel` directly (a ``TrainState`` is a pytree). An nnx
loop mutates its model, optimizer and metrics in place; this module makes
such a step data-parallel. The change to the official Flax nnx MNIST
example (``examples/mnist``: a CNN with BatchNorm and Dropout) is six lines:

    import jaxcomm.flax                                                    # +
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))     # + the workers
    tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.adamw(lr, momentum))  # +
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)                    # ~ tx
    jaxcomm.flax.init_optimizer(optimizer, mesh)                           # + worker axis

    @jaxcomm.flax.data_parallel(mesh)                                      # ~ was @nnx.jit
    def train_step(model, optimizer, metrics, batch, rngs):  # unchanged
        ...

With ``jax.make_mesh``'s default Explicit axes, a seventh line,
``jax.set_mesh(mesh)``, sets the mesh for the eager code after the step
(``metrics.reset()``, evaluation); the step refuses to run without it.

The rules are :mod:`jaxcomm.parallel`'s, for the state of the nnx objects
among the step's arguments:

* the jaxcomm part of an optimizer's state is per worker (a leading worker
  axis, added by :func:`init_optimizer`);
* the batch is found among the arguments that are not nnx objects (or named
  by ``batch_argnums``) and split over workers;
* ``nnx.BatchStat`` variables (BatchNorm's running statistics) are averaged
  over workers after each step (``batch_stats="per_worker"`` keeps them per
  worker, laid out by :func:`init_per_worker`);
* the keys of ``nnx.Rngs`` (and every PRNG key handed to the step) are folded
  with the worker index inside the step, so each worker draws its own
  dropout masks; the keys come back unchanged (the stream counters advance
  as on one device), so a run is reproducible from its seed;
* ``nnx.metrics.Average`` (and ``Accuracy``) sum their totals and counts over
  workers, so they describe the global batch; other ``nnx.Metric`` state
  averages its floating leaves;
* everything else is replicated, and checked to be: a value computed from
  the batch without an exchange is an error before the step runs.

Sharded (FSDP, :func:`jaxcomm.fsdp`): :func:`fsdp` shards an nnx model's
parameters and the optimizer state over the workers. Three lines replace the
``nnx.Optimizer`` and the jitted step (``loss_fn(model, batch) -> loss``):

    trainer, state = jaxcomm.flax.fsdp(model, loss_fn, optax.adamw(lr), mesh)  # +
    for batch in batches:
        state, loss = trainer.step(state, batch)          # ~ was train_step(...)
    jaxcomm.flax.fsdp_update(model, trainer, state)       # + the model, gathered

A linen ``TrainState`` needs no adapter: ``jaxcomm.fsdp(loss_fn, state.tx,
mesh)`` with ``loss_fn(params, batch)`` calling ``state.apply_fn``,
``trainer.init(state.params)``, and ``state.replace(params=trainer.params(s))``
to evaluate (save the sharded state itself: ``trainer.load`` restores it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import graph
from jax.sharding import AxisType, Mesh

from jaxcomm import parallel

__all__ = ["data_parallel", "fsdp", "fsdp_update", "init_optimizer", "init_per_worker"]


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


def _variables(nodes, kind) -> dict[int, tuple[str, nnx.Variable]]:
    """id -> (path, Variable) for the Variables of type ``kind`` reachable from ``nodes``."""
    found = {}
    for path, node in nnx.iter_graph(nodes):
        if isinstance(node, kind):
            found[id(node)] = ("".join(f".{p}" if isinstance(p, str) else f"[{p}]"
                                       for p in path), node)  # fmt: skip
    return found


_TAG = "jaxcomm_per_worker"  # Variable metadata: laid out with a worker axis


def _lay_out(variables, mesh, axis_name) -> None:
    for var in variables:
        if not var.get_metadata().get(_TAG):
            var.set_value(parallel.per_worker(var.get_value(), mesh, axis_name=axis_name))
            var.set_metadata(_TAG, True)


def init_optimizer(optimizer: nnx.Optimizer, mesh: Mesh, *, axis_name: str = "data") -> None:
    """Give the jaxcomm part of ``optimizer``'s state a leading worker axis, in place.

    Call once after building ``nnx.Optimizer(model, tx, ...)``; a checkpoint
    restored into an optimizer laid out this way keeps the layout.
    """
    parallel.axis_size(mesh, axis_name)
    parallel.state_mask(optimizer.opt_state)  # raises for local_sgd / diloco
    ids = _worker_variables(optimizer)
    leaves = jax.tree.leaves(optimizer.opt_state, is_leaf=_is_var)
    _lay_out([v for v in leaves if _is_var(v) and id(v) in ids], mesh, axis_name)


def init_per_worker(
    node: Any, mesh: Mesh, *, kind: type = nnx.BatchStat, axis_name: str = "data"
) -> None:
    """Give every ``kind`` Variable of ``node`` a leading worker axis, in place.

    For ``data_parallel(..., batch_stats="per_worker")``: each worker keeps
    its own BatchNorm statistics. Evaluate with one worker's copy (e.g.
    ``nnx.state(model, nnx.BatchStat)`` indexed ``[0]``).
    """
    parallel.axis_size(mesh, axis_name)
    _lay_out([v for _, v in _variables(node, kind).values()], mesh, axis_name)


def _mesh_context(mesh: Mesh) -> None:
    explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
    if explicit and jax.sharding.get_abstract_mesh() != mesh.abstract_mesh:
        raise ValueError(
            f"jaxcomm.flax.data_parallel: the mesh has Explicit axes {tuple(mesh.axis_names)} "
            "(jax.make_mesh's default) and is not the current mesh, so eager code after the "
            "step (metrics.reset(), evaluation) would fail with a device-assignment error. "
            "Run the training loop under `with jax.set_mesh(mesh):`, or make the mesh with "
            "axis_types=(jax.sharding.AxisType.Auto,)"
        )


def _sync(nodes, before, axis_name, batch_stats: str) -> None:
    """Metrics summed (Average) or averaged over workers; BatchStat averaged (``"mean"``)."""
    graph_nodes = dict(nnx.iter_graph(nodes))
    for path, var in graph_nodes.items():
        if not _is_var(var) or not hasattr(var.get_value(), "dtype"):
            continue
        owner, x = graph_nodes.get(path[:-1]), var.get_value()
        floating = jnp.issubdtype(jnp.result_type(x), jnp.inexact)
        if isinstance(owner, nnx.metrics.Average):  # sums: total and count over the workers
            var.set_value(before[id(var)] + jax.lax.psum(x - before[id(var)], axis_name))
        elif floating and isinstance(owner, nnx.Metric):
            var.set_value(jax.lax.pmean(x, axis_name))
        elif floating and isinstance(var, nnx.BatchStat) and batch_stats == "mean":
            var.set_value(jax.lax.pmean(x, axis_name))


def data_parallel(
    fn: Callable | None = None,
    mesh: Mesh | None = None,
    *,
    axis_name: str = "data",
    batch_argnums: Sequence[int | str] | None = None,
    batch_stats: str = "mean",
    fold_keys: bool = True,
    check_replicas: bool = False,
) -> Callable:
    """Make an nnx training step (mutating its nnx arguments) data-parallel over ``mesh``.

    Args:
      fn: ``fn(model, optimizer, metrics, batch, rngs) -> aux`` (any order), one
        worker's step as written for ``nnx.jit``, updating its nnx arguments in
        place. Call as ``data_parallel(fn, mesh)`` or decorate: ``@data_parallel(mesh)``.
      mesh: the device mesh. With Explicit axes, call the step (and the eager
        code after it) under ``jax.set_mesh(mesh)``.
      axis_name: the mesh axis of the workers.
      batch_argnums: the arguments split over workers, by position or name;
        ``None`` (default): those that are not nnx objects (never the batch)
        and whose arrays share a leading batch axis (an error if ambiguous).
      batch_stats: ``"mean"`` (default) averages ``nnx.BatchStat`` over
        workers after each step; ``"per_worker"`` keeps them per worker
        (lay them out with :func:`init_per_worker`).
      fold_keys: fold the keys of ``nnx.Rngs`` (and any PRNG key argument) with the worker index.
      check_replicas: a debug mode: compare the device copies of every
        replicated Variable after each step (see :func:`jaxcomm.data_parallel`).

    Returns:
      ``step(*args) -> aux``: updates the nnx arguments like ``fn`` and
      returns ``fn``'s output (floating leaves averaged over workers).

    Example:
      >>> @jaxcomm.flax.data_parallel(mesh)
      ... def train_step(model, optimizer, metrics, batch, rngs):
      ...     (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
      ...         model, batch, rngs)
      ...     metrics.update(loss=loss, logits=logits, labels=batch["label"])
      ...     optimizer.update(model, grads)
    """
    if isinstance(fn, Mesh):
        fn, mesh = None, fn
    options = dict(axis_name=axis_name, batch_argnums=batch_argnums, batch_stats=batch_stats,
                   fold_keys=fold_keys, check_replicas=check_replicas)  # fmt: skip
    if fn is None:
        return lambda f: data_parallel(f, mesh, **options)
    if mesh is None:
        raise ValueError("data_parallel: mesh is required, e.g. jax.make_mesh((8,), ('data',))")
    if batch_stats not in ("mean", "per_worker"):
        raise ValueError(f"batch_stats: expected 'mean' or 'per_worker', got {batch_stats!r}")
    n = parallel.axis_size(mesh, axis_name)
    compiled: dict[Any, Callable] = {}

    def step(*args):
        _mesh_context(mesh)
        names = parallel.param_names(fn, len(args))
        pos = [i for i, a in enumerate(args) if graph.is_graph_node(a)]
        _check_nnx_batch(batch_argnums, names, args, pos)
        nodes = {names[i]: args[i] for i in pos}
        ids = _worker_variables(nodes)
        stats = _variables(nodes, nnx.BatchStat) if batch_stats == "per_worker" else {}
        _check_layout(nodes, ids, set(stats), n)
        graphdef, state = nnx.split(nodes)
        mask = _worker_mask(state, ids, set(stats))
        rest_pos = [i for i in range(len(args)) if i not in pos]
        batch = _batch_positions(batch_argnums, names, len(args), rest_pos)
        key = (graphdef, batch, tuple(names))
        if key not in compiled:
            pure = _pure_step(fn, graphdef, names, pos, len(args), axis_name, batch_stats)
            compiled[key] = parallel.data_parallel(
                pure, mesh, axis_name=axis_name, batch_argnums=batch, mean_outputs=(1,),
                worker_mask=mask, fold_keys=fold_keys, check_replicas=check_replicas,
                names=("", *(names[i] for i in rest_pos)),
            )  # fmt: skip
        new_state, out = compiled[key](state, *(args[i] for i in rest_pos))
        nnx.update(nodes, new_state)
        return out

    return step


def _check_nnx_batch(batch_argnums, names, args, pos) -> None:
    """Refuse a ``batch_argnums`` entry that names an nnx object (state, not the batch)."""
    for b in batch_argnums or ():
        i = names.index(b) if isinstance(b, str) and b in names else b
        if isinstance(i, int) and -len(args) <= i < len(args) and i % len(args) in pos:
            raise ValueError(
                f"batch_argnums: {names[i]!r} is an nnx.{type(args[i]).__name__}, which is "
                "state, not the batch; name the argument that holds the data"
            )


def _check_layout(nodes, ids, stat_ids, n: int) -> None:
    """Refuse per-worker Variables (``ids``: optimizer state, ``stat_ids``: per-worker
    BatchStat) without the leading worker axis of size ``n``, naming the init to call."""
    found = _variables(nodes, nnx.Variable)
    for i in sorted(ids | stat_ids, key=lambda i: found[i][0]):
        path, var = found[i]
        if not jax.tree.leaves(var.get_value()):  # e.g. optax.masked's MaskedNode
            continue
        shape = jnp.shape(var.get_value())
        if not var.get_metadata().get(_TAG) or not shape or shape[0] != n:
            owner = path.lstrip(".").split(".")[0].split("[")[0]
            fix = "init_optimizer(optimizer" if i in ids else f"init_per_worker({owner}"
            raise ValueError(
                f"{path.lstrip('.')}: per-worker state needs a leading worker axis of size "
                f"{n}; got shape {shape}. Call jaxcomm.flax.{fix}, mesh) once after "
                "building it"
            )


def _worker_mask(state, ids, stat_ids) -> Callable:
    """The ``worker_mask`` of :func:`jaxcomm.data_parallel` for the split nnx ``state``: True
    at the leaves of the Variables in ``ids`` or ``stat_ids``, False for any other tree."""
    flags = jax.tree.map(lambda v: jax.tree.map(lambda _: id(v) in ids | stat_ids, v),
                         state, is_leaf=_is_var)  # fmt: skip
    paths = {p for p, f in jax.tree_util.tree_leaves_with_path(flags) if f}
    structure = jax.tree.structure(state)

    def mask(tree):
        if jax.tree.structure(tree) != structure:
            return jax.tree.map(lambda _: False, tree)
        return jax.tree_util.tree_map_with_path(lambda p, _: p in paths, tree)

    return mask


def _batch_positions(batch_argnums, names, n_args: int, rest_pos) -> tuple[int, ...] | None:
    """``batch_argnums`` as positions among the pure step's arguments (state first)."""
    if batch_argnums is None:
        return None
    where = [names.index(b) if isinstance(b, str) else b % n_args for b in batch_argnums]
    return tuple(1 + rest_pos.index(i) for i in where)


def _pure_step(fn, graphdef, names, pos, n_args: int, axis_name: str, batch_stats: str):
    """``fn`` as a pure function ``(state, *rest) -> (new state, out)`` of the nnx objects'
    state (merged into ``graphdef``) and the other arguments, metrics and BatchStat synced."""

    def pure(state, *rest):
        objs = nnx.merge(graphdef, state)
        before = {id(v): v.get_value() for _, v in nnx.iter_graph(objs) if _is_var(v)}
        rest_it = iter(rest)
        full = [objs[names[i]] if i in pos else next(rest_it) for i in range(n_args)]
        out = fn(*full)
        _sync(objs, before, axis_name, batch_stats)
        return nnx.state(objs), out

    return pure


def fsdp(
    model: nnx.Module,
    loss_fn: Callable[[nnx.Module, Any], Any],
    tx: Any,
    mesh: Mesh,
    *,
    wrt: Any = nnx.Param,
    **options: Any,
) -> tuple[parallel.Fsdp, parallel.FsdpState]:
    """Sharded data-parallel training of an nnx model: :func:`jaxcomm.fsdp`'s trainer and state.

    Args:
      model: the nnx module; its ``wrt`` variables are trained (the model is
        not changed until :func:`fsdp_update`).
      loss_fn: ``(model, batch) -> loss`` on one worker's slice of the batch
        (``(loss, aux)`` with ``has_aux=True``).
      tx: an element-wise optax optimizer (as :func:`jaxcomm.fsdp`).
      mesh: the device mesh.
      wrt: the variables trained and sharded (an nnx filter), default ``nnx.Param``.
      **options: :func:`jaxcomm.fsdp`'s (``axis_name``, ``weights``,
        ``gradients``, ``block_size``, ``has_aux``, ``replica_axis``).

    Returns:
      ``(trainer, state)``: ``trainer.step(state, batch)`` trains,
      ``trainer.params(state)`` gathers the ``wrt`` state.

    Raises:
      ValueError: at the first step (when it is traced), if the forward pass
        writes to a variable: the model's other state (BatchNorm statistics, an
        RNG stream's counter, a cache) is a constant of the sharded step and a
        ``wrt`` variable is the trainer's, so a write would be dropped. The
        variable is named. (``nnx.Intermediate`` values sown by the forward
        pass are dropped without complaint: they are outputs, not state.)

    The variables outside ``wrt`` are constants of the compiled step, whole on
    every worker (frozen weights under a LoRA-style ``wrt`` are not sharded).
    """
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def loss(p, batch):
        # fresh Variable objects over the same arrays (merge would share the model's)
        before = jax.tree.map(lambda x: x, rest)
        was = _leaves_by_path(p) | _leaves_by_path(before)  # the arrays, before the call
        m = nnx.merge(graphdef, p, before)
        out = loss_fn(m, batch)
        _, p_after, _, rest_after = nnx.split(m, wrt, nnx.Intermediate, ...)
        for path, new in (_leaves_by_path(p_after) | _leaves_by_path(rest_after)).items():
            if was.get(path) is not new:  # a variable the forward pass wrote (or added)
                raise ValueError(
                    f"model: the step writes {path}, which jaxcomm.flax.fsdp keeps as the "
                    "trainer's (the `wrt` variables) or as a constant (the rest): use a model "
                    "without BatchNorm statistics or RNG streams updated in the forward pass "
                    "(e.g. LayerNorm; dropout keys passed in the batch)"
                )
        return out

    trainer = parallel.fsdp(loss, tx, mesh, **options)
    return trainer, trainer.init(params)


def _leaves_by_path(state: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_leaves_with_path(state)}


def fsdp_update(
    model: nnx.Module, trainer: parallel.Fsdp, state: parallel.FsdpState, replica: int = 0
) -> None:
    """Write the trained variables (gathered from ``state``; with ``replica_axis``, those
    of replica ``replica``) into ``model``, in place."""
    nnx.update(model, trainer.params(state, replica))
