"""The data-parallel step: one worker's function under ``jax.shard_map``, checked, jitted."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import collectives, divergence
from jaxcomm.parallel.arguments import (
    check_worker_axes,
    find_batch,
    fold,
    is_batch_stats,
    key_kind,
    leaf_name,
    outputs_named,
    param_names,
    resolve_batch,
)
from jaxcomm.parallel.layout import axis_size, place, state_mask

__all__ = ["data_parallel"]


def _aval(x, spec, mesh):
    x = x if hasattr(x, "dtype") and hasattr(x, "shape") else jnp.asarray(x)
    dtype = x.dtype
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    return jax.ShapeDtypeStruct(jnp.shape(x), dtype, sharding=NamedSharding(mesh, spec))


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
                else "optax.MultiSteps' accumulator (each worker's own gradients, in state "
                "declared replicated): use jaxcomm.accumulate(tx, every=k), whose accumulator "
                "is per worker"
                if ".acc_grads" in name
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
    check_replicas: bool = False,
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
      check_replicas: a debug mode: after every step, compare each device's
        copy of every output returned as replicated (the copies this process
        holds) and raise naming the first leaf whose copies differ.
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
                   worker_mask=worker_mask, names=names, check_replicas=check_replicas,
                   wait_previous=wait_previous)  # fmt: skip
    if fn is None:
        return functools.partial(data_parallel, mesh=mesh, **options)
    runner = _Runner(fn, mesh, **options)

    def step(*args):
        return runner.step(*args)

    return step


def _hint(path) -> str:
    """How to lay out the per-worker state at ``path`` (for an argument without its axis)."""
    if is_batch_stats(path):
        return "Lay out per-worker batch statistics with jaxcomm.parallel.per_worker(tree, mesh)"
    if any(getattr(k, "name", None) == "opt_state" for k in path):  # a flax TrainState
        return (
            "Build the TrainState's optimizer state with "
            "state.replace(opt_state=jaxcomm.init_state(tx, params, mesh))"
        )
    return "Build the optimizer state with jaxcomm.init_state(tx, params, mesh)"


class _Runner:
    """What one :func:`data_parallel` step holds: its options, its compiled programs (one per
    argument layout) and, with ``wait_previous``, the previous step's outputs."""

    def __init__(
        self,
        fn,
        mesh,
        *,
        axis_name,
        batch_argnums,
        mean_outputs,
        batch_stats,
        fold_keys,
        donate_argnums,
        worker_mask,
        names,
        check_replicas,
        wait_previous,
    ):
        self.fn, self.mesh, self.axis_name, self.batch_argnums = fn, mesh, axis_name, batch_argnums
        self.mean_outputs, self.batch_stats, self.fold_keys = mean_outputs, batch_stats, fold_keys
        self.donate_argnums, self.names, self.check_replicas = donate_argnums, names, check_replicas
        self.n = axis_size(mesh, axis_name)
        self.state_of = worker_mask or state_mask
        one_in_flight = wait_previous
        if one_in_flight is None:
            one_in_flight = mesh.devices.flat[0].platform == "cpu" and len(mesh.local_devices) > 1
        self.one_in_flight = one_in_flight
        self.compiled: dict[Any, tuple[set[int], Callable, list[str]]] = {}  # batch, step, names
        self.last: Any = None

    def mask_of(self, tree):
        """The per-worker leaves of ``tree``: jaxcomm state (and per-worker batch stats)."""
        if self.batch_stats == "mean":
            return self.state_of(tree)
        bs = jax.tree_util.tree_map_with_path(lambda p, _: is_batch_stats(p), tree)
        return jax.tree.map(lambda a, b: a or b, self.state_of(tree), bs)

    def make_local(self, masks, keys):
        """One worker's step under ``shard_map``: per-worker state without its worker axis,
        keys folded with the worker index; outputs averaged where asked."""
        fn, axis_name, mean_outputs, mask_of = (
            self.fn,
            self.axis_name,
            self.mean_outputs,
            self.mask_of,
        )

        def local(*local_args):
            index = jax.lax.axis_index(axis_name)
            handed: dict[int, Any] = {}  # id of a folded key -> the key as handed in

            def enter(x, per_worker, key):
                if per_worker:
                    return x[0]
                if key:
                    folded = fold(x, index, key)
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
                if (avg or is_batch_stats(path)) and _floating(x):
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

    def trace_errors(self, e):
        """``e`` (raised while tracing the step) as a ValueError naming the mesh's axes."""
        bound = getattr(e, "axis_name", None)
        return ValueError(
            f"{e}\ndata_parallel runs the step over the mesh axes {tuple(self.mesh.axis_names)} "
            f"(workers on axis_name={self.axis_name!r})"
            + (f"; build the transform with axis_name={self.axis_name!r}" if bound else "")
        )

    def build(self, args, masks, keys, arg_names):
        """Trace, check and jit the step for ``args``' layout: the batch's positions, the
        jitted step and the names of the outputs returned as replicated."""
        mesh, axis_name = self.mesh, self.axis_name
        spec = lambda m, batch=False: P(axis_name) if m or batch else P()  # noqa: E731
        local = self.make_local(masks, keys)

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
            raise self.trace_errors(e) from None
        if self.batch_argnums is None:
            batch = find_batch(args, masks, keys, arg_names, shapes, self.n, axis_name)
        else:
            batch = resolve_batch(self.batch_argnums, arg_names, args, masks, self.n, axis_name)
        outs = shapes if isinstance(shapes, tuple) else (shapes,)
        specs = tuple(jax.tree.map(spec, self.mask_of(o)) for o in outs)
        specs = specs if isinstance(shapes, tuple) else specs[0]
        # keys inside the batch are split with it, not folded
        keys = tuple(jax.tree.map(lambda _: False, k) if i in batch else k
                     for i, k in enumerate(keys))  # fmt: skip
        local = self.make_local(masks, keys)
        mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs(batch), out_specs=specs,
                               check_vma=False)  # fmt: skip
        jitted = jax.jit(mapped, donate_argnums=tuple(self.donate_argnums))
        traced = jitted.trace(*avals(batch))
        flat_batch = [i in batch for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
        flat_specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
        out_names = outputs_named(shapes, args, arg_names, masks)
        _check_replicated(
            traced, flat_batch, flat_specs, out_names, axis_name,
            "average it over workers (mean_outputs=, or jax.lax.pmean in the step)",
        )  # fmt: skip
        replicated = [s == P() for s in flat_specs]
        return batch, jitted, [name for (name, _), r in zip(out_names, replicated) if r]

    def step(self, *args):
        """The data-parallel step on ``args`` (compiled once per layout)."""
        arg_names = tuple(self.names) if self.names is not None else param_names(self.fn, len(args))
        state_masks = tuple(self.state_of(a) for a in args)
        if not any(any(jax.tree.leaves(m)) for m in state_masks):
            raise ValueError(
                "data_parallel: no jaxcomm transform's state among the step's arguments, so "
                "nothing would exchange the gradients and the workers would drift apart; "
                f"put a jaxcomm transform with axis_name={self.axis_name!r} first in the optimizer "
                "chain and pass its state (jaxcomm.init_state; with flax nnx, "
                "jaxcomm.flax.init_optimizer)"
            )
        masks = tuple(self.mask_of(a) for a in args)
        leaves = jax.tree.leaves(args)
        cache_key = (
            jax.tree.structure(args),
            tuple((jnp.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves),
        )
        if cache_key not in self.compiled:
            check_worker_axes(args, masks, arg_names, self.n, _hint)
            keys = tuple(
                jax.tree_util.tree_map_with_path(
                    lambda p, x, m, name=name: (
                        self.fold_keys and not m and key_kind(leaf_name(name, p), x)
                    ),
                    a,
                    mk,
                )
                for name, a, mk in zip(arg_names, args, masks)
            )
            self.compiled[cache_key] = self.build(args, masks, keys, arg_names)
        batch, run, replicated_names = self.compiled[cache_key]
        args = place(args, masks, batch, self.mesh, self.axis_name)
        if self.one_in_flight and self.last is not None:
            jax.block_until_ready(self.last)
        out = run(*args)
        self.last = out if self.one_in_flight else None
        if self.check_replicas:
            _compare_copies(out, self.mask_of, replicated_names)
        return out


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _compare_copies(out, mask_of, names) -> None:
    """Raise naming the first replicated output leaf whose device copies differ."""
    outs = out if isinstance(out, tuple) else (out,)
    flat = [x for o in outs for x, m in zip(jax.tree.leaves(o), jax.tree.leaves(mask_of(o)))
            if not m]  # fmt: skip
    for name, x in zip(names, flat):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        shards = [np.asarray(s.data) for s in x.addressable_shards]
        differ = [i for i, c in enumerate(shards[1:], 1) if c.tobytes() != shards[0].tobytes()]
        if differ:
            raise ValueError(
                f"check_replicas: {name} is declared replicated but its copies differ between "
                f"devices ({len(differ)} of {len(shards) - 1} differ from device 0's): a value "
                "computed per worker (e.g. from per-worker state) and returned without an "
                "exchange"
            )
