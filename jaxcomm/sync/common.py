"""What the wrappers of :mod:`jaxcomm.sync` share: int32 counters, moving params to
updates and back, and the checks of a ``compressor=`` argument."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm import accounting, checks, core
from jaxcomm.collectives import AxisName


def zero_count() -> jax.Array:
    return jnp.zeros((), jnp.int32)


def inc_count(x: jax.Array) -> jax.Array:
    return optax.safe_int32_increment(x)


def add_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates``: ``(p + u)`` in the params' dtype."""
    return jax.tree.map(lambda p, u: (p + u).astype(jnp.result_type(p)), params, updates)


def updates_to(new: Any, params: Any, like: Any) -> Any:
    """Updates that move ``params`` to ``new``, in the dtypes of ``like``."""
    return jax.tree.map(lambda a, p, u: (a - p).astype(u.dtype), new, params, like)


def as_compressor(compressor: Any, axis_name: AxisName | None) -> Any:
    """A compressed-averaging transform from a jaxcomm transform or a Compressor."""
    if compressor is None:
        return None
    if isinstance(compressor, core.Compressor):
        if compressor.needs_key:
            raise ValueError(
                "compressor: this Compressor needs a PRNG key; pass the transform instead, e.g. "
                "compressor=jaxcomm.randomk(0.01, key=jax.random.key(0), axis_name=...)"
            )
        return core.compress(compressor, axis_name=axis_name, min_size=0)
    return checks.check_tx(compressor, "compressor")


def check_compressor_axis(comp: Any, params: Any, axis_name: AxisName | None) -> None:
    """The compressor must average over ``axis_name`` itself (abstract trace, no devices)."""
    axes = {c.axis for c in accounting.wire_report(comp, params, 2)}
    if axis_name is None and axes:
        raise ValueError(
            f"compressor: it communicates over {sorted(map(str, axes))} but axis_name=None; "
            f"build both with the same axis_name"
        )
    if axis_name is not None and axes != {axis_name}:
        raise ValueError(
            f"compressor: must average over axis_name={axis_name!r}, i.e. be built with "
            f"axis_name={axis_name!r} (e.g. jaxcomm.topk(0.01, axis_name={axis_name!r})); it "
            f"communicates over {sorted(map(str, axes)) or 'no axis'}"
        )


def check_float_params(params: Any) -> None:
    """Every leaf of ``params`` must be floating point (the outer step of DiLoCo moves each).

    ``TypeError`` naming the first integer/bool leaf and how to leave it out
    (the compressors' check, :func:`jaxcomm.core.check_float_leaves`).
    """
    core.check_float_leaves(jax.tree_util.tree_leaves_with_path(params), "params")
