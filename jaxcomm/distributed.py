"""Multi-process start-up, global meshes and per-process data: the only module that knows processes.

jaxcomm's transforms do not care how many processes the mesh spans: the same
transform under the same ``jax.shard_map`` runs on 8 fake devices in one
process, on 2 processes x 4 devices, or on one process per GPU host. This
module does the rest:

* :func:`initialize` starts ``jax.distributed`` from arguments, the usual
  environment variables (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
  ``JAX_PROCESS_ID``) or SLURM (``SLURM_NTASKS``, ``SLURM_PROCID``,
  ``SLURM_STEP_NODELIST``), selects gloo collectives on CPU, and turns the
  failures that would otherwise hang or abort the process (an unreachable
  coordinator, processes that disagree on the count, a process that never
  comes) into clear errors within a time-out.
* :func:`global_mesh` builds a 1-D mesh over every device of every process,
  each process's devices contiguous.
* :func:`shard_rows` turns host data with a leading worker axis into a global
  array sharded over the mesh axis, each process contributing only its own
  rows (``jax.make_array_from_process_local_data``); :func:`local_row`,
  :func:`gather` bring results back.

Example (the same script on every process; run it with ``experiments/launch.py``
or one process per host under SLURM)::

    info = jaxcomm.distributed.initialize()   # before any other JAX call
    mesh = jaxcomm.distributed.global_mesh("data")
    batch = jaxcomm.distributed.shard_rows(per_worker_batches, mesh, "data")
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
DEFAULT_PORT = 12355
# Exit status of a process whose start-up timed out (the watchdog's message says why).
TIMEOUT_EXIT_CODE = 3


class ProcessInfo(NamedTuple):
    """Where this process stands.

    Attributes:
      process_id: this process's index, 0 ... num_processes - 1.
      num_processes: processes in the run (1 without ``jax.distributed``).
      coordinator: ``host:port`` of the coordinator, or None for one process.
      local_devices: devices this process drives.
      device_count: devices over all processes.
    """

    process_id: int
    num_processes: int
    coordinator: str | None
    local_devices: int
    device_count: int


def _from_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``node[03-05,9],gpu1`` -> ``node03``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"SLURM_STEP_NODELIST: cannot read a host from {nodelist!r}")
    prefix, _, ranges = m.groups()
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


def _resolve(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> tuple[str | None, int | None, int | None, str]:
    """Fill the three settings from arguments, then env variables, then SLURM."""
    source = "arguments"
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _from_env(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _from_env(ENV_PROCESS_ID)
    if os.environ.get(ENV_COORDINATOR) or os.environ.get(ENV_NUM_PROCESSES):
        source = f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}"
    if num_processes is None and "SLURM_NTASKS" in os.environ and "SLURM_PROCID" in os.environ:
        source = "SLURM"
        num_processes = _from_env("SLURM_NTASKS")
        process_id = _from_env("SLURM_PROCID") if process_id is None else process_id
        if coordinator_address is None and os.environ.get("SLURM_STEP_NODELIST"):
            port = _from_env("JAX_COORDINATOR_PORT") or DEFAULT_PORT
            coordinator_address = f"{_first_slurm_host(os.environ['SLURM_STEP_NODELIST'])}:{port}"
    return coordinator_address, num_processes, process_id, source


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator_address: expected 'host:port' with a port in 1..65535, got {address!r}"
        )
    return host.strip("[]"), int(port)


def _preflight(host: str, port: int, process_id: int, deadline: float) -> None:
    """Errors JAX would only report by aborting the process, raised as Python exceptions."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(
            f"coordinator_address: host {host!r} does not resolve ({e}); give the address of "
            f"process 0's machine"
        ) from None
    if process_id == 0:
        # The coordinator service listens on every interface at `port`; the host part must
        # be this machine, or the other processes will look for it elsewhere.
        for family, stype, proto, _, addr in infos:
            with socket.socket(family, stype, proto) as s:
                try:
                    s.bind((addr[0], 0))
                except OSError:
                    raise ValueError(
                        f"coordinator_address: {host!r} is not an address of this machine, but "
                        f"this is process 0, which runs the coordinator there"
                    ) from None
        with socket.socket(socket.AF_INET6 if ":" in infos[0][4][0] else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError as e:
                raise OSError(
                    f"coordinator_address: port {port} is in use on this machine ({e}); pick "
                    f"another port (e.g. experiments.launch --port=...)"
                ) from None
        return
    while True:  # process 0 may still be starting: retry until the deadline
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"jaxcomm.distributed.initialize: could not reach the coordinator at "
                    f"{host}:{port} ({e}). Check that process 0 is running with the same "
                    f"coordinator address, that the address is reachable from this process "
                    f"(network namespace, firewall), and the time-out."
                ) from None
            time.sleep(0.2)


