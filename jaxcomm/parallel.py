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
* the **batch** arguments are split over workers along their leading axis
  (the global batch). Unless ``batch_argnums`` names them, they are found:
  the arguments whose array leaves share one leading size divisible by
  ``n``, that hold no per-worker state and no PRNG key, and that the step
  does not return (params and state come back, data does not). None, or
  candidates of different sizes, is an error naming the parameters;
* **everything else** (params, the other optimizer state, step counters) is
  replicated.

Inside the step each worker sees its own slice without the worker axis, and
gradients are per worker: the step runs under ``shard_map(check_vma=False)``
(pmap's semantics), so ``jax.grad`` of a replicated param does not insert
the dense all-reduce JAX adds under type checking, and the jaxcomm
transform does the only exchange. Outputs named in ``mean_outputs`` (e.g.
the loss) have their floating leaves averaged over workers; so have leaves
under a ``batch_stats`` key (linen's BatchNorm statistics) unless
``batch_stats="per_worker"``. PRNG keys handed to the step are folded with
the worker index (``fold_keys``), so each worker draws its own dropout.

Checks made before anything runs, each naming the leaf (by the step's
parameter names) and the fix: per-worker state without the worker axis
(state not built with :func:`init_state`), a batch whose leading axis does
not divide over the workers, a step with no jaxcomm state among its
arguments (gradients would not be exchanged), the parameter-averaging
wrappers (``local_sgd``, ``diloco``, ``zero_one_adam``), whose params are
per worker and need a hand-written step, a transform whose ``axis_name`` is
not the mesh's, and (:mod:`jaxcomm.divergence`, a walk over the traced step)
an output returned as replicated but computed from the batch without an
exchange, or a collective under a branch whose predicate comes from the
batch (``optax.apply_if_finite`` around a compressor).

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
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import collectives, divergence

__all__ = [
    "axis_size",
    "data_parallel",
    "init_state",
    "is_worker_state",
    "leaf_name",
    "param_names",
    "per_worker",
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


def param_names(fn: Callable, n_args: int) -> tuple[str, ...]:
    """The names of ``fn``'s first ``n_args`` positional parameters (``argument i`` if unknown)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            names += [f"{p.name}[{j}]" for j in range(n_args - len(names))]
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    names += [f"argument {i}" for i in range(len(names), n_args)]
    return tuple(names[:n_args])


def leaf_name(name: str, path) -> str:
    """``name`` and a tree path as the user writes it: ``opt_state[0].count``."""
    path = tuple(path)
    if not name and path and isinstance(getattr(path[0], "key", None), str):
        name, path = path[0].key, path[1:]  # a dict of named arguments (jaxcomm.flax)
    where = name + jax.tree_util.keystr(path)
    return where.removesuffix(".value")  # a flax nnx Variable's value


def _is_batch_stats(path) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) == "batch_stats" for k in path)


def _key_kind(name: str, x) -> str | bool:
    """``"typed"`` for a PRNG key array, ``"raw"`` for a uint32 ``(..., 2)`` leaf named like
    a key (``rng``, ``key``), else False."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "typed"
    lowered = name.lower()
    raw = dtype == jnp.uint32 and jnp.shape(x)[-1:] == (2,)
    return "raw" if raw and ("rng" in lowered or "key" in lowered) else False


def _fold(x, index, kind):
    keys = jax.random.wrap_key_data(x) if kind == "raw" else x
    flat = keys.reshape(-1)
    folded = jax.vmap(lambda k: jax.random.fold_in(k, index))(flat).reshape(keys.shape)
    return jax.random.key_data(folded) if kind == "raw" else folded


def _aval(x, spec, mesh):
    x = x if hasattr(x, "dtype") and hasattr(x, "shape") else jnp.asarray(x)
    dtype = x.dtype
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    return jax.ShapeDtypeStruct(jnp.shape(x), dtype, sharding=NamedSharding(mesh, spec))


def _signature(tree):
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple((tuple(jnp.shape(x)), str(getattr(x, "dtype", ""))) for x in leaves)


def _check_worker_axes(args, masks, names, n, hint):
    for name, arg, mask in zip(names, args, masks):
        paths = jax.tree_util.tree_leaves_with_path(arg)
        for (path, x), per_worker in zip(paths, jax.tree.leaves(mask)):
            shape = jnp.shape(x)
            if per_worker and (not shape or shape[0] != n):
                raise ValueError(
                    f"{leaf_name(name, path)}: per-worker state needs a leading worker axis of "
                    f"size {n}; got shape {shape}. {hint(path)}, and return the state the step "
                    "gave back unchanged in layout"
                )


def _resolve_batch(batch_argnums, names, args, masks, n, axis_name):
    """The positions of ``batch_argnums`` (ints or parameter names), each checked."""
    if not batch_argnums:
        raise ValueError(
            "data_parallel: batch_argnums is empty, so no argument would be split over the "
            "workers; name the batch, e.g. batch_argnums=('batch',)"
        )
    batch = set()
    for b in batch_argnums:
        if isinstance(b, str):
            if b not in names:
                raise ValueError(f"batch_argnums: {b!r} is not a parameter of the step "
                                 f"({', '.join(names)})")  # fmt: skip
            batch.add(names.index(b))
        elif not -len(args) <= b < len(args):
            raise ValueError(f"batch_argnums: {b} is out of range for the {len(args)} arguments "
                             f"({', '.join(names)})")  # fmt: skip
        else:
            batch.add(b % len(args))
    for i in sorted(batch):
        if any(jax.tree.leaves(masks[i])):
            raise ValueError(f"batch_argnums: {names[i]!r} holds per-worker state (a jaxcomm "
                             "transform's), not the batch")  # fmt: skip
        if not jax.tree.leaves(args[i]):
            raise ValueError(f"batch_argnums: {names[i]!r} holds no arrays to split")
        for path, x in jax.tree_util.tree_leaves_with_path(args[i]):
            shape = jnp.shape(x)
            if not shape or shape[0] % n:
                raise ValueError(
                    f"{leaf_name(names[i], path)}: a batch argument needs a leading axis "
                    f"divisible by the {n} workers of axis {axis_name!r}; got shape {shape}"
                )
    return batch


def _find_batch(args, masks, keys, names, outputs, n, axis_name):
    """The batch: the arguments whose array leaves share one leading size divisible by ``n``,
    that hold no per-worker state and no PRNG key and that the step does not return."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    returned = {_signature(o) for o in outputs}
    why, sizes = {}, {}
    for i, (arg, mask, key) in enumerate(zip(args, masks, keys)):
        leaves = jax.tree.leaves(arg)
        firsts = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
        if any(jax.tree.leaves(mask)):
            why[i] = "holds per-worker state"
        elif not leaves:
            why[i] = "holds no arrays"
        elif _signature(arg) in returned:
            why[i] = "is returned by the step (state, not data)"
        elif any(jax.tree.leaves(key)):
            why[i] = "holds a PRNG key"
        elif None in firsts:
            why[i] = "has a scalar leaf"
        elif len(firsts) > 1:
            why[i] = f"has leaves of different leading sizes {sorted(firsts)}"
        else:
            sizes[i] = firsts.pop()
    fix = "pass batch_argnums=('<the batch parameter>',)"
    if not sizes:
        reasons = "; ".join(f"{names[i]!r} {w}" for i, w in why.items())
        raise ValueError(f"data_parallel: no argument of the step looks like the batch to split "
                         f"over the {n} workers ({reasons}); {fix}")  # fmt: skip
    if len(set(sizes.values())) > 1:
        found = ", ".join(f"{names[i]!r} (leading size {s})" for i, s in sizes.items())
        raise ValueError(f"data_parallel: cannot tell which argument is the batch: {found} "
                         f"could each be; {fix}")  # fmt: skip
    return _resolve_batch(tuple(sizes), names, args, masks, n, axis_name)


def _check_replicated(traced, flat_batch, out_specs, out_names, axis_name, mean_hint):
    """Raise for a replicated output computed from the batch without an exchange, and for a
    collective under a branch that differs between workers (:mod:`jaxcomm.divergence`)."""
    varies, findings = divergence.check(traced.jaxpr, flat_batch, axis_name)
    for f in findings:
        raise ValueError(
            f"data_parallel: a collective ({f.collective} over {axis_name!r}) runs inside a "
            f"lax.{f.control} whose predicate comes from this worker's batch, so workers that "
            "decide otherwise never reach it (XLA:CPU aborts, NCCL hangs). optax.apply_if_finite "
            "around a jaxcomm transform does this: wrap the chain in jaxcomm.skip_nonfinite(...) "
            "instead, which decides after the exchange, alike on every worker"
        )
    for v, spec, (name, is_key) in zip(varies, out_specs, out_names):
        if v and spec == P():
            fix = (
                "a PRNG key the step derived from a key it was handed, which the helper folds "
                "with the worker index: split keys outside the step (or fold_keys=False)"
                if is_key
                else "a gradient leaf that no jaxcomm transform exchanges (e.g. left out by "
                "optax.masked or optax.partition): exchange it too, e.g. optax.masked("
                f"jaxcomm.allreduce(axis_name={axis_name!r}), <the leaves left out>); "
                f"a per-worker value such as a loss or a statistic: {mean_hint}"
            )
            raise ValueError(
                f"data_parallel: {name} is returned as replicated (one value for all workers) "
                "but is computed from this worker's batch (or index) without an exchange, so "
                f"the copies would differ. If it is {fix}"
            )


def _outputs_named(shapes, args, names, masks):
    """Per flat output leaf: (its name, whether it is a PRNG key). An output is named after
    the one argument it matches (its tree; and leaf shapes, unless it holds per-worker state)."""
    outs = shapes if isinstance(shapes, tuple) else (shapes,)

    def matches(o, a, m):
        if any(jax.tree.leaves(m)):
            return jax.tree.structure(o) == jax.tree.structure(a)
        return _signature(o) == _signature(a)

    named = []
    for k, o in enumerate(outs):
        found = [n for n, a, m in zip(names, args, masks) if matches(o, a, m)]
        base = found[0] if len(found) == 1 else "the output" if len(outs) == 1 else f"output {k}"
        for path, x in jax.tree_util.tree_leaves_with_path(o):
            named.append((leaf_name(base, path), _key_kind("key", x) == "typed"))
    return named


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


def data_parallel(
    fn: Callable | None = None,
    mesh: Mesh | None = None,
    *,
    axis_name: str = "data",
    batch_argnums: Sequence[int | str] | None = None,
    mean_outputs: Sequence[int] = (),
    batch_stats: str = "mean",
    fold_keys: bool = True,
    donate_argnums: Sequence[int] = (),
    worker_mask: Callable[[Any], Any] | None = None,
    names: Sequence[str] | None = None,
    wait_previous: bool | None = None,
) -> Callable:
    """Make one worker's training step a jitted data-parallel step over ``mesh``.

    Args:
      fn: the step of one worker, ``fn(*args) -> outputs``, written as for a
        single device (params, optimizer state, batch, ...). Call as
        ``data_parallel(fn, mesh)`` or decorate with ``@data_parallel(mesh)``.
      mesh: the device mesh (``jax.make_mesh``; Auto or Explicit axes).
      axis_name: the mesh axis of the workers (the jaxcomm transforms' axis).
      batch_argnums: the arguments split over workers along their leading
        axis, by position or parameter name; ``None`` (default): found (see
        the module docstring), an error if it cannot tell.
      mean_outputs: positions in the output tuple (or ``-1`` for a single
        output) whose floating leaves are averaged over workers, e.g. the
        loss. Any other output that is not per-worker state must be the same
        on every worker: one computed from the batch without an exchange is
        an error before the step runs.
      batch_stats: ``"mean"`` (default): floating leaves under a
        ``batch_stats`` key (linen's BatchNorm statistics) in the outputs are
        averaged over workers after each step; ``"per_worker"``: they are kept
        per worker, with a leading worker axis (:func:`per_worker`).
      fold_keys: fold every PRNG key handed to the step (typed keys, and
        uint32 ``(..., 2)`` leaves whose name says ``rng`` or ``key``) with
        the worker index, so that dropout differs between workers; a key
        returned unchanged comes back as it was handed in.
      donate_argnums: arguments whose buffers may be reused (``jax.jit``'s).
      worker_mask: ``tree -> tree of bools`` marking the per-worker leaves of
        an argument or output; default: the leaves inside a jaxcomm state
        (:func:`state_mask`). :mod:`jaxcomm.flax` passes one for nnx.
      names: the names of ``fn``'s arguments in error messages; default:
        its signature's.
      wait_previous: wait for the previous step before dispatching the next
        (see the module docstring); ``None``: exactly on XLA:CPU with several
        devices in this process.

    Returns:
      ``step(*args) -> outputs`` on global arrays: per-worker state with its
      worker axis, the batch whole, the rest replicated (see the module
      docstring for the layout and the checks).
    """
    if isinstance(fn, Mesh):  # @data_parallel(mesh)
        fn, mesh = None, fn
    if mesh is None:
        raise ValueError("data_parallel: mesh is required, e.g. jax.make_mesh((8,), ('data',))")
    if batch_stats not in ("mean", "per_worker"):
        raise ValueError(f"batch_stats: expected 'mean' or 'per_worker', got {batch_stats!r}")
    options = dict(axis_name=axis_name, batch_argnums=batch_argnums, mean_outputs=mean_outputs,
                   batch_stats=batch_stats, fold_keys=fold_keys, donate_argnums=donate_argnums,
                   worker_mask=worker_mask, names=names, wait_previous=wait_previous)  # fmt: skip
    if fn is None:
        return functools.partial(data_parallel, mesh=mesh, **options)
    n = axis_size(mesh, axis_name)
    state_of = worker_mask or state_mask

    def mask_of(tree):  # per-worker leaves
        if batch_stats == "mean":
            return state_of(tree)
        bs = jax.tree_util.tree_map_with_path(lambda p, _: _is_batch_stats(p), tree)
        return jax.tree.map(lambda a, b: a or b, state_of(tree), bs)

    def hint(path):
        if _is_batch_stats(path):
            return (
                "Lay out per-worker batch statistics with jaxcomm.parallel.per_worker(tree, mesh)"
            )
        return "Build the optimizer state with jaxcomm.init_state(tx, params, mesh)"

    one_in_flight = wait_previous
    if one_in_flight is None:
        one_in_flight = mesh.devices.flat[0].platform == "cpu" and len(mesh.local_devices) > 1
    compiled: dict[Any, tuple[set[int], Callable]] = {}
    last: list[Any] = [None]

    def make_local(masks, keys):
        def local(*local_args):
            index = jax.lax.axis_index(axis_name)
            handed: dict[int, Any] = {}  # id of a folded key -> the key as handed in

            def enter(x, per_worker, key):
                if per_worker:
                    return x[0]
                if key:
                    folded = _fold(x, index, key)
                    handed[id(folded)] = x
                    return folded
                return x

            local_args = tuple(jax.tree.map(enter, *t) for t in zip(local_args, masks, keys))
            out = fn(*local_args)
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            means = {k % len(outs) for k in mean_outputs}

            def leave(path, x, per_worker, avg):
                if per_worker:
                    return x[None]
                if id(x) in handed:
                    return handed[id(x)]
                if (avg or _is_batch_stats(path)) and _floating(x):
                    return jax.lax.pmean(x, axis_name)
                return x

            outs = tuple(
                jax.tree_util.tree_map_with_path(
                    functools.partial(leave, avg=k in means), o, mask_of(o)
                )
                for k, o in enumerate(outs)
            )
            return outs[0] if single else outs

        return local

    def trace_errors(e):
        bound = getattr(e, "axis_name", None)
        return ValueError(
            f"{e}\ndata_parallel runs the step over the mesh axes {tuple(mesh.axis_names)} "
            f"(workers on axis_name={axis_name!r})"
            + (f"; build the transform with axis_name={axis_name!r}" if bound else "")
        )

    def build(args, masks, keys, arg_names):
        spec = lambda m, batch=False: P(axis_name) if m or batch else P()  # noqa: E731
        local = make_local(masks, keys)

        def avals(batch):
            return tuple(
                jax.tree.map(lambda x, m, b=i in batch: _aval(x, spec(m, b), mesh), a, mk)
                for i, (a, mk) in enumerate(zip(args, masks))
            )

        def in_specs(batch):
            return tuple(jax.tree.map(lambda m, b=i in batch: spec(m, b), mk)
                         for i, mk in enumerate(masks))  # fmt: skip

        # the outputs' tree, traced with nothing split: their layout, and which arguments
        # come back (state, not the batch)
        probe = jax.shard_map(local, mesh=mesh, in_specs=in_specs(()), out_specs=P(),
                              check_vma=False)  # fmt: skip
        try:
            shapes = jax.eval_shape(probe, *avals(()))
        except (collectives.UnboundAxisError, NameError) as e:
            raise trace_errors(e) from None
        if batch_argnums is None:
            batch = _find_batch(args, masks, keys, arg_names, shapes, n, axis_name)
        else:
            batch = _resolve_batch(batch_argnums, arg_names, args, masks, n, axis_name)
        outs = shapes if isinstance(shapes, tuple) else (shapes,)
        specs = tuple(jax.tree.map(spec, mask_of(o)) for o in outs)
        specs = specs if isinstance(shapes, tuple) else specs[0]
        mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs(batch), out_specs=specs,
                               check_vma=False)  # fmt: skip
        jitted = jax.jit(mapped, donate_argnums=tuple(donate_argnums))
        traced = jitted.trace(*avals(batch))
        flat_batch = [i in batch for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
        _check_replicated(
            traced, flat_batch, jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
            _outputs_named(shapes, args, arg_names, masks), axis_name,
            "average it over workers (mean_outputs=, or jax.lax.pmean in the step)",
        )  # fmt: skip
        return batch, jitted

    def step(*args):
        arg_names = tuple(names) if names is not None else param_names(fn, len(args))
        state_masks = tuple(state_of(a) for a in args)
        if not any(any(jax.tree.leaves(m)) for m in state_masks):
            raise ValueError(
                "data_parallel: no jaxcomm transform's state among the step's arguments, so "
                "nothing would exchange the gradients and the workers would drift apart; "
                f"put a jaxcomm transform with axis_name={axis_name!r} first in the optimizer "
                "chain and pass its state (jaxcomm.init_state)"
            )
        masks = tuple(mask_of(a) for a in args)
        leaves = jax.tree.leaves(args)
        cache_key = (
            jax.tree.structure(args),
            tuple((jnp.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves),
        )
        if cache_key not in compiled:
            _check_worker_axes(args, masks, arg_names, n, hint)
            keys = tuple(
                jax.tree_util.tree_map_with_path(
                    lambda p, x, m, name=name: (
                        fold_keys and not m and _key_kind(leaf_name(name, p), x)
                    ),
                    a,
                    mk,
                )
                for name, a, mk in zip(arg_names, args, masks)
            )
            compiled[cache_key] = build(args, masks, keys, arg_names)
        batch, run = compiled[cache_key]
        args = _place(args, masks, batch, mesh, axis_name)
        if one_in_flight and last[0] is not None:
            jax.block_until_ready(last[0])
        out = run(*args)
        last[0] = out if one_in_flight else None
        return out

    return step


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)
