"""Alpha-beta network model: when is the network the bottleneck?

Pure Python (no JAX at import time). Three layers, each usable on its own:

1. **Collective costs** (Thakur et al. 2005; Patarasuk & Yuan 2009): seconds
   for one collective of ``nbytes`` over ``n`` workers on a :class:`Link`
   with latency α (s) and bandwidth B (``bandwidth_bps`` bits/s, so B/8 bytes/s):

   ===========================  ============================================
   ring all-reduce              ``2(n-1)α + 2(n-1)/n · S/B``
   halving/doubling all-reduce  ``2⌈log2 n⌉α + 2(n-1)/n · S/B``
   all-gather (s bytes each)    ``(n-1)α + (n-1) · s/B``
   reduce-scatter               ``(n-1)α + (n-1)/n · S/B``
   collective permute           ``α + s/B``
   parameter server, k shards   ``2α + 2n · S/(k·B)``
   hierarchical (m nodes × p)   reduce-scatter inside the node, all-reduce
                                between nodes, all-gather inside the node
   PowerSGD                     two all-reduces in sequence (P, then Q)
   ===========================  ============================================

   Every collective over ``n = 1`` worker costs nothing.

2. **Step time** (:func:`bucketed_step_time`, :func:`step_time`): compute
   ``T_c`` = forward + backward; gradients become ready bucket by bucket over
   the backward pass, each bucket's exchange starts when it is ready and the
   network is free, compression encode/decode run on the compute stream.
   ``SF = T_c / T_iter`` (Zhang et al. 2020). With many buckets and no
   latency this tends to ``T_iter = T_c + max(0, T_comm − backward time)``.

3. **Questions**: :func:`required_compression` (the compression ratio a
   link needs for a target SF), :func:`topk_allgather_ratio` /
   :func:`topk_break_even_density` (when top-k over all-gather beats a dense
   ring), :func:`exchange_time` / :func:`step_time_for` (time of a jaxcomm
   transform's :func:`jaxcomm.accounting.wire_report`).

Bandwidth convention for a :class:`Cluster`: ``intra`` is the bandwidth each
worker has to the others of its node (NVLink, PCIe); ``inter`` is the
bandwidth of a node's network interface, shared by its ``per_node`` workers
(a "100 Gbps network" is ``inter=Link(100e9)``). A flat ring over the cluster
crosses each node boundary once, so its slowest hop is
``min(intra, inter)``.

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
  Operations in MPICH", IJHPCA 2005.
  Patarasuk, Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009.
  Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
  Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization", NeurIPS 2019, arXiv:1905.13727.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

__all__ = [
    "ALGORITHMS",
    "KINDS",
    "Cluster",
    "Link",
    "StepTime",
    "allgather_time",
    "allreduce_time",
    "bucketed_step_time",
    "collective_permute_time",
    "collective_time",
    "exchange_time",
    "halving_doubling_allreduce_time",
    "hierarchical_allreduce_time",
    "parameter_server_time",
    "powersgd_bytes",
    "powersgd_time",
    "reduce_scatter_time",
    "alltoall_time",
    "required_compression",
    "ring_allreduce_time",
    "step_time",
    "step_time_for",
    "step_time_for_collectives",
    "topk_allgather_ratio",
    "topk_break_even_density",
]

#: All-reduce algorithms understood by :func:`allreduce_time`.
ALGORITHMS = ("ring", "halving_doubling", "hierarchical", "parameter_server")
#: Collective kinds understood by :func:`collective_time` (those of ``wire_report``).
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")

#: PyTorch DDP's default gradient bucket (``bucket_cap_mb=25``).
DEFAULT_BUCKET_BYTES = 25 * 2**20
#: Backward ≈ 2 × forward, so 2/3 of the compute can overlap communication.
DEFAULT_BACKWARD_FRACTION = 2 / 3


# --- validation -----------------------------------------------------------------


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number > 0, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number >= 0, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    return float(value)


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    return value


def _fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: must be in [0, 1], got {value!r}")
    return float(value)


def _choice(name: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}: must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


# --- value types ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Link:
    """A network link: bandwidth in bits per second, latency α in seconds.

    Args:
      bandwidth_bps: bandwidth in **bits** per second, > 0 (10 Gbps = ``10e9``).
      latency_s: per-message latency α in seconds, >= 0.

    Example:
      >>> Link(100e9, 10e-6).bytes_per_s
      12500000000.0
    """

    bandwidth_bps: float
    latency_s: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "bandwidth_bps", _positive("bandwidth_bps", self.bandwidth_bps))
        object.__setattr__(self, "latency_s", _non_negative("latency_s", self.latency_s))

    @classmethod
    def from_gbps(cls, gbps: float, latency_s: float = 0.0) -> Link:
        """A link of ``gbps`` gigabits per second (``Link.from_gbps(10)`` is 10 Gbps)."""
        return cls(_positive("gbps", gbps) * 1e9, latency_s)

    @property
    def bytes_per_s(self) -> float:
        """Bandwidth B in bytes per second."""
        return self.bandwidth_bps / 8

    def seconds(self, nbytes: float) -> float:
        """Time to push ``nbytes`` through the link, without latency."""
        return nbytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``n_nodes`` nodes of ``per_node`` workers: a fast link inside, a slow one between.

    Args:
      n_nodes: number of nodes (machines), >= 1.
      per_node: workers (accelerators) per node, >= 1.
      intra: each worker's link to the others in its node; ``None``: the
        same as ``inter``.
      inter: each node's network interface, shared by its workers (required).

    Example:
      >>> c = Cluster(8, 8, intra=Link(1200e9, 5e-6), inter=Link(100e9, 20e-6))
      >>> c.n_workers
      64
    """

    n_nodes: int
    per_node: int = 1
    intra: Link | None = None
    inter: Link | None = None

    def __post_init__(self):
        _count("n_nodes", self.n_nodes)
        _count("per_node", self.per_node)
        if not isinstance(self.inter, Link):
            raise TypeError(f"inter: expected a Link, got {self.inter!r}")
        if self.intra is None:
            object.__setattr__(self, "intra", self.inter)
        elif not isinstance(self.intra, Link):
            raise TypeError(f"intra: expected a Link or None, got {self.intra!r}")

    @property
    def n_workers(self) -> int:
        """Total number of workers, ``n_nodes · per_node``."""
        return self.n_nodes * self.per_node

    @property
    def flat_link(self) -> Link:
        """The link a flat (topology-unaware) collective sees: the slowest hop.

        One node: ``intra``. Several: the lower bandwidth and the higher
        latency of ``intra`` and ``inter``. Right for a ring (it crosses each
        node boundary once); optimistic for patterns that send from every
        worker of a node through the interface at once (halving/doubling).
        """
        if self.n_nodes == 1:
            return self.intra
        return Link(
            min(self.intra.bandwidth_bps, self.inter.bandwidth_bps),
            max(self.intra.latency_s, self.inter.latency_s),
        )


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
    n, nbytes = _count("n", n), _non_negative("nbytes", nbytes)
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
    n, nbytes = _count("n", n), _non_negative("nbytes", nbytes)
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
    n, nbytes = _count("n", n), _non_negative("nbytes", nbytes)
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
    n, nbytes = _count("n", n), _non_negative("nbytes", nbytes)
    return (n - 1) * link.latency_s + (n - 1) / n * link.seconds(nbytes)


