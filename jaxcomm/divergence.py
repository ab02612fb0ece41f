"""Which values of a data-parallel step may differ between workers: a walk over its jaxpr.

:func:`jaxcomm.data_parallel` runs a worker's step under ``jax.shard_map``
with pmap's semantics (``check_vma=False``: JAX does not type which values
are per worker, so autodiff inserts no dense all-reduce). Two mistakes then
go through without a word: a value returned as replicated that was computed
from this worker's batch without an exchange (a gradient leaf that
``optax.masked`` keeps away from the compressor: the copies drift apart), and
a collective inside a ``lax.cond`` (or a loop) whose predicate comes from
this worker's batch (``optax.apply_if_finite`` around a compressor: a worker
that takes the other branch leaves the rest waiting in the collective, an
abort on XLA:CPU, a hang on NCCL). :func:`check` finds both in the traced
step, before it runs.

The rule, a taint walk: a value *varies* (may differ between workers) if it
is computed from a varying value, the batch and ``axis_index`` being the
sources. ``psum``, ``pmax``, ``pmin``, ``all_gather`` and ``pbroadcast`` over
the workers' axis give every worker the same result, so their outputs do not
vary; ``ppermute``, ``all_to_all`` and ``psum_scatter`` outputs do. The state
of a jaxcomm transform (an error-feedback residual) is per worker by design
and is not a source: whether the transform keeps what must agree agreed is
its own contract, tested with it. The walk over-approximates (a value
computed from the batch and then multiplied by zero still varies), which
errs toward an error that names the leaf, never toward silence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from jax.extend import core as jcore

from jaxcomm.jaxprs import equations, subjaxprs

__all__ = ["AGREEING", "COLLECTIVES", "Finding", "check", "varying"]

# outputs equal on every worker of the reduced axes
AGREEING = frozenset(
    {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant", "pbroadcast"}
)
# every primitive that needs all workers of its axis to take part
COLLECTIVES = AGREEING | frozenset(
    {"ppermute", "all_to_all", "ragged_all_to_all", "reduce_scatter", "psend", "precv"}
)


class Finding(NamedTuple):
    """A collective reached only by the workers whose predicate says so.

    Attributes:
      control: the primitive that branches (``cond``, ``while``).
      collective: the collective inside it (e.g. ``all_gather_invariant``).
    """

    control: str
    collective: str


def _axes(eqn) -> tuple:
    p = eqn.params
    axes = p.get("axes", p.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _on_axis(eqn, axis_name) -> bool:
    return eqn.primitive.name in COLLECTIVES and axis_name in _axes(eqn)


def _collective_in(jaxpr, axis_name) -> str | None:
    return next((eqn.primitive.name for eqn in equations(jaxpr) if _on_axis(eqn, axis_name)), None)


class _Walk:
    def __init__(self, axis_name):
        self.axis_name = axis_name
        self.findings: list[Finding] = []

    def jaxpr(self, jaxpr, varying_in: Sequence[bool]) -> list[bool]:
        env: dict[Any, bool] = {v: False for v in jaxpr.constvars}
        env.update(zip(jaxpr.invars, varying_in))

        def read(v):
            return False if isinstance(v, jcore.Literal) else env.get(v, False)

        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def branch(self, control, pred, bodies):
        if pred:
            for body in bodies:
                name = _collective_in(body, self.axis_name)
                if name:
                    self.findings.append(Finding(control, name))
                    return

    def eqn(self, eqn, ins: list[bool]) -> list[bool]:
        name, n_out = eqn.primitive.name, len(eqn.outvars)
        if name == "axis_index":
            return [self.axis_name in _axes(eqn)] * n_out
        if name in AGREEING and self.axis_name in _axes(eqn):
            partial = eqn.params.get("axis_index_groups") is not None
            return [partial and any(ins)] * n_out
        if name == "cond":
            branches = [b.jaxpr for b in eqn.params["branches"]]
            self.branch("cond", ins[0], branches)
            outs = [self.jaxpr(b, ins[1:]) for b in branches]
            return [ins[0] or any(o) for o in zip(*outs)]
        if name == "while":
            return self.loop(eqn, ins)
        if name == "scan":
            return self.scan(eqn, ins)
        subs = [s for s in subjaxprs(eqn) if len(s.invars) == len(ins)]
        if len(subs) == 1 and len(subs[0].outvars) == n_out:
            return self.jaxpr(subs[0], ins)
        for sub in subjaxprs(eqn):  # an unknown call: look inside for branches, vary on any
            self.jaxpr(sub, [any(ins)] * len(sub.invars))
        return [any(ins)] * n_out

    def loop(self, eqn, ins):
        p = eqn.params
        cj, bj = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = ins[:nc], ins[nc : nc + nb], list(ins[nc + nb :])
        while True:
            pred = self.jaxpr(cj, cconsts + carry)[0]
            body = self.jaxpr(bj, bconsts + carry)
            new = [c or b or pred for c, b in zip(carry, body)]
            if new == carry:
                self.branch("while", pred, (cj, bj))
                return carry
            carry = new

    def scan(self, eqn, ins):
        p = eqn.params
        body, nc, ncarry = p["jaxpr"].jaxpr, p["num_consts"], p["num_carry"]
        consts, carry, xs = ins[:nc], list(ins[nc : nc + ncarry]), ins[nc + ncarry :]
        while True:
            outs = self.jaxpr(body, consts + carry + xs)
            new = [c or o for c, o in zip(carry, outs[:ncarry])]
            if new == carry:
                return carry + outs[ncarry:]
            carry = new


def varying(jaxpr, varying_in: Sequence[bool], axis_name: str) -> tuple[list[bool], list[Finding]]:
    """Which outputs of ``jaxpr`` may differ between workers, and the branched collectives.

    Args:
      jaxpr: a ``jax.core.Jaxpr`` (or ``ClosedJaxpr``) of one worker's step.
      varying_in: per input, whether it may differ between workers (the batch).
      axis_name: the workers' mesh axis.

    Returns:
      ``(varying_out, findings)``: per output whether it may differ, and each
      collective on ``axis_name`` under a branch or loop whose predicate may.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    walk = _Walk(axis_name)
    return walk.jaxpr(jaxpr, list(varying_in)), walk.findings


def check(closed_jaxpr, varying_in: Sequence[bool], axis_name: str) -> tuple[list[bool], list]:
    """:func:`varying` for the ``shard_map`` inside a traced ``jit(shard_map(step))``.

    ``varying_in`` is per flat input of the shard_map'ed step. Returns the
    same as :func:`varying` for the step's own jaxpr.
    """
    top = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    found = [e for e in top.eqns if e.primitive.name == "shard_map"]
    if len(found) != 1:
        raise ValueError(f"check: expected one shard_map in the traced step, found {len(found)}")
    inner = found[0].params["jaxpr"]
    # constants the trace hoisted come first, as replicated inputs
    lifted = len(inner.invars) - len(varying_in)
    return varying(inner, [False] * lifted + list(varying_in), axis_name)
