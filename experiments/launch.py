r"""Start N local processes of any experiments command, optionally on a shaped network.

Command:
  python -m experiments.launch --processes=2 --devices_per_process=2 -- \
      python -m experiments.main --config=experiments/configs/digits_mlp.py --workdir=runs/mp
  python -m experiments.launch --processes=2 --rate=100mbit -- python -m experiments.main ...

Each process gets ``--devices_per_process`` fake CPU devices (``XLA_FLAGS``) and
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, which
:func:`jaxcomm.distributed.initialize` reads (gloo collectives on CPU). Logs are
streamed with a ``[p0]`` prefix. If one process dies, the others are stopped and
the launcher exits non-zero (the dead process's status, or 128 + signal). Ctrl-C
or SIGTERM stops every process and tears the network lab down: each gets SIGTERM
(which ``experiments.main`` takes as a preemption notice: every process saves a
checkpoint at the same step and exits), then SIGKILL after ``--stop_grace_s``
(a second Ctrl-C/SIGTERM kills at once); the launcher exits with 128 + signal.

``--rate`` (e.g. ``10mbit``, ``100mbit``, ``1gbit``) runs each process in its own
network namespace of :mod:`experiments.netlab`: joined through a bridge, every
egress shaped with ``tc ... tbf`` (needs root and iproute2). Without ``--rate``
the processes talk over loopback. Latency cannot be added (netem is not
available); it stays in :mod:`jaxcomm.netsim`.

On a real cluster you do not need this launcher: start the same
``python -m experiments.main`` once per host with the three variables set (or
under SLURM's ``srun``, which :func:`jaxcomm.distributed.initialize` reads).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The launcher's command-line flags, defined only when it runs as a command.

    Importing this module for :func:`run` or :func:`free_port` defines none, so it
    can share a process with other experiments (``netstudy`` has its own
    ``--processes``).
    """
    flags.DEFINE_integer("processes", 2, "number of local processes", lower_bound=1)
    flags.DEFINE_integer("devices_per_process", 1, "fake CPU devices per process", lower_bound=1)
    flags.DEFINE_string("rate", None, "shape each link to this rate (tc syntax: 10mbit, 1gbit)")
    flags.DEFINE_string("burst", None, "tbf burst (default: netlab's rule for the rate)")
    flags.DEFINE_integer("port", 0, "coordinator port (0: a free one)", lower_bound=0)
    flags.DEFINE_float(
        "grace_s", 5.0, "seconds between SIGTERM and SIGKILL for the others when one process died"
    )
    flags.DEFINE_float(
        "stop_grace_s",
        60.0,
        "seconds between SIGTERM and SIGKILL when the launcher gets SIGTERM or Ctrl-C (time to "
        "save a checkpoint at the preemption sync point)",
    )


_print_lock = threading.Lock()
_SPLIT = re.compile(rb"[\r\n]")


def say(msg: str) -> None:
    with _print_lock:
        sys.stdout.write(f"[launch] {msg}\n")
        sys.stdout.flush()


def free_port() -> int:
    """A TCP port nobody listens on now (on loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_count_flags(xla_flags: str, devices: int) -> str:
    """``xla_flags`` (the ``XLA_FLAGS`` value) with ``devices`` fake CPU devices, any
    earlier count replaced."""
    xla = re.sub(r"--xla_force_host_platform_device_count=\S+", "", xla_flags)
    return f"{xla.strip()} --xla_force_host_platform_device_count={devices}".strip()


def process_env(base: dict, i: int, n: int, devices: int, coordinator: str) -> dict:
    """Environment of process ``i``: fake devices, CPU platform, the three jax.distributed vars."""
    env = dict(base)
    env["XLA_FLAGS"] = device_count_flags(env.get("XLA_FLAGS", ""), devices)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["JAX_COORDINATOR_ADDRESS"] = coordinator
    env["JAX_NUM_PROCESSES"] = str(n)
    env["JAX_PROCESS_ID"] = str(i)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the launcher dies (even by SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setpgrp()  # own process group: stopping it stops whatever it started


def _stream(i: int, pipe) -> None:
    """Copy a child's output, line by line (``\\r`` progress updates too), with ``[pI]``."""
    buf = b""
    while True:
        chunk = os.read(pipe.fileno(), 65536)
        if not chunk:
            break
        *lines, buf = _SPLIT.split(buf + chunk)
        with _print_lock:
            for line in lines:
                if line.strip():
                    sys.stdout.write(f"[p{i}] {line.decode(errors='replace')}\n")
            sys.stdout.flush()
    if buf.strip():
        with _print_lock:
            sys.stdout.write(f"[p{i}] {buf.decode(errors='replace')}\n")
            sys.stdout.flush()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live process group, then SIGKILL what is left after ``grace_s``.

    A Ctrl-C or SIGTERM to the launcher while it waits SIGKILLs at once.
    """
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        say("interrupted again; killing every process now")
    for p in live:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def culprit(codes: list[int | None]) -> tuple[int, int] | None:
    """The failed process to report, ``(index, status)``, or None: a process killed by a
    signal before one that exited non-zero (a peer that saw it die exits 1, and may be
    seen in the same poll), then the lowest index."""
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    return min(failed, key=lambda ic: (ic[1] > 0, ic[0])) if failed else None


def exit_code(rc: int) -> int:
    """A process's status as an exit code: negative (killed by signal s) -> 128 + s."""
    return 128 - rc if rc < 0 else rc


