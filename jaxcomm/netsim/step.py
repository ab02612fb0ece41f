"""Seconds for a list of collectives and for one training step (layer 2 of
:mod:`jaxcomm.netsim`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from jaxcomm.netsim.costs import collective_time
from jaxcomm.netsim.links import Cluster, Link, count, fraction, non_negative, positive

#: PyTorch DDP's default gradient bucket (``bucket_cap_mb=25``).
DEFAULT_BUCKET_BYTES = 25 * 2**20
#: Backward ≈ 2 × forward, so 2/3 of the compute can overlap communication.
DEFAULT_BACKWARD_FRACTION = 2 / 3


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
    t_c = positive("compute_time", compute_time)
    f = fraction("backward_fraction", backward_fraction)
    enc = non_negative("encode_time", encode_time)
    dec = non_negative("decode_time", decode_time)
    comm = [non_negative("bucket_comm_s", c) for c in bucket_comm_s]
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
    return max(1, math.ceil(gradient_bytes / positive("bucket_bytes", bucket_bytes)))


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
    payload = non_negative("payload_bytes", payload_bytes)
    grad = payload if gradient_bytes is None else non_negative("gradient_bytes", gradient_bytes)
    rounds = count("rounds", rounds)
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
    grad = total if gradient_bytes is None else non_negative("gradient_bytes", gradient_bytes)
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
