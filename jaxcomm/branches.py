"""Branches typed alike under ``shard_map``: :func:`typed_cond` and :func:`typed_switch`.

Under ``jax.shard_map`` every value carries the mesh axes it varies over. A
branch that averages returns values invariant over the axis while another
returns per-worker values, and ``lax.cond``/``lax.switch`` reject the
mismatch. These wrappers trace every branch abstractly first and then mark
each output leaf varying over the union of the axes it varies over in any
branch (a type cast, no data moves), so the results are bit for bit those of
the plain ``lax.cond``/``lax.switch``. Outside ``shard_map`` nothing varies and
they are the plain ones.

Built on :mod:`jaxcomm.collectives` (its ``varying_names`` and ``as_varying``)
and nothing else of jaxcomm.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from jaxcomm.collectives import as_varying, varying_names

__all__ = ["typed_cond", "typed_switch"]


def _typed(fns: Sequence[Callable], operands: tuple) -> list[Callable]:
    """``fns`` wrapped so that each returns its outputs cast to the union of the branches'
    varying axes, leaf by leaf."""
    shapes = [jax.eval_shape(fn, *operands) for fn in fns]
    first, treedef = jax.tree.flatten(shapes[0])
    want = [set(varying_names(x)) for x in first]
    for shape in shapes[1:]:
        for w, x in zip(want, jax.tree.leaves(shape)):
            w |= varying_names(x)

    def typed(fn):
        def branch(*ops):
            out = jax.tree.leaves(fn(*ops))
            return treedef.unflatten([as_varying(x, tuple(sorted(w))) for x, w in zip(out, want)])

        return branch

    return [typed(fn) for fn in fns]


def typed_cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    """``lax.cond`` whose two branches return values typed alike under ``shard_map``.

    A branch that averages returns values invariant over the mesh axis while
    the other returns per-worker values; ``lax.cond`` rejects the mismatch.
    Both branches are traced abstractly first and each output leaf is then
    marked varying over the union of the axes (a type cast, no data moves).

    Example:
      >>> u, syncs = typed_cond(is_sync, average, keep_local, u, syncs)
    """
    true_typed, false_typed = _typed([true_fn, false_fn], operands)
    return lax.cond(pred, true_typed, false_typed, *operands)


def typed_switch(index: jax.Array, branches: Sequence[Callable], *operands: Any) -> Any:
    """``lax.switch`` whose branches return values typed alike under ``shard_map``.

    As :func:`typed_cond`, for any number of branches: each output leaf is
    marked varying over the union of the axes it varies over in any branch.

    Example:
      >>> outs = typed_switch(phase, [run_phase_0, run_phase_1])
    """
    return lax.switch(index, _typed(branches, operands), *operands)