def run(
    argv: list[str],
    *,
    processes: int,
    devices_per_process: int,
    lab=None,
    port: int = 0,
    grace_s: float = 5.0,
    stop_grace_s: float = 60.0,
) -> int:
    """Run ``argv`` as ``processes`` processes; returns the exit code (0: all succeeded).

    ``grace_s``: SIGTERM to SIGKILL for the others when one process died.
    ``stop_grace_s``: the same on Ctrl-C or SIGTERM to the launcher (the
    processes save a checkpoint at JAX's preemption sync point meanwhile);
    returns 128 + the signal.
    """
    n = processes
    host = lab.address(0) if lab is not None else "127.0.0.1"
    coordinator = f"{host}:{port or free_port()}"
    procs: list[subprocess.Popen] = []
    threads = []
    try:
        for i in range(n):
            cmd = lab.command(i, argv) if lab is not None else list(argv)
            p = subprocess.Popen(
                cmd,
                env=process_env(os.environ, i, n, devices_per_process, coordinator),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
            procs.append(p)
            say(f"p{i} started (pid {p.pid})")
            t = threading.Thread(target=_stream, args=(i, p.stdout), daemon=True)
            t.start()
            threads.append(t)
        while True:
            codes = [p.poll() for p in procs]
            failed = culprit(codes)
            if failed:
                i, c = failed
                what = f"signal {-c}" if c < 0 else f"exit status {c}"
                say(f"p{i} died ({what}); stopping the other processes")
                _stop(procs, grace_s)
                return exit_code(c)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        say(
            f"{signal.Signals(signum).name}: stopping every process (SIGTERM: they checkpoint "
            f"and exit; SIGKILL after {stop_grace_s:g} s)"
        )
        _stop(procs, stop_grace_s)
        return 128 + signum
    finally:
        _stop(procs, grace_s)
        for t in threads:
            t.join(timeout=2)


class _Stopped(KeyboardInterrupt):
    """The launcher got a stop signal (``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupt(signum, frame):
    raise _Stopped(signum)


def main(argv: list[str]) -> None:
    command = argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise app.UsageError("give the command to run after --, e.g. -- python -m experiments.main")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    kwargs = dict(
        processes=FLAGS.processes,
        devices_per_process=FLAGS.devices_per_process,
        port=FLAGS.port,
        grace_s=FLAGS.grace_s,
        stop_grace_s=FLAGS.stop_grace_s,
    )
    if FLAGS.rate is None:
        sys.exit(run(command, **kwargs))
    from experiments import netlab

    try:
        netlab.Lab.check()
        lab = netlab.Lab(FLAGS.processes, FLAGS.rate, burst=FLAGS.burst)
    except (netlab.LabError, ValueError) as e:
        say(f"network lab unavailable: {e}")
        sys.exit(2)
    with lab:
        say(f"network lab up: {FLAGS.processes} hosts, {FLAGS.rate} per link ({lab.names})")
        code = run(command, lab=lab, **kwargs)
    say("network lab torn down")
    sys.exit(code)


if __name__ == "__main__":
    define_flags()
    app.run(main)
