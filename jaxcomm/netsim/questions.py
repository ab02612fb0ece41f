"""What a link needs: the compression ratio for a target scaling factor, and when top-k
over all-gather beats a dense ring (layer 3 of :mod:`jaxcomm.netsim`)."""

from __future__ import annotations

import math

from jaxcomm.netsim.links import Cluster, Link, count, open_fraction, positive
from jaxcomm.netsim.step import DEFAULT_BACKWARD_FRACTION, DEFAULT_BUCKET_BYTES, step_time


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
    model_bytes = positive("model_bytes", model_bytes)
    open_fraction("target_sf", target_sf)
    max_ratio = positive("max_ratio", max_ratio)

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
    density = positive("density", density)
    if density > 1:
        raise ValueError(f"density: must be in (0, 1], got {density!r}")
    n = count("n", n)
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
    n = count("n", n)
    if n < 2:
        raise ValueError(f"n: the break-even needs n >= 2 workers, got {n}")
    return 2 * dense_bytes / (n * (value_bytes + index_bytes))
