"""A data-parallel step's arguments: their names, the batch among them, the PRNG keys."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = [
    "check_worker_axes",
    "find_batch",
    "fold",
    "is_batch_stats",
    "key_kind",
    "leaf_name",
    "outputs_named",
    "param_names",
    "resolve_batch",
    "signature",
]


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


def is_batch_stats(path) -> bool:
    """Whether a tree path runs through a ``batch_stats`` key (linen's BatchNorm statistics)."""
    return any(getattr(k, "key", getattr(k, "name", None)) == "batch_stats" for k in path)


def key_kind(name: str, x) -> str | bool:
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


def fold(x, index, kind):
    """Every key of ``x`` (of :func:`key_kind` ``kind``) folded with ``index``."""
    keys = jax.random.wrap_key_data(x) if kind == "raw" else x
    flat = keys.reshape(-1)
    folded = jax.vmap(lambda k: jax.random.fold_in(k, index))(flat).reshape(keys.shape)
    return jax.random.key_data(folded) if kind == "raw" else folded


def signature(tree):
    """A tree's structure with its leaves' shapes and dtypes (to match outputs to arguments)."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple((tuple(jnp.shape(x)), str(getattr(x, "dtype", ""))) for x in leaves)


def check_worker_axes(args, masks, names, n, hint):
    """Raise naming the first per-worker leaf without a leading worker axis of size ``n``."""
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


def resolve_batch(batch_argnums, names, args, masks, n, axis_name):
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


def find_batch(args, masks, keys, names, outputs, n, axis_name):
    """The batch: the arguments whose array leaves share one leading size divisible by ``n``,
    that hold no per-worker state and no PRNG key and that the step does not return."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    returned = {signature(o) for o in outputs}
    why, sizes = {}, {}
    for i, (arg, mask, key) in enumerate(zip(args, masks, keys)):
        leaves = jax.tree.leaves(arg)
        firsts = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
        if any(jax.tree.leaves(mask)):
            why[i] = "holds per-worker state"
        elif not leaves:
            why[i] = "holds no arrays"
        elif signature(arg) in returned:
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
        reasons = "; ".join(f"{names[i]!r} {w}" for i, w in why.items() if names[i])
        raise ValueError(f"data_parallel: no argument of the step looks like the batch to split "
                         f"over the {n} workers ({reasons}); {fix}")  # fmt: skip
    if len(set(sizes.values())) > 1:
        found = ", ".join(f"{names[i]!r} (leading size {s})" for i, s in sizes.items())
        raise ValueError(f"data_parallel: cannot tell which argument is the batch: {found} "
                         f"could each be; {fix}")  # fmt: skip
    return resolve_batch(tuple(sizes), names, args, masks, n, axis_name)


def outputs_named(shapes, args, names, masks):
    """Per flat output leaf: (its name, whether it is a PRNG key). An output is named after
    the one argument it matches (its tree; and leaf shapes, unless it holds per-worker state)."""
    outs = shapes if isinstance(shapes, tuple) else (shapes,)

    def matches(o, a, m):
        if any(jax.tree.leaves(m)):
            return jax.tree.structure(o) == jax.tree.structure(a)
        return signature(o) == signature(a)

    named = []
    for k, o in enumerate(outs):
        found = [n for n, a, m in zip(names, args, masks) if matches(o, a, m)]
        base = found[0] if len(found) == 1 else "the output" if len(outs) == 1 else f"output {k}"
        for path, x in jax.tree_util.tree_leaves_with_path(o):
            named.append((leaf_name(base, path), key_kind("key", x) == "typed"))
    return named
