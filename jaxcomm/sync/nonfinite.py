"""Skipping non-finite steps on every worker alike: :func:`skip_nonfinite`."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import checks, collectives, stages
from jaxcomm.collectives import AxisName
from jaxcomm.sync.common import inc_count, zero_count


class SkipNonfiniteState(NamedTuple):
    """State of :func:`skip_nonfinite`.

    Attributes:
      inner_state: state of the wrapped transform, as of the last applied step.
      notfinite_count: int32 ``[]``, consecutive skipped steps (0 after an applied one).
      total_notfinite: int32 ``[]``, skipped steps in all.
      last_finite: bool ``[]``, whether the last step was applied.
    """

    inner_state: Any
    notfinite_count: jax.Array
    total_notfinite: jax.Array
    last_finite: jax.Array


def _all_finite(updates: Any, axis_name: AxisName | None) -> jax.Array:
    """bool ``[]``: whether every float leaf of ``updates`` is finite (True with none), agreed
    over ``axis_name`` (one 4-byte all-reduce) when it is given."""
    leaves = [u for u in jax.tree.leaves(updates) if jnp.issubdtype(u.dtype, jnp.inexact)]
    finite = stages.all_finite(leaves)
    if axis_name is not None:
        finite = collectives.agree((~finite).astype(jnp.int32), axis_name) == 0
    return finite


def skip_nonfinite(
    inner: optax.GradientTransformation,
    *,
    axis_name: AxisName | None = None,
    max_consecutive_errors: int | None = None,
) -> optax.GradientTransformation:
    """Skip steps whose update holds NaN/Inf, with one decision shared by all workers.

    Rule: run ``inner.update`` on every worker, every step; if any update leaf holds
    NaN/Inf the step is skipped (zero updates, ``inner``'s state kept) and
    ``state.total_notfinite`` counts it. Use it instead of ``optax.apply_if_finite``.
    Wire: nothing more, or one 4-byte all-reduce with ``axis_name``.

    Args:
      inner: the transform to protect.
      axis_name: ``None`` (decide from the update, relying on the NaN rule) or the
        mesh axis to agree over (for :func:`local_sgd` / :func:`diloco`).
      max_consecutive_errors: ``None`` (skip for ever) or an int >= 0: after more than
        this many consecutive skips the next non-finite update is applied.

    Returns:
      An ``optax.GradientTransformation`` with :class:`SkipNonfiniteState`.

    Example:
      >>> tx = jaxcomm.skip_nonfinite(
      ...     optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1)))
    """
    # Why: ``optax.apply_if_finite`` checks each worker's *gradient* and runs the inner update (and
    # the collectives in it) inside a ``lax.cond``, so with a NaN on one worker the others enter a
    # collective it does not: a type error under ``jax.shard_map``, a rendezvous abort (a hang on
    # NCCL) under ``jax.pmap``. This wrapper decides from the *output*, after the exchange; the
    # skipped step keeps ``inner``'s counters too.
    # Every jaxcomm transform follows the NaN rule (a non-finite gradient on any worker makes the
    # update non-finite on every worker; see :func:`jaxcomm.compress`), so for them the decision is
    # the same on every worker without another collective. Pass ``axis_name`` when the update is per
    # worker on some steps: local_sgd / diloco between synchronisations, or a chain whose exchange
    # is not jaxcomm's. The decision is then agreed with one 4-byte all-reduce (a max over workers),
    # so every worker skips the same steps and the sync counters stay equal.
    # ``max_consecutive_errors`` behaves as ``optax.apply_if_finite``'s, so a run that has truly
    # diverged shows it. References: none (an optax.apply_if_finite for collectives).
    inner = checks.check_tx(inner, "inner")
    axis_name = collectives.check_axis_name(axis_name)
    if max_consecutive_errors is not None:
        max_consecutive_errors = checks.check_int(
            max_consecutive_errors, "max_consecutive_errors", 0
        )

    def init_fn(params):
        return SkipNonfiniteState(
            inner_state=inner.init(params),
            notfinite_count=zero_count(),
            total_notfinite=zero_count(),
            last_finite=jnp.ones((), jnp.bool_),
        )

    def update_fn(updates, state, params=None):
        checks.check_state(state, SkipNonfiniteState, "skip_nonfinite")
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        finite = _all_finite(new_updates, axis_name)
        apply = finite
        if max_consecutive_errors is not None:
            apply = apply | (state.notfinite_count >= max_consecutive_errors)

        def pick(new, old):
            return jnp.where(apply, new, old) if hasattr(new, "dtype") else new

        out = jax.tree.map(lambda u: jnp.where(apply, u, jnp.zeros_like(u)), new_updates)
        return out, SkipNonfiniteState(
            inner_state=jax.tree.map(pick, new_inner, state.inner_state),
            notfinite_count=jnp.where(finite, 0, inc_count(state.notfinite_count)).astype(
                jnp.int32
            ),
            total_notfinite=state.total_notfinite + (~finite).astype(jnp.int32),
            last_finite=finite,
        )

    return optax.GradientTransformation(init_fn, update_fn)
