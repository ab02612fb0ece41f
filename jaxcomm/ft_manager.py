"""torchft's side of :mod:`jaxcomm.elastic`: a one-process replica group's ``Manager``
over gloo, and pytrees as the state dicts torchft sends a healing peer (bit-exact).

torch and torchft are an optional extra (``pip install "jaxcomm[ft]"``); nothing
here imports them until it is called.
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

from jaxcomm import checks

__all__ = ["gloo_manager", "load_tree_state_dict", "route_address", "tree_state_dict"]

_HINT = 'jaxcomm.elastic needs torch and torchft: pip install "jaxcomm[ft]"'
# each gloo_manager's TCPStore lives as long as its Manager (peers rendezvous through it)
_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def import_torch():
    """``torch`` (after checking that torchft imports too); an ImportError naming the extra."""
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
    import_torch()
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
    torch = import_torch()
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
