"""Seconds for one collective on a :class:`~jaxcomm.netsim.links.Link` or a
:class:`~jaxcomm.netsim.links.Cluster` (layer 1 of :mod:`jaxcomm.netsim`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from jaxcomm.netsim.links import Cluster, Link, choice, count, non_negative, positive

#: All-reduce algorithms understood by :func:`allreduce_time`.
ALGORITHMS = ("ring", "halving_doubling", "hierarchical", "parameter_server")
#: Collective kinds understood by :func:`collective_time` (those of ``wire_report``).
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


# --- collective costs -----------------------------------------------------------


def ring_allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of an ``nbytes`` payload: ``2(n-1)α + 2(n-1)/n · S/B``.

    Reduce-scatter then all-gather, ``n-1`` steps each, every step sending
    ``S/n`` bytes per worker.

    Args:
      nbytes: payload S per worker in bytes.
      n: number of workers, >= 1.
      link: the link between neighbours.

    Returns:
      Seconds.

    Example:
      >>> ring_allreduce_time(100e6, 8, Link(10e9))   # 2·7/8·100 MB / 1.25 GB/s
      0.14

    References:
      Patarasuk & Yuan, JPDC 2009.
    """
    n, nbytes = count("n", n), non_negative("nbytes", nbytes)
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * link.seconds(nbytes)


