"""Argument and state validators shared by every jaxcomm module.

A leaf module: it imports nothing of jaxcomm, so any module can use it. Each
check returns the value converted (``int``, ``float``, a dtype) or raises
``TypeError`` (wrong type; ``bool`` is never a number here) or ``ValueError``
(out of range, NaN, inf), with a message that names the argument and the
allowed range.
"""

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

_INTS = (int, np.integer)
_FLOATS = (int, float, np.integer, np.floating)


def check_ratio(ratio: Any, name: str = "ratio") -> float:
    """Validate a compression ratio in (0, 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, _FLOATS):
        raise TypeError(f"{name}: expected a float in (0, 1], got {ratio!r}")
    ratio = float(ratio)
    if not (0.0 < ratio <= 1.0) or math.isnan(ratio):
        raise ValueError(f"{name}: must be in (0, 1], got {ratio}")
    return ratio


def check_int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    """Validate an int argument in ``[lo, hi]`` (TypeError / ValueError naming it)."""
    allowed = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, _INTS):
        raise TypeError(f"{name}: expected {allowed}, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}: expected {allowed}, got {value}")
    return value


def check_float(
    value: Any,
    name: str,
    *,
    low: float,
    strict: bool,
    high: float | None = None,
    high_strict: bool = True,
) -> float:
    """Validate a finite float argument ``> low`` (``strict``) or ``>= low``.

    With ``high`` it must also be ``< high`` (``high_strict``) or ``<= high``;
    the message then names the interval, e.g. ``[0, 1)``. Bounds are printed
    as given: pass ``low=0`` for ``[0, 1)``, ``low=0.0`` for ``> 0.0``.
    """
    if high is None:
        allowed = f"float {'>' if strict else '>='} {low}"
        in_range = f"finite {allowed}"
    else:
        allowed = f"float in {'(' if strict else '['}{low}, {high}{')' if high_strict else ']'}"
        in_range = allowed
    if isinstance(value, bool) or not isinstance(value, _FLOATS):
        raise TypeError(f"{name}: expected a {allowed}, got {value!r}")
    value = float(value)
    bad = value <= low if strict else value < low
    if high is not None:
        bad = bad or (value >= high if high_strict else value > high)
    if bad or not math.isfinite(value):
        raise ValueError(f"{name}: expected a {in_range}, got {value}")
    return value


def check_positive(value: Any, name: str) -> float:
    """Validate a finite float argument > 0 (TypeError / ValueError naming it)."""
    return check_float(value, name, low=0, strict=True)


def check_state_dtype(value: Any, name: str = "state_dtype") -> Any:
    """Validate a ``state_dtype=`` option: ``None`` or a floating dtype."""
    if value is None:
        return None
    try:
        dt = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"{name}: expected None or a floating dtype, got {value!r}") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{name}: expected None or a floating dtype, got {dt}")
    return dt


def check_tx(tx: Any, name: str) -> optax.GradientTransformation:
    """Validate an optax optimizer argument (anything with callable ``init`` and ``update``)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{name}: expected an optax.GradientTransformation (e.g. optax.sgd(0.1)), "
            f"got {type(tx).__name__}"
        )
    return tx


def check_scalar_count(state: Any, fn: str) -> None:
    """A state's ``count`` is a scalar; a leading worker axis left on the state is named."""
    count = state.count if "count" in getattr(type(state), "_fields", ()) else None
    if count is not None and jnp.ndim(count) != 0:
        raise ValueError(
            f"state.count of {fn} has shape {jnp.shape(count)}, expected a scalar: the state "
            "still carries its leading worker axis. Inside shard_map, slice it off before "
            "update (jax.tree.map(lambda a: a[0], state)) and add it back after (a[None]), or "
            "let jaxcomm.data_parallel do both."
        )


def check_state(state: Any, cls: type, fn: str) -> None:
    """``state`` is a ``cls`` (made by ``fn(...).init``) whose ``count`` is a scalar."""
    if not isinstance(state, cls):
        raise TypeError(
            f"state: expected the {cls.__name__} made by {fn}(...).init(params), got "
            f"{type(state).__name__}"
        )
    check_scalar_count(state, fn)


def require_params(params: Any, fn: str) -> None:
    """Parameter-averaging transforms need ``params`` in ``update``."""
    if params is None:
        raise ValueError(
            f"params: {fn} averages parameters, so update needs the current per-worker params: "
            f"call tx.update(updates, state, params); got params=None"
        )