def alltoall_time(nbytes: float, n: int, link: Link) -> float:
    """Pairwise-exchange all-to-all of an ``nbytes`` operand: ``(n-1)α + (n-1)/n · S/B``.

    Each worker keeps its own ``S/n`` row and sends one row to each of the
    ``n-1`` others, one peer per step (the two-phase exchange's first phase).

    Example:
      >>> alltoall_time(8e6, 4, Link(8e9))   # 3 rows of 2 MB at 1 GB/s
      0.006
    """
    n, nbytes = _count("n", n), _non_negative("nbytes", nbytes)
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
    n, nbytes = _count("n", n), _non_negative("nbytes", nbytes)
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
    n, nbytes, shards = _count("n", n), _non_negative("nbytes", nbytes), _count("shards", shards)
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
    nbytes = _non_negative("nbytes", nbytes)
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
        return _count("n", n), target
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
    _choice("algorithm", algorithm, ALGORITHMS)
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
        piece s), as in :class:`jaxcomm.exchange.Collective`.
      target: a :class:`Link` (give ``n``) or a :class:`Cluster`.
      n: number of workers; ``None`` for a Cluster.
      algorithm: all-reduce algorithm, see :func:`allreduce_time`.

    Returns:
      Seconds.

    Example:
      >>> collective_time("all_gather", 1e6, Link(8e9), n=9)
      0.008
    """
    _choice("kind", kind, KINDS)
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
    rank = _count("rank", rank)
    rate = _positive("min_compression_rate", min_compression_rate)
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


def _axis_key(axis: Any) -> Any:
    return axis[0] if isinstance(axis, tuple) and len(axis) == 1 else axis


def exchange_time(
    collectives: Iterable[Any],
    n: int | None,
    target: Link | Cluster,
    *,
    algorithm: str = "ring",
    axis_links: Mapping[Any, tuple[int, Link]] | None = None,
) -> float:
    """Seconds for a list of collectives run one after another (no fusion).

    Duck-typed: any objects with ``.kind`` and ``.nbytes`` (and optionally
    ``.axis`` and ``.operands``), e.g. :func:`jaxcomm.accounting.wire_report`'s
    output. The latency term is charged per collective — α × collectives +
    bytes / rate — so a transform that buckets its payloads
    (:mod:`jaxcomm.buckets`) pays it once per bucket, not once per leaf. A
    compiled multi-operand collective (``operands`` > 1, from
    :func:`jaxcomm.accounting.hlo_collectives`) pays it once per operand, as
    XLA:CPU exchanges the operands one by one.

    Args:
      collectives: the collectives, each one message.
      n: number of workers (``None`` for a Cluster).
      target: a :class:`Link` or a :class:`Cluster`.
      algorithm: all-reduce algorithm, see :func:`allreduce_time`.
      axis_links: optional ``{axis name: (workers, Link)}``; a collective whose
        ``.axis`` is a key runs on that link with that many workers instead
        (e.g. a 2-D mesh: ``{"local": (8, nvlink), "node": (4, nic_share)}``).

    Returns:
      Seconds (sum of :func:`collective_time` of each).

    Example:
      >>> report = jaxcomm.accounting.wire_report(jaxcomm.topk(0.01, axis_name="data"),
      ...                                         params, 8)
      >>> exchange_time(report, 8, Link.from_gbps(10))
    """
    total = 0.0
    for c in collectives:
        axis = getattr(c, "axis", None)
        total += _one_collective(c.kind, c.nbytes, axis, n, target, algorithm, axis_links)
        extra = int(getattr(c, "operands", 1)) - 1
        if extra > 0:  # latency only: the bytes are already counted
            total += extra * _one_collective(c.kind, 0, axis, n, target, algorithm, axis_links)
    return total


def _one_collective(kind, nbytes, axis, n, target, algorithm, axis_links) -> float:
    key = _axis_key(axis)
    if axis_links and _hashable(key) and key in axis_links:
        n_axis, link = axis_links[key]
        return collective_time(kind, nbytes, link, n=n_axis, algorithm=algorithm)
    return collective_time(kind, nbytes, target, n=n, algorithm=algorithm)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


# --- step time ------------------------------------------------------------------


class StepTime(NamedTuple):
    """One training iteration, as modelled.

    Attributes:
      iteration_s: iteration time T_iter (seconds).
      compute_s: forward + backward compute T_c.
      comm_s: total communication time if run back to back.
      exposed_s: ``iteration_s − compute_s``: what communication and
        compression add to the step.
      encode_s: compression encode time (on the compute stream).
      decode_s: decode time (on the compute stream, after the data arrives).
      n_buckets: number of gradient buckets.
      scaling_factor: ``SF = compute_s / iteration_s`` in (0, 1].
    """

    iteration_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    encode_s: float
    decode_s: float
    n_buckets: int
    scaling_factor: float


def bucketed_step_time(
    bucket_comm_s: Sequence[float],
    *,
    compute_time: float,
    backward_fraction: float = DEFAULT_BACKWARD_FRACTION,
    encode_time: float = 0.0,
    decode_time: float = 0.0,
) -> StepTime:
    """Iteration time with communication of bucket i starting when its gradients are ready.

    The model (one compute stream, one network, both in order):

    * forward takes ``(1 − f)·T_c``, backward ``f·T_c`` (f =
      ``backward_fraction``); the m buckets' gradients are produced in equal
      parts of the backward pass, bucket i after ``(i+1)/m`` of it;
    * encoding bucket i takes ``encode_time/m`` on the compute stream right
      after its gradients (so it delays the rest of the backward pass);
    * the network sends bucket i from ``max(ready_i, end_{i−1})`` for
      ``bucket_comm_s[i]`` seconds;
    * decoding bucket i takes ``decode_time/m`` on the compute stream once it
      has arrived and the stream is free; the step ends after the last decode
      (or the last transfer, or the compute, whichever is later).

    Without encode/decode and latency, with per-bucket time c/m this gives
    ``T_iter = max(T_c + c/m, (1−f)·T_c + f·T_c/m + c)``; as ``m → ∞``,
    ``T_c + max(0, c − f·T_c)`` (Zhang et al. 2020); ``m = 1`` or ``f = 0``:
    ``T_c + c`` (no overlap).

    Args:
      bucket_comm_s: seconds each bucket's exchange takes, in the order the
        buckets become ready (the last layer's first).
      compute_time: forward + backward time T_c (seconds, > 0).
      backward_fraction: the part of T_c that is the backward pass, in
        [0, 1]; communication can overlap only with it.
      encode_time: total compression time per step (seconds, >= 0).
      decode_time: total decompression time per step (seconds, >= 0).

    Returns:
      A :class:`StepTime`.

    Example:
      >>> bucketed_step_time([0.1], compute_time=0.3).iteration_s   # one bucket: no overlap
      0.4

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data
      Parallel Training", VLDB 2020, arXiv:2006.15704 (gradient buckets);
      Zhang et al. 2020, arXiv:2006.10103.
    """
    t_c = _positive("compute_time", compute_time)
    f = _fraction("backward_fraction", backward_fraction)
    enc = _non_negative("encode_time", encode_time)
    dec = _non_negative("decode_time", decode_time)
    comm = [_non_negative("bucket_comm_s", c) for c in bucket_comm_s]
    if not comm:
        raise ValueError("bucket_comm_s: must hold at least one bucket")
    m = len(comm)
    t_fwd, t_bwd = (1 - f) * t_c, f * t_c
    net_free = 0.0
    arrived = []
    for i, c in enumerate(comm):
        ready = t_fwd + (i + 1) * (t_bwd + enc) / m
        net_free = max(ready, net_free) + c
        arrived.append(net_free)
    compute_free = t_c + enc
    for a in arrived:
        compute_free = max(compute_free, a) + dec / m
    t_iter = compute_free
    return StepTime(t_iter, t_c, sum(comm), t_iter - t_c, enc, dec, m, t_c / t_iter)


def _n_buckets(gradient_bytes: float, bucket_bytes: float | None) -> int:
    if bucket_bytes is None or gradient_bytes == 0:
        return 1
    return max(1, math.ceil(gradient_bytes / _positive("bucket_bytes", bucket_bytes)))


def step_time(
    payload_bytes: float,
    target: Link | Cluster,
    *,
    compute_time: float,
    n: int | None = None,
    kind: str = "all_reduce",
    algorithm: str = "ring",
    rounds: int = 1,
    gradient_bytes: float | None = None,
    bucket_bytes: float | None = DEFAULT_BUCKET_BYTES,
    backward_fraction: float = DEFAULT_BACKWARD_FRACTION,
    encode_time: float = 0.0,
    decode_time: float = 0.0,
) -> StepTime:
    """Iteration time when each worker exchanges ``payload_bytes`` per step.

    The gradient (``gradient_bytes``, default the payload) is cut into
    ``m = ⌈gradient_bytes / bucket_bytes⌉`` equal buckets; each bucket's
    share ``payload_bytes/m`` is exchanged with one collective of ``kind``
    (``rounds`` sequential collectives of ``payload_bytes/(m·rounds)``, e.g.
    2 for PowerSGD's P and Q; exact in the alpha-beta model because the
    bandwidth term is linear), then :func:`bucketed_step_time`.

    Args:
      payload_bytes: bytes one worker contributes per step (all-reduce: S;
        all-gather: its piece).
      target: a :class:`Link` (give ``n``) or a :class:`Cluster`.
      compute_time: forward + backward T_c in seconds.
      n: number of workers; ``None`` for a Cluster.
      kind: collective kind, see :func:`collective_time`.
      algorithm: all-reduce algorithm, see :func:`allreduce_time`.
      rounds: sequential collectives per bucket, >= 1.
      gradient_bytes: uncompressed gradient bytes (sets the buckets).
      bucket_bytes: gradient bytes per bucket (PyTorch DDP: 25 MiB); ``None``:
        one bucket, i.e. no overlap.
      backward_fraction: see :func:`bucketed_step_time`.
      encode_time: see :func:`bucketed_step_time`.
      decode_time: see :func:`bucketed_step_time`.

    Returns:
      A :class:`StepTime`.

    Example:
      >>> c = Cluster(8, 8, intra=Link(1200e9, 5e-6), inter=Link.from_gbps(10, 20e-6))
      >>> step_time(4 * 25.6e6, c, compute_time=0.1, algorithm="hierarchical").scaling_factor

    References:
      Zhang et al. 2020, arXiv:2006.10103.
    """
    payload = _non_negative("payload_bytes", payload_bytes)
    grad = payload if gradient_bytes is None else _non_negative("gradient_bytes", gradient_bytes)
    rounds = _count("rounds", rounds)
    m = _n_buckets(grad, bucket_bytes)
    per_msg = payload / (m * rounds)
    t = rounds * collective_time(kind, per_msg, target, n=n, algorithm=algorithm)
    return bucketed_step_time(
        [t] * m,
        compute_time=compute_time,
        backward_fraction=backward_fraction,
        encode_time=encode_time,
        decode_time=decode_time,
    )


def step_time_for_collectives(
    collectives: Sequence[Any],
    target: Link | Cluster,
    *,
    compute_time: float,
    n: int | None = None,
    algorithm: str = "ring",
    gradient_bytes: float | None = None,
    bucket_bytes: float | None = DEFAULT_BUCKET_BYTES,
    backward_fraction: float = DEFAULT_BACKWARD_FRACTION,
    encode_time: float = 0.0,
    decode_time: float = 0.0,
    axis_links: Mapping[Any, tuple[int, Link]] | None = None,
) -> StepTime:
    """Iteration time for a ``wire_report`` (duck-typed collectives), bucketed.

    The list order is taken as the order gradients become ready. Collectives
    are assigned to the m gradient buckets by their cumulative share of the
    payload; inside a bucket, collectives of the same kind and axis are fused
    into one message (as DDP / XLA's combiners do). Fusing merges PowerSGD's
    P and Q all-reduces of a bucket into one message: the bandwidth term is
    exact, one latency per bucket is missed (use :func:`powersgd_time` or
    ``step_time(..., rounds=2)`` for the exact count).

    Args:
      collectives: objects with ``.kind``, ``.nbytes`` and ``.axis``.
      target: a :class:`Link` (give ``n``) or a :class:`Cluster`.
      compute_time: forward + backward T_c in seconds.
      n: number of workers; ``None`` for a Cluster.
      algorithm: all-reduce algorithm, see :func:`allreduce_time`.
      gradient_bytes: uncompressed gradient bytes (sets the number of
        buckets); default: the total payload.
      bucket_bytes: gradient bytes per bucket; ``None``: one bucket.
      backward_fraction: see :func:`bucketed_step_time`.
      encode_time: see :func:`bucketed_step_time`.
      decode_time: see :func:`bucketed_step_time`.
      axis_links: see :func:`exchange_time`.

    Returns:
      A :class:`StepTime`.

    Example:
      >>> report = jaxcomm.accounting.wire_report(tx, params, 64)
      >>> step_time_for_collectives(report, cluster, compute_time=0.1).scaling_factor
    """
    items = [(c.kind, _axis_key(getattr(c, "axis", None)), float(c.nbytes)) for c in collectives]
    total = sum(b for _, _, b in items)
    grad = total if gradient_bytes is None else _non_negative("gradient_bytes", gradient_bytes)
    m = _n_buckets(grad, bucket_bytes)
    fused: list[dict[tuple[str, Any], float]] = [{} for _ in range(m)]
    done = 0.0
    for kind, axis, nbytes in items:
        i = min(m - 1, int(done / total * m)) if total else 0
        key = (kind, axis if _hashable(axis) else repr(axis))
        fused[i][key] = fused[i].get(key, 0.0) + nbytes
        done += nbytes
    comm = [
        sum(
            _one_collective(kind, nbytes, axis, n, target, algorithm, axis_links)
            for (kind, axis), nbytes in bucket.items()
        )
        for bucket in fused
    ]
    return bucketed_step_time(
        comm,
        compute_time=compute_time,
        backward_fraction=backward_fraction,
        encode_time=encode_time,
        decode_time=decode_time,
    )


def step_time_for(
    tx: Any,
    params: Any,
    cluster: Cluster,
    compute_time: float,
    *,
    n_workers: int | Mapping[str, int] | None = None,
    backend: str | None = "gpu",
    **kwargs: Any,
) -> StepTime:
    """Iteration time of an optax transform ``tx`` on ``cluster`` (uses ``wire_report``).

    Imports :mod:`jaxcomm.accounting` (and so JAX) only when called.

    Args:
      tx: an optax transform containing jaxcomm transforms (with ``axis_name``).
      params: params or ``jax.ShapeDtypeStruct`` tree; gradients have their shape.
      cluster: the :class:`Cluster`.
      compute_time: forward + backward T_c in seconds.
      n_workers: passed to ``wire_report``; default ``cluster.n_workers``.
      backend: the bytes of which backend's collectives (``wire_report``):
        ``"gpu"`` (default; TPU moves the same), ``"cpu"`` (XLA:CPU sums
        bf16 in float32) or ``None`` for the one JAX runs on.
      **kwargs: options of :func:`step_time_for_collectives`; its
        ``gradient_bytes`` defaults to the params' bytes.

    Returns:
      A :class:`StepTime`.

    Example:
      >>> tx = optax.chain(jaxcomm.topk(0.01, axis_name="data"), optax.sgd(0.1))
      >>> step_time_for(tx, params, Cluster(4, 8, intra=nvlink, inter=eth10), 0.1)
    """
    import jax  # lazy: netsim itself does not need JAX

    from jaxcomm import accounting

    sizes = cluster.n_workers if n_workers is None else n_workers
    report = accounting.wire_report(tx, params, sizes, backend=backend)
    if "gradient_bytes" not in kwargs:
        kwargs["gradient_bytes"] = sum(
            math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)
        )
    return step_time_for_collectives(report, cluster, compute_time=compute_time, **kwargs)


# --- questions ------------------------------------------------------------------


def required_compression(
    model_bytes: float,
    compute_time: float,
    target: Link | Cluster,
    target_sf: float,
    *,
    n: int | None = None,
    kind: str = "all_reduce",
    algorithm: str = "ring",
    bucket_bytes: float | None = DEFAULT_BUCKET_BYTES,
    backward_fraction: float = DEFAULT_BACKWARD_FRACTION,
    encode_time: float = 0.0,
    decode_time: float = 0.0,
    max_ratio: float = 1e9,
) -> float:
    """Smallest compression ratio r >= 1 with ``SF >= target_sf`` (inverts :func:`step_time`).

    The compressed payload is ``model_bytes / r`` exchanged with ``kind``
    (``"all_reduce"``: a compressor that can be summed, e.g. low precision,
    PowerSGD, shared-index random-k; ``"all_gather"``: a sparse or bit-packed
    payload), buckets set by the uncompressed ``model_bytes``. SF is
    non-decreasing in r, so bisection on ``log r`` finds it to a relative
    tolerance of 1e-9.

    Args:
      model_bytes: uncompressed gradient bytes per worker (4 × params for fp32).
      compute_time: forward + backward T_c in seconds.
      target: a :class:`Link` (give ``n``) or a :class:`Cluster`.
      target_sf: the scaling factor wanted, in (0, 1).
      n: number of workers; ``None`` for a Cluster.
      kind: ``"all_reduce"`` or ``"all_gather"``.
      algorithm: all-reduce algorithm, see :func:`allreduce_time`.
      bucket_bytes: see :func:`step_time`.
      backward_fraction: see :func:`bucketed_step_time`.
      encode_time: compression cost per step (seconds); counts against SF.
      decode_time: decompression cost per step (seconds).
      max_ratio: largest ratio tried.

    Returns:
      The ratio; ``1.0`` if no compression is needed, ``math.inf`` if even
      ``max_ratio`` does not reach ``target_sf`` (latency or encode bound).

    Example:
      >>> c = Cluster(8, 8, intra=Link(1200e9, 5e-6), inter=Link.from_gbps(10, 20e-6))
      >>> required_compression(4 * 25.6e6, 0.1, c, 0.9, algorithm="hierarchical")

    References:
      Zhang et al. 2020, arXiv:2006.10103 (Section 5, what-if analysis).
    """
    model_bytes = _positive("model_bytes", model_bytes)
    if isinstance(target_sf, bool) or not isinstance(target_sf, (int, float)):
        raise TypeError(f"target_sf: expected a number in (0, 1), got {target_sf!r}")
    if not 0.0 < target_sf < 1.0:
        raise ValueError(f"target_sf: must be in the open interval (0, 1), got {target_sf!r}")
    max_ratio = _positive("max_ratio", max_ratio)

    def sf(ratio: float) -> float:
        return step_time(
            model_bytes / ratio,
            target,
            compute_time=compute_time,
            n=n,
            kind=kind,
            algorithm=algorithm,
            gradient_bytes=model_bytes,
            bucket_bytes=bucket_bytes,
            backward_fraction=backward_fraction,
            encode_time=encode_time,
            decode_time=decode_time,
        ).scaling_factor

    if sf(1.0) >= target_sf:
        return 1.0
    if sf(max_ratio) < target_sf:
        return math.inf
    lo, hi = 0.0, math.log(max_ratio)  # sf(e^lo) < target <= sf(e^hi)
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        if sf(math.exp(mid)) >= target_sf:
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


def topk_allgather_ratio(
    density: float,
    n: int,
    *,
    value_bytes: int = 4,
    index_bytes: int = 4,
    dense_bytes: int = 4,
) -> float:
    """Bandwidth-term ratio of top-k over all-gather to a dense ring all-reduce.

    With d entries and ``k = ρ·d`` kept (ρ = ``density``), the all-gather's
    bandwidth term is ``(n−1)·ρ·d·(v+i)/B`` and the ring's ``2(n−1)/n·d·b/B``,
    so

        ratio = (n−1)·ρ·(v+i) / (2·(n−1)/n · b) = n·ρ·(v+i) / (2·b)

    (v, i: value and index bytes; b: dense bytes per entry). For fp32 values,
    int32 indices and an fp32 ring this is ``n·ρ``: top-k moves less only
    while ``ρ < 1/n``. Latency is left out (the all-gather has ``n−1``
    messages, the ring ``2(n−1)``).

    Args:
      density: ρ = k/d, in (0, 1].
      n: number of workers, >= 2.
      value_bytes: bytes per sent value.
      index_bytes: bytes per sent index.
      dense_bytes: bytes per entry of the dense all-reduce.

    Returns:
      The ratio (< 1: top-k sends less time's worth of bytes).

    Example:
      >>> topk_allgather_ratio(0.01, 64)
      0.64
    """
    density = _positive("density", density)
    if density > 1:
        raise ValueError(f"density: must be in (0, 1], got {density!r}")
    n = _count("n", n)
    if n < 2:
        raise ValueError(f"n: the ratio needs n >= 2 workers (n = 1 sends nothing), got {n}")
    return n * density * (value_bytes + index_bytes) / (2 * dense_bytes)


def topk_break_even_density(
    n: int, *, value_bytes: int = 4, index_bytes: int = 4, dense_bytes: int = 4
) -> float:
    """Density ρ* at which top-k over all-gather costs a dense ring: ``2·b / (n·(v+i))``.

    Args:
      n: number of workers, >= 2.
      value_bytes: bytes per sent value.
      index_bytes: bytes per sent index.
      dense_bytes: bytes per entry of the dense all-reduce.

    Returns:
      ρ* (``1/n`` for fp32 values, int32 indices, fp32 ring).

    Example:
      >>> topk_break_even_density(64)
      0.015625
    """
    n = _count("n", n)
    if n < 2:
        raise ValueError(f"n: the break-even needs n >= 2 workers, got {n}")
    return 2 * dense_bytes / (n * (value_bytes + index_bytes))
