"""Calibrate the alpha-beta model on the user's mesh: α and B per collective kind.

:mod:`jaxcomm.netsim` charges every collective at one :class:`~jaxcomm.netsim.Link`.
Real backends run different collectives at different rates (an all-gather
or an all-to-all is often slower per byte than the all-reduce the link was
measured with), so this module

* fits α (latency, s) and B (bytes/s) of one collective kind to measured
  times at a few payload sizes (:func:`fit_alpha_beta`), through netsim's own
  formula for that kind, so the model and the fit cannot disagree;
* holds one Link per kind (:class:`KindLinks`) and times a
  :func:`jaxcomm.accounting.wire_report` with each collective charged at its
  own kind's link (:func:`exchange_time`);
* measures them on a mesh axis (:func:`calibrate`): one small jitted
  ``shard_map`` program per kind and size, timed, fitted, cached per mesh,
  printable as a table (:meth:`Calibration.table`).

The α fitted by :func:`calibrate` includes the cost of dispatching one
jitted program (it is what a step pays per collective launched alone).
"""

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import collectives, netsim

__all__ = [
    "ATTEMPTS",
    "DEFAULT_KINDS",
    "DEFAULT_SIZES",
    "Calibration",
    "KindLinks",
    "Probe",
    "calibrate",
    "clear_cache",
    "exchange_time",
    "fit_alpha_beta",
    "axis_size",
    "probe_program",
    "slowest_process",
]

#: Collective kinds :func:`calibrate` measures unless told otherwise.
DEFAULT_KINDS = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter")
#: Operand bytes per worker :func:`calibrate` probes unless told otherwise.
DEFAULT_SIZES = (64 * 2**10, 2**20, 4 * 2**20)

#: Times :func:`calibrate` measures ``repeats`` more rounds when a kind's times do not fit.
ATTEMPTS = 3

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


# --- measuring ------------------------------------------------------------------


def _probe_body(kind: str, axis_name: Any, n: int):
    """The per-worker function of one probe: one collective of ``kind`` on a 1-D operand."""
    perm = [(i, (i + 1) % n) for i in range(n)]

    def body(x):
        if kind == "all_reduce":
            return collectives.psum(x, axis_name)
        if kind == "all_gather":
            return collectives.all_gather(x, axis_name, tiled=True)
        if kind == "reduce_scatter":
            return collectives.psum_scatter(x, axis_name)
        if kind == "all_to_all":
            return collectives.all_to_all(x.reshape(n, -1), axis_name).reshape(-1)
        return collectives.ppermute(x, axis_name, perm)

    return body


