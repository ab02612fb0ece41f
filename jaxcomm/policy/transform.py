"""The transform the policy returns: :func:`auto`, optionally after :func:`dense_warmup`."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import calibrate, checks
from jaxcomm.branches import typed_cond
from jaxcomm.compressors import dense
from jaxcomm.policy.choice import DEFAULT_CANDIDATES, MIN_WINS, Candidate, check_candidates, choose


class WarmupState(NamedTuple):
    """State of :func:`dense_warmup`: the step counter, dense's and the chosen transform's."""

    count: jax.Array
    dense: Any
    chosen: Any


def dense_warmup(
    tx: optax.GradientTransformation, steps: int, axis_name: str
) -> optax.GradientTransformation:
    """The dense mean for the first ``steps`` steps, then ``tx`` (its state starts then).

    Both branches are traced; the step counter decides which runs (every
    worker agrees on it), so shapes stay static. ``steps=0`` returns ``tx``.
    """
    steps = checks.check_int(steps, "warmup_steps", 0)
    if steps == 0:
        return tx
    ref = dense.allreduce(axis_name=axis_name)

    def init_fn(params):
        return WarmupState(jnp.zeros([], jnp.int32), ref.init(params), tx.init(params))

    def update_fn(updates, state, params=None):
        checks.check_state(state, WarmupState, "dense_warmup")

        def warm(u, s):
            out, d = ref.update(u, s.dense, params)
            return out, s._replace(dense=d)

        def after(u, s):
            out, c = tx.update(u, s.chosen, params)
            return out, s._replace(chosen=c)

        out, new = typed_cond(state.count < steps, warm, after, updates, state)
        return out, new._replace(count=optax.safe_int32_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def auto(
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    *,
    warmup_steps: int = 0,
    candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
    margin: float = 0.1,
    max_ratio: float | None = None,
    calibration: calibrate.Calibration | None = None,
    repeats: int = 5,
    costs: dict[str, float] | None = None,
    rounds: dict[str, Sequence[float]] | None = None,
    min_wins: float = MIN_WINS,
    log: Callable[[str], None] | None = print,
) -> optax.GradientTransformation:
    """The exchange :func:`choose` picks for ``params`` on ``mesh`` (never slower than dense).

    Args:
      params, mesh, axis_name, candidates, margin, max_ratio, calibration,
        repeats, costs, rounds, min_wins: see :func:`choose`.
      warmup_steps: steps of dense exchange before the chosen one
        (:func:`dense_warmup`), an int >= 0.
      log: called with the choice's table (``None``: silent); only process 0 logs.

    Returns:
      An ``optax.GradientTransformation`` taking gradients and returning the
      worker mean, as the chosen candidate does; chain an optimizer after it.

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = optax.chain(jaxcomm.auto(params, mesh, "data"), optax.adamw(1e-3))
    """
    choice = choose(
        params, mesh, axis_name, candidates=candidates, margin=margin, max_ratio=max_ratio,
        calibration=calibration, repeats=repeats, costs=costs, rounds=rounds, min_wins=min_wins,
    )  # fmt: skip
    if log is not None and jax.process_index() == 0:
        log(choice.table())
    make = next(c.make for c in check_candidates(candidates) if c.name == choice.name)
    return dense_warmup(make(axis_name), warmup_steps, axis_name)
