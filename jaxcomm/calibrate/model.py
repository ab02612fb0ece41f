"""The per-kind alpha-beta model: α and B of one collective kind fitted to measured times
(:func:`fit_alpha_beta`), one Link per kind (:class:`KindLinks`), the results of a
calibration and the time of a wire report at those links (:func:`exchange_time`)."""

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxcomm import netsim

_UNIT = netsim.Link(8.0)  # 1 byte/s, no latency: the formula's bandwidth coefficient
_LATENCY_ONLY = netsim.Link(8.0, 1.0)  # α = 1 s, applied to 0 bytes: its latency coefficient


# --- fitting --------------------------------------------------------------------


def _coefficients(kind: str, n: int, sizes: Sequence[float], algorithm: str) -> np.ndarray:
    """Rows ``(a, b)`` with ``time = a·α + b·(1/B)`` for each size, from netsim's formula."""
    a = netsim.collective_time(kind, 0.0, _LATENCY_ONLY, n=n, algorithm=algorithm)
    rows = [(a, netsim.collective_time(kind, s, _UNIT, n=n, algorithm=algorithm)) for s in sizes]
    return np.asarray(rows, dtype=np.float64)


def _check_fit_args(kind, n, sizes, times) -> tuple[list[float], list[float]]:
    if kind not in netsim.KINDS:
        raise ValueError(f"kind: must be one of {', '.join(map(repr, netsim.KINDS))}; got {kind!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n: the fit needs an integer number of workers >= 2, got {n!r}")
    sizes, times = [float(s) for s in sizes], [float(t) for t in times]
    if len(sizes) != len(times):
        raise ValueError(f"sizes, times: need one time per size, got {len(sizes)} and {len(times)}")
    if len(set(sizes)) < 2:
        raise ValueError(f"sizes: need at least 2 different payload sizes, got {sizes}")
    for name, values in (("sizes", sizes), ("times", times)):
        bad = [v for v in values if not (math.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"{name}: every value must be a finite number > 0, got {bad[0]!r}")
    return sizes, times


def fit_alpha_beta(
    kind: str,
    n: int,
    sizes: Sequence[float],
    times: Sequence[float],
    *,
    algorithm: str = "ring",
) -> tuple[float, float]:
    """Fit latency α and bandwidth B of one collective kind to measured times.

    The model is netsim's formula for ``kind`` (:func:`jaxcomm.netsim.collective_time`),
    linear in α and 1/B: ``t(S) = a·α + b(S)/B``, with ``a`` and ``b(S)`` read
    off the formula itself (evaluated at α = 1 with no bytes, and at α = 0
    with B = 1 byte/s). The fit minimises the *relative* squared error
    ``Σ ((t(S_i) − T_i)/T_i)²``, so the small sizes (which carry α) count as
    much as the large ones (which carry B). A negative α is clipped to 0 and
    B refitted alone. Exact times give α and B back exactly.

    Args:
      kind: one of :data:`jaxcomm.netsim.KINDS`.
      n: number of workers the collective ran over, >= 2.
      sizes: payload bytes per worker of each measurement, in netsim's
        convention (:class:`jaxcomm.ledger.Collective`: all-reduce,
        reduce-scatter and all-to-all: the whole operand S; all-gather: the
        worker's piece); at least 2 different sizes, each > 0.
      times: measured seconds, one per size, each > 0.
      algorithm: all-reduce algorithm of the model (see
        :func:`jaxcomm.netsim.allreduce_time`); other kinds ignore it.

    Returns:
      ``(alpha_s, bandwidth_bytes_per_s)``; ``netsim.Link(8 * B, alpha_s)``
      is the link.

    Raises:
      ValueError: bad arguments, or times that do not grow with the size
        (no positive bandwidth fits: probe larger sizes).

    Example:
      >>> link = netsim.Link(8e9, 1e-5)
      >>> ts = [netsim.allgather_time(s, 8, link) for s in (1e4, 1e6)]
      >>> fit_alpha_beta("all_gather", 8, [1e4, 1e6], ts)   # ≈ (1e-05, 1e9)
    """
    sizes, times = _check_fit_args(kind, n, sizes, times)
    coef = _coefficients(kind, n, sizes, algorithm)
    t = np.asarray(times)
    w, rhs = coef / t[:, None], np.ones_like(t)  # relative error: each row over its time
    (alpha, beta), *_ = np.linalg.lstsq(w, rhs, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(w[:, 1] @ rhs / (w[:, 1] @ w[:, 1]))
    if not beta > 0:
        raise ValueError(
            f"times: the {kind} times do not grow with the size (fitted 1/B = {beta:.3g}); "
            f"probe larger sizes or take more repeats"
        )
    return float(alpha), float(1.0 / beta)


# --- per-kind links -------------------------------------------------------------


class KindLinks(NamedTuple):
    """One :class:`jaxcomm.netsim.Link` per collective kind (``None``: not known).

    Attributes are the kinds of :data:`jaxcomm.netsim.KINDS`.

    Example:
      >>> links = KindLinks.uniform(netsim.Link.from_gbps(10))._replace(
      ...     all_gather=netsim.Link.from_gbps(5))
      >>> links.link("all_gather").bandwidth_bps
      5000000000.0
    """

    all_reduce: netsim.Link | None = None
    all_gather: netsim.Link | None = None
    reduce_scatter: netsim.Link | None = None
    all_to_all: netsim.Link | None = None
    collective_permute: netsim.Link | None = None

    @classmethod
    def uniform(cls, link: netsim.Link) -> "KindLinks":
        """The same ``link`` for every kind (what plain netsim assumes)."""
        if not isinstance(link, netsim.Link):
            raise TypeError(f"link: expected a netsim.Link, got {link!r}")
        return cls(*([link] * len(cls._fields)))

    def link(self, kind: str) -> netsim.Link:
        """The link of ``kind``; a clear error if it was not calibrated."""
        if kind not in self._fields:
            raise ValueError(
                f"kind: must be one of {', '.join(map(repr, self._fields))}; got {kind!r}"
            )
        found = getattr(self, kind)
        if found is None:
            raise ValueError(
                f"kind: no link for {kind!r}; calibrate it (calibrate(..., kinds=(..., {kind!r}))) "
                f"or set it with links._replace({kind}=netsim.Link(...))"
            )
        return found


# --- results and the time of a report -------------------------------------------


class Probe(NamedTuple):
    """One measurement: ``kind`` over ``n`` workers with ``nbytes`` per worker took ``seconds``.

    ``seconds`` is the minimum over the repeats (the maximum of that over
    processes); ``nbytes`` follows :class:`jaxcomm.ledger.Collective`.
    """

    kind: str
    n: int
    nbytes: int
    seconds: float


class Calibration(NamedTuple):
    """What :func:`calibrate` measured: the fitted links and the raw probes.

    Attributes:
      links: a :class:`KindLinks`; the kinds not measured are ``None``.
      n: workers on the calibrated axis.
      axis_name: the mesh axis (or tuple of axes) calibrated.
      probes: every :class:`Probe`, kind by kind, sizes ascending.
    """

    links: KindLinks
    n: int
    axis_name: Any
    probes: tuple[Probe, ...]

    def table(self) -> str:
        """A text table: kind, α (µs), bandwidth (MB/s), rate relative to the all-reduce."""
        ref = self.links.all_reduce
        lines = [
            f"calibration over axis {self.axis_name!r}, n = {self.n}",
            f"{'kind':<20}{'alpha (us)':>12}{'MB/s':>12}{'vs all_reduce':>15}",
        ]
        for kind, link in zip(KindLinks._fields, self.links):
            if link is None:
                continue
            rel = f"{link.bytes_per_s / ref.bytes_per_s:.2f}" if ref is not None else "-"
            lines.append(
                f"{kind:<20}{link.latency_s * 1e6:>12.1f}{link.bytes_per_s / 1e6:>12.1f}{rel:>15}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def exchange_time(
    report: Iterable[Any],
    links: KindLinks | Calibration,
    n: int | None = None,
    *,
    algorithm: str = "ring",
) -> float:
    """Seconds for a ``wire_report``'s collectives, each at its own kind's link.

    :func:`jaxcomm.netsim.exchange_time` (one collective after another, α per
    collective and per extra operand) with the link chosen by ``.kind``.
    Every collective is charged as running over ``n`` workers (the axis was
    calibrated on; other axes are not told apart).

    Args:
      report: objects with ``.kind`` and ``.nbytes`` (and optionally
        ``.operands``), e.g. a list of :class:`jaxcomm.ledger.Collective`.
      links: a :class:`KindLinks`, or a :class:`Calibration` (its links).
      n: number of workers, >= 1; default: the Calibration's ``n``
        (required with a KindLinks).
      algorithm: all-reduce algorithm, see :func:`jaxcomm.netsim.allreduce_time`.

    Returns:
      Seconds.

    Example:
      >>> cal = calibrate(mesh, "data")
      >>> exchange_time(jaxcomm.accounting.wire_report(tx, params, 8), cal)
    """
    if isinstance(links, Calibration):
        n = links.n if n is None else n
        links = links.links
    if not isinstance(links, KindLinks):
        raise TypeError(f"links: expected a KindLinks or a Calibration, got {links!r}")
    if n is None:
        raise ValueError("n: the number of workers is required with a KindLinks")
    return sum(
        (netsim.exchange_time([c], n, links.link(c.kind), algorithm=algorithm) for c in report),
        0.0,
    )