def _watchdog(seconds: float, what: str) -> threading.Timer:
    """Exit with a clear message if start-up is still stuck after ``seconds``.

    JAX's coordination client aborts the process from C++ on a time-out (no
    Python exception can be caught), so this fires first and says why.
    """

    def fire():
        sys.stderr.write(
            f"\njaxcomm.distributed.initialize: timed out after {seconds:g} s: {what}\n"
        )
        sys.stderr.flush()
        os._exit(TIMEOUT_EXIT_CODE)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def coordination_state():
    """JAX's distributed-runtime state (its key-value client and coordinator address).

    JAX has no public handle on the coordination service's key-value store,
    which :func:`initialize` uses to compare the processes' setups before any
    collective could hang, and :func:`barrier` to wait with a timeout. This is
    the one place jaxcomm reaches into ``jax._src``; the supported JAX versions
    are bounded in ``pyproject.toml`` and ``tests/test_package.py`` fails when
    the name moves.
    """
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state


def _agree(num_processes: int, process_id: int, local_devices: int, timeout_s: float) -> None:
    """Every process must have asked for the same count and hold as many devices."""
    client = coordination_state().client
    mine = f"{num_processes},{local_devices}"
    client.key_value_set(f"jaxcomm/setup/{process_id}", mine)
    for other in range(jax.process_count()):
        theirs = client.blocking_key_value_get(f"jaxcomm/setup/{other}", int(timeout_s * 1000))
        if theirs != mine:
            n_o, dev_o = theirs.split(",")
            raise ValueError(
                f"jaxcomm.distributed.initialize: processes disagree: process {process_id} was "
                f"started with num_processes={num_processes} and {local_devices} local devices, "
                f"process {other} with num_processes={n_o} and {dev_o}. Start every process "
                f"with the same process count and devices per process."
            )
    if jax.process_count() != num_processes:
        raise ValueError(
            f"jaxcomm.distributed.initialize: num_processes={num_processes} but the "
            f"coordinator counts {jax.process_count()} processes; start every process with "
            f"the same process count"
        )


def _check_settings(
    coordinator_address: Any, num_processes: Any, process_id: Any, cpu_collectives: Any, source: str
) -> None:
    """Raise ``ValueError`` naming the first malformed setting (and where it came from)."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes: expected an int >= 1, got {num_processes!r} ({source})")
    if process_id is None or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id: expected an int in [0, {num_processes - 1}] for "
            f"num_processes={num_processes}, got {process_id!r} ({source})"
        )
    if coordinator_address is None:
        raise ValueError(
            f"coordinator_address: required for {num_processes} processes; pass it or set "
            f"{ENV_COORDINATOR}=host:port (the address of process 0)"
        )
    if cpu_collectives not in ("gloo", "mpi"):
        raise ValueError(f"cpu_collectives: expected 'gloo' or 'mpi', got {cpu_collectives!r}")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: float = 120.0,
    cpu_collectives: str = "gloo",
) -> ProcessInfo:
    """Start ``jax.distributed`` if the run spans several processes; else do nothing.

    Call it first, before any JAX computation. Settings come from the
    arguments, else ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
    ``JAX_PROCESS_ID``, else SLURM (``SLURM_NTASKS``, ``SLURM_PROCID``, the
    first host of ``SLURM_STEP_NODELIST`` with ``JAX_COORDINATOR_PORT`` or
    12355). With none of them set (or one process) it returns a single-process
    :class:`ProcessInfo` and starts nothing. Calling it again returns the same.

    Args:
      coordinator_address: ``host:port`` of process 0 (it runs the coordinator).
      num_processes: processes in the run.
      process_id: this process's index in ``[0, num_processes)``.
      timeout_s: how long to wait for the coordinator and the other processes.
      cpu_collectives: CPU collectives across processes (``"gloo"``, or
        ``"mpi"``); GPU (NCCL) and TPU runs are unaffected by it.

    Returns:
      A :class:`ProcessInfo`.

    Raises:
      ValueError: a malformed setting, a coordinator host that does not
        resolve (or, on process 0, is not this machine), processes started
        with different counts or devices per process.
      TimeoutError: the coordinator was not reachable within ``timeout_s``.
      OSError: process 0's coordinator port is in use.
      If other processes never arrive, JAX would abort the process from C++;
      a watchdog prints why and exits with status 3 instead (no hang).

    Example:
      >>> info = jaxcomm.distributed.initialize()  # env from experiments.launch / SLURM
      >>> mesh = jaxcomm.distributed.global_mesh("data")
    """
    if jax.distributed.is_initialized():
        return process_info()
    coordinator_address, num_processes, process_id, source = _resolve(
        coordinator_address, num_processes, process_id
    )
    if num_processes is None or num_processes == 1:
        return process_info()
    _check_settings(coordinator_address, num_processes, process_id, cpu_collectives, source)
    host, port = _split_address(coordinator_address)
    deadline = time.monotonic() + timeout_s
    _preflight(host, port, process_id, deadline)
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    remaining = max(1.0, deadline - time.monotonic())
    timer = _watchdog(
        remaining,
        f"process {process_id} of {num_processes} reached the coordinator at "
        f"{coordinator_address} but not every process registered; check that all "
        f"{num_processes} processes were started, with the same process count and coordinator.",
    )
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            initialization_timeout=int(remaining) + 10,  # the watchdog speaks first
        )
        _agree(num_processes, process_id, jax.local_device_count(), remaining)
    finally:
        timer.cancel()
    return process_info()


def process_info() -> ProcessInfo:
    """This process's :class:`ProcessInfo` (initialises JAX's backends)."""
    coordinator = None
    if jax.distributed.is_initialized():
        coordinator = coordination_state().coordinator_address
    return ProcessInfo(
        jax.process_index(),
        jax.process_count(),
        coordinator,
        jax.local_device_count(),
        jax.device_count(),
    )


def global_mesh(axis_name: str = "data", n_devices: int | None = None) -> Mesh:
    """A 1-D mesh over every device of every process, each process's devices contiguous.

    Args:
      axis_name: the mesh axis name.
      n_devices: use only the first ``n_devices`` (one process only; with
        several processes every device must take part).

    Returns:
      A ``jax.sharding.Mesh`` with one axis.
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if n_devices is not None and n_devices != len(devices):
        if jax.process_count() > 1:
            raise ValueError(
                f"n_devices: {n_devices} of {len(devices)} devices; with "
                f"{jax.process_count()} processes every device must be in the mesh"
            )
        if not 1 <= n_devices <= len(devices):
            raise ValueError(f"n_devices: expected 1..{len(devices)}, got {n_devices}")
        devices = devices[:n_devices]
    return Mesh(np.array(devices), (axis_name,))