def probe_program(mesh, axis_name: str | tuple[str, ...], kind: str, nbytes: int):
    """The compiled program :func:`calibrate` times for one kind and size, and its input.

    One ``jax.shard_map`` over ``mesh`` doing one collective of ``kind`` over
    ``axis_name`` on a float32 operand of ``nbytes`` per worker (netsim's
    convention, see :func:`fit_alpha_beta`).

    Args:
      mesh: a ``jax.sharding.Mesh``.
      axis_name: a mesh axis (or tuple of axes) with n >= 2 devices.
      kind: one of :data:`jaxcomm.netsim.KINDS`.
      nbytes: operand bytes per worker, a positive multiple of ``4 · n``.

    Returns:
      ``(compiled, x)``: call ``compiled(x)`` to run the probe.

    Example:
      >>> compiled, x = probe_program(mesh, "data", "all_gather", 2**20)
      >>> compiled(x).block_until_ready()
    """
    n = axis_size(mesh, axis_name)
    if kind not in netsim.KINDS:
        raise ValueError(f"kind: must be one of {', '.join(map(repr, netsim.KINDS))}; got {kind!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1 or nbytes % (4 * n):
        raise ValueError(f"nbytes: must be a positive multiple of 4 * n = {4 * n}, got {nbytes!r}")
    spec = P(axis_name)
    sharding = NamedSharding(mesh, spec)
    x = jax.jit(lambda: jnp.ones((n * nbytes // 4,), jnp.float32), out_shardings=sharding)()
    out_spec = P() if kind in ("all_reduce", "all_gather") else spec
    fn = jax.shard_map(
        _probe_body(kind, axis_name, n), mesh=mesh, in_specs=spec, out_specs=out_spec
    )
    return jax.jit(fn).lower(x).compile(), x


def _warm_programs(mesh, axis_name, plan: list[tuple[str, int]]) -> list[tuple[Any, Any]]:
    """Compile every ``(kind, nbytes)`` probe and run it once (warm-up)."""
    programs = [probe_program(mesh, axis_name, kind, nbytes) for kind, nbytes in plan]
    for compiled, x in programs:
        compiled(x).block_until_ready()
    return programs


def _measure(programs: list[tuple[Any, Any]], repeats: int) -> list[float]:
    """Minimum seconds over ``repeats`` rounds of each probe.

    Each round times every probe once, so a burst of load on the host
    spreads over all probes instead of spoiling all repeats of one.
    """
    best = [math.inf] * len(programs)
    for _ in range(repeats):
        for i, (compiled, x) in enumerate(programs):
            start = time.perf_counter()
            compiled(x).block_until_ready()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _fit_kinds(probes, kinds, n, algorithm) -> tuple[dict[str, netsim.Link], list[str]]:
    """A Link per kind that fits, and the error of each kind that does not."""
    fitted, errors = {}, []
    for kind in kinds:
        mine = [p for p in probes if p.kind == kind]
        sizes, times = [p.nbytes for p in mine], [p.seconds for p in mine]
        try:
            alpha, bw = fit_alpha_beta(kind, n, sizes, times, algorithm=algorithm)
        except ValueError as e:
            errors.append(f"{e} (bytes {sizes}, seconds {[f'{t:.3g}' for t in times]})")
            continue
        fitted[kind] = netsim.Link(8.0 * bw, alpha)
    return fitted, errors


def slowest_process(seconds: list[float]) -> list[float]:
    """The slowest process's time for each probe, so every process fits the same links."""
    if jax.process_count() == 1:
        return seconds
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(seconds, np.float64))
    return [float(v) for v in np.max(np.asarray(gathered), axis=0)]


def axis_size(mesh, axis_name) -> int:
    """Devices along ``axis_name`` (an axis or a tuple of axes) of ``mesh``; >= 2 or an error."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(a, str) for a in names):
        raise TypeError(
            f"axis_name: expected a mesh axis name or a tuple of them, got {axis_name!r}"
        )
    missing = [a for a in names if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"axis_name: {missing[0]!r} is not an axis of the mesh; its axes are "
            f"{tuple(mesh.axis_names)}"
        )
    n = math.prod(mesh.shape[a] for a in names)
    if n < 2:
        raise ValueError(f"axis_name: {axis_name!r} has {n} device; calibration needs >= 2")
    return n


def _check_calibrate_args(sizes, repeats, kinds) -> tuple[tuple[int, ...], tuple[str, ...]]:
    sizes = tuple(sizes)
    if len(set(sizes)) < 2:
        raise ValueError(f"sizes: need at least 2 different payload sizes, got {sizes}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 4:
            raise ValueError(f"sizes: each must be an integer number of bytes >= 4, got {s!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: must be an integer >= 1, got {repeats!r}")
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError("kinds: need at least one collective kind")
    for k in kinds:
        if k not in netsim.KINDS:
            allowed = ", ".join(map(repr, netsim.KINDS))
            raise ValueError(f"kinds: each must be one of {allowed}; got {k!r}")
    return tuple(sorted(sizes)), tuple(dict.fromkeys(kinds))


_CACHE: dict[Any, Calibration] = {}


def clear_cache() -> None:
    """Forget every cached :func:`calibrate` result of this process."""
    _CACHE.clear()


def calibrate(
    mesh: jax.sharding.Mesh,
    axis_name: str | tuple[str, ...],
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    kinds: Sequence[str] = DEFAULT_KINDS,
    algorithm: str = "ring",
    refresh: bool = False,
) -> Calibration:
    """Measure α and B of each collective kind over ``axis_name`` of ``mesh``.

    For each kind and size, one ``jax.shard_map`` program doing that one
    collective on a float32 operand of about ``size`` bytes per worker is
    compiled and run once to warm up; then ``repeats`` rounds time every
    probe once each (``block_until_ready``); the minimum is kept and
    :func:`fit_alpha_beta` fits α and B per kind. Where a kind's times do not
    grow with the size (host noise), up to :data:`ATTEMPTS` − 1 more sets of
    rounds are timed, keeping the minimum. Seconds, not minutes, for the
    defaults. The result
    is cached in this process by (mesh devices and shape, axis, sizes,
    repeats, kinds, algorithm).

    Multi-process: **every process must call it** with the same arguments
    (the probes are collectives over the whole mesh); each process times its
    own calls and every probe is charged at the slowest process's time, so
    all processes get the same links.

    Args:
      mesh: the ``jax.sharding.Mesh`` training will run on.
      axis_name: the mesh axis (or tuple of axes) the exchange runs over;
        >= 2 devices along it.
      sizes: operand bytes per worker to probe (netsim's convention, see
        :func:`fit_alpha_beta`), integers >= 4, at least 2 different; rounded
        to a whole number of float32 entries divisible by the axis size.
      repeats: timed calls per probe, >= 1.
      kinds: kinds to measure, from :data:`jaxcomm.netsim.KINDS`.
      algorithm: all-reduce algorithm of the model fitted.
      refresh: measure again even if a cached result exists.

    Returns:
      A :class:`Calibration` (``print(cal)`` shows the table).

    Raises:
      ValueError: bad arguments, or a kind whose times still do not grow
        with the size after :data:`ATTEMPTS` sets of rounds (probe larger sizes).

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> cal = jaxcomm.calibrate.calibrate(mesh, "data")
      >>> print(cal)
      >>> jaxcomm.calibrate.exchange_time(jaxcomm.accounting.wire_report(tx, params, 8), cal)
    """
    n = axis_size(mesh, axis_name)
    sizes, kinds = _check_calibrate_args(sizes, repeats, kinds)
    netsim.allreduce_time(0.0, _UNIT, n=n, algorithm=algorithm)  # validates algorithm
    devices = tuple(int(d.id) for d in mesh.devices.flat)
    key = (devices, tuple(mesh.shape.items()), axis_name, sizes, repeats, kinds, algorithm)
    if key in _CACHE and not refresh:
        return _CACHE[key]
    rounded = [4 * n * max(1, round(s / (4 * n))) for s in sizes]  # whole float32 rows
    if len(set(rounded)) < 2:
        raise ValueError(f"sizes: {sizes} round to one size, {rounded[0]} bytes (4·n multiples)")
    plan = [(kind, b) for kind in kinds for b in rounded]
    programs = _warm_programs(mesh, axis_name, plan)
    seconds = [math.inf] * len(plan)
    for _ in range(ATTEMPTS):  # noisy hosts: more rounds until every kind fits
        fresh = slowest_process(_measure(programs, repeats))
        seconds = [min(a, b) for a, b in zip(seconds, fresh)]
        probes = tuple(Probe(k, n, b, t) for (k, b), t in zip(plan, seconds))
        fitted, errors = _fit_kinds(probes, kinds, n, algorithm)
        if not errors:
            break
    else:
        raise ValueError(f"{errors[0]}; after {ATTEMPTS} x {repeats} rounds")
    result = Calibration(KindLinks(**fitted), n, axis_name, probes)
    _CACHE[key] = result
    return result
