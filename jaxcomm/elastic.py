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
copy again). With ``fragments=F`` (Streaming DiLoCo without overlap,
``delay=0, mix=0``), round ``r`` syncs fragment ``r % F`` only (the leaves
of :func:`jaxcomm.loco.streaming.fragment_of`); the others stay local.

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

import socket
import urllib.parse
import weakref
from datetime import timedelta
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import checks
from jaxcomm.loco.streaming import fragment_of

__all__ = ["ElasticDiLoCo", "gloo_manager", "load_tree_state_dict", "tree_state_dict"]

_OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)
_HINT = 'jaxcomm.elastic needs torch and torchft: pip install "jaxcomm[ft]"'
# each gloo_manager's TCPStore lives as long as its Manager (peers rendezvous through it)
_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _import_torch():
    try:
        import torch
        import torchft  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{_HINT} ({e})") from e
    return torch


def route_address(peer: str) -> str:
    """The address this machine reaches ``peer`` from: its interface on the route
    (``127.0.0.1`` for a local peer). No packet is sent."""
    if peer in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # a UDP connect only picks the route
        return s.getsockname()[0]


def gloo_manager(
    replica_id: str,
    lighthouse: str,
    *,
    min_replicas: int = 1,
    host: str | None = None,
    timeout_s: float = 60.0,
    quorum_timeout_s: float = 3600.0,
    init_sync: bool = True,
) -> Any:
    """A torchft ``Manager`` for a one-process replica group, over a gloo process group.

    Starts the replica group's TCP store (peers rendezvous through it) and a
    ``Manager`` with a synchronous quorum, as DiLoCo needs.

    Args:
      replica_id: this replica group's name; torchft appends a fresh uuid, so a
        restarted replica may reuse it (end it in digits: torchft's global rank).
      lighthouse: the lighthouse's address, e.g. ``"http://host:29650"``
        (``torchft_lighthouse --min_replicas 1 --bind [::]:29650``).
      min_replicas: fewest replicas a sync may commit with.
      host: the address the other replicas reach this one at. ``None``
        (default): this machine's address on its route to the lighthouse
        (:func:`route_address`): ``127.0.0.1`` for a local lighthouse, the
        interface that reaches it otherwise.
      timeout_s: the all-reduce, commit and healing timeout.
      quorum_timeout_s: how long a sync waits for its quorum (longer than a round).
      init_sync: at step 0 the replicas but one heal from it (identical start).

    Returns:
      A ``torchft.manager.Manager``; give it to :class:`ElasticDiLoCo`.
    """
    _import_torch()
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    if not isinstance(replica_id, str) or not replica_id:
        raise ValueError(f"replica_id: a non-empty string; got {replica_id!r}")
    min_replicas = checks.check_int(min_replicas, "min_replicas", 1)
    timeout = timedelta(seconds=checks.check_positive(timeout_s, "timeout_s"))
    if host is None:
        host = route_address(urllib.parse.urlsplit(lighthouse).hostname or "localhost")
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        checkpoint_transport=_transport(host, timeout),
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=checks.check_positive(quorum_timeout_s, "quorum")),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
        hostname=host,
        init_sync=init_sync,
    )
    _STORES[manager] = store
    return manager


def _transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (what a healing peer fetches from), advertising
    ``host``: torchft's own names ``socket.gethostname()``, which a peer resolves to itself
    where the replicas share a hostname (containers, network namespaces) or to an
    interface it cannot reach."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class HostTransport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return HostTransport(timeout=timeout, num_chunks=0)


def tree_state_dict(tree: Any) -> dict:
    """A pytree's leaves as torch uint8 tensors of their bytes, with dtype and shape.

    What torchft sends a healing peer; :func:`load_tree_state_dict` restores it
    bit-exactly (bfloat16, integer and bool leaves included).
    """
    torch = _import_torch()
    leaves = jax.tree.leaves(tree)
    arrays = [np.asarray(x) for x in leaves]
    for i, a in enumerate(arrays):
        if a.dtype == object or jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):
            raise TypeError(f"tree: leaf {i} has dtype {a.dtype}: only plain arrays travel")
    return {
        "bytes": [torch.from_numpy(np.array(a).reshape(-1).view(np.uint8)) for a in arrays],
        "dtypes": [a.dtype.name for a in arrays],
        "shapes": [list(a.shape) for a in arrays],
    }


