"""Streaming DiLoCo: DiLoCo whose parameters synchronise in fragments, staggered and overlapped.

The params' leaves are split into ``fragments`` groups of about equal size
(contiguous in tree order). Fragment ``f`` synchronises every ``every``
inner steps like DiLoCo, but the fragments take turns: fragment ``f``
sends at the inner steps ``s`` (counted from 1) with
``s % every == ((f + 1) * every // fragments) % every``, so a sync moves
``1/fragments`` of DiLoCo's bytes and one happens every
``every // fragments`` steps.

At a send, worker ``i``'s outer gradient of the fragment is
``anchor_f - local_f`` (optionally through an error-feedback compressor,
e.g. int8 or 4-bit QSGD over the two-phase exchange); the outer optimizer
steps the fragment's anchor on the worker mean. The result is merged into
the local params ``delay`` inner steps later (``delay`` = tau of the paper,
the steps the exchange overlaps): ``local_f <- mix * local_f + (1 - mix) *
anchor_f``. The ``delay`` inner steps the workers take meanwhile are kept
in proportion ``mix`` (``mix=0``: discarded, as in the paper's default and
torchft's ``fragment_update_alpha=0``).

``delay`` fixes *when* the result is used, so the arithmetic is the same
whether the exchange really overlaps the inner steps or not: under one
compiled step the exchange runs at the send step (the delay is simulated),
and a runtime that runs a collective asynchronously may overlap it with the
``delay`` steps without changing a bit (see ``experiments/results/`` for
what was measured).

With ``fragments=1, delay=0`` this is exactly :func:`jaxcomm.diloco`.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import buckets, checks, collectives
from jaxcomm.branches import typed_cond
from jaxcomm.collectives import AxisName
from jaxcomm.sync.common import (
    add_updates,
    as_compressor,
    check_compressor_axis,
    check_float_params,
    inc_count,
    updates_to,
    zero_count,
)

__all__ = ["StreamingDiLoCo", "StreamingDiLoCoState", "fragment_of", "streaming_diloco"]

_OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


class StreamingDiLoCoState(NamedTuple):
    """State of :func:`streaming_diloco`.

    Attributes:
      count: int32 ``[]``, inner steps made (saturates at the int32 maximum).
      syncs: int32 ``[]``, fragment synchronisations sent.
      inner_state: state of the inner optimizer (kept across rounds).
      anchor: the global params (each fragment as of its last outer step).
      outer_state: tuple, the outer optimizer's state of each fragment.
      compressor_state: tuple, each fragment's compressor state (``None``
        entries without a compressor).
    """

    count: jax.Array
    syncs: jax.Array
    inner_state: Any
    anchor: Any
    outer_state: tuple
    compressor_state: tuple


def fragment_of(params: Any, fragments: int) -> list[int]:
    """The fragment of each leaf of ``params`` (tree order): contiguous groups of ~equal size.

    Leaf ``j`` goes to fragment ``floor(fragments * c_j / total)`` where ``c_j``
    is the number of elements before the leaf's middle; every fragment gets at
    least one leaf (``ValueError`` when ``params`` has fewer leaves than
    ``fragments``).
    """
    sizes = [math.prod(x.shape) for x in jax.tree.leaves(params)]
    if len(sizes) < fragments:
        raise ValueError(
            f"fragments: {fragments} fragments need at least as many param leaves; "
            f"params has {len(sizes)}"
        )
    total, seen, out = sum(sizes), 0, []
    for size in sizes:
        out.append(min(fragments - 1, int(fragments * (seen + size / 2) // max(total, 1))))
        seen += size
    # every fragment non-empty: move boundaries forward where a fragment got no leaf
    for f in range(fragments):
        if f not in out:
            j = max(j for j, g in enumerate(out) if g < f)
            out[j:] = [max(g, f) for g in out[j:]]
    return out


def _pick(leaves: list, members: list[int]) -> list:
    return [leaves[j] for j in members]


def _put(leaves: list, members: list[int], values: list) -> list:
    out = list(leaves)
    for j, v in zip(members, values):
        out[j] = v
    return out


def _check(every: int, fragments: int, delay: int, mix: float) -> tuple[int, int, int, float]:
    every = checks.check_int(every, "every", 1)
    fragments = checks.check_int(fragments, "fragments", 1)
    delay = checks.check_int(delay, "delay", 0)
    if every % fragments:
        raise ValueError(
            f"fragments: must divide every={every} (one fragment syncs every every/fragments "
            f"steps); got {fragments}"
        )
    if delay >= every // fragments:
        raise ValueError(
            f"delay: must be in [0, every/fragments) = [0, {every // fragments}) so that one "
            f"exchange is in flight at a time; got {delay}"
        )
    mix = checks.check_float(mix, "mix", low=0, strict=False, high=1, high_strict=False)
    return every, fragments, delay, mix


def streaming_diloco(
    inner: optax.GradientTransformation,
    *,
    every: int,
    fragments: int,
    axis_name: AxisName | None,
    delay: int = 0,
    mix: float = 0.0,
    outer: optax.GradientTransformation = _OUTER,
    compressor: Any = None,
    bucket_bytes: int | str | None = buckets.DEFAULT_BUCKET_BYTES,
    overlap: bool = False,
) -> optax.GradientTransformation:
    """Streaming DiLoCo: ``fragments`` staggered DiLoCo syncs, each merged ``delay`` steps late.

    Rule and bytes (each fragment a DiLoCo round): :mod:`jaxcomm.loco.streaming`.

    Args:
      inner: the inner (local) optimizer. every: steps between a fragment's syncs, >= 1.
      fragments: number of fragments P, an int >= 1 dividing ``every``.
      axis_name: mesh axis to average over; ``None``: a single worker.
      delay: steps between a fragment's send and its merge, in ``[0, every // fragments)``.
      mix: local params' weight at the merge, in ``[0, 1]``. outer: default Nesterov SGD.
      compressor: ``None``, a jaxcomm transform (same ``axis_name``) or a ``Compressor``.
      bucket_bytes: tensor fusion of the dense averaging (see :func:`jaxcomm.compress`).
      overlap: ``True``: :class:`jaxcomm.loco.Overlap` runs the exchange in a thread.

    Returns:
      An ``optax.GradientTransformation`` with :class:`StreamingDiLoCoState`; needs ``params``.

    Example:
      >>> tx = jaxcomm.streaming_diloco(optax.adamw(4e-4), every=100, fragments=4, delay=5)

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication", 2025, arXiv:2501.18512.
    """
    # Notes. ``compressor`` e.g. ``jaxcomm.int8(axis_name=..., exchange="two_phase")`` or a
    # :class:`jaxcomm.Compressor`; each fragment gets its own state. ``overlap=False``: the exchange
    # runs inside the step at the send step (the delay is simulated). ``overlap=True``: ``update``
    # never communicates; :class:`jaxcomm.loco.Overlap` runs each fragment's exchange in a host
    # thread while the next ``delay`` (>= 1) steps run, with the same result. ``delay`` is tau in
    # the paper, ``mix`` alpha; the default outer optimizer is Nesterov SGD (lr 0.7, momentum 0.9).
    # Title: "Towards a Distributed Free Lunch".
    rule = StreamingDiLoCo(
        inner, every=every, fragments=fragments, axis_name=axis_name, delay=delay, mix=mix,
        outer=outer, compressor=compressor, bucket_bytes=bucket_bytes,
    )  # fmt: skip
    return rule.transform(overlap=overlap)


class StreamingDiLoCo:
    """The rule of :func:`streaming_diloco`: its transform, schedule and one fragment's exchange.

    :func:`streaming_diloco`'s arguments (but ``overlap``); what
    :class:`jaxcomm.loco.Overlap` needs to run the exchanges outside the step.
    """

    def __init__(self, inner, *, every, fragments, axis_name, delay=0, mix=0.0, outer=_OUTER,
                 compressor=None, bucket_bytes=buckets.DEFAULT_BUCKET_BYTES):  # fmt: skip
        self.inner = checks.check_tx(inner, "inner")
        self.outer = checks.check_tx(outer, "outer")
        self.every, self.fragments, self.delay, self.mix = _check(every, fragments, delay, mix)
        self.axis_name = collectives.check_axis_name(axis_name)
        self.bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
        self.comp = as_compressor(compressor, axis_name)
        self.offsets = [((f + 1) * every // fragments) % every for f in range(fragments)]

    def sends(self, s: int) -> list[int]:
        """The fragments that send at inner step ``s`` (1-based), on the host."""
        return [f for f, o in enumerate(self.offsets) if s % self.every == o]

    def lands(self, s: int) -> list[int]:
        """The fragments whose exchange is merged at inner step ``s`` (1-based), on the host."""
        return self.sends(s - self.delay) if s - self.delay >= 1 else []

    def members(self, params: Any) -> list[list[int]]:
        """The leaf indices (tree order) of each fragment."""
        of = fragment_of(params, self.fragments)
        return [[j for j, g in enumerate(of) if g == f] for f in range(self.fragments)]

    def init(self, params: Any) -> StreamingDiLoCoState:
        check_float_params(params)
        if self.comp is not None:
            check_compressor_axis(self.comp, params, self.axis_name)
        anchor = jax.tree.map(jnp.asarray, params)
        leaves = jax.tree.leaves(anchor)
        members = self.members(params)
        return StreamingDiLoCoState(
            count=zero_count(),
            syncs=zero_count(),
            inner_state=self.inner.init(params),
            anchor=anchor,
            outer_state=tuple(self.outer.init(_pick(leaves, m)) for m in members),
            compressor_state=tuple(
                None if self.comp is None else self.comp.init(_pick(leaves, m)) for m in members
            ),
        )

    def send(self, local: list, anchor: list, outer_state: Any, comp_state: Any) -> tuple:
        """One fragment's exchange and outer step: ``(anchor, outer_state, comp_state)``.

        ``local``/``anchor``: the fragment's leaves of this worker's params after
        the send step and of the anchor. Communicates over ``axis_name``.
        """
        if self.comp is not None:
            drift = [a - x for a, x in zip(anchor, local)]
            delta, comp_state = self.comp.update(drift, comp_state, anchor)
        else:
            mean = local
            if self.axis_name is not None:
                mean = buckets.bucketed_pmean(local, self.axis_name, self.bucket_bytes)
            delta = [a - m for a, m in zip(anchor, mean)]
        step, outer_state = self.outer.update(delta, outer_state, anchor)
        return add_updates(anchor, step), outer_state, comp_state

    def _fragment(self, f, s, parts, overlap):
        """Fragment ``f`` at inner step ``s``: send (unless ``overlap``), merge what lands."""
        local, anchor, outer_state, comp_state = parts
        sends = s % self.every == self.offsets[f]
        if not overlap:
            anchor, outer_state, comp_state = typed_cond(
                sends, self.send, lambda _local, *rest: rest, *parts
            )
        lands = (s - self.delay >= 1) & ((s - self.delay) % self.every == self.offsets[f])
        mix = self.mix
        merged = [(mix * x + (1.0 - mix) * a).astype(x.dtype) for x, a in zip(local, anchor)]
        local = [jnp.where(lands, m, x) for m, x in zip(merged, local)]
        return local, anchor, outer_state, comp_state, sends

    def update(self, updates, state, params=None, *, overlap: bool = False):
        checks.require_params(params, "streaming_diloco")
        checks.check_state(state, StreamingDiLoCoState, "streaming_diloco")
        collectives.check_per_worker(updates, self.axis_name)
        u, inner_state = self.inner.update(updates, state.inner_state, params)
        s = state.count + 1  # this is inner step s (1-based)
        local = jax.tree.leaves(add_updates(params, u))
        anchor, treedef = jax.tree.flatten(state.anchor)
        outer_states, comp_states, syncs = [], [], state.syncs
        for f, m in enumerate(self.members(params)):
            parts = (_pick(local, m), _pick(anchor, m), state.outer_state[f],
                     state.compressor_state[f])  # fmt: skip
            loc, anc, o, c, sent = self._fragment(f, s, parts, overlap)
            local, anchor = _put(local, m, loc), _put(anchor, m, anc)
            outer_states.append(o)
            comp_states.append(c)
            syncs = syncs + sent.astype(jnp.int32)
        new = treedef.unflatten(local)
        return updates_to(new, params, u), StreamingDiLoCoState(
            count=inc_count(state.count),
            syncs=syncs,
            inner_state=inner_state,
            anchor=treedef.unflatten(anchor),
            outer_state=tuple(outer_states),
            compressor_state=tuple(comp_states),
        )

    def transform(self, *, overlap: bool = False) -> optax.GradientTransformation:
        """The optax transform; ``overlap=True``: no exchange in ``update`` (see ``Overlap``)."""
        if overlap and self.delay < 1:
            raise ValueError(
                "delay: overlap=True needs delay >= 1 (the steps the exchange overlaps); got 0"
            )

        def update_fn(updates, state, params=None):
            return self.update(updates, state, params, overlap=overlap)

        return optax.GradientTransformation(self.init, update_fn)
