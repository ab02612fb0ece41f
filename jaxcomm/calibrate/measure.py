"""Measuring the per-kind links on a mesh axis: one small jitted ``shard_map`` program per
kind and size, timed the same on every process, fitted and cached (:func:`calibrate`)."""

import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import collectives, netsim
from jaxcomm.calibrate.model import Calibration, KindLinks, Probe, fit_alpha_beta

#: Collective kinds :func:`calibrate` measures unless told otherwise.
DEFAULT_KINDS = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter")
#: Operand bytes per worker :func:`calibrate` probes unless told otherwise.
DEFAULT_SIZES = (64 * 2**10, 2**20, 4 * 2**20)

#: Times :func:`calibrate` measures ``repeats`` more rounds when a kind's times do not fit.
ATTEMPTS = 3


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
    netsim.allreduce_time(0.0, netsim.Link(8.0), n=n, algorithm=algorithm)  # checks algorithm
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