def load_tree_state_dict(like: Any, state: dict, name: str = "tree") -> Any:
    """The pytree ``state`` (from :func:`tree_state_dict`) holds, in ``like``'s structure.

    Each leaf must have ``like``'s dtype and shape (``ValueError`` naming
    ``name`` and the leaf otherwise); JAX leaves land on ``like``'s sharding.
    """
    leaves, treedef = jax.tree.flatten(like)
    if len(state["bytes"]) != len(leaves):
        raise ValueError(f"{name}: {len(state['bytes'])} leaves sent, {len(leaves)} expected")
    out = []
    for i, (old, raw, dt, shape) in enumerate(
        zip(leaves, state["bytes"], state["dtypes"], state["shapes"])
    ):
        want = np.asarray(old) if not isinstance(old, jax.Array) else old
        if jnp.dtype(dt) != want.dtype or tuple(shape) != tuple(want.shape):
            raise ValueError(
                f"{name}: leaf {i} sent as {dt}{tuple(shape)}, expected "
                f"{want.dtype}{tuple(want.shape)}"
            )
        a = np.array(raw.numpy()).view(jnp.dtype(dt)).reshape(shape)
        if isinstance(old, jax.Array):
            out.append(jax.device_put(a, old.sharding))
        elif isinstance(old, np.ndarray):
            out.append(a)
        else:  # a Python scalar
            out.append(type(old)(a.item()))
    return jax.tree.unflatten(treedef, out)


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
      key: the name this state is registered under with the manager.

    Example:
      >>> manager = jaxcomm.elastic.gloo_manager("replica_0", "http://localhost:29650")
      >>> loop = jaxcomm.ElasticDiLoCo(manager, params, inner.init(params))
      >>> params, state = loop.join()          # a restarted replica heals here
      >>> while loop.rounds < 100:
      ...     params, state = inner_steps(params, state, loop.inner_steps)  # jitted, H steps
      ...     params, state, committed = loop.sync(params, state, steps=H)

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
        key: str = "jaxcomm_diloco",
    ) -> None:
        self._torch = _import_torch()
        if getattr(manager, "_use_async_quorum", True):
            raise ValueError(
                "manager: DiLoCo needs a synchronous quorum (torchft Manager with "
                "use_async_quorum=False; jaxcomm.elastic.gloo_manager builds one)"
            )
        outer = checks.check_tx(outer, "outer")
        fragments = checks.check_int(fragments, "fragments", 1)
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
        self.participants = 0  # replicas in the last sync's quorum
        self._delta = jax.jit(_delta)
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
        return params, inner_state

    def sync(self, params: Any, inner_state: Any, *, steps: int) -> tuple[Any, Any, bool]:
        """One outer round over the live replicas (see the module docstring).

        Args:
          params: the params after this round's inner steps.
          inner_state: the inner optimizer's state after them.
          steps: inner steps taken since the last sync (counted in ``inner_steps``).

        Returns:
          ``(params, inner_state, committed)``: the params to go on from (the
          new anchor's fragment if committed, the old anchor's if rolled
          back), the inner state (a peer's if this replica healed), and
          whether the round committed.
        """
        torch = self._torch
        from torch.distributed import ReduceOp

        if jax.tree.structure(params) != jax.tree.structure(self._anchor):
            raise ValueError(
                f"params: structure {jax.tree.structure(params)} is not the initial params' "
                f"{jax.tree.structure(self._anchor)}"
            )
        self.inner_steps += checks.check_int(steps, "steps", 0)
        # what a healing peer is sent, if the quorum asks for it
        self._params, self._inner_state = params, inner_state
        self.healed = False
        self._manager.start_quorum()  # may call load_state_dict (sets self.healed)
        self.participants = self._manager.num_participants()
        f = self._manager.current_step() % len(self._members)
        members = self._members[f]
        leaves = jax.tree.leaves(self._params)
        anchor = jax.tree.leaves(self._anchor)
        a_f, p_f = [anchor[j] for j in members], [leaves[j] for j in members]
        weight = jnp.float32(0.0 if self.healed else 1.0)
        buf = torch.from_numpy(np.array(self._delta(a_f, p_f, weight)))
        self._manager.allreduce(buf, reduce_op=ReduceOp.SUM).wait()
        committed = self._manager.should_commit()
        if committed:
            s_f = self._outer_state[f]
            a_f, s_f = self._apply(a_f, s_f, jnp.asarray(buf.numpy()))
            anchor = _put(anchor, members, a_f)
            self._anchor = jax.tree.unflatten(jax.tree.structure(self._anchor), anchor)
            self._outer_state = _replace(self._outer_state, f, s_f)
        # committed or not, the fragment goes on from the anchor (never half-applied)
        treedef = jax.tree.structure(self._params)
        self._params = jax.tree.unflatten(treedef, _put(leaves, members, a_f))
        return self._params, self._inner_state, committed

    def state_dict(self) -> dict:
        """Everything a restarted replica heals from (torchft calls it on a live peer)."""
        return {
            "params": tree_state_dict(self._params),
            "inner_state": tree_state_dict(self._inner_state),
            "anchor": tree_state_dict(self._anchor),
            "outer_state": tree_state_dict(self._outer_state),
            "inner_steps": int(self.inner_steps),
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
        self.healed = True


def _delta(anchor: list, params: list, weight: jax.Array) -> jax.Array:
    """``weight * (anchor - params)`` in float32, flat, with ``weight`` appended."""
    parts = [
        (a.astype(jnp.float32) - p.astype(jnp.float32)).ravel() for a, p in zip(anchor, params)
    ]
    return jnp.concatenate([weight * jnp.concatenate(parts), weight[None]])


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