def local_rows(mesh: Mesh, axis_name: str, n_rows: int) -> slice:
    """Rows of a leading axis of length ``n_rows`` that this process holds when it is
    sharded over ``axis_name`` (a contiguous block)."""
    sharding = NamedSharding(mesh, P(axis_name))
    index = sharding.addressable_devices_indices_map((n_rows,))
    starts = [idx[0].start or 0 for idx in index.values()]
    stops = [n_rows if idx[0].stop is None else idx[0].stop for idx in index.values()]
    return slice(min(starts), max(stops))


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``)."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_data(tree: Any) -> Any:
    """``tree`` with every typed PRNG key array replaced by its raw uint32 key data."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def shard_rows(tree: Any, mesh: Mesh, axis_name: str = "data") -> Any:
    """Host arrays with a leading worker axis -> global arrays sharded over ``axis_name``.

    Every process passes the whole tree (or at least correct values in its own
    rows, :func:`local_rows`); only its rows are read, via
    ``jax.make_array_from_process_local_data``. Typed PRNG keys are kept.
    """
    sharding = NamedSharding(mesh, P(axis_name))

    def place(x):
        if is_key(x):
            impl = jax.random.key_impl(x)
            data = place(np.asarray(jax.random.key_data(x)))
            return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl))(data)
        x = np.asarray(x)
        rows = local_rows(mesh, axis_name, x.shape[0])
        return jax.make_array_from_process_local_data(sharding, x[rows], x.shape)

    return jax.tree.map(place, tree)


def local_row(tree: Any, row: int) -> Any:
    """Row ``row`` of every leaf's leading axis as numpy, if this process holds it; else None."""
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x in leaves:
        if is_key(x):
            x = jax.random.key_data(x)
        found = None
        for shard in x.addressable_shards:
            sl = shard.index[0]
            start = sl.start or 0
            stop = x.shape[0] if sl.stop is None else sl.stop
            if start <= row < stop:
                found = np.asarray(shard.data)[row - start]
                break
        if found is None:
            return None
        out.append(found)
    return jax.tree.unflatten(treedef, out)


def gather(tree: Any) -> Any:
    """The whole of every (global) array as numpy on every process; keys as raw key data.

    A collective when the run spans several processes: every process must call it.
    """
    tree = key_data(tree)
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def barrier(name: str, timeout_s: float = 300.0) -> None:
    """Wait until every process reaches ``name`` (nothing to wait for with one process)."""
    if jax.process_count() > 1:
        coordination_state().client.wait_at_barrier(name, int(timeout_s * 1000))


__all__ = [
    "ProcessInfo",
    "initialize",
    "process_info",
    "global_mesh",
    "local_rows",
    "shard_rows",
    "local_row",
    "gather",
    "barrier",
    "is_key",
    "key_data",
]
