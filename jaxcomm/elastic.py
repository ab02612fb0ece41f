"""Fault-tolerant DiLoCo: replicas that survive a lost worker, riding on torchft.

Each replica group is its own JAX program (its own process, its own devices;
no ``jax.distributed`` across replicas). It runs its inner steps on device
(jitted, e.g. a ``lax.scan`` of H steps) and meets the others only at the
outer sync, where :class:`ElasticDiLoCo` hands the pseudo-gradient to a
torchft ``Manager`` (Meta's fault-tolerant training library, an optional
extra: ``pip install "jaxcomm[ft]"``). torchft owns the protocol: the
lighthouse forms a quorum of the live replicas for every sync, its
reconfigurable gloo process group carries the all-reduce, ``should_commit``
says whether the sync succeeded, and a replica that (re)joins behind the
others heals by pulling a live peer's state over HTTP. Nothing here is a
protocol of its own.

One outer round (:meth:`ElasticDiLoCo.sync`)::

    manager.start_quorum()                # live replicas; a late joiner heals here
    delta = anchor - params               # float32, one flat buffer (+ a weight word)
    manager.allreduce(delta, SUM)         # over the quorum's gloo group
    if manager.should_commit():           # no error anywhere in the round
        anchor = anchor + outer(delta_sum / weight_sum);  params = anchor
    else:
        params = anchor                   # the round is rolled back, never half-applied

A replica that healed in this round sends zeros with weight 0, so the mean is
over the replicas that did the work (torchft's own DiLoCo counts the healed
copy again). With ``fragments=F`` (Streaming DiLoCo), round ``r`` syncs
fragment ``r % F`` only (the leaves of
:func:`jaxcomm.loco.streaming.fragment_of`); the others stay local.

Streaming DiLoCo's overlap (its ``tau`` and ``alpha``, torchft's
``fragment_sync_delay`` and ``fragment_update_alpha``): :meth:`ElasticDiLoCo.start`
forms the quorum, takes the pseudo-gradient and launches the all-reduce without
waiting; the replica takes ``tau`` more inner steps while it travels;
:meth:`ElasticDiLoCo.finish` waits, asks ``should_commit`` and sets the
fragment to ``(1 - mix) * new_anchor + mix * local`` (``local``: the params
after those ``tau`` steps); a rolled-back round sets it to the old anchor, as
torchft does. :meth:`ElasticDiLoCo.sync` is ``start`` then ``finish`` with no
step between (``tau = 0``).

Why torchft and not JAX's own fault tolerance: on CPU, ``jax.distributed``
cannot heal a restarted process into a running job, nor survive losing
process 0 (the coordination service lives there). Outer syncs of DiLoCo are
rare and host-side anyway, so they can travel through torchft's gloo group
while the inner steps stay on device.

What a lost replica costs:
  * killed between syncs (during its inner steps): the lighthouse drops it at
    its heartbeat timeout, the survivors' next sync forms a smaller quorum and
    commits; nothing is lost but the dead replica's work;
  * killed inside the outer all-reduce: the survivors' all-reduce fails,
    ``should_commit`` is False everywhere, each rolls back to its last anchor
    (that round's inner steps are lost) and the next round goes on without it
    (``should_commit`` is decided per replica: one whose all-reduce happened to
    finish commits, and a peer that rolled back heals from it at the next quorum);
  * restarted: it builds a fresh ``ElasticDiLoCo`` and calls :meth:`join`
    (a sync with no inner steps); at the quorum it is behind, so it loads
    params, inner optimizer state, anchor, outer state and step counters from
    a peer (bit-exact, dtypes included) and trains on in step with the others.

Limits: one process per replica group (torchft's group rank 0; a replica
spanning several JAX processes would need torchft's group-rank plumbing); the
state a peer sends is the whole replica state, host-side; every-step
data-parallel compressors (``jaxcomm.topk`` ...) keep restart-from-checkpoint
(orbax, ``experiments/checkpoints.py``): a step-level quorum would put a
lighthouse round trip on every step.

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of
  Language Models", 2023, arXiv:2311.08105. Douillard et al., "Streaming
  DiLoCo with overlapping communication", 2025, arXiv:2501.18512. torchft:
  https://github.com/pytorch/torchft (Manager, lighthouse, local_sgd.DiLoCo).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import checks
from jaxcomm.ft_manager import (
    gloo_manager,
    import_torch,
    load_tree_state_dict,
    route_address,
    tree_state_dict,
)
from jaxcomm.loco.streaming import fragment_of

__all__ = [
    "ElasticDiLoCo",
    "gloo_manager",
    "load_tree_state_dict",
    "route_address",
    "tree_state_dict",
]

_OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


class ElasticDiLoCo:
    """DiLoCo's outer loop for one replica that is its own JAX program, over torchft.

    The replica trains with its own jitted inner steps and calls :meth:`sync`
    every H inner steps (every ``H / fragments`` with fragments). See the
    module docstring for the round, the rollback and healing.

    Args:
      manager: a torchft ``Manager`` with ``use_async_quorum=False``
        (:func:`gloo_manager` builds one).
      params: the replica's initial params (floating-point leaves).
      inner_state: the inner optimizer's state (healed with the rest).
      outer: the outer optimizer; default ``optax.sgd(0.7, momentum=0.9,
        nesterov=True)`` as in the paper.
      fragments: Streaming DiLoCo's fragment count (1: DiLoCo); round ``r``
        syncs fragment ``r % fragments``.
      mix: Streaming DiLoCo's ``alpha`` in ``[0, 1]``: a committed fragment
        becomes ``(1 - mix) * anchor + mix * local`` (0: the anchor, DiLoCo).
      delay: Streaming DiLoCo's ``tau``: the inner steps the caller takes
        between :meth:`start` and :meth:`finish` (``finish(steps=delay)``).
        A peer serving a heal from inside its :meth:`start` is that many
        steps before its round's end: a replica that heals in :meth:`join`
        takes the peer's position after them (it skips those batches), so
        that its rounds line up with the peers'.
      key: the name this state is registered under with the manager.

    Example:
      >>> manager = jaxcomm.elastic.gloo_manager("replica_0", "http://localhost:29650")
      >>> loop = jaxcomm.ElasticDiLoCo(manager, params, inner.init(params))
      >>> params, state = loop.join()          # a restarted replica heals here
      >>> while loop.rounds < 100:
      ...     params, state = inner_steps(params, state, loop.inner_steps)  # jitted, H steps
      ...     params, state, committed = loop.sync(params, state, steps=H)

      With overlap (``tau`` inner steps while the fragment travels)::

          params, state = loop.start(params, state, steps=H // F - tau)
          params, state = inner_steps(params, state, tau)
          params, state, committed = loop.finish(params, state, steps=tau)

      or the same in one call, ``inner(params, state, position, n) -> (params,
      state, aux)`` taking ``n`` steps from data position ``position``:
      ``params, state, committed, auxes = loop.round(params, state, inner,
      steps=H // F)``.

    References:
      Douillard et al. 2023, arXiv:2311.08105; Streaming DiLoCo, 2025,
      arXiv:2501.18512; torchft (github.com/pytorch/torchft).
    """

    def __init__(
        self,
        manager: Any,
        params: Any,
        inner_state: Any,
        *,
        outer: optax.GradientTransformation = _OUTER,
        fragments: int = 1,
        mix: float = 0.0,
        delay: int = 0,
        key: str = "jaxcomm_diloco",
    ) -> None:
        self._torch = import_torch()
        if getattr(manager, "_use_async_quorum", True):
            raise ValueError(
                "manager: DiLoCo needs a synchronous quorum (torchft Manager with "
                "use_async_quorum=False; jaxcomm.elastic.gloo_manager builds one)"
            )
        outer = checks.check_tx(outer, "outer")
        fragments = checks.check_int(fragments, "fragments", 1)
        if not 0.0 <= float(mix) <= 1.0:
            raise ValueError(f"mix: {mix} is outside [0, 1] (Streaming DiLoCo's alpha)")
        self._mix = float(mix)
        self._delay = checks.check_int(delay, "delay", 0)
        self._pending = None  # a started round: (fragment, members, buffer, work)
        self._ahead = 0  # steps this replica takes before its round ends (what a healer skips)
        self._healed_ahead = 0  # the peer's, when this replica healed
        for i, x in enumerate(jax.tree.leaves(params)):
            if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
                raise TypeError(f"params: leaf {i} has dtype {jnp.asarray(x).dtype}; "
                                "the outer step moves floating-point leaves only")  # fmt: skip
        self._manager = manager
        self._outer = outer
        self._params = jax.tree.map(jnp.asarray, params)
        self._inner_state = inner_state
        self._anchor = self._params
        owner = fragment_of(self._params, fragments)
        self._members = [[j for j, f in enumerate(owner) if f == g] for g in range(fragments)]
        # the outer state in float32 (momentum of low-precision params, as the deltas)
        f32 = [x.astype(jnp.float32) for x in jax.tree.leaves(self._anchor)]
        self._outer_state = tuple(outer.init([f32[j] for j in m]) for m in self._members)
        self.inner_steps = 0  # inner steps taken on this trajectory (a data position)
        self.healed = False  # whether the last sync loaded a peer's state
        self.committed = False  # whether the last round committed
        self.participants = 0  # replicas in the last sync's quorum
        self.wait_s = 0.0  # seconds the last :meth:`round` spent in start and finish
        self._delta = jax.jit(_delta)
        self._blend = jax.jit(_blend, static_argnums=2)
        self._apply = jax.jit(lambda a, s, d: _outer_step(outer, a, s, d))
        manager.register_state_dict_fn(key, self.load_state_dict, self.state_dict)

    @property
    def params(self) -> Any:
        return self._params

    @property
    def inner_state(self) -> Any:
        return self._inner_state

    @property
    def anchor(self) -> Any:
        """The global params (each fragment as of its last committed outer step)."""
        return self._anchor

    @property
    def outer_state(self) -> tuple:
        """Each fragment's outer optimizer state (float32, whatever the params' dtype)."""
        return self._outer_state

    @property
    def rounds(self) -> int:
        """Outer rounds committed (the manager's step; healed from a peer)."""
        return self._manager.current_step()

    def join(self) -> tuple[Any, Any]:
        """A sync with no inner steps: call it once before training (a late replica heals).

        Returns:
          ``(params, inner_state)`` to start the inner steps from.
        """
        params, inner_state, _ = self.sync(self._params, self._inner_state, steps=0)
        if self.healed:  # the peer served it from before its delay steps (see ``delay``)
            self.inner_steps += self._healed_ahead
        return params, inner_state

    def sync(self, params: Any, inner_state: Any, *, steps: int) -> tuple[Any, Any, bool]:
        """One outer round over the live replicas (see the module docstring).

        Args:
          params: the params after this round's inner steps.
          inner_state: the inner optimizer's state after them.
          steps: inner steps taken since the last sync (counted in ``inner_steps``).

        Returns:
          ``(params, inner_state, committed)``: the params to go on from (the
          new anchor's fragment if committed, mixed with the local one by
          ``mix``; the old anchor's if rolled back), the inner state (a peer's
          if this replica healed), and whether the round committed.
        """
        params, inner_state = self._start(params, inner_state, steps, ahead=0)
        return self._finish(params, inner_state, 0)

    def round(
        self, params: Any, inner_state: Any, inner: Callable, *, steps: int
    ) -> tuple[Any, Any, bool, list]:
        """One whole round: inner steps, :meth:`start`, ``delay`` steps beside it, :meth:`finish`.

        Args:
          params, inner_state: where the round's inner steps start.
          inner: ``inner(params, inner_state, position, n) -> (params, inner_state, aux)``
            takes ``n`` inner steps from data position ``position`` (its first
            batch is the one the trajectory's step ``position`` draws).
          steps: the round's inner steps in all (``H / fragments``), more than ``delay``.

        Returns:
          ``(params, inner_state, committed, auxes)``: as :meth:`sync`, and the
          ``aux`` of each ``inner`` call in order (one, or two with a delay).
          ``wait_s`` then holds the seconds spent inside :meth:`start` and
          :meth:`finish`: the exchange's time not hidden behind the steps.
        """
        if checks.check_int(steps, "steps", 1) <= self._delay:
            raise ValueError(f"steps: {steps} in a round, but delay={self._delay} of them "
                             "travel beside the all-reduce (need steps > delay)")  # fmt: skip
        params, inner_state, aux = inner(params, inner_state, self.inner_steps, steps - self._delay)
        auxes = [aux]
        t = time.perf_counter()
        params, inner_state = self.start(params, inner_state, steps=steps - self._delay)
        self.wait_s = time.perf_counter() - t
        if self._delay:  # the all-reduce travels beside these steps
            params, inner_state, aux = inner(params, inner_state, self.inner_steps, self._delay)
            auxes.append(aux)
        t = time.perf_counter()
        params, inner_state, committed = self.finish(params, inner_state, steps=self._delay)
        self.wait_s += time.perf_counter() - t
        return params, inner_state, committed, auxes

    def start(self, params: Any, inner_state: Any, *, steps: int) -> tuple[Any, Any]:
        """The first half of a round: quorum, pseudo-gradient, all-reduce launched, not waited.

        Args:
          params, inner_state: after the inner steps since the last round.
          steps: inner steps taken since the last round.

        Returns:
          ``(params, inner_state)`` to take the overlapped inner steps from: the
          same ones, or a peer's if this replica healed at the quorum.
        """
        return self._start(params, inner_state, steps, ahead=self._delay)

    def _start(self, params: Any, inner_state: Any, steps: int, ahead: int) -> tuple[Any, Any]:
        from torch.distributed import ReduceOp

        if self._pending is not None:
            raise RuntimeError("start: the round started before has not finished (call finish)")
        self._check_structure(params)
        self.inner_steps += checks.check_int(steps, "steps", 0)
        # what a healing peer is sent, if the quorum asks for it
        self._params, self._inner_state, self._ahead = params, inner_state, ahead
        self.healed = False
        self._manager.start_quorum()  # may call load_state_dict (sets self.healed)
        self.participants = self._manager.num_participants()
        f = self._manager.current_step() % len(self._members)
        members = self._members[f]
        leaves, anchor = jax.tree.leaves(self._params), jax.tree.leaves(self._anchor)
        weight = jnp.float32(0.0 if self.healed else 1.0)
        delta = self._delta([anchor[j] for j in members], [leaves[j] for j in members], weight)
        buf = self._torch.from_numpy(np.array(delta))
        work = self._manager.allreduce(buf, reduce_op=ReduceOp.SUM)
        self._pending = (f, members, buf, work)
        return self._params, self._inner_state

    def finish(self, params: Any, inner_state: Any, *, steps: int) -> tuple[Any, Any, bool]:
        """The second half: wait for the all-reduce, commit or roll back, the outer step.

        Args:
          params, inner_state: after the inner steps taken since :meth:`start`.
          steps: those inner steps (``tau``).

        Returns:
          ``(params, inner_state, committed)`` as :meth:`sync`.
        """
        if checks.check_int(steps, "steps", 0) != self._delay:
            raise ValueError(f"steps: {steps} inner steps since start, but delay={self._delay}")
        return self._finish(params, inner_state, steps)

    def _finish(self, params: Any, inner_state: Any, steps: int) -> tuple[Any, Any, bool]:
        if self._pending is None:
            raise RuntimeError("finish: no round was started (call start first)")
        self._check_structure(params)
        f, members, buf, work = self._pending
        self._pending = None
        self.inner_steps += steps
        work.wait()
        committed = self._manager.should_commit()
        leaves, anchor = jax.tree.leaves(params), jax.tree.leaves(self._anchor)
        a_f = [anchor[j] for j in members]
        if committed:
            a_f, s_f = self._apply(a_f, self._outer_state[f], jnp.asarray(buf.numpy()))
            anchor = _put(anchor, members, a_f)
            self._anchor = jax.tree.unflatten(jax.tree.structure(self._anchor), anchor)
            self._outer_state = _replace(self._outer_state, f, s_f)
            if self._mix:
                a_f = self._blend(a_f, [leaves[j] for j in members], self._mix)
        # rolled back, the fragment goes on from the old anchor (never half-applied)
        treedef = jax.tree.structure(params)
        self._params = jax.tree.unflatten(treedef, _put(leaves, members, a_f))
        self._inner_state, self.committed = inner_state, committed
        return self._params, self._inner_state, committed

    def _check_structure(self, params: Any) -> None:
        if jax.tree.structure(params) != jax.tree.structure(self._anchor):
            raise ValueError(
                f"params: structure {jax.tree.structure(params)} is not the initial params' "
                f"{jax.tree.structure(self._anchor)}"
            )

    def state_dict(self) -> dict:
        """Everything a restarted replica heals from (torchft calls it on a live peer)."""
        return {
            "params": tree_state_dict(self._params),
            "inner_state": tree_state_dict(self._inner_state),
            "anchor": tree_state_dict(self._anchor),
            "outer_state": tree_state_dict(self._outer_state),
            "inner_steps": int(self.inner_steps),
            "ahead": int(self._ahead),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output bit-exactly (torchft calls it when healing)."""
        self._params = load_tree_state_dict(self._params, state["params"], "params")
        self._inner_state = load_tree_state_dict(
            self._inner_state, state["inner_state"], "inner_state"
        )
        self._anchor = load_tree_state_dict(self._anchor, state["anchor"], "anchor")
        self._outer_state = load_tree_state_dict(
            self._outer_state, state["outer_state"], "outer_state"
        )
        self.inner_steps = int(state["inner_steps"])
        self._healed_ahead = int(state["ahead"])
        self.healed = True


def _delta(anchor: list, params: list, weight: jax.Array) -> jax.Array:
    """``weight * (anchor - params)`` in float32, flat, with ``weight`` appended."""
    parts = [
        (a.astype(jnp.float32) - p.astype(jnp.float32)).ravel() for a, p in zip(anchor, params)
    ]
    return jnp.concatenate([weight * jnp.concatenate(parts), weight[None]])


def _blend(anchor: list, local: list, mix: float) -> list:
    """``(1 - mix) * anchor + mix * local`` in float32, in each leaf's dtype."""
    return [
        ((1 - mix) * a.astype(jnp.float32) + mix * x.astype(jnp.float32)).astype(x.dtype)
        for a, x in zip(anchor, local)
    ]


def _outer_step(outer: optax.GradientTransformation, anchor: list, state: Any, total: jax.Array):
    """The outer step on the weighted mean of the summed buffer ``[sum delta, sum weight]``."""
    mean = total[:-1] / total[-1]
    deltas, start = [], 0
    for a in anchor:
        deltas.append(mean[start : start + a.size].reshape(a.shape))
        start += a.size
    updates, state = outer.update(deltas, state, anchor)
    return optax.apply_updates(anchor, updates), state


def _put(leaves: list, members: list[int], values: list) -> list:
    out = list(leaves)
    for j, v in zip(members, values):
        out[j] = v
    return out


def _replace(states: tuple, f: int, new: Any) -> tuple:
    return states[:f] + (new,) + states[f + 1 :]
