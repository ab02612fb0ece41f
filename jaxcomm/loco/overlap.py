"""Streaming DiLoCo with real overlap: each fragment's exchange runs in a host thread.

Build the transform with ``overlap=True`` (its ``update`` then never
communicates) and drive the training step through :class:`Overlap`::

    rule = jaxcomm.loco.StreamingDiLoCo(optax.adamw(4e-4), every=100, fragments=4,
                                        delay=5, axis_name="data")
    tx = rule.transform(overlap=True)
    ov = jaxcomm.loco.Overlap(rule, mesh)
    for batch in batches:
        params, opt_state, loss = ov.step(train_step, params, opt_state, batch)
    opt_state = ov.drain(opt_state)  # before a checkpoint (training may go on after it)

After the call of inner step ``s`` in which fragment ``f`` sends,
:meth:`Overlap.step` starts the fragment's exchange and outer step (a
program of its own, :meth:`StreamingDiLoCo.send`) in a host thread on the
params that call returned, and dispatches the next calls without waiting;
before the call of step ``s + delay`` (whose update merges the fragment) it
joins the thread and writes the new anchor, outer and compressor state of
the fragment into the optimizer state. The arithmetic is that of
``overlap=False``: the anchor of a fragment is read only by its merge and
its next send, so writing it early (:meth:`Overlap.drain`) changes nothing.

Why a thread: on XLA:CPU a second program dispatched to the same device
waits for the first, so JAX's asynchronous dispatch alone does not overlap
the exchange (``experiments/bench/overlap.py`` measures both). A program
running in another host thread does.

Layout: ``train_step(params, opt_state, *args)`` returns ``(params,
opt_state, ...)`` for one inner step; with a ``mesh``, every leaf of
``params`` and ``opt_state`` carries a leading worker axis sharded over
``rule.axis_name`` (per-worker params, as DiLoCo needs); without one, a
single worker. The step must run no collective of its own while a fragment
is in flight (two threads' collectives on one communicator could interleave
differently on different processes): average metrics at merge steps or on
the host.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomm.loco.streaming import StreamingDiLoCo, StreamingDiLoCoState

__all__ = ["Overlap"]


class Overlap:
    """Runs a :class:`StreamingDiLoCo` rule's exchanges in host threads (see the module doc).

    ``wait_s`` accumulates the host seconds :meth:`step` waited for an
    exchange to land: the part of the communication the ``delay`` steps did
    not hide.

    Args:
      rule: the rule whose ``transform(overlap=True)`` the step uses; ``delay >= 1``.
      mesh: the mesh of per-worker params and state (leading worker axis
        sharded over ``rule.axis_name``); ``None`` for one worker.
    """

    def __init__(self, rule: StreamingDiLoCo, mesh: Mesh | None = None) -> None:
        if rule.delay < 1:
            raise ValueError("rule: Overlap needs delay >= 1 (the steps an exchange overlaps)")
        if mesh is not None and rule.axis_name not in mesh.axis_names:
            raise ValueError(
                f"mesh: has axes {mesh.axis_names}, not the rule's axis_name={rule.axis_name!r}"
            )
        self.rule, self.mesh = rule, mesh
        self.step_count: int | None = None  # inner steps done, on the host
        self._flight: dict[int, tuple[threading.Thread, list]] = {}
        self._programs: dict[int, Callable] = {}
        self._members: list[list[int]] | None = None  # leaf indices per fragment, found once
        self.wait_s = 0.0  # host seconds spent waiting for exchanges to land (not hidden)

    def step(self, fn: Callable, params: Any, opt_state: Any, *args: Any) -> tuple:
        """One inner step ``fn(params, opt_state, *args)``, merging and starting exchanges."""
        if self.step_count is None:  # once: where a restored state left off
            count = _state(opt_state).count
            shards = getattr(count, "addressable_shards", None)  # a process's own rows
            self.step_count = int(np.asarray(shards[0].data if shards else count).reshape(-1)[0])
        s = self.step_count + 1
        for f in self.rule.lands(s):
            if f in self._flight:  # not joined already by :meth:`drain`
                opt_state = self._join(f, opt_state)
        out = fn(params, opt_state, *args)
        for f in self.rule.sends(s):
            self._start(f, out[0], out[1])
        self.step_count = s
        return out

    @property
    def in_flight(self) -> list[int]:
        """The fragments whose exchange has started and not yet been merged."""
        return sorted(self._flight)

    def program(self, f: int) -> Callable:
        """The compiled exchange + outer step of fragment ``f`` (what the thread runs)."""
        return self._program(f)

    def drain(self, opt_state: Any) -> Any:
        """``opt_state`` with every exchange in flight joined and written in (exact; see above)."""
        for f in sorted(self._flight):
            opt_state = self._join(f, opt_state)
        return opt_state

    def _worker_params(self, params: Any) -> Any:
        if self.mesh is None:
            return params
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)

    def _program(self, f: int) -> Callable:
        if f not in self._programs:
            send = self.rule.send
            if self.mesh is None:
                self._programs[f] = jax.jit(send)
            else:
                first = lambda t: jax.tree.map(lambda x: x[0], t)
                lead = lambda t: jax.tree.map(lambda x: x[None], t)
                spec = P(self.rule.axis_name)
                self._programs[f] = jax.jit(
                    jax.shard_map(
                        lambda *a: lead(send(*first(a))),
                        mesh=self.mesh,
                        in_specs=spec,
                        out_specs=spec,
                    )  # fmt: skip
                )
        return self._programs[f]

    def _fragment(self, f: int, params: Any) -> list[int]:
        """Leaf indices of fragment ``f`` (the split depends only on the shapes: computed once)."""
        if self._members is None:
            self._members = self.rule.members(self._worker_params(params))
        return self._members[f]

    def warm_up(self, params: Any, opt_state: Any) -> None:
        """Compile every fragment's exchange program by running it once on this state.

        The results are discarded (nothing changes), but the exchanges are real: call
        it on every process, before the first :meth:`step`. Otherwise a program
        compiles in the thread of its first send, and the step that merges it waits
        for the compilation (minutes for a large compressed fragment on CPU).
        """
        for f in range(self.rule.fragments):
            jax.block_until_ready(self._program(f)(*self._args(f, params, opt_state)))

    def _args(self, f: int, params: Any, opt_state: Any) -> tuple:
        """The exchange program's arguments: the fragment's params, anchor and states."""
        state = _state(opt_state)
        m = self._fragment(f, params)
        params_leaves, anchor_leaves = jax.tree.leaves(params), jax.tree.leaves(state.anchor)
        local = [params_leaves[j] for j in m]
        anchor = [anchor_leaves[j] for j in m]
        return local, anchor, state.outer_state[f], state.compressor_state[f]

    def _start(self, f: int, params: Any, opt_state: Any) -> None:
        args = self._args(f, params, opt_state)
        box: list = []
        program = self._program(f)
        thread = threading.Thread(
            target=lambda: box.append(jax.block_until_ready(program(*args))), daemon=True
        )
        thread.start()
        self._flight[f] = (thread, box)

    def _join(self, f: int, opt_state: Any) -> Any:
        thread, box = self._flight.pop(f)
        t0 = time.perf_counter()
        thread.join()
        self.wait_s += time.perf_counter() - t0
        if not box:
            raise RuntimeError(f"the exchange of fragment {f} failed (see the thread's error)")
        anchor_f, outer_f, comp_f = box[0]
        state = _state(opt_state)
        leaves, treedef = jax.tree.flatten(state.anchor)
        m = self._fragment(f, state.anchor)
        for j, x in zip(m, anchor_f):
            leaves[j] = x
        replace = lambda t, x: t[:f] + (x,) + t[f + 1 :]
        new = state._replace(
            anchor=treedef.unflatten(leaves),
            outer_state=replace(state.outer_state, outer_f),
            compressor_state=replace(state.compressor_state, comp_f),
        )
        return new if isinstance(opt_state, StreamingDiLoCoState) else _swap(opt_state, new)


def _state(opt_state: Any) -> StreamingDiLoCoState:
    if isinstance(opt_state, StreamingDiLoCoState):
        return opt_state
    found = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, StreamingDiLoCoState))
        if isinstance(x, StreamingDiLoCoState)
    ]
    if len(found) != 1:
        raise ValueError(f"opt_state: expected one StreamingDiLoCoState inside, found {len(found)}")
    return found[0]


def _swap(opt_state: Any, new: StreamingDiLoCoState) -> Any:
    is_sd = lambda x: isinstance(x, StreamingDiLoCoState)
    return jax.tree.map(lambda x: new if is_sd(x) else x, opt_state, is_leaf=is_sd)