def halving_doubling_allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Recursive halving/doubling all-reduce: ``2⌈log2 n⌉α + 2(n-1)/n · S/B``.

    Rabenseifner's algorithm: the bandwidth term of the ring with a
    logarithmic number of messages (for n not a power of two, the
    ``⌈log2 n⌉`` rounds are the usual approximation).

    Args:
      nbytes: payload S per worker in bytes.
      n: number of workers, >= 1.
      link: the link between partners.

    Returns:
      Seconds.

    Example:
      >>> halving_doubling_allreduce_time(0, 5, Link(1e9, 1e-3))   # 2·3 rounds of α
      0.006

    References:
      Thakur, Rabenseifner & Gropp, IJHPCA 2005.
    """
    n, nbytes = count("n", n), non_negative("nbytes", nbytes)
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    return 2 * rounds * link.latency_s + 2 * (n - 1) / n * link.seconds(nbytes)


def allgather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather of ``nbytes`` per worker: ``(n-1)α + (n-1) · s/B``.

    Each worker receives every other worker's piece, so the cost grows with n
    (unlike an all-reduce): the reason sparse payloads lose at scale.

    Args:
      nbytes: the piece s each worker contributes, in bytes.
      n: number of workers, >= 1.
      link: the link between neighbours.

    Returns:
      Seconds.

    Example:
      >>> allgather_time(1e6, 9, Link(8e9))   # 8 pieces of 1 MB at 1 GB/s
      0.008

    References:
      Thakur, Rabenseifner & Gropp, IJHPCA 2005.
    """
    n, nbytes = count("n", n), non_negative("nbytes", nbytes)
    return (n - 1) * link.latency_s + (n - 1) * link.seconds(nbytes)


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of an ``nbytes`` payload: ``(n-1)α + (n-1)/n · S/B``.

    Args:
      nbytes: payload S per worker in bytes (each ends with S/n of the sum).
      n: number of workers, >= 1.
      link: the link between neighbours.

    Returns:
      Seconds.

    Example:
      >>> reduce_scatter_time(8e6, 4, Link(8e9))   # 3/4 · 8 MB at 1 GB/s
      0.006

    References:
      Thakur, Rabenseifner & Gropp, IJHPCA 2005.
    """
    n, nbytes = count("n", n), non_negative("nbytes", nbytes)
    return (n - 1) * link.latency_s + (n - 1) / n * link.seconds(nbytes)


def alltoall_time(nbytes: float, n: int, link: Link) -> float:
    """Pairwise-exchange all-to-all of an ``nbytes`` operand: ``(n-1)α + (n-1)/n · S/B``.

    Each worker keeps its own ``S/n`` row and sends one row to each of the
    ``n-1`` others, one peer per step (the two-phase exchange's first phase).

    Example:
      >>> alltoall_time(8e6, 4, Link(8e9))   # 3 rows of 2 MB at 1 GB/s
      0.006
    """
    n, nbytes = count("n", n), non_negative("nbytes", nbytes)
    return (n - 1) * link.latency_s + (n - 1) / n * link.seconds(nbytes)


def collective_permute_time(nbytes: float, n: int, link: Link) -> float:
    """One collective permute (every worker sends ``nbytes`` to one peer): ``α + s/B``.

    Args:
      nbytes: bytes each worker sends.
      n: number of workers, >= 1 (n = 1 sends to itself: free).
      link: the link between peers.

    Returns:
      Seconds.

    Example:
      >>> collective_permute_time(1e6, 8, Link(8e9, 1e-5))
      0.00101

    References:
      Thakur, Rabenseifner & Gropp, IJHPCA 2005.
    """
    n, nbytes = count("n", n), non_negative("nbytes", nbytes)
    return 0.0 if n == 1 else link.latency_s + link.seconds(nbytes)


def parameter_server_time(nbytes: float, n: int, link: Link, *, shards: int = 1) -> float:
    """Push to and pull from a parameter server: ``2α + 2n · S/(k·B)``.

    All n workers send S to the server and receive S back through the
    server's link; ``k = shards`` servers each hold ``S/k``.

    Args:
      nbytes: payload S per worker in bytes.
      n: number of workers, >= 1 (a single worker needs no server: free).
      link: the server's link.
      shards: number of server shards k, >= 1.

    Returns:
      Seconds.

    Example:
      >>> parameter_server_time(1e6, 8, Link(8e9), shards=2)   # 2·8·1 MB / (2 · 1 GB/s)
      0.008

    References:
      Li et al., "Scaling Distributed Machine Learning with the Parameter
      Server", OSDI 2014.
    """
    n, nbytes, shards = count("n", n), non_negative("nbytes", nbytes), count("shards", shards)
    if n == 1:
        return 0.0
    return 2 * link.latency_s + 2 * n * link.seconds(nbytes) / shards


def hierarchical_allreduce_time(nbytes: float, cluster: Cluster) -> float:
    """Two-level all-reduce: reduce-scatter in the node, all-reduce across, all-gather in.

    With m = ``n_nodes`` and p = ``per_node``:

    1. ring reduce-scatter of S among the p workers of a node (``intra``);
    2. ring all-reduce between nodes: each worker's ``S/p`` shard, p at once
       through the node's interface, i.e. S per interface:
       ``2(m-1)α + 2(m-1)/m · S/B_inter``;
    3. ring all-gather of the ``S/p`` shards inside the node (``intra``).

    When ``inter`` gives each worker the bandwidth of ``intra``
    (``inter.bandwidth_bps = p · intra.bandwidth_bps``) the bandwidth term is
    exactly the flat ring's, ``2(N-1)/N · S/B``; only the latency differs
    (``2(p-1) + 2(m-1)`` messages instead of ``2(N-1)``).

    Args:
      nbytes: payload S per worker in bytes.
      cluster: the :class:`Cluster`.

    Returns:
      Seconds.

    Example:
      >>> c = Cluster(4, 8, intra=Link(1200e9), inter=Link(100e9))
      >>> round(hierarchical_allreduce_time(100e6, c), 4)   # inter: 2·3/4·100 MB/12.5 GB/s
      0.0133

    References:
      Sergeev & Del Balso, "Horovod", 2018, arXiv:1802.05799 (hierarchical
      all-reduce); Mikami et al. 2018, arXiv:1811.05233 (2-D torus all-reduce).
    """
    nbytes = non_negative("nbytes", nbytes)
    m, p = cluster.n_nodes, cluster.per_node
    inside = reduce_scatter_time(nbytes, p, cluster.intra) + allgather_time(
        nbytes / p, p, cluster.intra
    )
    return inside + ring_allreduce_time(nbytes, m, cluster.inter)


def _resolve(target: Link | Cluster, n: int | None) -> tuple[int, Link]:
    """Workers and the link a flat collective sees, for a Link or a Cluster."""
    if isinstance(target, Cluster):
        if n is not None and n != target.n_workers:
            raise ValueError(
                f"n: a Cluster has n_workers={target.n_workers}; pass n=None or that number, "
                f"got {n}"
            )
        return target.n_workers, target.flat_link
    if isinstance(target, Link):
        if n is None:
            raise ValueError("n: the number of workers is required with a Link")
        return count("n", n), target
    raise TypeError(f"target: expected a Link or a Cluster, got {target!r}")


def allreduce_time(
    nbytes: float,
    target: Link | Cluster,
    *,
    n: int | None = None,
    algorithm: str = "ring",
    shards: int = 1,
) -> float:
    """All-reduce of ``nbytes`` with a named algorithm, on a Link or a Cluster.

    Args:
      nbytes: payload S per worker in bytes.
      target: a :class:`Link` (give ``n``) or a :class:`Cluster`.
      n: number of workers; ``None`` for a Cluster (its ``n_workers``).
      algorithm: ``"ring"``, ``"halving_doubling"`` (flat, on the cluster's
        slowest link), ``"hierarchical"`` (Cluster only; on a Link, a ring)
        or ``"parameter_server"`` (server on the slowest link).
      shards: parameter-server shards.

    Returns:
      Seconds.

    Example:
      >>> allreduce_time(100e6, Link(10e9), n=8)
      0.14
    """
    choice("algorithm", algorithm, ALGORITHMS)
    n_workers, link = _resolve(target, n)
    if algorithm == "hierarchical" and isinstance(target, Cluster):
        return hierarchical_allreduce_time(nbytes, target)
    if algorithm == "halving_doubling":
        return halving_doubling_allreduce_time(nbytes, n_workers, link)
    if algorithm == "parameter_server":
        return parameter_server_time(nbytes, n_workers, link, shards=shards)
    return ring_allreduce_time(nbytes, n_workers, link)


def collective_time(
    kind: str,
    nbytes: float,
    target: Link | Cluster,
    *,
    n: int | None = None,
    algorithm: str = "ring",
) -> float:
    """Seconds for one collective of a ``wire_report`` kind.

    Args:
      kind: ``"all_reduce"`` (uses ``algorithm``), ``"all_gather"``,
        ``"reduce_scatter"``, ``"all_to_all"`` or ``"collective_permute"`` (flat, on the
        cluster's slowest link).
      nbytes: bytes one worker contributes (all-reduce: S; all-gather: its
        piece s), as in :class:`jaxcomm.ledger.Collective`.
      target: a :class:`Link` (give ``n``) or a :class:`Cluster`.
      n: number of workers; ``None`` for a Cluster.
      algorithm: all-reduce algorithm, see :func:`allreduce_time`.

    Returns:
      Seconds.

    Example:
      >>> collective_time("all_gather", 1e6, Link(8e9), n=9)
      0.008
    """
    choice("kind", kind, KINDS)
    if kind == "all_reduce":
        return allreduce_time(nbytes, target, n=n, algorithm=algorithm)
    n_workers, link = _resolve(target, n)
    fn = {
        "all_gather": allgather_time,
        "reduce_scatter": reduce_scatter_time,
        "all_to_all": alltoall_time,
        "collective_permute": collective_permute_time,
    }[kind]
    return fn(nbytes, n_workers, link)


def powersgd_bytes(
    shapes: Iterable[Sequence[int]],
    rank: int,
    *,
    bytes_per_value: int = 4,
    min_compression_rate: float = 2.0,
) -> tuple[int, int, int]:
    """PowerSGD payload bytes: ``(P bytes, Q bytes, dense bytes)`` for a list of shapes.

    Each shape is viewed as an ``a × b`` matrix (``a = shape[0]``, b the
    rest). It is compressed when ``(a+b)·r < a·b / min_compression_rate``:
    then P has ``a·r`` values and Q ``b·r``; otherwise (vectors, small
    matrices) it goes dense. This mirrors PyTorch's PowerSGD DDP hook.

    Args:
      shapes: parameter shapes.
      rank: rank r, >= 1.
      bytes_per_value: bytes per value on the wire (4 for fp32).
      min_compression_rate: see above (PyTorch's default 2).

    Returns:
      ``(p_bytes, q_bytes, dense_bytes)`` per worker.

    Example:
      >>> powersgd_bytes([(1000, 500), (1000,)], 2)
      (8000, 4000, 4000)

    References:
      Vogels et al., NeurIPS 2019, arXiv:1905.13727.
    """
    rank = count("rank", rank)
    rate = positive("min_compression_rate", min_compression_rate)
    p = q = dense = 0
    for shape in shapes:
        size = math.prod(shape)
        a = shape[0] if len(shape) >= 2 else 1
        b = size // a if len(shape) >= 2 else size
        if len(shape) >= 2 and (a + b) * rank < a * b / rate:
            p += a * rank
            q += b * rank
        else:
            dense += size
    return p * bytes_per_value, q * bytes_per_value, dense * bytes_per_value


def powersgd_time(
    p_bytes: float,
    q_bytes: float,
    target: Link | Cluster,
    *,
    n: int | None = None,
    dense_bytes: float = 0.0,
    algorithm: str = "ring",
) -> float:
    """PowerSGD's exchange: all-reduce P, orthogonalise, then all-reduce Q (sequential).

    The two all-reduces cannot overlap (Q = Mᵀ P̂ needs the reduced P), so
    the latency term is paid twice; uncompressed leaves add one dense
    all-reduce (skipped when ``dense_bytes`` is 0).

    Args:
      p_bytes: bytes of all P factors (batched into one all-reduce).
      q_bytes: bytes of all Q factors.
      target: a :class:`Link` (give ``n``) or a :class:`Cluster`.
      n: number of workers; ``None`` for a Cluster.
      dense_bytes: bytes of the leaves sent uncompressed.
      algorithm: all-reduce algorithm, see :func:`allreduce_time`.

    Returns:
      Seconds.

    Example:
      >>> powersgd_time(8000, 4000, Link(8e9), n=2)   # 2 all-reduces: 8 µs + 4 µs
      1.2e-05

    References:
      Vogels et al., NeurIPS 2019, arXiv:1905.13727.
    """
    t = allreduce_time(p_bytes, target, n=n, algorithm=algorithm)
    t += allreduce_time(q_bytes, target, n=n, algorithm=algorithm)
    if dense_bytes:
        t += allreduce_time(dense_bytes, target, n=n, algorithm=algorithm)
    return t
